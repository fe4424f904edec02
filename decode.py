"""
Decoding from the command line: plain autoregressive sampling and speculative decoding, through
the one loop of speculative.py, with the draft, verifier, layout and machine a user asks for, and
defaults that never print other text than plain decoding at T = 0.

    python decode.py --prompt "Why is the sky blue?"                       # prompt lookup, greedy (the default)
    python decode.py --verifier none --temperature 0.7 --prompt "..."      # plain sampling
    python decode.py --target qwen3-4b --draft qwen3-0.6b --verifier overshoot --temperature 1
"""
import argparse
import codecs
import json
import math
import sys

import torch

import model as M
from engine.checkpoints import (CONFIDENCE_EXIT_DEFAULT, DEFAULT_DRAFTS, EARLY_EXIT_DEFAULT, build_draft,
                                draft_spec_problem)
from engine.compiled import COMPILED_K, cache_slots, compile_draft, compile_target, start_compiler
from engine.files import repo_path, repo_relative
from engine.layouts import (drafting_is_exact, forget_timings, layout_of, layout_reason, load_target, run_block_costs,
                            target_layout)
from engine.timing_cache import recheck_kept_timing
from engine.machine import (ArgumentParser, DefaultsHelpFormatter, add_machine_options, compiled_draft_problem,
                            machine_problem, pick_threads, run_script, wall_clock, wants_compile)
from data.prompts import read_prompts
from draft import EXIT_SIGNALS
from speculative import DECODE_K, adaptive, adaptive_tree_problem, check_request, exact_verifier, generate
from tokenizer import load_tokenizer
from verify import LOSSY, VERIFIERS, Verifier, check_temperature
from engine.weights import DEFAULT_TARGET, HF_REPOS, read_config, resolve_model


def get_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = ArgumentParser(description="Plain and speculative decoding with a verifier of your choice.",
                        formatter_class=DefaultsHelpFormatter, argv=argv)
    for add in (add_first_args, add_drafting_args, add_lossy_args, add_sampling_args, add_machine_args):
        add(ap)
    args = ap.parse_args(argv)
    check_and_complete(ap, args)
    return args


def threshold(value: str):
    """--early-exit's value: 'auto' or a number (its range is checked with the other settings)."""
    return value if value == "auto" else float(value)


def add_first_args(ap):
    """What a user types first: the target, the draft, the verifier, the prompt and how to sample."""
    g = ap.add_argument_group("what decodes what")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"model name ({', '.join(HF_REPOS)}) or a Hugging Face model directory")
    g.add_argument("--draft", default=None,
                   help="lookup (prompt lookup, the default), a trained draft's directory, eagle3:DIR, dflash:DIR, "
                        "a model sharing the target's tokenizer, or lookup+ONE OF THOSE (lookup where it matches)")
    g.add_argument("--verifier", default=None, choices=("none",) + VERIFIERS,
                   help="'none' is plain decoding; default: greedy at T = 0, lossless at T > 0")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help=f"tokens drafted per step (default: {DECODE_K}; compiled, {COMPILED_K})")
    g.add_argument("--prompt", default=None, help="the user message (default: a short demo question)")
    g.add_argument("--prompt-file", default=None,
                   help="a text file (one prompt) or jsonl (Spec-Bench, ShareGPT, Alpaca, GSM8K records)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy; default 0, or 1 with a lossy verifier (at 0 it would change nothing)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="at most this many tokens an answer")


def add_drafting_args(ap):
    """How much is drafted, and how the answer is shown."""
    g = ap.more_options("drafting")
    g.add_argument("--early-exit", nargs="?", const="auto", default=None,
                   type=threshold,
                   help="EAGLE-3/DFlash: stop drafting where the exit signal falls below this. Default and bare "
                        f"flag: the draft's recorded threshold, else {EARLY_EXIT_DEFAULT} (the confidence: "
                        f"{CONFIDENCE_EXIT_DEFAULT}); 0: never")
    g.add_argument("--early-exit-signal", default=None, choices=EXIT_SIGNALS,
                   help="what early exit reads: VAT's verification head (default; its probability that the "
                        "token is kept) or the draft's confidence (its probability of its top token)")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="draft each step the length (with --tree: EAGLE-3's tree size) that pays here; none: a "
                        "plain step. Default: on, off with --tree; --no-adaptive drafts -k tokens every step")
    g.add_argument("--tree", type=int, default=0, metavar="N",
                   help="draft a tree of at most N tokens (depth at most -k), verified in one forward: EAGLE-2's "
                        "dynamic tree for EAGLE-3, several matches for lookup. 0 (default): chains")
    g.add_argument("--show", action="store_true",
                   help="colour each token by where it came from: a draft token the verifier kept (by its "
                        "position in the block) or the target's own; plain text when stdout is not a terminal")


def add_lossy_args(ap):
    """The parameters of verify.py's lossy verifiers."""
    g = ap.more_options("lossy verifiers' parameters")
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


def add_sampling_args(ap):
    """The rest of what is asked, and how the answer is sampled."""
    g = ap.more_options("prompt and sampling")
    g.add_argument("--system", default=None, help="system message (default: the model's own, if any)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)


def add_machine_args(ap):
    """How the target's weights are laid out and on what they run, and the output format."""
    g = ap.more_options("weights and machine")
    g.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length (capped by the model's)")
    add_machine_options(g, "device", "dtype", "compile", "threads")
    g.add_argument("--no-pack", dest="pack", action="store_false",
                   help="with --dtype float32 or bfloat16 on CPU, keep nn.Linear weights unpacked (not oneDNN's layout)")
    g.add_argument("--retime", action="store_true",
                   help="time the weight layouts again before loading (a kept timing made while the machine was "
                        "busy would steer --dtype auto and --adaptive); run it with nothing else busy")
    g.add_argument("--json", action="store_true", help="end with one JSON line of results per prompt")


def check_and_complete(ap, args):
    """Refuse bad values in one line, then fill in what was left out (README: the defaults table)."""
    for name in ("temperature", "top_p", "p_base", "eps", "delta", "lam", "lenience", "ceiling"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            ap.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.num_draft_tokens is None:
        args.num_draft_tokens = COMPILED_K if wants_compile(args.compile, args.device) else DECODE_K
    if args.num_draft_tokens < 1:
        ap.error(f"-k must be >= 1, got {args.num_draft_tokens}")
    if args.max_seq_len < 2:
        ap.error(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    if not 0 <= args.seed < 2 ** 63:  # (torch's generators take a 64-bit seed)
        ap.error(f"--seed must lie in [0, 2^63), got {args.seed}")
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
    complete_draft(ap, args, lossy)
    if args.tree < 0:
        ap.error(f"--tree takes a number of draft tokens >= 1 (0: chains), got {args.tree}")
    if args.tree and args.verifier == "none":
        ap.error("--tree drafts trees for a verifier to check; with --verifier none nothing is drafted")
    if args.adaptive and adaptive_tree_problem(args.tree, args.temperature):
        ap.error(adaptive_tree_problem(args.tree, args.temperature))
    problem = compiled_draft_problem(args.num_draft_tokens, bool(args.tree))
    if wants_compile(args.compile, args.device) and args.verifier != "none" and problem:
        ap.error(problem)
    if args.adaptive is None:  # every draft's chain: a draft that does not pay here then costs only its probes
        args.adaptive = not args.tree
    complete_early_exit(ap, args)


def complete_draft(ap, args, lossy: bool):
    """--draft and --verifier: their defaults (adaptive lookup and the exact verifier; a lossy
    verifier's, lookup and the committed chat draft), and a draft refused before the target loads
    where it names nothing that can draft or nothing would verify it."""
    committed = DEFAULT_DRAFTS.get(args.target)
    if args.draft is None and lossy:  # the trained draft, and lookup where the context repeats
        args.draft = f"lookup+{committed}" if committed is not None and committed.is_dir() else "lookup"
    args.default_draft = args.draft is None and args.verifier is None
    if args.default_draft:
        args.draft = "lookup"  # exact at any temperature, and drafting only where it pays (--adaptive)
    if args.verifier is None:
        args.verifier = "none" if args.draft is None else ("greedy" if args.temperature == 0 else "lossless")
    if args.verifier != "none" and args.draft is None:
        args.draft = "lookup"  # a verifier needs something to verify; the training-free draft
    if args.verifier == "none" and args.draft is not None:
        ap.error("--draft proposes tokens for a verifier to check; --verifier none decodes plainly "
                 "(drop --draft)")
    if args.verifier != "none" and draft_spec_problem(args.draft):  # (before the target loads)
        ap.error(draft_spec_problem(args.draft))


def complete_early_exit(ap, args):
    """--early-exit and --early-exit-signal: refused where nothing can exit (they would change
    nothing), else their defaults: the draft's recorded threshold, read by VAT's head."""
    asked = [flag for flag, value in (("--early-exit", args.early_exit),
                                      ("--early-exit-signal", args.early_exit_signal)) if value is not None]
    if asked and (args.verifier == "none" or args.draft == "lookup"):
        why = "--verifier none drafts nothing" if args.verifier == "none" else "prompt lookup has no exit signal"
        ap.error(f"{' and '.join(asked)} stop an EAGLE-3 or DFlash draft's chain early; {why}")
    args.early_exit = "auto" if args.early_exit is None else args.early_exit
    args.early_exit_signal = args.early_exit_signal or "head"


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


def draft_shown(spec: str) -> str:
    """--draft as outputs show it: a path inside the repository (also after lookup+) as a relative one."""
    hybrid = spec.startswith("lookup+")
    return ("lookup+" if hybrid else "") + repo_relative(spec.removeprefix("lookup+"))


def summary_line(result: dict, args, speculative: bool, layout: str) -> str:
    """What speculation did for one answer, in one line for stderr."""
    how = "plain decoding"
    if speculative:
        how = f"{draft_shown(args.draft)} draft, {args.verifier} verifier, k={args.num_draft_tokens}"
        how += f", trees of {args.tree}" if args.tree else ""
    line = (f"[{how}, T={args.temperature:g}, {layout} weights] {result['new_tokens']} tokens at "
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
    drafted = max(args.num_draft_tokens, args.tree) if args.verifier != "none" else 0
    remedy = "lower --max-new-tokens, -k or --tree, or raise --max-seq-len"
    if context < args.max_seq_len:  # the model's own limit binds, not --max-seq-len
        remedy = "the model's max_position_embeddings: a shorter prompt, or lower --max-new-tokens, -k or --tree"
    for ids in encoded:
        check_request(context, len(ids), args.max_new_tokens, drafted, verifier, args.temperature, remedy)
    return encoded


def run_draft(args, target, tokenizer, generator):
    """The draft asked for, built, or None (--verifier none)."""
    if args.verifier == "none":
        return None
    return build_draft(args.draft, target, tokenizer, temperature=args.temperature, top_p=args.top_p,
                       generator=generator, early_exit=args.early_exit, exit_signal=args.early_exit_signal)


def exact_draft(args, target, choice: dict, draft, compiled=None):
    """The draft the run decodes with: None where the run's blocks (compiled's, when the run is
    compiled) do not give the bits of its one-token steps here and the draft is the default one
    (drafting would change the output; a draft asked for runs, with a warning), and with
    --adaptive its length chosen each step by what its blocks cost."""
    if draft is None:
        return None
    def exact():
        return drafting_is_exact(target, choice, args.num_draft_tokens + 1, compiled)
    if not (compiled.kept_check("blocks give the bits of steps", exact) if compiled is not None else exact()):
        remedy = "--compile off" if compiled is not None else "--dtype float32"
        print(f"note: on this CPU {layout_of(target)} blocks of {args.num_draft_tokens + 1} tokens do not give the "
              "bits of one-token steps, so drafting changes the output" +
              (": decoding plainly" if args.default_draft else "") +
              f" ({remedy} drafts exactly)", file=sys.stderr)
        if args.default_draft:
            return None
    if not args.adaptive:
        return draft
    costs = compiled.block_costs() if compiled is not None and args.device == "cpu" else run_block_costs(target, choice)
    return adaptive(draft, costs, args.tree, args.temperature, wall_clock(args.device))


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
    if args.retime:
        print(f"note: --retime: {forget_timings(path)} kept layout timings of this model dropped", file=sys.stderr)
    # the cache holds what this run can reach, not all of --max-seq-len
    reach = max(len(ids) for ids in encoded) + args.max_new_tokens + max(args.num_draft_tokens, args.tree) + 1
    slots = cache_slots(reach, context) if compiled else min(context, reach)
    compiler = start_compiler() if compiled and args.device == "cpu" else None  # (while the weights load)
    target, _, choice = load_target(str(path), args.device, layout, slots)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    print(f"[{layout_reason(target, choice)}]", file=sys.stderr)
    draft = run_draft(args, target, tokenizer, generator)
    block = args.num_draft_tokens + 1 if draft else 1
    step_fn = compile_target(target, block, draft.target_layers if draft else (), args.device,
                             compiler) if compiled else None
    if compiled:
        compile_draft(draft)
    draft = exact_draft(args, target, choice, draft, step_fn)
    results = decode_prompts(args, encoded, target, tokenizer, draft, verifier, generator, step_fn)
    if args.device == "cpu" and not compiled:  # (a compiled step is faster than the eager one timed)
        recheck_timing(path, target, bool(choice), encoded, results)


def recheck_timing(path, target, auto: bool, encoded: list, results: list):
    """The run's own time a target forward against the kept layout timing it decoded by, which is
    timed again at the next start where this run was much faster (engine.layouts.recheck_kept_timing)."""
    forwards = sum(r["target_forwards"] for r in results)
    seconds = sum(r["seconds"] - r["prefill_seconds"] - r["draft_seconds"] for r in results)
    context = sum(len(ids) + r["new_tokens"] / 2 for ids, r in zip(encoded, results)) / max(len(results), 1)
    if forwards:
        recheck_kept_timing(path, layout_of(target), auto, 1e3 * seconds / forwards, round(context))


def decode_prompts(args, encoded: list, target, tokenizer, draft, verifier, generator, step_fn) -> list:
    """Decode each prompt, streaming its text to stdout and a summary line to stderr (and with
    --json its results); returns generate's results."""
    layout, results = layout_of(target), []
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
                          on_tokens=stream, step_fn=step_fn, tree=args.tree, clock=wall_clock(args.device))
        sys.stdout.write(utf8.decode(b"", final=True) + "\n")
        sys.stdout.flush()
        print(summary_line(result, args, draft is not None, layout), file=sys.stderr)
        if args.json:
            result["text"] = tokenizer.decode([t for t in result["tokens"] if t not in stop_ids])
            result.update(target=args.target, draft=draft_shown(args.draft) if draft else None,
                          verifier=args.verifier if draft else "none", layout=layout, tree=args.tree,
                          k=args.num_draft_tokens if draft else 0, temperature=args.temperature)
            print(json.dumps(result))
        results.append(result)
    return results


if __name__ == "__main__":
    run_script(main)
