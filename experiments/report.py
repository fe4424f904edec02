"""
The results report: every speed table README shows, measured again on the machine it runs on.

    python experiments/report.py                  # measure again (README says how long it takes)
    python experiments/report.py --render-only    # the tables again from docs/results.json

Two task sets with the embedded default target: Spec-Bench (one question per category: writing,
roleplay, reasoning, math, coding, extraction, stem, humanities, translation, summarization, QA,
math reasoning, retrieval-augmented generation) and the last GSM8K test questions, the in-domain
task of the committed GSM8K draft. Each at T = 0 (greedy, every speculative run emits plain
decoding's tokens) and T = 1 (sampling, lossless verification: every run emits the target's
distribution). Every run of a task goes on each prompt before the next prompt (speed.interleave),
so drift of the machine falls on all of them alike, and a speedup is the median over prompts of
(run's tokens/s) / (plain decoding's tokens/s on the same prompt: decode.py --verifier none, in
decode.py's own weight layout). A rate is new tokens over
the whole call, prompt included, which is what transformers' generate can be timed on too.

It writes docs/results.json (every run on every prompt, the summary and the machine: CPU model and
features, cores, threads, torch, commit, date) and rewrites, between their markers and from that
file alone, README's summary (one speedup and tau per run and task) and the full tables of its docs
page (docs/results/README.md: tokens/s, interquartile ranges, exactness, the weight layout); a test
checks that both show what the file renders to.
Run it with nothing else busy: with 2 OpenMP threads another process slows a step several times.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the core modules, one folder up

import torch

from harness import peers
from harness import speed
from engine.files import DATA, ROOT, read_json_object, repo_relative, write_atomically
from engine.layouts import layout_of, load_target
from engine.timing_cache import CPU_FEATURES
from engine.machine import ArgumentParser, machine_problem, pick_threads, run_script
from data.prompts import load_prompts
from harness.results import machine_stamp, save_figure, unwritable, write_results
from speculative import DECODE_K
from engine.weights import DEFAULT_TARGET, resolve_model

RESULTS = ROOT / "docs" / "results.json"
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "results" / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
GENERAL_DRAFT = "drafts/smollm2-135m-eagle3-vat"  # trained on general prompts
GSM8K_DRAFT = "drafts/smollm2-135m-eagle3-gsm8k-2ep"  # trained on GSM8K-train answers

# (label, temperatures, weights of the target, draft spec as bench takes it or None, transformers peer).
# "auto" is decode.py's own weight layout, the one every run of decode.py on this machine uses; the
# first row of each table is the baseline, `decode.py --verifier none`.
PLAIN = ("plain decoding (decode.py --verifier none)", (0, 1), "auto", None, False)
DEFAULT = ("decode.py's default: adaptive prompt lookup", (0, 1), "auto", "lookup@adapt", False)
SPEC_BENCH_RUNS = [
    PLAIN,
    ("plain decoding, fp32 weights", (0,), "fp32", None, False),
    ("transformers generate, fp32", (0,), None, None, True),
    DEFAULT,
    ("prompt lookup, every step", (0,), "auto", "lookup", False),
    ("general EAGLE-3 draft, early exit, adaptive", (0,), "auto", f"{GENERAL_DRAFT}@ee@adapt", False),
]
GSM8K_RUNS = [
    PLAIN,
    DEFAULT,
    ("prompt lookup, every step", (0,), "auto", "lookup", False),
    ("GSM8K draft, every step", (0, 1), "auto", GSM8K_DRAFT, False),
    ("GSM8K draft, early exit, adaptive", (0, 1), "auto", f"{GSM8K_DRAFT}@ee@adapt", False),
    ("lookup + GSM8K draft, early exit, adaptive", (0,), "auto", f"lookup+{GSM8K_DRAFT}@ee@adapt", False),
]
WEIGHTS = {"fp32": "float32-packed", "auto": "auto"}  # load_target's layouts


def task_prompts(task: str, limit: int, tokenizer) -> list:
    """[(category, chat-encoded ids)]: one Spec-Bench question per category, or the last GSM8K
    test questions (`limit` of them)."""
    if task == "Spec-Bench":
        chosen = load_prompts(DATA / "spec_bench_questions.jsonl", None, 1)[:limit]
    else:
        chosen = [("gsm8k", text) for _, text in load_prompts(DATA / "gsm8k_test.jsonl", None, limit,
                                                                     from_end=True)]
    return [(c, tokenizer.encode_chat([{"role": "user", "content": t}])) for c, t in chosen]


def build_runs(table: list, targets: dict, tokenizer, generator, k: int) -> tuple:
    """speed.Run objects for a table, its first row the baseline at each temperature, and {run
    name: the layout its target ran in}. targets: {weights: (target, auto's layout decision)}."""
    runs, layouts = [], {}
    for label, temperatures, weights, spec, peer in table:
        for t in temperatures:
            name = "baseline" if label == table[0][0] else label
            if peer:
                runs.append(speed.Run(f"{name} T={t:g}", t, peer=peers.hf_peer(
                    resolve_model(DEFAULT_TARGET), "generate", k)))
                layouts[runs[-1].name] = "transformers float32"
                continue
            target, choice = targets[weights]
            draft = None if spec is None else speed.make_draft(spec, target, tokenizer, t, generator)
            runs.append(speed.Run(f"{name} T={t:g}", t, target, draft))
            layouts[runs[-1].name] = layout_of(target)
    return runs, layouts


def measure(tasks: dict, max_new_tokens: int, k: int, seed: int) -> tuple:
    """Load the target in each weight layout, run every table: (tasks' results, auto's decision)."""
    targets = {}
    for key, layout in WEIGHTS.items():
        target, tokenizer, choice = load_target(DEFAULT_TARGET, "cpu", layout, 4096)
        targets[key] = target, choice
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for task, (table, limit) in tasks.items():
        t0 = time.perf_counter()
        runs, layouts = build_runs(table, targets, tokenizer, generator, k)
        prompts = task_prompts(task, limit, tokenizer)
        records = speed.interleave(runs, prompts, k, max_new_tokens, tokenizer.stop_ids, generator, "cpu",
                                   warmup=1, desc=f"{task} (prompts)")
        labels = {run.name: run.name.replace("baseline", table[0][0]) for run in runs}
        temperatures = {run.name: run.temperature for run in runs}
        out[task] = {"prompts": len(prompts), "labels": labels, "layouts": layouts,
                     "summary": speed.summarize(records, temperatures),
                     "seconds": time.perf_counter() - t0, "runs": speed.records_for_file(records, temperatures)}
    return out, targets["auto"][1]


def render(results: dict) -> str:
    """The docs page's full tables, from the results file alone."""
    m = results["machine"]
    features = ", ".join(m["cpu_features"]) or "none of " + ", ".join(CPU_FEATURES)
    lines = [BEGIN,
             f"Measured by `{results['command']}` on {m['cpu']} ({features}), {m['cores']} cores, "
             f"{m['threads']} threads, torch {m['torch']}, commit {m['commit']}, {m['date']}; raw numbers in "
             f"`{results.get('out', 'docs/results.json')}`. Up to {results['max_new_tokens']} new tokens per "
             f"prompt, k = {results['k']} (decode.py's default). tokens/s counts the prompt's prefill; speedup "
             f"is the median over prompts of the ratio to plain decoding (`decode.py --verifier none`) at the "
             f"same temperature on the same prompt (interquartile range in brackets); tau is tokens per target "
             f"forward; exact counts the prompts on which a T = 0 run printed plain decoding's tokens.", ""]
    choice = results.get("auto_choice") or {}
    if choice.get("ms"):
        others = ", ".join(f"{layout} {ms:.1f}" for layout, ms in choice["ms"].items() if layout != choice["layout"])
        blocks = choice.get("blocks_ms", {})
        cost = f"; at a short context a block of {results['k'] + 1} tokens costs " \
               f"{blocks[str(results['k'] + 1)] / blocks['1']:.1f} one-token steps there" \
            if str(results["k"] + 1) in blocks and "1" in blocks else ""
        exact = "its blocks give the bits of one-token steps there" if choice["layout"] not in choice.get("inexact", []) \
            else "its blocks are not exact there, so the default decodes plainly"
        lines += [f"`--dtype auto` runs every forward of every run in {choice['layout']} on the machine above: the "
                  f"fastest estimated one-token step ({choice['ms'][choice['layout']]:.1f} ms; {others}), and "
                  f"{exact}{cost}.", ""]
    for task, table in results["tasks"].items():
        lines += [f"**{task}** ({table['prompts']} prompt{'s' if table['prompts'] > 1 else ''})", "",
                  "| run | T | tau | tokens/s | speedup | exact |", "|---|---|---|---|---|---|"]
        for name, s in sorted(table["summary"].items(), key=lambda item: item[1]["temperature"]):
            label = table["labels"][name].rsplit(" T=", 1)[0]
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            lo, hi = s["speedup_iqr"]
            exact = f"{s['prompts_with_the_baseline_tokens']}/{table['prompts']}" \
                if s["temperature"] == 0 and s["drafted_tokens"] else "-"
            lines.append(f"| {label} | {s['temperature']:g} | {tau} | {s['tokens_per_s_median']:.1f} | "
                         f"{s['speedup_median']:.2f}x ({lo:.2f}-{hi:.2f}) | {exact} |")
        lines.append("")
    return "\n".join(lines + [END])


def render_summary(results: dict) -> str:
    """README's results: each run's median speedup and tau per task and temperature, one table,
    from the results file alone; the rest is the page's (render)."""
    m, cells, columns, exact, tried = results["machine"], {}, [], 0, 0
    for task, table in results["tasks"].items():
        for name, s in sorted(table["summary"].items(), key=lambda item: item[1]["temperature"]):
            column = f"{task}, T = {s['temperature']:g}"
            columns += [] if column in columns else [column]
            tau = f", tau {s['tau']:.2f}" if s["tau"] and s["drafted_tokens"] else ""
            label = table["labels"][name].rsplit(" T=", 1)[0]
            cells.setdefault(label, {})[column] = f"{s['speedup_median']:.2f}x{tau}"
            if s["temperature"] == 0 and s["drafted_tokens"]:
                exact, tried = exact + s["prompts_with_the_baseline_tokens"], tried + table["prompts"]
    prompts = ", ".join(f"{table['prompts']} {task}" for task, table in results["tasks"].items())
    lines = [BEGIN,
             f"Median over prompts ({prompts}) of the speedup over plain decoding (`decode.py --verifier none`) "
             f"at the same temperature on the same prompt, and tau (tokens per target forward); measured by "
             f"`{results['command']}` on {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch "
             f"{m['torch']}, commit {m['commit']}, {m['date']}. At T = 0 the speculative runs printed plain "
             f"decoding's tokens on {exact} of {tried} prompts. Tokens/s, interquartile ranges and the weight "
             f"layout: [docs/results](docs/results/README.md).", "",
             "| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(row.get(c, "-") for c in columns) + " |" for label, row in cells.items()]
    return "\n".join(lines + [END])


def shown_command(argv: list) -> str:
    """The command line as README shows it: its settings, not where this machine kept its files."""
    shown, i = [], 0
    while i < len(argv):
        if argv[i] in ("--out", "--readme", "--page"):
            i += 2
            continue
        if not argv[i].startswith(("--out=", "--readme=", "--page=")):
            shown.append(argv[i])
        i += 1
    return " ".join(["python experiments/report.py", *shown])


def read_results(path: Path) -> dict:
    """A results file report.py wrote; anything else is a one-line error."""
    results = read_json_object(path, "results file (python experiments/report.py writes it)")
    for key in ("machine", "tasks", "command", "k", "max_new_tokens"):
        if key not in results:
            raise ValueError(f"{path} holds no {key!r}: is it a results file report.py wrote?")
    return results


def draw(results: dict, path: Path) -> Path:
    """README's figure: each configuration's median speedup over plain decoding with its
    interquartile range, one panel per prompt set, both temperatures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = results["tasks"]
    heights = [len(table["summary"]) for table in tasks.values()]
    fig, axes = plt.subplots(len(tasks), 1, figsize=(9, 1.2 + 0.3 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (task, table) in zip(axes[:, 0], tasks.items()):
        rows = sorted(table["summary"].items(), key=lambda item: (item[1]["temperature"], item[0] != "baseline"))
        labels = [f"{table['labels'][name].rsplit(' T=', 1)[0]}, T={s['temperature']:g}" for name, s in rows]
        medians = [s["speedup_median"] for _, s in rows]
        errors = [[m - s["speedup_iqr"][0] for m, (_, s) in zip(medians, rows)],
                  [s["speedup_iqr"][1] - m for m, (_, s) in zip(medians, rows)]]
        y = range(len(rows))[::-1]
        colours = ["#4c72b0" if s["temperature"] == 0 else "#dd8452" for _, s in rows]
        ax.barh(list(y), medians, xerr=errors, color=colours, capsize=2)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.set_xlabel("speedup over plain decoding, decode.py --verifier none (median over prompts, IQR)", fontsize=8)
        ax.set_title(f"{task} ({table['prompts']} prompts)", fontsize=9)
    m = results["machine"]
    fig.suptitle(f"{m['cpu']}, {m['threads']} threads, torch {m['torch']}, commit {m['commit']}", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def marker_problem(path: Path) -> str | None:
    """Why `path` cannot take the rendered results between its markers, or None."""
    if not path.is_file() or BEGIN not in path.read_text() or END not in path.read_text():
        return f"{path} has no {BEGIN} ... {END} markers to write the results between"
    return None


def write_tables(results: dict, readme: Path, page: Path):
    """Replace what lies between the markers of README (the summary) and of the docs page (the
    full tables), each atomically, after checking both: one bad file leaves the other as it was."""
    problem = marker_problem(readme) or marker_problem(page)
    if problem:
        raise ValueError(problem)
    for path, text in ((readme, render_summary(results)), (page, render(results))):
        head, rest = path.read_text().split(BEGIN, 1)
        write_atomically(path, head + text + rest.split(END, 1)[1])


def main(argv=None):
    ap = ArgumentParser(description="Regenerate README's results on this machine: "
                                    "docs/results.json and the tables it renders to.")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite README's summary and the docs page's tables from the results file")
    ap.add_argument("--spec-bench", type=int, default=13, help="Spec-Bench prompts (one per category, in order)")
    ap.add_argument("--gsm8k", type=int, default=20, help="GSM8K test questions, from the end of the file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=DECODE_K,
                    help="tokens drafted per step (default: decode.py's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", default="auto", help="as decode.py's; measure with nothing else busy")
    ap.add_argument("--out", default=str(RESULTS), help="the results file")
    ap.add_argument("--readme", default=str(README), help="the README whose summary is rewritten")
    ap.add_argument("--page", default=str(PAGE), help="the docs page whose full tables are rewritten")
    args = ap.parse_args(argv)
    if min(args.spec_bench, args.gsm8k, args.max_new_tokens, args.num_draft_tokens) < 1:
        ap.error("--spec-bench, --gsm8k, --max-new-tokens and -k must be >= 1")
    problem = machine_problem("cpu", args.threads, None)
    if problem:
        ap.error(problem)
    out, readme, page = Path(args.out), Path(args.readme), Path(args.page)
    if args.render_only:
        results = read_results(out)
        write_tables(results, readme, page)
        draw(results, out.with_suffix(".png"))
        return
    problem = unwritable(out)
    if problem:
        ap.error(f"cannot write {out}: {problem}")
    problem = marker_problem(readme) or marker_problem(page)
    if problem:
        ap.error(problem)
    torch.set_num_threads(pick_threads(args.threads))
    machine = machine_stamp("cpu")  # before the runs: the commit measured, not one made during them
    t0 = time.perf_counter()
    tasks, auto = measure({"Spec-Bench": (SPEC_BENCH_RUNS, args.spec_bench), "GSM8K test": (GSM8K_RUNS, args.gsm8k)},
                          args.max_new_tokens, args.num_draft_tokens, args.seed)
    results = {"command": shown_command(argv if argv is not None else sys.argv[1:]), "machine": machine,
               "out": repo_relative(out), "max_new_tokens": args.max_new_tokens, "k": args.num_draft_tokens,
               "seed": args.seed, "seconds": time.perf_counter() - t0, "auto_choice": auto, "tasks": tasks}
    write_results(out, results)
    write_tables(results, readme, page)
    draw(results, out.with_suffix(".png"))
    print(render_summary(results))


if __name__ == "__main__":
    run_script(main, "interrupted: nothing written (report.py writes its results once every run is done)")
