"""
What a decode step costs on this machine: the decode-speed table (each layout's one-token step for a
target's shape with random weights, against the bandwidth floor of the bytes it reads, and what a
verification block costs against it), where a step spends its time (profiled), and what the cheaper
layouts cost in quality. bench.py's --decode-table, --profile-step and --weights-quality.
"""
import math
import statistics
import sys
import time

import torch
from tqdm import tqdm

from engine import linear_forms as LF
import model as M
from engine.files import DATA, read_jsonl
from engine.layouts import LAYOUTS, apply_layout, block_cost_model, layout_dtype, load_target
from engine.compiled import CompiledTarget

# -----------------------------------------------------------------------------
# Decode-speed table: the named targets' shapes with random weights, against the bandwidth floor.
# A decode step reads every weight once, so weight bytes / copy bandwidth is the fastest a step
# can be; the table says how close one eager or compiled step gets, and what verifying k+1 tokens
# in one forward costs next to one token (on a GPU the weights dominate, so it is close to 1).

SHAPES = {  # the fields of the published config.json files that fix the shape
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         rope_theta=1e5, tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     rope_theta=1e6, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         rope_theta=5e5, tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def seconds_per_call(fn, device: str, reps: int) -> float:
    """Median wall time of fn() over reps calls, after warm-up, with the device synchronized."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes per second of one large on-device copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), device, reps)


def random_target(shape: dict, device: str, dtype: torch.dtype) -> M.Transformer:
    """A target of the named shape with random weights, built in place on the device."""
    with torch.device("meta"):
        net = M.Transformer(M.ModelArgs.from_hf_config(shape)).to(dtype)
    net = net.to_empty(device=device).eval().requires_grad_(False)
    if net.args.tie_word_embeddings:  # to_empty may give the two names separate storage
        net.lm_head.weight = net.embed_tokens.weight
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    return net


def bytes_read_per_step(net: M.Transformer) -> int:
    """The bytes of weights a one-token step reads: every parameter and weight buffer (quantized
    codes and their scales, oneDNN-packed weights), the embedding table only as a tied lm_head (a
    step reads one row of it otherwise); not the KV cache or the RoPE tables."""
    tensors = {}
    for path, module in net.named_modules():
        if path == "embed_tokens" or isinstance(module, M.KVCache):
            continue
        own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if isinstance(module, LF.PackedLinear):  # its weight and bias are plain attributes
            own.update(weight=module.weight, bias=module.bias)
        for name, t in own.items():
            if t is not None and not (path == "" and name.startswith("rope_")):
                tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def cpu_layouts() -> list:
    """The layouts the CPU decode table times: every one load_target builds but float16."""
    return [layout for layout in LAYOUTS if layout != "float16" and
            not (layout == "bfloat16-packed" and not LF.packable(torch.bfloat16))]


def decode_speed_table(names, device: str, layouts, compile_modes=(False, True), verify_k=(3, 5, 7),
                       context: int = 256, reps: int = 20, copy_bytes: int = 1 << 30):
    """Per shape and weight layout: one decode step (eager, and compiled for the fp32 and int4 (CPU)
    or bf16 (CUDA) layouts when asked), against the bandwidth floor of the bytes that step reads, and
    what verifying k+1 tokens costs against it (compiled: chains of up to 8 tokens, every one a
    block of the longest padded, as decoding compiled runs them)."""
    bandwidth = copy_bandwidth(device, copy_bytes)
    compilable = ("bfloat16",) if device.startswith("cuda") else ("float32", "int4")
    rows = []
    for name in tqdm(names, desc="decode-speed table", file=sys.stderr):
        for layout in layouts:
            net = random_target(SHAPES[name], device, layout_dtype(layout))
            params_b = sum(p.numel() for p in {id(p): p for p in net.parameters()}.values()) / 1e9
            apply_layout(net, layout, device)
            net.setup_caches(1, context + max(verify_k) + 1)
            step_bytes = bytes_read_per_step(net)
            tokens = torch.randint(0, net.args.vocab_size, (1, context + max(verify_k) + 1), device=device)

            def measure(step, compile_mode, ks):
                def forward(n):  # n query tokens at the end of the context (a rewrite of the same slots)
                    pos = torch.arange(context, context + n, device=device)
                    return lambda: step(tokens[:, context:context + n], pos)
                t0 = time.perf_counter()
                one = seconds_per_call(forward(1), device, reps)
                verify = {k + 1: seconds_per_call(forward(k + 1), device, reps) / one for k in ks}
                rows.append({"target": name, "compiled": compile_mode is not None, "compile_mode": compile_mode,
                             "layout": layout, "params_b": params_b, "weight_gb_per_step": step_bytes / 1e9,
                             "bandwidth_gb_s": bandwidth / 1e9, "floor_ms": 1e3 * step_bytes / bandwidth,
                             "ms_per_token": 1e3 * one, "tokens_per_s": 1 / one,
                             "fraction_of_floor": step_bytes / bandwidth / one, "verify_cost": verify,
                             "wall_s": time.perf_counter() - t0})

            with torch.no_grad():
                net(tokens[:, :context], torch.arange(context, device=device))  # fill the cache once
                if False in compile_modes:
                    measure(net, None, verify_k)
                if True in compile_modes and layout in compilable:
                    # the decode path's graphs (engine.compiled): a step and one block of the longest
                    # chain, which shorter blocks are padded to (CUDA graphs on CUDA)
                    chains = [k for k in verify_k if k <= 7]
                    cuda = device.startswith("cuda")
                    measure(CompiledTarget(net, max(chains) + 1, (), "reduce-overhead" if cuda else "default"),
                            "reduce-overhead" if cuda else "freezing", chains)
            del net
            torch._dynamo.reset()  # drop the compiled graphs before the next layout
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_int_mm", "mkldnn::_linear_pointwise",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


@torch.no_grad()
def step_profile(target, blocks=(1, 8), context: int = 64) -> dict:
    """Where a forward of the loaded target spends its time on this machine, for each block size:
    the profiled time of the matmuls (the weights), of attention and of every other op, with
    their call counts. (The profiler adds a little to each call, so the total runs above a timed
    step's.)"""
    from torch.profiler import ProfilerActivity, profile
    tokens = torch.randint(0, target.args.vocab_size, (1, context + max(blocks)))
    target(tokens[:, :context], torch.arange(context))
    out = {}
    for n in blocks:
        def step():
            target(tokens[:, context:context + n], torch.arange(context, context + n))
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        parts = {"matmul": [0.0, 0], "attention": [0.0, 0], "other": [0.0, 0]}
        for event in prof.key_averages():
            kind = "matmul" if event.key in MATMUL_OPS else \
                "attention" if "scaled_dot_product" in event.key else "other"
            parts[kind][0] += event.self_cpu_time_total / 1e3
            # (an attention call runs a kernel op inside it: count the call once)
            parts[kind][1] += event.count if kind != "attention" or event.key == "aten::scaled_dot_product_attention" \
                else 0
        out[n] = {"profiled_ms": sum(ms for ms, _ in parts.values()),
                  **{f"{kind}_ms": ms for kind, (ms, _) in parts.items()},
                  **{f"{kind}_calls": calls for kind, (_, calls) in parts.items()}}
    return out


QUALITY_WEIGHTS = {"int8": "int8", "bfloat16": "bfloat16-packed", "int4": "int4"}  # compared with fp32


@torch.no_grad()
def weights_quality(target_name: str, n_texts: int, max_tokens: int = 400) -> dict:
    """What cheaper weights cost: on held-out text (GSM8K test questions with their reference
    answers, teacher-forced), how often the int8, bf16 and int4 targets' next-token argmax agrees
    with the fp32 one's, and the perplexities. {weights: {...}} per entry of QUALITY_WEIGHTS."""
    models = {"fp32": load_target(target_name, "cpu", "float32-packed", max_tokens)}
    models.update({w: load_target(target_name, "cpu", layout, max_tokens) for w, layout in QUALITY_WEIGHTS.items()})
    tokenizer = models["fp32"][1]
    agree, nll, count = dict.fromkeys(QUALITY_WEIGHTS, 0), dict.fromkeys(models, 0.0), 0
    for _, r in read_jsonl(DATA / "gsm8k_test.jsonl")[:n_texts]:
        ids = torch.tensor([tokenizer.encode(r["question"] + "\n" + r["answer"])[:max_tokens]])
        positions = torch.arange(ids.shape[1])
        logits = {name: model(ids, positions)[0][0, :-1].float() for name, (model, _, _) in models.items()}
        count += ids.shape[1] - 1
        for name, lg in logits.items():
            nll[name] += torch.nn.functional.cross_entropy(lg, ids[0, 1:], reduction="sum").item()
            if name != "fp32":
                agree[name] += (logits["fp32"].argmax(-1) == lg.argmax(-1)).sum().item()
    return {w: {"texts": n_texts, "tokens": count, "top1_agreement": agree[w] / count,
                "perplexity_fp32": math.exp(nll["fp32"] / count), "perplexity": math.exp(nll[w] / count)}
            for w in QUALITY_WEIGHTS}


def print_auto_choice(target_name: str, choice: dict, k: int):
    """What --dtype auto runs for this target here, and the numbers behind it."""
    if not choice:
        return
    cost = block_cost_model(choice, choice["layout"] in ("bfloat16-packed", "bfloat16", "int8", "int4"))
    why = "the fastest estimated one-token step" if choice["ms"] else f"the fixed order ({choice['fixed']})"
    print(f"\n--dtype auto for {target_name} here: {choice['layout']}, {why} "
          f"(drafting {'exact' if choice['layout'] not in choice['inexact'] else 'NOT exact: the default decodes plainly'})")
    print("| layout | one-token step (ms, est.) | blocks exact |\n|---|---|---|")
    for layout, ms in sorted(choice["ms"].items(), key=lambda item: item[1]):
        print(f"| {layout} | {ms:.1f} | {'no' if layout in choice['inexact'] else 'yes'} |")
    print(f"\nin {choice['layout']}, a block verifying n drafted tokens costs, in one-token steps:")
    print("| context | " + " | ".join(f"n={n}" for n in range(1, k + 1)) + " |\n" + "|---" * (k + 1) + "|")
    for context in (64, 1024, 4096):
        print(f"| {context} | " + " | ".join(f"{cost(n, context):.2f}" for n in range(1, k + 1)) + " |")
