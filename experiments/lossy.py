"""
The lossy-verification experiment: what each lossy verifier buys in block efficiency (tokens per
target forward) and what it costs, in task accuracy and in distortion of the target's distribution,
with every verifier run on the same problems from the same random seed so that their differences
are measured paired.

Tasks. Graded arithmetic by default ("What is a + b? Reply with the number only.", four levels from
one-digit sums to two-digit ones, generated from a fixed seed), on which the default 135M target
scores well above zero; GSM8K (exact match) and HumanEval (pass@1, run in sandbox.py's isolation)
are the hard end, for a real target on a GPU.

Pairing. Each problem has its own seed, and every configuration restarts the sampler from it. The
draft and every sampling rule draw the same random numbers whatever they decide (verify.py), so two
verifiers produce the same tokens until the first token where their rules differ: most problems
come out the same under both, and a paired test (McNemar's) on the problems where they differ
separates a few points of accuracy with far fewer problems than two independent runs would need.

Distortion. At every committed token the verifier's one-step output distribution is known in
closed form (verify.induced for a drafted position, verify.own_distribution for a bonus token), so
the run reports its total-variation distance and KL divergence from the target's p, averaged over
the tokens of the real trajectories. This separates verifiers even where accuracy cannot.

    python experiments/lossy.py                              # graded arithmetic, default target
    python experiments/lossy.py --problems 250               # more power (docs/lossy-arithmetic/); rerun to continue
    python experiments/lossy.py --tasks gsm8k,humaneval --target qwen3-4b --draft eagle3:PATH --temperature 1

Each finished problem is appended to OUT.problems.jsonl, so an interrupted run continues where it
stopped when rerun with the same arguments (a larger --problems extends it). At the end: markdown tables on stdout, every problem's
outcome in OUT (JSON), the figures beside it, and one JSON line of headline figures.
"""
import difflib
import json
import multiprocessing
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the core modules, one folder up

import torch
from lossy_figures import plots
from sandbox import SandboxError, check_sandbox
from sweep import CONFIGS, TREE_SUFFIX, TREE_VERSIONS, verifier_of
from tasks import correct, load_problems
from tqdm import tqdm

import model as M
from engine.checkpoints import DEFAULT_DRAFTS, build_draft
from engine.files import ROOT, repo_path
from engine.layouts import experiment_layout, load_target
from engine.machine import (ArgumentParser, DefaultsHelpFormatter, add_machine_options, machine_problem,
                            pick_threads, run_script)
from harness.results import figures_beside, machine_stamp, shown, unwritable, write_results
from speculative import generate
from harness.stats import paired_difference, problems_for_power, rank_correlation, wilson
from verify import Verifier, induced, own_distribution
from engine.weights import DEFAULT_TARGET, HF_REPOS, resolve_model

GSM8K_DRAFT = ROOT / "drafts" / "smollm2-135m-eagle3-gsm8k"  # the strongest draft for answers with numbers

# -----------------------------------------------------------------------------
# Distortion along a trajectory

class DistortionMeter:
    """Passed to generate() as on_verify: the total-variation distance and KL(out || p) of each
    committed token's one-step output distribution from the target's p."""

    def __init__(self, verifier: Verifier):
        self.verifier, self.tv, self.kl = verifier, [], []

    def __call__(self, p, q, guesses, n):
        # p (m + 1, V) the target at the m drafted positions and the bonus one; q (m, V) or None
        m = len(guesses)
        if q is None and m:  # a deterministic draft proposes its token with probability one
            q = torch.zeros_like(p[:m]).scatter_(-1, guesses.to(p.device)[:, None], 1.0)
        drafted = min(n + 1, m)  # the kept positions and, on a rejection, the corrected one
        out = induced(p[:drafted], q[:drafted], self.verifier) if drafted else p[:0]
        if n == m:  # every guess kept: a bonus token from the verifier's own distribution
            out = torch.cat([out, own_distribution(p[m:m + 1], self.verifier)])
        target = p[:n + 1].double()  # (n + 1, V): the committed tokens' positions
        out = out.double()
        self.tv += (0.5 * (out - target).abs().sum(-1)).tolist()
        # 0 log 0 = 0; p underflowing to 0 where out > 0 would make KL infinite: floor it at 1e-30
        log_ratio = torch.log(out.clamp_min(1e-300)) - torch.log(target.clamp_min(1e-30))
        # (rounding can leave an exact rule's KL a hair below zero; it is zero)
        self.kl += torch.where(out > 0, out * log_ratio, 0.0).sum(-1).clamp_min(0).tolist()

    def per_token(self, n_tokens: int):
        """Sums over the committed tokens (the last block may be cut at a stop token or the budget)."""
        return sum(self.tv[:n_tokens]), sum(self.kl[:n_tokens])


# -----------------------------------------------------------------------------
# Running: every configuration on every problem, problems spread over worker processes

def run_problem(problem: dict, target, tokenizer, draft, generator, args) -> dict:
    """Every configuration on one problem, each restarted from the problem's seed."""
    ids = tokenizer.encode_chat([{"role": "user", "content": problem["prompt"]}])
    seed = zlib.crc32(f"{args.seed}:{problem['id']}".encode())
    runs = {}
    for label in args.configs:
        verifier = verifier_of(label)
        tree = args.tree if label.endswith(TREE_SUFFIX) else 0
        generator.manual_seed(seed)
        # a tree's one-step output is a mixture over the children it might have drawn: no closed
        # form to measure its distortion by, so trees report accuracy and block efficiency only
        meter = None if tree else DistortionMeter(verifier or Verifier("lossless"))
        r = generate(target, ids, draft if verifier else None, verifier or Verifier("lossless"),
                     k=args.num_draft_tokens if verifier else 0, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, stop_ids=tokenizer.stop_ids, generator=generator,
                     on_verify=meter, tree=tree)
        text = tokenizer.decode([t for t in r["tokens"] if t not in tokenizer.stop_ids])
        tv, kl = meter.per_token(r["new_tokens"]) if meter else (None, None)
        runs[label] = {"correct": correct(problem, text), "new_tokens": r["new_tokens"],
                       "target_forwards": r["target_forwards"], "tv_sum": tv, "kl_sum": kl, "text": text}
    return {"id": problem["id"], "level": problem["level"], "runs": runs}


_worker = {}  # one per process: the target, tokenizer, draft and generator, loaded once


def start_worker(args):
    try:
        torch.set_num_threads(args.threads_per_worker)
        target, tokenizer, _ = load_target(args.target, args.device, experiment_layout(args.device),
                                           args.max_seq_len)
        generator = torch.Generator(device=args.device)
        draft = build_draft(str(args.draft), target, tokenizer, temperature=args.temperature, generator=generator)
        _worker.update(target=target, tokenizer=tokenizer, draft=draft, generator=generator, args=args)
    except (M.CheckpointError, ValueError) as e:
        # raised from work() instead: a Pool whose initializer fails restarts its workers forever
        _worker["error"] = e


def work(problem: dict) -> dict:
    w = _worker
    if "error" in w:
        raise w["error"]
    return run_problem(problem, w["target"], w["tokenizer"], w["draft"], w["generator"], w["args"])


def problems_log(out: Path) -> Path:
    """Every finished problem, one line each, kept beside the results: a rerun with the same
    settings continues from it, also with a larger --problems (the first problems stay the same)."""
    return out.with_name(out.name + ".problems.jsonl")


def read_partial(path: Path, fingerprint: dict) -> dict:
    """The problems a previous run with the same configuration finished, by id. A last line cut
    off by a stopped run is removed from the file, so that the next record starts a line of its
    own; any other line that is not a problem's record is an error naming the line."""
    if not path.is_file():
        return {}
    raw = path.read_bytes()
    ours = (json.dumps({"config": fingerprint}) + "\n").encode()
    head = raw.split(b"\n", 1)[0] + b"\n"
    torn_header = b"\n" not in raw and ours.startswith(raw)  # stopped while writing the settings
    if raw and head != ours and not torn_header:  # refused before anything is written to a file not ours
        raise ValueError(f"{path} holds a run with other settings (or is not a problems log); pass "
                         f"another --out, or delete it to start over")
    if raw and not raw.endswith(b"\n"):  # the line being written when the run was stopped
        raw = raw[:raw.rfind(b"\n") + 1]
        with path.open("r+b") as f:
            f.truncate(len(raw))
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a problems log (not UTF-8 at byte {e.start}); pass another --out, or "
                         f"delete it to start over") from None
    configs = fingerprint.get("configs") or []
    done = {}
    for number, line in enumerate(lines[1:], 2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("id"), str)
                and isinstance(record.get("runs"), dict)
                and all(isinstance(record["runs"].get(c), dict) for c in configs)):
            raise ValueError(f"{path} line {number} is not a problem's record with a run of each of "
                             f"--configs; delete that line (or the file) and rerun")
        done[record["id"]] = record
    return done


def run_all(args, problems: list) -> list:
    """Every problem, resuming from OUT.problems.jsonl; returns the records in problem order."""
    fingerprint = {k: shown(v) for k, v in vars(args).items() if k in FINGERPRINT}
    path = problems_log(args.out)
    done = read_partial(path, fingerprint)
    todo = [p for p in problems if p["id"] not in done]
    if done:
        print(f"resuming {path}: {len(problems) - len(todo)} of {len(problems)} problems done",
              file=sys.stderr)
    if todo:
        bar = tqdm(total=len(problems), initial=len(problems) - len(todo), desc="problems", file=sys.stderr)
        with bar, path.open("a") as log:  # (the bar closes before an error is printed)
            def keep(record):
                if not done:  # the settings head the log, written with its first problem
                    log.write(json.dumps({"config": fingerprint}) + "\n")
                done[record["id"]] = record
                log.write(json.dumps(record) + "\n")  # one whole line per problem
                log.flush()
                bar.update()
            if args.workers == 1:
                start_worker(args)
                for problem in todo:
                    keep(work(problem))
            else:  # spawn: a forked child would inherit the parent's OpenMP state
                with multiprocessing.get_context("spawn").Pool(args.workers, start_worker, (args,)) as pool:
                    for record in pool.imap_unordered(work, todo):
                        keep(record)
    return [done[p["id"]] for p in problems]


FINGERPRINT = ("target", "draft", "tasks", "configs", "tree", "num_draft_tokens", "temperature",
               "max_new_tokens", "seed")


# -----------------------------------------------------------------------------
# Statistics

def summarize(records: list, configs: list) -> dict:
    """Per level (and 'all'): each configuration's accuracy, block efficiency and distortion, and
    its paired difference from lossless on the same problems."""
    levels = list(dict.fromkeys(r["level"] for r in records))
    out = {}
    for level in levels + (["all"] if len(levels) > 1 else []):
        rows = [r for r in records if level in ("all", r["level"])]
        lossless = [r["runs"]["lossless"]["correct"] for r in rows] if "lossless" in configs else None
        out[level] = {}
        for label in configs:
            runs = [r["runs"][label] for r in rows]
            hits, tokens = sum(x["correct"] for x in runs), sum(x["new_tokens"] for x in runs)
            measured = all(x["tv_sum"] is not None for x in runs)  # (not for trees)
            verifier = verifier_of(label)
            s = {"n": len(runs), "accuracy": hits / len(runs), "ci95": wilson(hits, len(runs)),
                 "block_efficiency": tokens / max(sum(x["target_forwards"] for x in runs), 1),
                 "tv": sum(x["tv_sum"] for x in runs) / max(tokens, 1) if measured else None,
                 # (rounding leaves an exact rule's KL a hair below zero; it is zero)
                 "kl": max(sum(x["kl_sum"] for x in runs) / max(tokens, 1), 0.0) if measured else None,
                 "family": verifier.family if verifier else "plain"}
            if lossless is not None and label != "lossless":
                s["vs_lossless"] = paired_difference(lossless, [x["correct"] for x in runs])
            chain = label.removesuffix(TREE_SUFFIX)
            if chain != label and chain in configs:  # a tree against its own chain, problem by problem
                chain_runs = [r["runs"][chain] for r in rows]
                s["vs_chain"] = paired_difference([x["correct"] for x in chain_runs], [x["correct"] for x in runs])
                s["vs_chain"]["block_efficiency_ratio"] = s["block_efficiency"] / out[level][chain]["block_efficiency"]
            out[level][label] = s
    return out


def distortion_predicts_loss(pooled: dict) -> dict:
    """Across the lossy configurations: how well each distortion measure ranks their accuracy loss."""
    rows = [s for s in pooled.values() if s["family"] in ("truncation", "collaborative") and "vs_lossless" in s
            and s["tv"] is not None]
    if len(rows) < 3:
        return {}
    loss = [-s["vs_lossless"]["difference"] for s in rows]
    return {m: rank_correlation([s[m] for s in rows], loss) for m in ("tv", "kl", "block_efficiency")}


def power_note(summary: dict) -> dict:
    """Per level: the median discordance with lossless over the lossy configurations, and what it
    means: the problems needed for a 5-point difference, and the difference this run can detect."""
    notes = {}
    for level, rows in summary.items():
        d = sorted(s["vs_lossless"]["discordance"] for label, s in rows.items()
                   if "vs_lossless" in s and s["family"] not in ("plain", "exact"))
        if not d or d[len(d) // 2] == 0:  # no disagreement seen: nothing to size a test with
            continue
        median, n = d[len(d) // 2], next(iter(rows.values()))["n"]
        detectable = next((x / 100 for x in range(1, 101) if problems_for_power(median, x / 100) <= n), 1.0)
        notes[level] = {"median_discordance": median, "problems": n,
                        "problems_for_5_points": problems_for_power(median, 0.05),
                        "detectable_difference": detectable}
    return notes


# -----------------------------------------------------------------------------
# Report

def print_report(args, summary: dict, power: dict, predicts: dict):
    levels = [lv for lv in summary if lv != "all"]
    pooled = summary["all" if "all" in summary else levels[0]]
    print(f"\n{args.target}, draft {shown(args.draft)}, k={args.num_draft_tokens}, T={args.temperature:g}, "
          f"{pooled[next(iter(pooled))]['n']} problems ({args.problems} per level)\n")
    print("| configuration | family | block efficiency | accuracy (95% CI) | vs lossless (95% CI) | McNemar p "
          "| TV per token | KL per token |")
    print("|---|---|---|---|---|---|---|---|")
    for label, s in pooled.items():
        vs = s.get("vs_lossless")
        diff = f"{100 * vs['difference']:+.1f} ({100 * vs['ci95'][0]:+.1f}, {100 * vs['ci95'][1]:+.1f})" if vs else "-"
        p = f"{vs['mcnemar_p']:.3f}" if vs else "-"
        tv, kl = ("-", "-") if s["tv"] is None else (f"{s['tv']:.4f}", f"{s['kl']:.4f}")
        print(f"| {label} | {s['family']} | {s['block_efficiency']:.2f} | {100 * s['accuracy']:.1f} "
              f"({100 * s['ci95'][0]:.1f}-{100 * s['ci95'][1]:.1f}) | {diff} | {p} | {tv} | {kl} |")
    trees = {label: s["vs_chain"] for label, s in pooled.items() if "vs_chain" in s}
    if trees:
        print(f"\ndraft trees of {args.tree} tokens against their chains of {args.num_draft_tokens}, on the same "
              "problems\n")
        print("| configuration | block efficiency, tree / chain | accuracy, tree - chain (95% CI) | McNemar p |")
        print("|---|---|---|---|")
        for label, vs in trees.items():
            print(f"| {label} | {vs['block_efficiency_ratio']:.3f} | {100 * vs['difference']:+.1f} "
                  f"({100 * vs['ci95'][0]:+.1f}, {100 * vs['ci95'][1]:+.1f}) | {vs['mcnemar_p']:.3f} |")
    if len(levels) > 1:
        tests = sum("vs_lossless" in s for lv in levels for s in summary[lv].values())
        print("\naccuracy (%) per level; * where the paired 95% interval of the difference from lossless "
              f"excludes zero, ** where McNemar's p also survives Bonferroni over the table's {tests} "
              "comparisons (at 5% each, about 1 in 20 exact-vs-exact differences is starred by chance)\n")
        print("| configuration | " + " | ".join(levels) + " |")
        print("|---|" + "---|" * len(levels))
        for label in pooled:
            cells = []
            for level in levels:
                s = summary[level][label]
                vs = s.get("vs_lossless")
                star = "*" if vs and (vs["ci95"][0] > 0 or vs["ci95"][1] < 0) else ""
                star += "*" if star and vs["mcnemar_p"] < 0.05 / tests else ""
                cells.append(f"{100 * s['accuracy']:.0f}{star}")
            print(f"| {label} | " + " | ".join(cells) + " |")
    if predicts:
        print("\nrank correlation (Spearman) across the lossy configurations with their accuracy loss: "
              + ", ".join(f"{m} {rho:.2f}" for m, rho in predicts.items()))
    if power:
        print("\npower: median share of problems on which a lossy configuration and lossless disagree\n")
        print("| level | problems | discordance | problems for a 5-point difference | detectable now |")
        print("|---|---|---|---|---|")
        for level, note in power.items():
            print(f"| {level} | {note['problems']} | {note['median_discordance']:.3f} | "
                  f"{note['problems_for_5_points']} | {100 * note['detectable_difference']:.0f} points |")


def get_args(argv=None):
    ap = ArgumentParser(description="The lossy-verification experiment: block efficiency, accuracy "
                                    "and distortion of every verifier, paired on the same problems.",
                        formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET,
                    help=f"model name ({', '.join(HF_REPOS)}) or a Hugging Face model directory")
    ap.add_argument("--draft", default=None,
                    help="the draft, as decode.py's --draft takes it; the in-domain GSM8K draft for the default "
                         "target (prompt lookup is no fair draft for short answers)")
    ap.add_argument("--tasks", default="arithmetic",
                    help="comma-separated: arithmetic (graded levels), gsm8k, humaneval")
    ap.add_argument("--problems", type=int, default=100, help="problems per arithmetic level, or per task")
    ap.add_argument("--configs", default="all",
                    help="comma-separated configuration names (all by default; README's lossy section lists them)")
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="tokens drafted per target forward")
    ap.add_argument("--tree", type=int, default=0, metavar="N",
                    help=f"also run {', '.join(TREE_VERSIONS)} with draft trees of N tokens (depth -k), "
                         "paired with their chains; 0: chains only")
    ap.add_argument("--temperature", type=float, default=0.5,
                    help="sampling temperature (README: why not 1 on the 135M default)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="answer length limit; 32 for arithmetic, 256 for gsm8k and humaneval")
    ap.add_argument("--seed", type=int, default=0, help="seeds the problems' samplers (and nothing else)")
    ap.add_argument("--workers", default="auto",
                    help="processes, one thread each; auto = one per idle core (on a CPU)")
    add_machine_options(ap, "device")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 problem per level, 8 new tokens")
    ap.add_argument("--out", default=None, help="JSON results path; results/lossy-<time>.json when omitted")
    ap.add_argument("--plots-from", type=Path, default=None, metavar="FILE",
                    help="draw a results file's figures again beside it, then stop")
    args = ap.parse_args(argv)
    check_and_complete(ap, args)
    return args


def check_and_complete(ap, args):
    """Refuse bad values in one line, before anything loads."""
    for name, value in (("problems", 1), ("max_new_tokens", 8)) if args.quick else ():
        if getattr(args, name) == ap.get_default(name):  # --quick fills in what the user left out
            setattr(args, name, value)
    args.tasks = [t for t in args.tasks.split(",") if t]
    if not args.tasks or any(t not in ("arithmetic", "gsm8k", "humaneval") for t in args.tasks):
        ap.error("--tasks takes arithmetic, gsm8k and/or humaneval")
    if args.problems < 1 or args.num_draft_tokens < 1:
        ap.error("--problems and -k must be >= 1")
    problem = machine_problem(args.device, "auto", None)
    if problem:
        ap.error(problem)
    if not 0 < args.temperature <= 2:
        ap.error(f"--temperature must lie in (0, 2]: lossy verifiers act on sampling, got {args.temperature}")
    args.configs = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",")]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(CONFIGS), n=3)
        ap.error(f"unknown configuration {unknown[0]!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                 + f"; {len(CONFIGS)} are known, from {next(iter(CONFIGS))} on (README's lossy section)")
    if args.tree < 0:
        ap.error(f"--tree takes a number of draft tokens >= 1 (0: chains only), got {args.tree}")
    if args.tree:
        args.configs += [c + TREE_SUFFIX for c in args.configs if c in TREE_VERSIONS]
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.tasks == ["arithmetic"] else 256
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.draft is None:
        args.draft = GSM8K_DRAFT if args.target == DEFAULT_TARGET and GSM8K_DRAFT.is_dir() else \
            DEFAULT_DRAFTS.get(args.target)
        if args.draft is None:
            ap.error(f"no committed draft for {args.target}: pass --draft")
    elif repo_path(args.draft).is_dir():  # a committed draft's folder, from any working directory
        args.draft = repo_path(args.draft)
    if args.workers == "auto":
        args.workers = 1 if args.device != "cpu" else pick_threads("auto")
    elif not (args.workers.isdigit() and int(args.workers) >= 1):
        ap.error(f"--workers takes auto or a whole number >= 1, got {args.workers}")
    args.workers = int(args.workers)
    args.threads_per_worker = 1 if args.workers > 1 else pick_threads("auto")
    args.max_seq_len = 1024 if args.max_new_tokens <= 256 else 4096
    args.out = Path(args.out or ROOT / "results" / f"lossy-{time.strftime('%Y%m%d-%H%M%S')}.json")
    problem = unwritable(args.out)
    if problem:
        ap.error(f"cannot write --out {args.out}: {problem}")
    if "humaneval" in args.tasks:
        try:
            check_sandbox()
        except SandboxError as e:
            ap.error(str(e))


def main(argv=None):
    args = get_args(argv)
    if args.plots_from:
        try:
            summary = json.loads(args.plots_from.read_text())["summary"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{args.plots_from} is not a lossy.py results file ({type(e).__name__})") from None
        print("\n".join(map(str, plots(summary, args.plots_from.parent, args.plots_from.stem))))
        return
    problems = load_problems(args.tasks, args.problems, args.seed)
    resolve_model(args.target)  # missing weights: one line now, not from inside the workers
    t0 = time.time()
    records = run_all(args, problems)
    summary = summarize(records, args.configs)
    power = power_note(summary) if "lossless" in args.configs else {}
    predicts = distortion_predicts_loss(summary["all" if "all" in summary else next(iter(summary))])
    print_report(args, summary, power, predicts)
    out = args.out
    images = figures_beside(plots, summary, out)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"config": {**{k: shown(v) for k, v in vars(args).items()}, "git_commit": commit or "unknown",
                         "torch": torch.__version__, "seconds_this_run": round(time.time() - t0, 1)},
              "machine": machine_stamp(args.device), "summary": summary, "power": power, "distortion_predicts_loss": predicts, "plots": [shown(p) for p in images],
              "problems": records}
    out = write_results(out, result)
    pooled = summary["all" if "all" in summary else next(iter(summary))]
    print(json.dumps({"results": str(out), "accuracy": {lb: s["accuracy"] for lb, s in pooled.items()},
                      "block_efficiency": {lb: s["block_efficiency"] for lb, s in pooled.items()},
                      "tv": {lb: s["tv"] for lb, s in pooled.items()}}))


if __name__ == "__main__":
    run_script(main, "interrupted: the problems finished are kept in --out's .problems.jsonl, and the same command "
               "continues from them")
