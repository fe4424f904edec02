"""
The lossy-verification experiment's figures, the paper's in kind, drawn from a run's summary
(experiments/lossy.py): accuracy by level, block efficiency against accuracy, truncation's block
efficiency against its parameter, and distortion against block efficiency.
"""
from pathlib import Path

from harness.results import save_figure
from sweep import CONFIGS, PARAMETER, TREE_SUFFIX

def plots(summary: dict, out_dir: Path, stem: str) -> list:
    """Draw the figures that the run's configurations allow; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = [lv for lv in summary if lv != "all"]
    pooled = summary["all" if "all" in summary else levels[0]]
    pooled = {label: s for label, s in pooled.items() if not label.endswith(TREE_SUFFIX)}  # (chains only)
    families = list(dict.fromkeys(label.split()[0] for label in pooled if label.split()[0] in
                                  ("minp", "eta", "cos", "lenience", "overshoot")))
    truncation = [f for f in families if f in ("minp", "eta")]
    figures = {"accuracy-by-level": len(levels) > 1 and families and accuracy_by_level,
               "tradeoff": tradeoff, "truncation-efficiency": truncation and truncation_efficiency,
               "distortion": families and distortion}
    written = []
    for name, draw in figures.items():
        if draw:
            fig = draw(plt, summary, levels, pooled, families)
            fig.tight_layout()
            written.append(out_dir / f"{stem}-{name}.png")
            save_figure(fig, written[-1])
    plt.close("all")
    return written


def accuracy_by_level(plt, summary, levels, pooled, families):
    """The paper's Figure 1: accuracy against difficulty, a panel per family, lossless on each."""
    fig, axes = plt.subplots(1, len(families), figsize=(3.3 * len(families), 3.6), sharey=True, squeeze=False)
    for ax, family in zip(axes[0], families):
        for label, style in (("lossless", "k-"), ("plain sampling", "k:")):
            if label in pooled:
                ax.plot(range(len(levels)), [summary[lv][label]["accuracy"] for lv in levels], style, lw=1.5,
                        label=label)
        for label in (lb for lb in pooled if lb.split()[0] == family):
            ax.plot(range(len(levels)), [summary[lv][label]["accuracy"] for lv in levels], "o-", ms=3,
                    label=label.removeprefix(family + " "))
        ax.set_xticks(range(len(levels)), levels, rotation=30, ha="right", fontsize=7)
        ax.set_title(family)
        ax.legend(fontsize=6)
    axes[0, 0].set_ylabel("accuracy")
    return fig


def tradeoff(plt, summary, levels, pooled, families):
    """The paper's Figure 3: block efficiency against accuracy, a curve per family, levels pooled."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for group in curves(pooled, ["lossless", "plain"] + families):
        errorbar(ax, sorted((s for lb, s in pooled.items() if lb == group or lb.startswith(group + " ")),
                            key=lambda s: s["block_efficiency"]), group)
    ax.set_xlabel("block efficiency (tokens per target forward)")
    ax.set_ylabel("accuracy (all levels)")
    ax.legend(fontsize=7)
    return fig


def truncation_efficiency(plt, summary, levels, pooled, families):
    """The paper's Figure 5: truncation block efficiency against its parameter, per level."""
    truncation = [f for f in families if f in ("minp", "eta")]
    fig, axes = plt.subplots(1, len(truncation), figsize=(4.2 * len(truncation), 3.6), squeeze=False)
    for ax, family in zip(axes[0], truncation):
        labels = sorted((lb for lb in pooled if lb.split()[0] == family),
                        key=lambda lb: getattr(CONFIGS[lb], PARAMETER[family]))
        xs = [getattr(CONFIGS[lb], PARAMETER[family]) for lb in labels]
        for level in levels + (["all"] if "all" in summary else []):
            ax.plot(xs, [summary[level][lb]["block_efficiency"] for lb in labels], "o-", ms=3, label=level,
                    lw=2.5 if level == "all" else 1)
        if "lossless" in pooled:
            ax.axhline(pooled["lossless"]["block_efficiency"], color="k", lw=1, label="lossless (all)")
        ax.set_xscale("log")
        ax.set_xlabel(PARAMETER[family])
        ax.set_ylabel("block efficiency")
        ax.set_title(family)
        ax.legend(fontsize=6)
    return fig


def distortion(plt, summary, levels, pooled, families):
    """Distortion against block efficiency: what each token gained costs, per family."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for group in curves(pooled, families):
        rs = sorted((s for lb, s in pooled.items() if lb.startswith(group + " ")), key=lambda s: s["block_efficiency"])
        ax.plot([s["block_efficiency"] for s in rs], [s["tv"] for s in rs], "o-", ms=3, label=group)
    if "lossless" in pooled:
        ax.plot(pooled["lossless"]["block_efficiency"], pooled["lossless"]["tv"], "ks", label="lossless")
    ax.set_xlabel("block efficiency (tokens per target forward)")
    ax.set_ylabel("mean total variation from p per token")
    ax.legend(fontsize=7)
    return fig


def curves(pooled: dict, families: list) -> list:
    """The curves of a figure: a family's settings joined, overshoot's once per lam ('plain' is the
    plain-sampling point, 'lossless' the lossless one)."""
    groups = [lb.rsplit(" ", 1)[0] if lb.startswith("overshoot") else lb.split()[0] for lb in pooled]
    return [g for g in dict.fromkeys(groups) if g.split()[0] in families]


def errorbar(ax, rows: list, label: str):
    ax.errorbar([s["block_efficiency"] for s in rows], [s["accuracy"] for s in rows],
                yerr=[[s["accuracy"] - s["ci95"][0] for s in rows], [s["ci95"][1] - s["accuracy"] for s in rows]],
                fmt="o-" if len(rows) > 1 else "s", ms=4, capsize=2, alpha=0.85, label=label)
