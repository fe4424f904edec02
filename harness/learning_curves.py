"""
The record of finished training runs (train_vat.py --learning-curves FILE --runs DIR ...): each
run's learning curve, read from its log, with what its last checkpoint says it trained, written
as a results file stamped with the machine, and drawn beside it.
"""
import sys
from pathlib import Path

from engine.checkpoints import draft_kind, draft_record
from engine.training_runs import read_log
from engine.weights import read_config
from harness.results import machine_stamp, save_figure, write_results

CURVE_FIELDS = ("step", "loss", "sim_tau", "head_acc", "weighting_changes", "real_tau", "response_tokens")


def learning_curves(run_dirs: list) -> dict:
    """Each run's log, cut to what a learning curve needs, with the draft kind and objective its last
    checkpoint records: the curve as columns, {field: [its value at each logged step]}. Real tau is
    in the steps that evaluated it (--eval-every), None in the others."""
    runs = {}
    for folder in map(Path, run_dirs):
        log = read_log(folder / "log.jsonl")
        if not log or not (folder / "checkpoint").is_dir():
            raise ValueError(f"{folder} holds no training log and checkpoint: not a train_vat.py --out directory")
        if folder.name in runs:  # the record is keyed by run name: a second one would overwrite the first
            raise ValueError(f"two runs named {folder.name} in --runs: give each run its own name")
        config = read_config(folder / "checkpoint")
        trained = {k: v for k, v in draft_record(folder / "checkpoint").items() if k != "early_exit_threshold"}
        if trained.get("objective") == "baseline":  # checkpoints once recorded every part for it
            trained = {**trained, "vat_parts": []}
        runs[folder.name] = {"draft": draft_kind(config), **trained,
                             "curve": {k: [s.get(k) for s in log] for k in CURVE_FIELDS if any(k in s for s in log)}}
    return runs


def write_learning_curves(out: Path, run_dirs: list, argv=None):
    command = "python train_vat.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    runs = learning_curves(run_dirs)
    write_results(out, {"command": command, "machine": machine_stamp("cpu"), "runs": runs})
    plot_learning_curves(runs, out.with_suffix(".png"))
    for name, run in runs.items():
        curve = run["curve"]
        evaluated = [(tau, step) for tau, step in zip(curve.get("real_tau", []), curve["step"]) if tau is not None]
        print(f"{name}: {run['draft']} {run['objective']}, {curve['step'][-1]} steps, real tau "
              + " ".join(f"{tau:.2f}@{step}" for tau, step in evaluated))


def plot_learning_curves(runs: dict, path: Path):
    """Real tau (held-out prompts, at each evaluation) against the response tokens trained on so far."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, run in runs.items():
        curve = run["curve"]
        seen, points = 0, []
        for tokens, tau in zip(curve.get("response_tokens", [None] * len(curve["step"])), curve.get("real_tau", [])):
            seen += tokens or 0
            if tau is not None:
                points.append((seen, tau))
        if points and seen:
            ax.plot(*zip(*points), marker="o", ms=3, label=f"{name} ({run['draft']}, {run['objective']})")
    ax.set_xscale("log")
    # ticks at 1, 2 and 5 of each decade, as 200k and 1M (log axes' own minor labels overlap)
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda x, _: f"{x / 1e6:g}M" if x >= 1e6 else f"{x / 1e3:g}k"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("response tokens trained on (log scale)")
    ax.set_ylabel("real tau, held-out prompts (T = 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
