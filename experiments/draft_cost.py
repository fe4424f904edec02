"""
What one drafted token costs, in target steps: an EAGLE-3 draft's token (its heads, the argmax and
its one-token forward, eagle3.Eagle3Draft.step) timed against the target's one-token step, eager
and compiled (engine/compiled.py), with the draft's weights in fp32, bf16 and int8, and the token
decode.py drafts, eager and with --compile on (the draft as build_draft loads it: bf16 activations
where the CPU multiplies bf16, int8 weights; compiled, its chain row a graph). A chain of k tokens costs k of these on
top of its verification block, so this is what decides whether compiling the draft can make it
pay where blocks are dear: a compiled chain of COMPILED_K beats plain decoding only where its tau
exceeds its block's cost plus its tokens', both recorded here in target steps. A DFlash draft's
block (all its guesses in one forward) is timed too, eager as decode.py runs it, compiled whole,
and its forward compiled with the heads left eager (as a compiled target leaves its head), with
the part no compiling shrinks: the target's output head, which DFlash reads for every guess. And
where a compiled step's and block's time goes (torch's profiler), which says what a cheaper block
would have to change.

    python experiments/draft_cost.py --out docs/draft-cost/draft-cost.json

Run it with nothing else busy. Medians of --repeats calls each, after a warm-up; the draft's state
is a fixed vector at the end of a chat prompt's context (what it holds does not change the cost).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the core modules, one folder up

import torch

from eagle3 import Eagle3Draft
from engine.checkpoints import build_draft, draft_dir_problem, load_draft
from engine.compiled import COMPILED_K, CPU_OPTIONS, cache_slots, compile_draft, compile_target
from engine.layouts import layout_of, load_target
from engine import linear_forms as LF
from engine.linear_forms import Int8Linear, quantize_int8
from engine.machine import ArgumentParser, pick_threads, run_script
from engine.weights import DEFAULT_TARGET, resolve_model
from harness.results import machine_stamp, unwritable, write_results
from tokenizer import load_tokenizer

PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."
MAX_CONTEXT = 4096  # (the cache holds the context, a block and a DFlash draft's block after it)


def get_args(argv=None):
    ap = ArgumentParser(description="What one drafted token costs, in target steps.")
    ap.add_argument("--draft", default="drafts/smollm2-135m-eagle3-chat", help="an EAGLE-3 draft's directory")
    ap.add_argument("--dflash-draft", default="drafts/smollm2-135m-dflash-gsm8k",
                    help="a DFlash draft's directory, whose block is timed eager and compiled")
    ap.add_argument("--dtype", default="int4", choices=("int4", "int8", "bfloat16", "float32"),
                    help="the target's weight layout (decode.py's --dtype; compiled graphs read plain weights)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed calls")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per variant (medians)")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)
    if args.repeats < 5 or not 8 <= args.context <= MAX_CONTEXT:
        ap.error(f"--repeats must be >= 5 and --context from 8 to {MAX_CONTEXT}")
    for flag, where, kind in (("--draft", args.draft, "eagle3"), ("--dflash-draft", args.dflash_draft, "dflash")):
        problem = draft_dir_problem(where, kind)
        if problem:
            ap.error(f"{flag} {problem}")
    problem = unwritable(args.out)
    if problem:
        ap.error(problem)
    return args


def median_seconds(call, repeats: int) -> float:
    call()  # (a first call allocates, picks kernels or compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def token_call(draft):
    """One drafted token as a function of the draft's state (1, dim) and the visible cache slots
    (a slice whose length is the key count, dynamic in a graph): -> (token, next state)."""
    net = draft.net

    def draft_token(state, visible):
        logits, _ = net.heads(state[-1])
        token = net.draft_to_target().index_select(0, logits.argmax(-1, keepdim=True))  # (1,)
        position = visible[-1:]
        seen = torch.ones(1, visible.shape[0], dtype=torch.bool)  # (1, kv_len)
        return token, draft.step(token, state, position, position, seen)
    return draft_token


def block_anatomy(compiled, context: int, repeats: int) -> dict:
    """Where a compiled one-token step and a compiled block of COMPILED_K + 1 go, in ms a call, from
    torch's profiler (self times): the layers' int4 matmuls (torch's kernel, which dequantizes a
    tile once and multiplies it into each row), the oneDNN-packed output head, the graph's own
    kernels (attention, each row apart, norms, RoPE, the rest) and everything else."""
    from torch.profiler import ProfilerActivity, profile
    anatomy = {}
    for T in (1, COMPILED_K + 1):
        def call():
            compiled(torch.zeros(1, T, dtype=torch.long), torch.arange(context, context + T))
        call()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(repeats):
                call()
        parts = {"int4_matmuls": 0.0, "output_head": 0.0, "graph_kernels": 0.0, "other": 0.0}
        for event in profiled.key_averages():
            part = ("int4_matmuls" if "_weight_int4pack_mm" in event.key else
                    "output_head" if "_linear_pointwise" in event.key else
                    "graph_kernels" if "CompiledFxGraph" in event.key else "other")
            parts[part] += event.self_cpu_time_total / 1e3 / repeats
        anatomy["step" if T == 1 else f"block_of_{T}"] = parts
    return anatomy


def dflash_block(spec, target, tokenizer, ids, repeats: int) -> dict:
    """A DFlash draft's block (block_size - 1 guesses in one forward after one committed pair), in
    ms: as decode.py proposes it (eager, oneDNN's layout), its forward and heads compiled (dynamic
    shapes, plain weights, which inductor reads), and the target's output head alone on its rows,
    which the draft shares and no compiling makes read fewer bytes."""
    draft = build_draft(spec, target, tokenizer)
    net, k = draft.net, draft.net.block_size - 1
    # (L-1, layers * dim): the target's states of the context (a fixed value: it does not change the cost)
    features = torch.zeros(len(ids) - 1, len(net.target_layers) * target.args.dim,
                           dtype=target.embed_tokens.weight.dtype)
    draft.start(ids, features)

    def proposal():
        draft.commit([ids[-1]], 0, features[-1:])
        draft.propose(k)
    eager_s = median_seconds(proposal, repeats)
    rows = torch.zeros(k, target.args.dim, dtype=target.embed_tokens.weight.dtype)
    head_s = median_seconds(lambda: target.lm_head(rows), repeats)
    # the block as proposal() runs it, one new context row, at the context it reached, compiled
    block = torch.tensor([[ids[-1]] + [net.mask_token_id] * k])
    cached = [(c.k[:, :, :draft.context_len], c.v[:, :, :draft.context_len]) for c in draft.caches]
    positions = torch.arange(draft.context_len, draft.context_len + 2 + k)
    # the same weights, plain (the eager draft above keeps oneDNN's layout)
    head = torch.nn.Linear(target.args.dim, target.args.vocab_size, bias=False, device="meta")
    head.weight = torch.nn.Parameter(LF.dense_weight(target.lm_head), requires_grad=False)
    plain = torch.nn.ModuleDict({"net": build_draft(spec, target, tokenizer, pack=False).net, "lm_head": head})

    def block_call(new_features, cached, positions):
        context = plain.net.context(new_features)[None]  # (1, 1, dim)
        h, kvs = plain.net(draft.embed(block), context, draft.cos[positions], draft.sin[positions], None, cached)
        logits, _ = plain.net.heads(h[0, 1:], plain.lm_head)  # (k, V)
        return logits.argmax(-1), kvs
    graph = torch.compile(block_call, dynamic=True, options=CPU_OPTIONS)
    new_features = features[-1:].to(net.fc.weight.dtype)
    compiled_s = median_seconds(lambda: graph(new_features, cached, positions), repeats)

    # the forward alone compiled, its heads eager through the packed head, as a compiled target
    # leaves its own head out of its graphs (engine/compiled.py)
    def forward_call(new_features, cached, positions):
        context = plain.net.context(new_features)[None]  # (1, 1, dim)
        return plain.net(draft.embed(block), context, draft.cos[positions], draft.sin[positions], None, cached)
    forward_graph = torch.compile(forward_call, dynamic=True, options=CPU_OPTIONS)

    def forward_then_heads():
        h, _ = forward_graph(new_features, cached, positions)  # (1, k + 1, dim)
        return net.heads(h[0, 1:], draft.lm_head)[0].argmax(-1)
    forward_s = median_seconds(forward_then_heads, repeats)
    return {"draft": spec, "guesses": k, "eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3,
            "compiled_forward_ms": forward_s * 1e3, "target_head_ms": head_s * 1e3}


def main(argv=None):
    args = get_args(argv)
    torch.set_num_threads(pick_threads("auto"))
    path = resolve_model(DEFAULT_TARGET)
    tokenizer = load_tokenizer(path)
    target, _, _ = load_target(str(path), "cpu", args.dtype, cache_slots(args.context + 64, 8192))
    # the draft's own weights in fp32, for the forms below
    _, net = load_draft(resolve_model(args.draft), target, dtype=torch.float32)
    draft = Eagle3Draft(net, target.embed_tokens, target.max_seq_len)
    ids = tokenizer.encode(PROMPT)[:args.context]
    ids = (ids * (args.context // len(ids) + 1))[:args.context]  # (L,): a context of the asked length
    slots = torch.arange(target.max_seq_len)
    visible = slots[:args.context + 1]
    eager_step = lambda: target(torch.tensor([[ids[-1]]]), visible[-1:])  # noqa: E731
    with torch.inference_mode():
        target(torch.tensor([ids[:-1]]), torch.arange(args.context - 1))
        eager_step_s = median_seconds(eager_step, args.repeats)
        compiled = compile_target(target, COMPILED_K + 1, (), "cpu")
        step_s = median_seconds(lambda: compiled(torch.tensor([[ids[-1]]]), visible[-1:]), args.repeats)
        block_steps = compiled.block_costs(args.repeats)[0](COMPILED_K, args.context)
        anatomy = block_anatomy(compiled, args.context, args.repeats)
        rows = {}
        for form in ("float32", "bfloat16", "int8"):  # (int8: weights of the layer and head, bf16 activations)
            if form == "int8":
                quantize_int8(draft.net.midlayer)
                draft.net.lm_head = Int8Linear(draft.net.lm_head)
            else:
                draft.net.to(getattr(torch, form))
            dtype = draft.net.fc.weight.dtype  # (the form's activations, which the embedding feeds)
            draft.embed = torch.nn.Embedding.from_pretrained(LF.dense_weight(target.embed_tokens).to(dtype))
            state = torch.zeros(1, draft.net.args.dim, dtype=dtype)
            call = token_call(draft)
            graph = torch.compile(call, fullgraph=True, options=CPU_OPTIONS)

            def compiled_call():
                torch._dynamo.maybe_mark_dynamic(visible, 0)
                return graph(state, visible)
            for mode, timed in (("eager", lambda: call(state, visible)), ("compiled", compiled_call)):
                seconds = median_seconds(timed, args.repeats)
                rows[f"{form} {mode}"] = {
                    "ms": seconds * 1e3, "compiled_target_steps": seconds / step_s,
                    "eager_target_steps": seconds / eager_step_s}
        # the drafted token decode.py drafts, eager and with --compile on: the draft as it builds
        # (and compiles) it, timed as what one more token adds to a proposal (its heads, sampling
        # and chain row), a proposal of 5 against one of 1, each after one committed pair
        for compiled_draft in (False, True):
            product = build_draft(args.draft, target, tokenizer)
            seconds = compile_draft(product) if compiled_draft else None
            features = torch.zeros(args.context - 1, 3 * target.args.dim, dtype=target.embed_tokens.weight.dtype)
            product.start(ids, features)

            def proposal(k):
                def call():
                    product.commit([ids[-1]], 0, features[-1:])
                    product.propose(k)
                return call
            token_s = (median_seconds(proposal(5), args.repeats) - median_seconds(proposal(1), args.repeats)) / 4
            form = "int8 weights" if isinstance(product.net.lm_head, Int8Linear) else "its dtype's weights"
            activations = str(product.net.fc.weight.dtype).removeprefix('torch.')
            command = "decode.py --compile on" if compiled_draft else "decode.py"
            rows[f"{command} ({activations} activations, {form})"] = {
                "ms": token_s * 1e3, "compiled_target_steps": token_s / step_s,
                "eager_target_steps": token_s / eager_step_s, "compile_seconds": seconds}
        dflash = dflash_block(args.dflash_draft, target, tokenizer, ids, args.repeats)
        for key in ("eager", "compiled", "compiled_forward", "target_head"):
            dflash[f"{key}_compiled_target_steps"] = dflash[f"{key}_ms"] / 1e3 / step_s
    result = {"machine": machine_stamp("cpu"),
              "config": {"target": DEFAULT_TARGET, "layout": layout_of(target), "draft": args.draft,
                         "context": args.context, "repeats": args.repeats},
              "target_step_ms": {"eager": eager_step_s * 1e3, "compiled": step_s * 1e3},
              # what a compiled chain of COMPILED_K costs before its draft tokens: its padded block
              "compiled_block_steps": {"block_len": COMPILED_K + 1, "steps": block_steps},
              "compiled_anatomy_ms": anatomy,
              "draft_token": rows,
              "dflash_block": dflash}
    out = write_results(args.out, result)
    print(f"target step: eager {eager_step_s * 1e3:.2f} ms, compiled {step_s * 1e3:.2f} ms; a compiled "
          f"block of {COMPILED_K + 1}: {block_steps:.2f} steps")
    for what, parts in anatomy.items():
        print(f"compiled {what.replace('_', ' ')}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in parts.items()))
    for name, row in rows.items():
        print(f"draft token, {name}: {row['ms']:.2f} ms = {row['compiled_target_steps']:.2f} compiled steps")
    print(f"DFlash block of {dflash['guesses']} guesses: eager {dflash['eager_ms']:.2f} ms, compiled "
          f"{dflash['compiled_ms']:.2f} ms, its forward compiled {dflash['compiled_forward_ms']:.2f} ms; "
          f"the target's head on its rows {dflash['target_head_ms']:.2f} ms")
    print(f"results: {out}")


if __name__ == "__main__":
    run_script(main, "interrupted: nothing written (the results are written once every timing is done)")
