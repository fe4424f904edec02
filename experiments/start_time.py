"""
How long decode.py takes to start, compiled and eager: whole processes, from the command to its
exit, of a one-token plain decode (`--verifier none --max-new-tokens 1`), so the figure is the start
a user waits for. Compiled, the first run in an empty graph cache compiles the step (cold) and
later runs load it (warm, engine/graph_cache.py); warm and eager runs alternate, so a drift of the
machine's speed moves both alike.

    python experiments/start_time.py --out docs/compiled/start-time.json

Run it with nothing else busy. The cold run uses a graph cache and an inductor cache of its own,
both empty, in a temporary folder; the warm runs read that graph cache.
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.files import ROOT
from engine.machine import ArgumentParser, run_script
from harness.results import machine_stamp, unwritable, write_results

PROMPT = "Repeat after me: one two three, one two three."


def get_args(argv=None):
    ap = ArgumentParser(description="How long decode.py takes to start, compiled (cold, warm) and eager.")
    ap.add_argument("--repeats", type=int, default=5, help="warm and eager runs each, alternated (medians)")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")
    problem = unwritable(args.out)
    if problem:
        ap.error(problem)
    return args


def run_seconds(compile_flag: str, env: dict) -> float:
    """Wall seconds of one decode.py process; a failed run stops the measurement with its error."""
    command = [sys.executable, str(ROOT / "decode.py"), "--compile", compile_flag, "--verifier", "none",
               "--max-new-tokens", "1", "--prompt", PROMPT]
    t0 = time.perf_counter()
    r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} failed: {r.stderr.strip().splitlines()[-1:]}")
    return seconds


def main(argv=None):
    args = get_args(argv)
    with tempfile.TemporaryDirectory(prefix="start-time-") as scratch:
        env = {**os.environ, "SPECDEC_GRAPH_CACHE": f"{scratch}/graphs", "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor"}
        cold = run_seconds("on", env)
        print(f"compiled, cold: {cold:.1f} s", file=sys.stderr)
        warm, eager = [], []
        for i in range(args.repeats):
            warm.append(run_seconds("on", env))
            eager.append(run_seconds("off", env))
            print(f"run {i + 1}/{args.repeats}: warm {warm[-1]:.1f} s, eager {eager[-1]:.1f} s", file=sys.stderr)
    late = [w - e for w, e in zip(warm, eager)]
    result = {"machine": machine_stamp("cpu"),
              "config": {"command": "decode.py --compile on|off --verifier none --max-new-tokens 1",
                         "repeats": args.repeats},
              "seconds": {"compiled_cold": cold, "compiled_warm": warm, "eager": eager,
                          "compiled_warm_median": statistics.median(warm), "eager_median": statistics.median(eager),
                          "warm_minus_eager_median": statistics.median(late)}}
    out = write_results(args.out, result)
    print(f"start: eager {statistics.median(eager):.1f} s, compiled warm {statistics.median(warm):.1f} s "
          f"({statistics.median(late):+.1f} s, median of pairs), compiled cold {cold:.0f} s\nresults: {out}")


if __name__ == "__main__":
    run_script(main, "interrupted: nothing written (the results are written once every start is timed)")
