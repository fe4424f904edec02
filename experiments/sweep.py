"""
The lossy-verification experiment's sweep: the verifier configurations experiments/lossy.py runs,
their labels, and the ones it also runs with draft trees.
"""
from verify import Verifier

# The sweep: at least four settings per lossy family, from near the target to lenient, next to
# lossless speculative sampling and plain sampling (the two exact references).
SWEEP = [None, Verifier("lossless")] + \
        [Verifier("minp", p_base=v) for v in (0.3, 0.1, 0.05, 0.02)] + \
        [Verifier("eta", eps=v) for v in (3e-4, 0.01, 0.09, 0.3)] + \
        [Verifier("cos", lam=v) for v in (0.9, 0.75, 0.5, 0.25)] + \
        [Verifier("lenience", lenience=v) for v in (0.9, 0.75, 0.5, 0.25)] + \
        [Verifier("overshoot", lam=lam, ceiling=c) for lam in (0.5, 0.25) for c in (2.0, 4.0)]  # None: plain
PARAMETER = {"minp": "p_base", "eta": "eps", "cos": "lam", "lenience": "lenience"}


def config_label(verifier: Verifier | None) -> str:
    if verifier is None:
        return "plain sampling"
    if verifier.name == "overshoot":
        return f"overshoot lam={verifier.lam:g} c={verifier.ceiling:g}"
    name = PARAMETER.get(verifier.name)
    return verifier.name + (f" {name}={getattr(verifier, name):g}" if name else "")


CONFIGS = {config_label(v): v for v in SWEEP}
# With --tree N these configurations (lossless and at least one per lossy family) also run with draft
# trees of N tokens, labelled "<configuration> tree", paired with their chains on the same problems.
# The tree's children at T > 0 are drawn without replacement from the draft (verify.py's tree rule).
TREE_VERSIONS = ("lossless", "minp p_base=0.3", "eta eps=0.3", "cos lam=0.9", "lenience lenience=0.75",
                 "overshoot lam=0.5 c=2")
TREE_SUFFIX = " tree"


def verifier_of(label: str) -> Verifier | None:
    return CONFIGS[label.removesuffix(TREE_SUFFIX)]
