"""
The end-to-end benchmark: what each draft and verifier buys in acceptance length (tau) and
wall-clock speed over plain autoregressive decoding, measured side by side in one run. (What each
lossy verifier costs in task quality is lossy.py's experiment.)

Speed runs are interleaved prompt by prompt (A B C A B C ...) after a warm-up, so that machine
drift cancels in the ratios: every speedup is the median over prompts of (tokens/s of the run) /
(tokens/s of the plain baseline on the same prompt), with its interquartile range.

    python bench.py --quick                                      # smoke test (CI runs it)
    python bench.py --limit 5 --drafts lookup,drafts/smollm2-135m-eagle3-vat --temperatures 0
    python bench.py --prompt-file my.jsonl --peers               # add transformers' generate (and llama.cpp)
    python bench.py --speed-off --decode-table smollm2-135m --weights-quality 40 --profile-step

The target runs in the layout --dtype asks for (auto: the one whose one-token step was timed
fastest here, as decode.py's); every run of ours shares it.

Writes a markdown table to stdout, every raw number and the configuration to --out (JSON), PNG
plots beside it, and ends stdout with one JSON line of headline figures.
"""
import json
import sys
import time
from pathlib import Path

import torch

from engine.checkpoints import DEFAULT_DRAFTS, draft_spec_problem
from dflash import DFlashDraft
from draft import Draft
from eagle3 import Eagle3Draft
from engine.compiled import cache_slots, compile_draft, compile_target
from engine.files import ROOT, repo_path
from engine.layouts import choose_layout, layout_of, load_target, run_block_costs, target_layout
from engine.machine import (ArgumentParser, DefaultsHelpFormatter, add_machine_options, compiled_draft_problem,
                            machine_problem, pick_threads, run_script, wants_compile)
from data.prompts import load_prompts
from harness.results import figures_beside, machine_stamp, save_figure, shown, unwritable, write_results
from harness.speed import (Run, adapt_draft, draft_label, interleave, make_draft, paired_runs, parse_spec,
                           peer_runs, records_for_file, summarize)
from harness.stats import reliability
from harness.step_table import (SHAPES, cpu_layouts, decode_speed_table, print_auto_choice, step_profile,
                        weights_quality)
from speculative import adaptive_tree_problem
from verify import VERIFIERS, Verifier, check_temperature
from engine.weights import DEFAULT_TARGET, HF_REPOS, resolve_model

# -----------------------------------------------------------------------------
# Runs

def encode_prompts(args, tokenizer) -> list:
    """[(category, chat-templated ids)] of the prompts the speed runs use."""
    prompts = load_prompts(repo_path(args.prompt_file), args.categories, args.limit, args.from_end)
    return [(c, tokenizer.encode_chat([{"role": "user", "content": t}])) for c, t in prompts]


class HeadCalibration(Draft):
    """A draft with a verification head, watched: each drafted token's head probability beside
    whether the verifier kept it (proposal_head_logits against n_accepted), the data of bench's
    reliability plot. It drafts exactly what the draft drafts."""

    def __init__(self, draft: Draft):
        self.draft, self.pairs, self.last_probs = draft, [], []
        self.target_layers, self.max_tokens = draft.target_layers, draft.max_tokens

    @property
    def forwards(self):
        return self.draft.forwards

    def start(self, prompt_ids, features=None):
        self.draft.start(prompt_ids, features)

    def propose(self, k: int):
        tokens, q = self.draft.propose(k)
        heads = self.draft.proposal_head_logits
        self.last_probs = torch.sigmoid(torch.cat([h.float().flatten() for h in heads])).tolist() if heads else []
        return tokens, q

    def commit(self, new_ids, n_accepted, features=None):
        self.pairs += [(prob, i < n_accepted) for i, prob in enumerate(self.last_probs)]
        self.last_probs = []
        self.draft.commit(new_ids, n_accepted, features)


def speed_runs(args, target, choice: dict, tokenizer, generator, encoded: list):
    """Every draft x verifier x temperature and the baseline on the encoded prompts ([(category,
    ids)]), interleaved prompt by prompt, decoding with the target, compiled with --compile
    (engine.compiled, after the drafts: its graphs return the hidden states they read).
    Returns {run name: [one result per prompt]}, {run name: temperature}, the verification
    heads' reliability per run and the seconds each compiled graph took to compile ({} eager)."""
    drafts = {(spec, t): make_draft(spec, target, tokenizer, t, generator) for t in args.temperatures
              for spec in args.drafts}
    step_fn = None
    if args.compile:
        hidden_layers = sorted({i for draft in drafts.values() for i in draft.target_layers})
        step_fn = compile_target(target, args.num_draft_tokens + 1 if drafts else 1, hidden_layers, args.device)
        for draft in drafts.values():
            seconds = compile_draft(draft)
            if seconds is not None:
                step_fn.compile_seconds.setdefault("draft's one-token step", seconds)
    costs = None  # timed only where a draft adapts its length to them (@adapt)
    if any(parse_spec(spec)[3] for spec in args.drafts):
        costs = step_fn.block_costs() if step_fn is not None and args.device == "cpu" else \
            run_block_costs(target, choice)
    runs = []
    for temperature in args.temperatures:
        runs.append(Run(f"baseline T={temperature:g}", temperature, target))
        for spec in args.drafts:
            draft = adapt_draft(spec, drafts[spec, temperature], costs, temperature, args.device)
            if isinstance(draft, (Eagle3Draft, DFlashDraft)):  # its head's probability against what was kept
                draft = HeadCalibration(draft)
            for name in args.verifiers:
                if name == "greedy" and temperature > 0:
                    continue
                if name == "lossless" and temperature == 0 and "greedy" in args.verifiers:
                    continue  # at T=0 lossless keeps exactly what greedy keeps: the run would repeat it
                runs.append(Run(f"{draft_label(spec)} {name} T={temperature:g}", temperature, target, draft,
                                Verifier(name), tree=parse_spec(spec)[2]))
        if args.peers:
            runs += peer_runs(args.target, temperature, args.num_draft_tokens, transformers=args.peers == "all")
    records = interleave(runs, encoded, args.num_draft_tokens, args.max_new_tokens, tokenizer.stop_ids,
                         generator, args.device, args.warmup, step_fn)
    calibrations = {run.name: reliability(run.draft.pairs) for run in runs if isinstance(run.draft, HeadCalibration)}
    compile_seconds = step_fn.compile_seconds if step_fn is not None else {}
    return records, {run.name: run.temperature for run in runs}, calibrations, compile_seconds


# -----------------------------------------------------------------------------
# Report

def plots(summary, out_dir: Path, stem: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["axes.prop_cycle"] = plt.cycler(color=plt.get_cmap("tab20").colors)  # >10 runs stay apart
    written = []
    drafts = {n: s for n, s in summary.items() if s["tau"] and not n.startswith("baseline")}
    if drafts:  # tau per task group for each draft
        cats = sorted({c for s in drafts.values() for c in s["tau_per_category"]})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
        width = 0.8 / len(drafts)
        for i, (name, s) in enumerate(drafts.items()):
            ax.bar([j + i * width for j in range(len(cats))], [s["tau_per_category"].get(c, 0) for c in cats],
                   width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_ylabel("tau (tokens per target forward)")
        ax.axhline(1, color="grey", lw=0.5)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / f"{stem}-tau-per-task.png")
        save_figure(fig, written[-1])
        # acceptance rate by draft position
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, s in drafts.items():
            if s["acceptance_per_position"]:
                ax.plot(range(1, len(s["acceptance_per_position"]) + 1), s["acceptance_per_position"],
                        "o-", label=name)
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of blocks that kept it")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / f"{stem}-acceptance-by-position.png")
        save_figure(fig, written[-1])
    heads = {n: s["head_calibration"] for n, s in summary.items() if s.get("head_calibration", {}).get("bins")}
    if heads:  # reliability: the head's predicted probability against the share of those tokens kept
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
        for name, h in heads.items():
            ax.plot([b["predicted"] for b in h["bins"]], [b["kept"] for b in h["bins"]], "o-",
                    label=f"{name} (Brier {h['brier']:.3f})")
        ax.set_xlabel("verification head's probability (bin mean)")
        ax.set_ylabel("share of those drafted tokens kept")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / f"{stem}-head-calibration.png")
        save_figure(fig, written[-1])
    plt.close("all")
    return written


def get_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = ArgumentParser(description="Speculative decoding benchmark: speed, side by side.",
                        formatter_class=DefaultsHelpFormatter, argv=argv)
    for add in (add_run_args, add_prompt_args, add_peer_args, add_weights_args, add_table_args, add_machine_args):
        add(ap)
    args = ap.parse_args(argv)
    check_and_complete(ap, args)
    return args


def add_run_args(ap):
    """What is benchmarked: every draft under every verifier and temperature."""
    g = ap.add_argument_group("what is measured")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"model name ({', '.join(HF_REPOS)}) or a Hugging Face model directory")
    committed = DEFAULT_DRAFTS.get(DEFAULT_TARGET)
    default_drafts = "lookup" + (f",{committed},{committed}@ee" if committed and committed.is_dir() else "")
    g.add_argument("--drafts", default=default_drafts,
                   help="comma-separated drafts as decode.py's --draft takes them, suffixed @ee or @ee0.2 "
                        "(early exit), @conf, @tree16, @adapt; default: lookup and the default target's "
                        "committed draft, without and with @ee")
    g.add_argument("--verifiers", default="greedy,lossless",
                   help=f"comma-separated, from {','.join(VERIFIERS)}; greedy runs at T=0 only, and "
                        "lossless not there when greedy does (the same rule at T=0)")
    g.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=7, help="tokens drafted per target forward")
    g.add_argument("--prompt-file", default="data/spec_bench_questions.jsonl",
                   help="Spec-Bench-style jsonl (or any supported jsonl)")
    g.add_argument("--limit", type=int, default=3, help="prompts per category")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="new tokens per speed-run prompt, at most")
    g.add_argument("--peers", nargs="?", const="all", default=None, choices=("all", "llama.cpp"),
                   help="also run peers on the same weights: all (transformers' generate and assisted lookup, "
                        "and llama.cpp on the default target's GGUF) or llama.cpp alone")
    g.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 16 tokens, T=0 and 1")
    g.add_argument("--out", default=None, help="JSON results path; results/bench-<time>.json when omitted")


def add_prompt_args(ap):
    """Which prompts the speed runs decode, and how much of each."""
    g = ap.more_options("prompts")
    g.add_argument("--categories", default=None,
                   help="comma-separated Spec-Bench categories; all when omitted")
    g.add_argument("--from-end", action="store_true",
                   help="take each category's last --limit prompts, not its first (report.py's GSM8K test "
                        "questions are the file's last)")
    g.add_argument("--warmup", type=int, default=1, help="prompts run untimed first")


def add_peer_args(ap):
    """transformers' generation beside ours, or no speed runs at all."""
    g = ap.more_options("pairs, peers and speed runs")
    g.add_argument("--paired", action="append", default=[], metavar="A,B",
                   help="two of --drafts: their tau and speed ratio, A over B, with 95%% paired bootstrap "
                        "intervals over the prompts (e.g. a VAT draft against its baseline-objective twin); "
                        "repeat it for more pairs")
    g.add_argument("--speed-off", action="store_true", help="skip the speed runs")


def add_weights_args(ap):
    """The target's layout and compilation, as decode.py's."""
    g = ap.more_options("target weights")
    add_machine_options(g, "dtype", "compile")  # (a named --dtype is the only layout --decode-table times)


def add_table_args(ap):
    """Measurements beside the speed runs."""
    g = ap.more_options("decode table, weights quality and step profile")
    g.add_argument("--decode-table", default="auto",
                   help=f"comma-separated shapes from {','.join(SHAPES)} timed with random weights against "
                        "the memory-bandwidth floor; auto = qwen3-4b,llama-3.1-8b on CUDA, none on CPU; "
                        "'none' skips")
    g.add_argument("--decode-table-compile", default="auto", choices=("auto", "both", "off"),
                   help="time torch.compile'd steps (CUDA graphs on CUDA, weight freezing on CPU) next to "
                        "eager ones; auto = both on CUDA, eager only on CPU (a compile per query "
                        "length costs minutes there)")
    g.add_argument("--weights-quality", type=int, default=0, metavar="N",
                   help="compare the int8, bf16 and int4 targets with fp32 on N held-out GSM8K texts: top-1 "
                        "agreement and perplexity (CPU)")
    g.add_argument("--profile-step", action="store_true",
                   help="profile a one-token and a k+1-token forward of the target in its layout: time in "
                        "matmuls, attention and everything else, with call counts (what is left to cut)")


def add_machine_args(ap):
    """The smoke test, seeds, device, threads and where the results go."""
    g = ap.more_options("machine and output")
    g.add_argument("--seed", type=int, default=0, help="seeds the sampling generator")
    add_machine_options(g, "device", "threads")  # (the results record the thread count used)
    g.add_argument("--plots-from", type=Path, default=None, metavar="FILE",
                   help="draw a results file's figures again beside it, then stop (docs/ keeps only the ones "
                        "its pages show)")


def check_counts(ap, args):
    """--quick's settings where the user left the defaults, then every count the user typed checked."""
    for name, value in (("limit", 1), ("max_new_tokens", 16), ("warmup", 0)) if args.quick else ():
        if getattr(args, name) == ap.get_default(name):  # --quick fills in what the user left out
            setattr(args, name, value)
    if args.quick:
        args.categories = args.categories or "writing,translation"
    if args.weights_quality < 0 or args.warmup < 0:
        ap.error(f"--weights-quality takes a number of texts >= 1 (0, the default: none) and --warmup a number "
                 f"of prompts >= 0, got {args.weights_quality} and {args.warmup}")
    if min(args.num_draft_tokens, args.max_new_tokens, args.limit) < 1:
        ap.error("-k, --max-new-tokens and --limit must be >= 1")


def check_drafts(ap, args):
    """Each of --drafts: its suffixes parse, an adaptive tree can sample, the draft exists (unless
    nothing runs), and no two share a name (runs and results are keyed by it)."""
    for spec in args.drafts:
        try:
            _, _, tree, adapt, _ = parse_spec(spec)
        except ValueError as e:
            ap.error(f"--drafts {e}")
        if adapt and adaptive_tree_problem(tree, max(args.temperatures)):
            ap.error(f"--drafts {spec}: {adaptive_tree_problem(tree, max(args.temperatures))}")
        problem = None if args.speed_off else draft_spec_problem(spec.partition("@")[0])
        if problem:  # (before the target loads and its layouts are timed)
            ap.error(problem.replace("--draft ", "--drafts ", 1))
    labels = [draft_label(spec) for spec in args.drafts]
    if len(set(labels)) < len(labels):  # runs and results are keyed by label: one would replace another
        ap.error(f"two --drafts have one name: {', '.join(sorted({n for n in labels if labels.count(n) > 1}))}")


def check_and_complete(ap, args):
    """Parse the lists, refuse bad values in one line, and check that the results can be written,
    all before hours of measuring."""
    problem = machine_problem(args.device, args.threads, args.dtype, wants_compile(args.compile, args.device))
    if problem:
        ap.error(problem)
    check_counts(ap, args)
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        ap.error(f"--temperatures takes comma-separated numbers, got {args.temperatures!r}")
    for t in args.temperatures:
        if check_temperature(t, "--temperatures"):
            ap.error(check_temperature(t, "--temperatures"))
    args.verifiers = args.verifiers.split(",")
    args.drafts = [d for d in args.drafts.split(",") if d]
    args.paired = [pair.split(",") for pair in args.paired]
    if any(len(pair) != 2 or any(d not in args.drafts for d in pair) for pair in args.paired):
        ap.error("--paired takes two of the --drafts, comma-separated")
    if any(a == b for a, b in args.paired):
        ap.error("--paired compares two different drafts; a draft against itself is 1.000 by construction")
    check_drafts(ap, args)
    args.categories = args.categories.split(",") if args.categories else None
    args.compile = wants_compile(args.compile, args.device)
    problem = compiled_draft_problem(args.num_draft_tokens, any(parse_spec(spec)[2] for spec in args.drafts),
                                     "--drafts ...@tree")
    if args.compile and args.drafts and problem:
        ap.error(problem)
    table = {"auto": "qwen3-4b,llama-3.1-8b" if args.device.startswith("cuda") else "", "none": ""}
    args.decode_table = [n for n in table.get(args.decode_table, args.decode_table).split(",") if n]
    if any(n not in SHAPES for n in args.decode_table):
        ap.error(f"--decode-table takes shapes from {', '.join(SHAPES)}")
    if args.speed_off and (args.paired or not (args.decode_table or args.weights_quality or args.profile_step)):
        ap.error("--paired compares timed runs, which --speed-off skips" if args.paired else
                 "--speed-off leaves nothing to measure: add --decode-table, --weights-quality N or --profile-step")
    args.decode_table_compile = (False, True) if args.decode_table_compile == "both" or (
        args.decode_table_compile == "auto" and args.device.startswith("cuda")) else (False,)
    for name in args.verifiers:
        Verifier(name)  # unknown names fail before anything loads
    if not args.speed_off:
        try:  # a bad prompt file is refused before any weights load
            load_prompts(repo_path(args.prompt_file), args.categories, args.limit)
        except ValueError as e:
            ap.error(str(e))
    args.out = Path(args.out or ROOT / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    problem = unwritable(args.out)
    if problem:
        ap.error(f"cannot write --out {args.out}: {problem}")


def print_report(args, summary: dict, table: list):
    """The results as markdown tables on stdout."""
    print(f"\n{args.target} on {args.device} ({torch.get_num_threads()} threads), k={args.num_draft_tokens}, "
          f"{args.max_new_tokens} new tokens max\n")
    if summary:
        memory = "GPU memory" if args.device.startswith("cuda") else "peak RSS"
        print(f"| run | tau | tokens/s, prompt included (median) | speedup (median, IQR) | draft time | {memory} |")
        print("|---|---|---|---|---|---|")
        for name, s in summary.items():
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            lo, hi = s["speedup_iqr"]
            print(f"| {name} | {tau} | {s['tokens_per_s_median']:.1f} | {s['speedup_median']:.2f}x "
                  f"({lo:.2f}-{hi:.2f}) | {100 * s['draft_time_fraction']:.0f}% | "
                  f"{s['peak_memory_mb']:.0f} MiB |")
    if table:
        print(f"\ndecode speed, random weights, copy bandwidth "
              f"{table[0]['bandwidth_gb_s']:.0f} GB/s\n")
        ks = list(table[0]["verify_cost"])
        print("| shape | torch.compile | weights read/step | floor | ms/token | tokens/s | of floor | "
              + " | ".join(f"verify {n} tok" for n in ks) + " |")
        print("|---|---|---|---|---|---|---|" + "---|" * len(ks))
        for r in table:
            costs = " | ".join(f"{v:.2f}x" for v in r["verify_cost"].values())
            print(f"| {r['target']}, {r['layout']} | {r['compile_mode'] or 'eager'} | "
                  f"{r['weight_gb_per_step']:.2f} GB | "
                  f"{r['floor_ms']:.2f} ms | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{100 * r['fraction_of_floor']:.0f}% | {costs} |")


def print_measurements(layout, paired: dict, profiled: dict, quality: dict):
    """The paired ratios, the step profile (of the target in `layout`) and the weights' quality, after
    the speed table."""
    for name, r in paired.items():
        print(f"\n{name} on {r['prompts']} prompts: tau ratio {r['tau']['ratio']:.3f} (95% CI "
              f"{r['tau']['ci95'][0]:.3f}-{r['tau']['ci95'][1]:.3f}; detects {r['tau']['detectable_ratio']:.3f}), "
              f"tokens/s ratio {r['tokens_per_s']['ratio']:.3f} "
              f"({r['tokens_per_s']['ci95'][0]:.3f}-{r['tokens_per_s']['ci95'][1]:.3f})")
    for n, r in profiled.items():
        print(f"\n{layout} forward of {n} token{'s' if n > 1 else ''}, profiled: {r['profiled_ms']:.1f} ms = "
              f"matmuls {r['matmul_ms']:.1f} ms ({r['matmul_calls']} calls) + attention {r['attention_ms']:.1f} ms "
              f"({r['attention_calls']}) + other ops {r['other_ms']:.1f} ms ({r['other_calls']})")
    for weights, q in quality.items():
        print(f"\n{weights} against fp32 on {q['tokens']} tokens of held-out text: top-1 agreement "
              f"{q['top1_agreement']:.3f}, perplexity {q['perplexity_fp32']:.3f} -> {q['perplexity']:.3f}")


def replot(path: Path):
    """The figures of a bench results file, drawn again beside it."""
    try:
        speed = json.loads(path.read_text())["speed"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a bench.py results file ({type(e).__name__})") from None
    for image in plots(speed, path.parent, path.stem):
        print(image)


def main(argv=None):
    args = get_args(argv)
    if args.plots_from:
        return replot(args.plots_from)
    if args.device == "cpu":
        torch.set_num_threads(pick_threads(args.threads))
    summary, records, paired, profiled, compile_seconds = {}, {}, {}, {}, {}
    layout, choice = None, {}  # (the target's, when one is loaded)
    if not args.speed_off or args.profile_step:
        layout = target_layout(args.dtype, args.device, args.compile)
        target, tokenizer, choice = load_target(args.target, args.device, layout, 4096)
        layout = layout_of(target)
    if args.profile_step:
        profiled = step_profile(target, blocks=(1, args.num_draft_tokens + 1))
    if not args.speed_off:
        encoded = encode_prompts(args, tokenizer)
        if args.compile:  # a compiled run's cache in buckets, so that other prompts meet the same graphs
            reach = max(len(ids) for _, ids in encoded) + args.max_new_tokens + \
                max(args.num_draft_tokens, max((parse_spec(d)[2] for d in args.drafts), default=0)) + 1
            target.setup_caches(1, cache_slots(reach, target.max_seq_len))
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        records, temperatures, calibrations, compile_seconds = speed_runs(args, target, choice, tokenizer,
                                                                          generator, encoded)
        summary = summarize(records, temperatures, calibrations)
        paired = paired_runs(args.paired, records)
    target = None  # the decode table and the quality check want the memory
    layouts = ([target_layout(args.dtype, args.device, False)] if args.dtype not in (None, "auto") else
               cpu_layouts() if args.device == "cpu" else ["bfloat16"])  # (--dtype names the one to time)
    # blocks of 4-8 tokens verify chains; of 16 and 32, trees of 15 and 31 drafted tokens
    table = decode_speed_table(args.decode_table, args.device, layouts, args.decode_table_compile,
                               verify_k=sorted({3, 5, 7, 15, 31, args.num_draft_tokens})) if args.decode_table else []
    quality = weights_quality(args.target, args.weights_quality) if args.weights_quality else {}
    auto = choose_layout(resolve_model(args.target)) if args.decode_table and args.device == "cpu" else {}
    print_report(args, summary, table)
    print_auto_choice(args.target, auto, args.num_draft_tokens)
    print_measurements(layout if profiled else None, paired, profiled, quality)

    out = args.out
    images = figures_beside(plots, summary, out)
    config = {**{k: shown(v) for k, v in vars(args).items()}, "layout": layout, "layout_choice": choice}
    result = {
        "config": config, "machine": machine_stamp(args.device),
        "speed": summary, "paired": paired, "decode_table": table, "auto_choice": auto,
        "weights_quality": quality, "step_profile": profiled, "compile_seconds": compile_seconds,
        "plots": [shown(p) for p in images],
        "runs": records_for_file(records, temperatures) if records else {},  # every run on every prompt
    }
    out = write_results(out, result)
    speedups = {n: s["speedup_median"] for n, s in summary.items()
                if not n.startswith(("baseline", "transformers"))}
    best = max(speedups, key=speedups.get) if speedups else None
    print(json.dumps({"results": str(out), "best": best, "best_speedup": speedups.get(best),
                      "tokens_per_s": {n: s["tokens_per_s_median"] for n, s in summary.items()},
                      "tau": {n: s["tau"] for n, s in summary.items() if s["tau"]},
                      "decode_tokens_per_s": {f"{r['target']} {r['layout']} {r['compile_mode'] or 'eager'}":
                                              r["tokens_per_s"] for r in table}}))


if __name__ == "__main__":
    run_script(main, "interrupted: no results written (bench.py writes them once every run is done)")
