"""
The commands a user types, timed as typed. Each row is a decode.py command line, run once per
prompt as its own process (the prompt, --seed with the prompt's index and --max-new-tokens
appended); on each prompt every row runs before the next prompt, so drift of the machine falls on
all rows alike. A row's speed on a prompt is decode.py's own tokens/s (new tokens over the
decoding, prefill excluded); its ratio is to the plain row of its temperature on the same prompt,
summarized as the median over prompts. A T = 0 row must print plain decoding's tokens.

    python experiments/commands.py --old drafts/smollm2-135m-eagle3-vat --new drafts/NEW \\
        --out docs/chat-draft/commands.json

Prompts: the first turn of the first Spec-Bench question of each of its 13 categories. Rows: plain
decoding at T = 0 and T = 1, decode.py's default at T = 0, the card's `decode.py --verifier
overshoot` as typed (its default draft), and for the old and the new draft: greedy with a fixed
k and no early exit (the draft's own tau) and as decode.py drafts by default (adaptive length,
early exit), lossless and overshoot (T = 1); last, the new draft behind prompt lookup (T = 0).
Run it with nothing else busy. --render FILE prints a results file's tables (markdown) again.
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the core modules, one folder up

from engine.files import DATA, ROOT
from engine.machine import ArgumentParser, pick_threads
from data.prompts import load_prompts
from harness.results import machine_stamp, unwritable, write_results

PLAIN = {0: "decode.py --verifier none", 1: "decode.py --verifier none --temperature 1"}


def fixed_k(draft: str) -> str:
    """The draft's own tau: k tokens drafted every step, none declined by its head."""
    return f"decode.py --draft {draft} --no-adaptive --early-exit 0"


def rows(old: str, new: str) -> list:
    """[(command as typed, temperature)]: the baselines first."""
    out = [(PLAIN[0], 0), (PLAIN[1], 1), ("decode.py", 0), ("decode.py --verifier overshoot", 1)]
    for draft in (old, new):
        out += [(fixed_k(draft), 0), (f"decode.py --draft {draft}", 0),
                (f"decode.py --verifier lossless --temperature 1 --draft {draft}", 1),
                (f"decode.py --verifier overshoot --draft {draft}", 1)]
    return out + [(f"decode.py --draft lookup+{new}", 0)]


def run_once(command: str, prompt: str, seed: int, max_new_tokens: int) -> dict:
    """One decode.py process on one prompt: its --json record (tokens, tokens/s, tau)."""
    argv = [sys.executable, str(ROOT / "decode.py"), *command.split()[1:], "--prompt", prompt, "--seed", str(seed),
            "--max-new-tokens", str(max_new_tokens), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise RuntimeError(f"{command} failed: {last}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: record[k] for k in ("tokens", "tokens_per_s", "tau", "new_tokens", "drafted_tokens")}


def measure(commands: list, prompts: list, max_new_tokens: int) -> dict:
    """{command: [record on each prompt]}, every command on a prompt before the next prompt."""
    records = {command: [] for command, _ in commands}
    for i, (category, text) in enumerate(prompts):
        t0 = time.perf_counter()
        for command, _ in commands:
            records[command].append(run_once(command, text, i, max_new_tokens))
        print(f"prompt {i + 1}/{len(prompts)} ({category}): {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return records


def summarize(commands: list, records: dict) -> dict:
    """Per command: median tokens/s, mean tau, the median over prompts of the ratio to plain
    decoding at its temperature, and at T = 0 whether every prompt printed plain decoding's tokens."""
    out = {}
    for command, temperature in commands:
        base = records[PLAIN[temperature]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(records[command], base)]
        out[command] = {"temperature": temperature,
                        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[command]),
                        "mean_tau": statistics.fmean(r["tau"] for r in records[command]),
                        "median_ratio": statistics.median(ratios), "ratios": ratios}
        if temperature == 0:
            out[command]["exact_prompts"] = sum(r["tokens"] == b["tokens"] for r, b in zip(records[command], base))
    return out


def render(result: dict) -> str:
    """The summary (a row per command) and, per prompt's category, the old and the new draft side
    by side: tau greedy with a fixed k, tau lossless and overshoot, and overshoot's speed ratio."""
    n = len(result["prompts"])
    lines = ["| command | T | tau | tokens/s (median) | vs plain (median ratio) | exact |", "|---|---|---|---|---|---|"]
    for command, s in result["summary"].items():
        exact = f"{s['exact_prompts']}/{n}" if "exact_prompts" in s else "-"
        lines.append(f"| `{command}` | {s['temperature']} | {s['mean_tau']:.2f} | {s['median_tokens_per_s']:.1f} | "
                     f"{s['median_ratio']:.2f}x | {exact} |")
    old, new = result["old"], result["new"]
    columns = [(fixed_k(d), "tau") for d in (old, new)] + \
        [(f"decode.py --verifier lossless --temperature 1 --draft {d}", "tau") for d in (old, new)] + \
        [(f"decode.py --verifier overshoot --draft {d}", "tau") for d in (old, new)] + \
        [(f"decode.py --verifier overshoot --draft {d}", "ratio") for d in (old, new)]
    lines += ["", "| category | greedy tau, fixed k (old / new) | lossless tau (old / new) | overshoot tau (old / new) "
                  "| overshoot vs plain T = 1 (old / new) |", "|---|---|---|---|---|"]
    for i, category in enumerate(result["prompts"]):
        cells = []
        for command, field in columns:
            if field == "tau":
                cells.append(f"{result['records'][command]['tau'][i]:.2f}")
            else:
                cells.append(f"{result['summary'][command]['ratios'][i]:.2f}x")
        lines.append(f"| {category} | " + " | ".join(f"{a} / {b}" for a, b in zip(cells[::2], cells[1::2])) + " |")
    return "\n".join(lines)


def read_results(ap, path: Path) -> dict:
    """A results file this script wrote, or a one-line error."""
    try:
        result = json.loads(path.read_text())
    except OSError as e:
        ap.error(f"--render: cannot read {path} ({e.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError):
        ap.error(f"--render: {path} is not JSON")
    if not (isinstance(result, dict) and {"summary", "records", "prompts", "old", "new"} <= set(result)):
        ap.error(f"--render: {path} is not a results file of experiments/commands.py")
    return result


def main(argv=None):
    ap = ArgumentParser(description="decode.py's command lines as a user types them, timed per prompt.")
    ap.add_argument("--render", default=None, metavar="FILE", help="print a results file's tables, measure nothing")
    ap.add_argument("--old", help="the draft before (a draft directory)")
    ap.add_argument("--new", help="the draft after")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=13, help="prompts (one per Spec-Bench category)")
    ap.add_argument("--out", help="results file (JSON)")
    args = ap.parse_args(argv)
    if args.render:
        print(render(read_results(ap, Path(args.render))))
        return
    if not (args.old and args.new and args.out):
        ap.error("--old, --new and --out go together (or --render FILE)")
    for draft in (args.old, args.new):
        if not (ROOT / draft / "config.json").is_file():
            ap.error(f"no draft directory {draft}")
    if args.max_new_tokens < 1 or args.limit < 1:
        ap.error("--max-new-tokens and --limit must be >= 1")
    if unwritable(Path(args.out)):
        ap.error(f"--out {args.out} cannot be written ({unwritable(Path(args.out))})")
    for draft in (args.old, args.new):  # a draft decode.py refuses fails here, not after the first prompts
        run_once(f"decode.py --draft {draft}", "Hi", 0, 1)
    prompts = load_prompts(DATA / "spec_bench_questions.jsonl", None, 1)[:args.limit]
    commands = rows(args.old, args.new)
    t0 = time.perf_counter()
    records = measure(commands, prompts, args.max_new_tokens)
    summary = summarize(commands, records)
    import torch
    torch.set_num_threads(pick_threads("auto"))  # (the stamp names the threads decode.py picks)
    result = {"command": "python experiments/commands.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_stamp("cpu"), "minutes": (time.perf_counter() - t0) / 60,
              "prompts": [category for category, _ in prompts], "max_new_tokens": args.max_new_tokens,
              "old": args.old, "new": args.new,
              "summary": summary, "records": {c: {k: [r[k] for r in rs] for k in rs[0]} for c, rs in records.items()}}
    write_results(Path(args.out), result)
    print(render(json.loads(Path(args.out).read_text())))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:  # (a decode.py that failed: its own last line says why)
        sys.exit(f"error: {e}")
