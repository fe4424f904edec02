"""
Decoding: plain autoregressive sampling and speculative decoding, in one loop.

Each step feeds the target the last committed token plus the draft's k guesses at positions
[L-1, L+k-1], one forward. The verifier keeps n guesses and appends one more token, so a step
commits n+1 tokens; the target's KV cache needs no rewind beyond starting the next step at the new
position (stale entries past it are masked, then overwritten). With no draft, k = 0 and the loop is
ordinary autoregressive decoding: the baseline every speedup is measured against.

    python decode.py --prompt "Why is the sky blue?"                       # prompt lookup, greedy (the default)
    python decode.py --verifier none --temperature 0.7 --prompt "..."      # plain sampling
    python decode.py --target qwen3-4b --draft qwen3-0.6b --verifier overshoot --temperature 1
"""
import argparse
import codecs
import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch

import model as M
from checkpoints import DEFAULT_DRAFTS, EARLY_EXIT_DEFAULT, build_draft
from draft import AdaptiveDraft, NoDraft, tree_depths
from files import repo_path, repo_relative
from layouts import drafting_is_exact, layout_reason, load_target, run_block_costs, target_layout
from machine import compile_step, default_device, machine_problem, pick_threads, wants_compile
from prompts import read_prompts
from tokenizer import load_tokenizer
from verify import LOSSY, VERIFIERS, Verifier, probs_from_logits, verify, verify_tree
from weights import DEFAULT_TARGET, HF_REPOS, read_config, resolve_model

DECODE_K = 5  # tokens drafted per step by default (report.py measures the same)


@dataclass
class Stats:
    """What one generation's speculation did: the counters behind tau and the speed tables."""
    k: int
    forwards: int = 0  # target forwards, one per step
    drafted: int = 0  # tokens the draft proposed
    declined: int = 0  # positions the draft chose not to propose (early exit, no lookup match)
    draft_seconds: float = 0.0
    drafted_at: list = field(default_factory=list)  # per draft position: blocks that drafted it
    kept_at: list = field(default_factory=list)  # per draft position: blocks in which it was kept

    def __post_init__(self):
        self.drafted_at, self.kept_at = [0] * self.k, [0] * self.k

    def result(self, new: list, seconds: float, prefill_seconds: float, draft_forwards: int) -> dict:
        return {
            "tokens": new,
            "new_tokens": len(new),
            "seconds": seconds,
            "prefill_seconds": prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "tokens_per_s": len(new) / max(seconds - prefill_seconds, 1e-9),
            "target_forwards": self.forwards,
            "draft_forwards": draft_forwards,
            "drafted_tokens": self.drafted,
            "declined_tokens": self.declined,  # early exits and lookup misses alike
            "tau": len(new) / max(self.forwards, 1),
            # fraction of blocks that drafted position i in which the token at i was kept
            "accepted_per_position": [a / d if d else 0.0 for a, d in zip(self.kept_at, self.drafted_at)],
        }

    def count(self, asked: int, drafted: int, kept: int, depth: int | None = None):
        """One step: `asked` guesses wanted, `drafted` proposed, `kept` accepted; a tree also says
        its depth (acceptance by position is then by depth)."""
        self.forwards += 1
        self.drafted += drafted
        self.declined += asked - drafted
        for i in range(drafted if depth is None else depth):
            self.drafted_at[i] += 1
            self.kept_at[i] += i < kept


def speculative_step(step_fn, seq: list, draft, k: int, verifier: Verifier, stats: Stats, device,
                     temperature: float = 0.0, top_p: float = 1.0, generator=None, on_verify=None,
                     tree: int = 0, target=None):
    """The algorithm: the draft guesses k tokens; one target forward scores the last committed
    token and the k guesses at positions [L-1, L+k-1]; the verifier keeps n guesses and adds one
    token of its own. Returns the n + 1 new tokens, n, and the target's hidden states there.
    With a tree budget, the draft proposes a tree of at most `tree` nodes and depth k instead; the
    forward scores every node against its own ancestors, the verifier walks down one path, and
    the target's cache keeps that path (target.keep_path). on_verify(p, q, guesses, n), when
    given, sees what the verifier saw (lossy.py measures the distortion of each committed token
    from it); for a tree, guesses are the accepted path's and p, q its rows."""
    guesses, q, parents = torch.tensor([], dtype=torch.long), None, None
    if k > 0:  # (plain decoding pays no timing and no GPU sync here)
        t0 = time.perf_counter()
        if tree:
            guesses, parents, q = draft.propose_tree(tree, k)
        else:
            guesses, q = draft.propose(k)
        synchronize(device)
        stats.draft_seconds += time.perf_counter() - t0
    x = torch.cat([torch.tensor([seq[-1]]), guesses.cpu()]).to(device)[None]  # (1, n_guesses + 1)
    positions = torch.arange(len(seq) - 1, len(seq) + len(guesses), device=device)
    chain_shaped = parents is None or parents == list(range(-1, len(guesses) - 1))
    logits, hidden = step_fn(x, positions, hidden_layers=draft.target_layers,
                             tree_parents=None if chain_shaped else parents)
    p = probs_from_logits(logits[0], temperature, top_p)  # (n_guesses + 1, V)
    q = None if q is None else q.to(device)
    if parents is None:
        n, next_token = verify(p[None], None if q is None else q[None], guesses.to(device)[None], verifier,
                               generator)
        n = int(n)  # the one host sync of the step
        stats.count(k, len(guesses), n)
    else:
        path, next_token = verify_tree(p, q, guesses.to(device), parents, verifier, generator)
        n, rows = len(path), [0] + [i + 1 for i in path]  # the root's row and the accepted nodes'
        target.keep_path([len(seq) + i for i in path], len(seq))
        depth = max(tree_depths(parents), default=0)
        stats.count(tree, len(guesses), n, depth=depth)  # (a tree is asked for `tree` nodes)
        guesses, p = guesses[path], p[rows]
        q = None if q is None else q[path]
        hidden = [h[:, rows] for h in hidden]
    if on_verify is not None:
        on_verify(p, q, guesses, n)
    return guesses[:n].tolist() + [int(next_token)], n, hidden


def exact_verifier(temperature: float) -> Verifier:
    """The rule that keeps the output the target's own: greedy at T = 0, lossless speculative
    sampling at T > 0 (with no draft, k = 0, that is plain sampling from the warped p)."""
    return Verifier("greedy" if temperature <= 0 else "lossless")


@torch.inference_mode()  # (no_grad's version and view tracking cost a few percent of a CPU step)
def generate(target, prompt_ids: list, draft=None, verifier: Verifier | None = None, k: int = 0,
             max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, stop_ids=(),
             generator: torch.Generator | None = None, on_tokens=None, step_fn=None, on_verify=None,
             tree: int = 0) -> dict:
    """Generate up to max_new_tokens tokens after prompt_ids, speculatively when a draft is given
    (plain decoding is the case of no draft, k = 0). The verifier defaults to the exact rule for the
    temperature; greedy at T > 0 is refused, as it would emit the argmax whatever T says. Returns
    the new ids and statistics: tau (new tokens per target forward, bonus included), forwards,
    per-position acceptance. tree > 0 drafts trees of at most `tree` nodes and depth k instead of
    chains of k."""
    verifier = exact_verifier(temperature) if verifier is None else verifier
    step_fn = target if step_fn is None else step_fn  # (a compiled module has no truth value)
    draft, k = (NoDraft(), 0) if draft is None else (draft, k)
    check_request(target.max_seq_len, len(prompt_ids), max_new_tokens, max(k, tree if k else 0), verifier,
                  temperature)
    device, L = target.embed_tokens.weight.device, len(prompt_ids)
    t_start = time.perf_counter()
    draft_forwards_before = draft.forwards
    # prefill everything but the last prompt token: each step starts by feeding that one
    _, hidden = target(torch.tensor([prompt_ids[:-1]], device=device), torch.arange(L - 1, device=device),
                       hidden_layers=draft.target_layers, last_logits_only=True) if L > 1 else (None, [])
    draft.start(prompt_ids, torch.cat(hidden, -1)[0] if hidden else None)  # (L-1, n_layers * dim)
    synchronize(device)
    t_prefill = time.perf_counter() - t_start
    seq, new, stats = list(prompt_ids), [], Stats(k)
    while len(new) < max_new_tokens:
        # guesses past the token budget are wasted; a DFlash block holds at most block_size - 1
        budget = min(k, max_new_tokens - len(new) - 1, draft.max_tokens)
        out, n, hidden = speculative_step(step_fn, seq, draft, budget, verifier, stats, device,
                                          temperature=temperature, top_p=top_p, generator=generator,
                                          on_verify=on_verify, tree=tree, target=target)
        # a stop token, even inside a kept block, ends generation there
        stop = next((j for j, t in enumerate(out) if t in stop_ids), None)
        out = out[:min(len(out) if stop is None else stop + 1, max_new_tokens - len(new))]
        seq += out
        new += out
        if on_tokens is not None:
            on_tokens(out, min(n, len(out)))  # (the first n came from the draft)
        if stop is not None or len(new) >= max_new_tokens:
            break
        # the target's states at the committed positions: the token fed and the n kept
        draft.commit(out, n, torch.cat(hidden, -1)[0, :n + 1] if hidden else None)
    synchronize(device)
    return stats.result(new, time.perf_counter() - t_start, t_prefill, draft.forwards - draft_forwards_before)


def check_request(max_seq_len: int, L: int, max_new_tokens: int, k: int, verifier: Verifier,
                  temperature: float):
    """A one-line error for what generate cannot do: an empty prompt, more positions than the
    cache holds, greedy verification at T > 0 (it would emit the argmax whatever T says)."""
    if verifier.name == "greedy" and temperature > 0:
        raise ValueError(f"the greedy verifier keeps the target's argmax, which is temperature 0; at "
                         f"temperature {temperature:g} use lossless (or a lossy verifier)")
    if L == 0:
        raise ValueError("empty prompt")
    if L + max_new_tokens + k > max_seq_len:
        raise ValueError(f"prompt of {L} tokens + {max_new_tokens} new + {k} drafted needs "
                         f"{L + max_new_tokens + k} positions; the context holds {max_seq_len} "
                         f"(lower --max-new-tokens or raise --max-seq-len)")


def synchronize(device: torch.device):
    """Wait for the GPU, so wall times measure the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def get_args(argv=None):
    ap = argparse.ArgumentParser(description="Plain and speculative decoding with a verifier of your choice.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (add_speculation_args, add_lossy_args, add_prompt_args, add_machine_args):
        add(ap)
    args = ap.parse_args(argv)
    check_and_complete(ap, args)
    return args


def threshold(value: str):
    """--early-exit's value: 'auto' or a number (its range is checked with the other settings)."""
    return value if value == "auto" else float(value)


def add_speculation_args(ap):
    """What decodes: the target, the draft, the verifier and how much is drafted."""
    g = ap.add_argument_group("target, draft and verifier")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"model name ({', '.join(HF_REPOS)}) or a Hugging Face model directory")
    g.add_argument("--draft", default=None,
                   help="lookup (prompt lookup, the default), a trained draft's directory, eagle3:DIR, dflash:DIR, "
                        "a model sharing the target's tokenizer, or lookup+ONE OF THOSE (lookup where it matches)")
    g.add_argument("--verifier", default=None, choices=("none",) + VERIFIERS,
                   help="'none' is plain autoregressive decoding (sampling at T > 0); default: greedy at "
                        "T = 0, lossless at T > 0")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=DECODE_K, help="tokens drafted per step")
    g.add_argument("--early-exit", nargs="?", const="auto", default=None,
                   type=threshold,
                   help="EAGLE-3/DFlash: stop drafting where the verification head's probability falls below this "
                        f"(bare flag: the draft's recorded threshold, else {EARLY_EXIT_DEFAULT})")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="draft each step the length (with --tree: EAGLE-3's tree size, T = 0) that pays, from "
                        "recent acceptance and what a block costs here; none: a plain step. Default: on with lookup")
    g.add_argument("--tree", type=int, default=0, metavar="N",
                   help="draft a tree of at most N tokens (depth at most -k), verified in one forward: EAGLE-2's "
                        "dynamic tree for EAGLE-3, several matches for lookup. 0 (default): chains")
    g.add_argument("--show", action="store_true",
                   help="colour each token by where it came from: a draft token the verifier kept (by its "
                        "position in the block) or the target's own; plain text when stdout is not a terminal")


def add_lossy_args(ap):
    """The parameters of verify.py's lossy verifiers."""
    g = ap.add_argument_group("lossy verifiers' parameters")
    g.add_argument("--p-base", type=float, default=0.1, help="minp: keep x iff p(x) >= p_base * max p")
    g.add_argument("--eps", type=float, default=3e-4,
                   help="eta: keep x iff p(x) >= min(eps, delta*exp(-H(p))); 3e-4 is eta-sampling's "
                        "setting, 0.09 Medusa's typical acceptance")
    g.add_argument("--delta", type=float, default=None, help="eta: default sqrt(eps), as eta-sampling")
    g.add_argument("--lam", type=float, default=0.5,
                   help="cos / overshoot: weight of p in lam*p + (1-lam)*q")
    g.add_argument("--lenience", type=float, default=0.5, help="lenience: accept with min(1, p/(l*q))")
    g.add_argument("--ceiling", type=float, default=2.0,
                   help="overshoot: an overshot token gets at most c*p(x)")


def add_prompt_args(ap):
    """What is asked, and how the answer is sampled."""
    g = ap.add_argument_group("prompt and sampling")
    g.add_argument("--prompt", default=None, help="the user message (default: a short demo question)")
    g.add_argument("--prompt-file", default=None,
                   help="a text file (one prompt) or jsonl (Spec-Bench, ShareGPT, Alpaca, GSM8K records)")
    g.add_argument("--system", default=None, help="system message (default: the model's own, if any)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy; default 0, or 1 with a lossy verifier (at 0 every verifier keeps "
                        "exactly the target's argmax, so a lossy one would change nothing)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)


def add_machine_args(ap):
    """How the target's weights are laid out and on what they run, and the output format."""
    g = ap.add_argument_group("weights and machine")
    g.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length (capped by the model's)")
    g.add_argument("--device", default=default_device())
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8", "int4"),
                   help="the target's weights. auto (default): one layout for the whole run, the fastest exact one "
                        "timed here (README: weight layouts); int8/int4 change the model a little")
    g.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="torch.compile the decode step; auto: on for CUDA only. On a CPU the one-token step compiles "
                        "once (slowly at first, then cached on disk), which pays only over long runs")
    g.add_argument("--no-pack", dest="pack", action="store_false",
                   help="with --dtype float32 or bfloat16 on CPU, keep nn.Linear weights unpacked (not oneDNN's layout)")
    g.add_argument("--threads", default="auto",
                   help="CPU threads; auto: one per core idle when decoding starts (a thread on a busy core stalls "
                        "the others)")
    g.add_argument("--json", action="store_true", help="end with one JSON line of results per prompt")


def check_temperature(value: float, flag: str = "--temperature") -> str | None:
    if not math.isfinite(value) or value < 0:
        return f"{flag} must be a finite number >= 0, got {value}"
    return None


def check_and_complete(ap, args):
    """Refuse bad values in one line, then fill in what was left out (README: the defaults table)."""
    for name in ("temperature", "top_p", "p_base", "eps", "delta", "lam", "lenience", "ceiling"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            ap.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.num_draft_tokens < 1:
        ap.error(f"-k must be >= 1, got {args.num_draft_tokens}")
    problem = machine_problem(args.device, args.threads, args.dtype, wants_compile(args.compile, args.device))
    if problem:
        ap.error(problem)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.prompt is not None and not args.prompt.strip():
        ap.error("--prompt is empty")
    if isinstance(args.early_exit, float) and not 0 <= args.early_exit <= 1:
        ap.error(f"--early-exit must lie in [0, 1], got {args.early_exit}")
    lossy = args.verifier in LOSSY
    if args.temperature is None:
        args.temperature = 1.0 if lossy else 0.0
        if lossy:
            print(f"note: {args.verifier} verifies sampled tokens, so --temperature defaults to 1 here "
                  f"(at 0 every verifier keeps exactly the target's argmax)", file=sys.stderr)
    elif lossy and args.temperature == 0:
        print(f"note: at --temperature 0 the {args.verifier} verifier is greedy verification: it keeps "
              f"exactly the target's argmax tokens (set --temperature > 0 to see what it changes)",
              file=sys.stderr)
    if check_temperature(args.temperature):
        ap.error(check_temperature(args.temperature))
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.verifier == "greedy" and args.temperature > 0:
        ap.error("--verifier greedy keeps the target's argmax, which is --temperature 0; at T > 0 use "
                 "lossless (or a lossy verifier)")
    committed = DEFAULT_DRAFTS.get(args.target)
    if args.draft is None and lossy:
        args.draft = str(committed) if committed is not None and committed.is_dir() else "lookup"
    args.default_draft = args.draft is None and args.verifier is None
    if args.default_draft:
        args.draft = "lookup"  # exact at any temperature, and drafting only where it pays (--adaptive)
    if args.verifier is None:
        args.verifier = "none" if args.draft is None else ("greedy" if args.temperature == 0 else "lossless")
    if args.verifier != "none" and args.draft is None:
        args.draft = "lookup"  # a verifier needs something to verify; the training-free draft
    if args.tree < 0:
        ap.error(f"--tree takes a number of draft tokens >= 1 (0: chains), got {args.tree}")
    if args.tree and args.verifier == "none":
        ap.error("--tree drafts trees for a verifier to check; with --verifier none nothing is drafted")
    if args.tree and args.adaptive and args.temperature > 0:
        ap.error("--adaptive sizes trees at --temperature 0 only: at T > 0 a tree's nodes are drawn, and "
                 "pruning drawn nodes by their value would bias what the verifier sees")
    if args.tree and wants_compile(args.compile, args.device) and args.device != "cpu":
        ap.error("--tree needs --compile off on CUDA: a compiled step there has one static graph per block shape, "
                 "and every tree has a shape of its own")
    if args.adaptive is None:
        args.adaptive = args.draft == "lookup" and not args.tree


def adaptive(draft, target, tree: int = 0, temperature: float = 0.0) -> AdaptiveDraft:
    """The draft with its length (or with tree > 0, its tree's size) chosen each step by what a
    block costs on this machine, in the run's layout (draft.AdaptiveDraft; layouts.block_cost_model)."""
    if tree and not (getattr(draft, "sizes_trees", False) and temperature <= 0):
        raise ValueError("adaptive trees are sized for EAGLE-3 drafts at temperature 0, whose tree nodes come "
                         "ranked (at T > 0 pruning drawn nodes would bias the verifier): drop --adaptive or --tree")
    return AdaptiveDraft(draft, *run_block_costs(target))


def make_verifier(name: str, temperature: float, **params) -> Verifier:
    """--verifier as a rule: 'none' (plain decoding) is the exact rule for the temperature, which
    with no draft draws every token from the target's warped distribution."""
    return exact_verifier(temperature) if name == "none" else Verifier(name, **params)


class TokenColours:
    """--show: a kept draft token in the colour of its position in the block (1st, 2nd, ... kept),
    the target's own token (a correction or bonus, or every token of plain decoding) uncoloured."""
    BY_DEPTH = ("32", "36", "34", "35", "33")  # green, cyan, blue, magenta, yellow (and deeper)

    def __init__(self, on: bool):
        self.on = on

    def paint(self, piece: str, depth: int) -> str:
        if not self.on or depth == 0 or not piece:
            return piece
        return f"\x1b[{self.BY_DEPTH[min(depth, len(self.BY_DEPTH)) - 1]}m{piece}\x1b[0m"

    def legend(self, k: int) -> str:
        kept = " ".join(self.paint(f"kept #{d}", d) for d in range(1, min(k, len(self.BY_DEPTH)) + 1))
        return f"[--show: {kept}; uncoloured: the target's own token]"


def summary_line(result: dict, args, speculative: bool) -> str:
    """What speculation did for one answer, in one line for stderr."""
    how = "plain decoding"
    if speculative:
        how = f"{repo_relative(args.draft)} draft, {args.verifier} verifier, k={args.num_draft_tokens}"
        how += f", trees of {args.tree}" if args.tree else ""
    line = (f"[{how}, T={args.temperature:g}, {args.layout} weights] {result['new_tokens']} tokens at "
            f"{result['tokens_per_s']:.1f} tok/s, {result['target_forwards']} target forwards")
    if speculative:
        kept = result["new_tokens"] - result["target_forwards"]  # every forward adds one token of its own
        line += (f", tau {result['tau']:.2f} ({result['drafted_tokens']} drafted, {max(kept, 0)} kept, "
                 f"{100 * result['draft_seconds'] / max(result['seconds'], 1e-9):.0f}% of the time drafting)")
    return line


def encode_prompts(args, tokenizer, context: int, verifier: Verifier) -> list:
    """The prompts of --prompt or --prompt-file as token ids (chat-templated unless --raw), each
    checked to fit the context with the tokens the run may add."""
    prompts = read_prompts(repo_path(args.prompt_file)) if args.prompt_file else \
        [args.prompt if args.prompt is not None else "Explain in three sentences why the sky is blue."]
    system = [{"role": "system", "content": args.system}] if args.system else []
    encoded = [tokenizer.encode(text) if args.raw else tokenizer.encode_chat(system + [{"role": "user", "content": text}])
               for text in prompts]
    k = args.num_draft_tokens if args.verifier != "none" else 0
    for ids in encoded:
        if args.tree and len(ids) + args.max_new_tokens + args.tree > context:
            raise ValueError(f"--tree {args.tree} drafts up to {args.tree} tokens a step: after a prompt of {len(ids)} "
                             f"tokens and --max-new-tokens {args.max_new_tokens} the context of {context} has room "
                             f"for {max(context - len(ids) - args.max_new_tokens, 0)}; lower --tree")
        check_request(context, len(ids), args.max_new_tokens, k, verifier, args.temperature)
    return encoded


def run_draft(args, target, tokenizer, generator, step_fn=None):
    """The run's draft, or None. Where the layout's blocks (in the run's forward step_fn, default
    the target's own) are not exact here, the default decodes plainly (drafting would change the
    output) and a draft asked for is run with a warning. So it does where a CPU run compiles its
    one-token steps (machine.compile_step) and verifies with eager blocks: inductor's kernels
    compute some functions (exp, rsqrt) to other last bits than eager code, and now and then a
    value rounds to another bf16, so a block's row can part from the compiled step's."""
    if args.verifier == "none":
        return None
    if target.one_token_trunk is not None:
        why, remedy = "--compile on compiles one-token steps only, and blocks round a few values otherwise", \
            "--compile off"
    elif not drafting_is_exact(target, args.num_draft_tokens + 1, step_fn):
        why, remedy = f"on this CPU {target.layout} blocks do not give the bits of one-token steps", "--dtype float32"
    else:
        why = None
    if why:
        print(f"note: {why}, so drafting changes the output" + (": decoding plainly" if args.default_draft else "") +
              f" ({remedy} drafts exactly)", file=sys.stderr)
        if args.default_draft:
            args.verifier, args.draft = "none", None
            return None
    draft = build_draft(args.draft, target, tokenizer, temperature=args.temperature, top_p=args.top_p,
                        generator=generator, early_exit=args.early_exit)
    return adaptive(draft, target, args.tree, args.temperature) if args.adaptive else draft


def main(argv=None):
    args = get_args(argv)
    verifier = make_verifier(args.verifier, args.temperature, p_base=args.p_base, eps=args.eps,
                             delta=args.delta, lam=args.lam, lenience=args.lenience,
                             ceiling=args.ceiling)  # bad parameters fail before any weights load
    if args.device == "cpu":
        torch.set_num_threads(pick_threads(args.threads))
    compiled = wants_compile(args.compile, args.device)
    path = resolve_model(args.target)
    tokenizer = load_tokenizer(path)
    context = min(args.max_seq_len, M.ModelArgs.from_hf_config(read_config(path)).max_position_embeddings)
    encoded = encode_prompts(args, tokenizer, context, verifier)  # every prompt checked before loading
    layout = target_layout(args.dtype, args.device, compiled, args.pack)
    # the cache holds what this run can reach, not all of --max-seq-len
    reach = max(len(ids) for ids in encoded) + args.max_new_tokens + max(args.num_draft_tokens, args.tree) + 1
    target, _ = load_target(str(path), args.device, layout, min(context, reach))
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    print(f"[{layout_reason(target)}]", file=sys.stderr)
    step_fn = compile_step(target) if compiled else target
    if compiled and args.device == "cpu":
        # compiled here, once, rather than inside the first prompt's timing (a key count of 0 or 1
        # would be compiled as a constant: the step runs at a later slot, which the prefill rewrites)
        t0 = time.perf_counter()
        with torch.inference_mode():
            target(torch.zeros(1, 1, dtype=torch.long), torch.tensor([min(8, target.max_seq_len - 1)]))
        print(f"note: --compile on: the one-token step compiled in {time.perf_counter() - t0:.0f} s (the first time "
              f"slowly, then from inductor's cache on disk); blocks and trees run uncompiled", file=sys.stderr)
    elif compiled:
        print("note: --compile on compiles the step for each block length the run meets, when it first meets it",
              file=sys.stderr)
    draft = run_draft(args, target, tokenizer, generator, step_fn if compiled else None)
    args.layout = target.layout

    show = TokenColours(args.show and sys.stdout.isatty())
    if show.on:
        print(show.legend(args.num_draft_tokens), file=sys.stderr)
    for ids in encoded:
        stop_ids = tokenizer.stop_ids
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def stream(new_ids, n_kept):
            for depth, token in enumerate(new_ids, 1):
                piece = utf8.decode(tokenizer.decode_bytes([token] if token not in stop_ids else []))
                sys.stdout.write(show.paint(piece, depth if depth <= n_kept else 0))
            sys.stdout.flush()

        result = generate(target, ids, draft, verifier, k=args.num_draft_tokens,
                          max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, stop_ids=stop_ids,
                          generator=generator,
                          on_tokens=stream, step_fn=step_fn, tree=args.tree)
        sys.stdout.write(utf8.decode(b"", final=True) + "\n")
        sys.stdout.flush()
        print(summary_line(result, args, draft is not None), file=sys.stderr)
        if args.json:
            result["text"] = tokenizer.decode([t for t in result["tokens"] if t not in stop_ids])
            result.update(target=args.target, draft=repo_relative(args.draft) if draft else None,
                          verifier=args.verifier, layout=target.layout, tree=args.tree,
                          k=args.num_draft_tokens if draft else 0, temperature=args.temperature)
            print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except (M.CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
