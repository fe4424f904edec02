"""
The weight-layout decisions a machine keeps (engine/layouts.py makes them): one JSON file,
LAYOUT_CACHE, of timings keyed by what they hold for (the CPU, torch, the model, the step's code,
the timing method, the threads), read and rewritten whole, and the rules a kept timing must meet
to be used: a timing that no quiet forward could give is timed again, never used as it is, and one
that a run outpaces is marked stale.
"""
import ast
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch

from engine import linear_forms as LF
import model as M
from engine.files import write_atomically
from engine.weights import cache_dir

LAYOUT_CACHE = Path(os.environ.get("SPECDEC_LAYOUT_CACHE") or cache_dir() / "layouts.json")
BLOCKS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)  # the block sizes a table holds, timed; others are interpolated
LONG_CONTEXT = 1024  # where attention's cost per cached key is read off


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> dict:
    """The CPU's model name and which of the features that decide the fastest weight layout it has."""
    import platform
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_features": [f for f in CPU_FEATURES if f in flags]}


def step_code_digest() -> str:
    """A digest of the code a step runs (model.py and linear_forms.py): a decision timed on other
    code is timed again."""
    return code_digest(M, LF)


def code_digest(*modules) -> str:
    """A digest of these modules' code as Python compiles it: docstrings, comments and line
    layout left out, so that an edit of the text alone keeps what was kept for the code."""
    trees = []
    for module in modules:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        trees.append(ast.dump(tree))
    return hashlib.sha1("\n".join(trees).encode()).hexdigest()[:10]


# Raised when the way the probes estimate a forward, or what an entry holds, changes: decisions
# kept the old way are timed again.
TIMING_METHOD = 3


def cache_key(path: Path, what: str, threads: bool = True) -> str:
    """What a kept decision holds for: the CPU, torch, the model, the step's code
    (step_code_digest), the timing method and, for timings, the thread count. The layout choice
    leaves the thread count out: --threads auto takes fewer threads on a busy machine, and such a
    run must decode in the layout a quiet run chose for the model on this machine."""
    cpu = cpu_description()
    step_code = f"{step_code_digest()} timing {TIMING_METHOD}"
    return " | ".join([cpu["cpu"], ",".join(cpu["cpu_features"]), f"torch {torch.__version__}",
                       *([f"{torch.get_num_threads()} threads"] if threads else []),
                       str(Path(path).resolve()), what, f"step code {step_code}"])


NOTED = set()  # the notes this process has printed: each is said once


def note_once(text: str):
    if text not in NOTED:
        NOTED.add(text)
        print(f"note: {text}", file=sys.stderr)


def read_cache() -> dict:
    """The kept decisions; an unreadable cache is named (once) and treated as empty (then rewritten)."""
    try:
        cache = json.loads(LAYOUT_CACHE.read_text()) if LAYOUT_CACHE.exists() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        why = e.strerror if isinstance(e, OSError) else "not JSON"
        note_once(f"{LAYOUT_CACHE} is unreadable ({why}): measuring the weight layouts again")
        return {}
    return cache if isinstance(cache, dict) else {}


def write_cache(cache: dict, failing: str) -> bool:
    """LAYOUT_CACHE rewritten whole; through a symbolic link, the file it points to (a shared
    cache stays shared). One that cannot be written is named, with `failing`: what that means for
    the run. Returns whether it was written."""
    try:
        path = LAYOUT_CACHE.resolve() if LAYOUT_CACHE.is_symlink() else LAYOUT_CACHE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(cache, indent=1))
        return True
    except (OSError, RuntimeError) as e:  # (RuntimeError: a loop of links)
        note_once(f"{LAYOUT_CACHE} could not be written ({getattr(e, 'strerror', None) or e}): {failing}")
        return False


# Models whose kept entries this process no longer reads (--retime), whether or not the cache
# could be rewritten without them.
FORGOTTEN = set()


def kept_entry(key: str):
    """The cache's entry at `key`, or None where --retime set this model's entries aside."""
    if any(f" | {model} | " in key for model in FORGOTTEN):
        return None
    return read_cache().get(key)


def keep(key: str, entry: dict, not_kept: str | None):
    """Add a decision to the cache, unless not_kept says why its timing cannot be trusted."""
    if not_kept:
        note_once(f"{not_kept} while the block costs were timed: they steer --adaptive for this run only")
        return
    cache = read_cache()
    cache[key] = entry
    write_cache(cache, "the timing is used for this run only")


# A kept timing is trusted until a run shows it was disturbed: a run whose forwards take less than
# the kept one-token step / RUN_MARGIN measured what the probes could not have (a busy machine only
# slows a timing down), and its entry is marked stale, to be timed again at the next quiet start.
# The margin leaves room for the probes' cold-cache estimate, which a warm run beats a little.
RUN_MARGIN = 1.5
# Two timings of the same one-token step that part by more than this are not trusted.
REPEAT_AGREEMENT = 1.25


def agree(a: float, b: float) -> bool:
    return max(a, b) <= REPEAT_AGREEMENT * min(a, b)


def recheck_kept_timing(path: Path, layout: str, auto: bool, step_ms: float, context: int) -> bool:
    """After a run: compare its measured time a forward, step_ms at about `context` cached tokens,
    with the kept block table it decoded by; where the run was faster by more than RUN_MARGIN,
    mark it stale, and auto's choice with it (timed again at the next quiet start). Returns
    whether it did."""
    blocks_key, choice_key = cache_key(path, f"blocks {layout}"), cache_key(path, "layout", threads=False)
    cache = read_cache()
    entry = cache.get(blocks_key)
    if impossible_blocks(entry) or "stale" in entry or not (finite(step_ms) and step_ms > 0):
        return False
    kept = float(entry["blocks_ms"]["1"]) + float(entry["attention_ms_per_key"]) * max(context - 64, 0)
    if step_ms * RUN_MARGIN >= kept:
        return False
    why = f"a run measured {step_ms:.1f} ms a forward against {kept:.1f} kept"
    for key in [blocks_key] + ([choice_key] if auto and isinstance(cache.get(choice_key), dict) else []):
        cache[key]["stale"] = why
    write_cache(cache, "a kept timing that a run outpaced could not be marked to be timed again")
    return True


def finite(value) -> bool:
    """A number (not a bool) that is finite and not negative."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def valid_ms(table) -> bool:
    return isinstance(table, dict) and bool(table) and all(finite(v) and v > 0 for v in table.values())


# What a timing must be to be possible. A busy machine, a disturbed repeat or a hand edit can leave
# a timing no quiet forward could give: such an entry is timed again, never used as it is.
NOISE = 1.1  # a longer block may time this much cheaper than a shorter one, no more
STEP_MS = (1e-3, 1e4)  # a forward of the whole model takes between a microsecond and ten seconds
ATTENTION_STEPS = 4  # a query's attention over LONG_CONTEXT cached keys: at most this many steps (the
# keys and values of a thousand tokens are a fraction of the weights a step reads, for any model here)


def impossible_blocks(entry) -> str | None:
    """Why a block table is not a possible measurement, or None: every timed block size, none
    cheaper than a shorter block or a one-token step, a block of n no dearer than n one-token
    steps (a block reads the weights once), attention's cost per cached key finite and bounded."""
    if not isinstance(entry, dict) or not valid_ms(entry.get("blocks_ms")) or \
            set(entry["blocks_ms"]) != {str(b) for b in BLOCKS}:
        return "a block size untimed"
    ms = [float(entry["blocks_ms"][str(b)]) for b in BLOCKS]
    one = ms[0]
    if not STEP_MS[0] <= one <= STEP_MS[1]:
        return f"a one-token step of {one:g} ms"
    for (a, ms_a), (b, ms_b) in zip(zip(BLOCKS, ms), zip(BLOCKS[1:], ms[1:])):
        if ms_b * NOISE < ms_a:
            return f"a block of {b} ({ms_b:g} ms) cheaper than a block of {a} ({ms_a:g} ms)"
    for b, ms_b in zip(BLOCKS, ms):
        if ms_b * NOISE < one or ms_b > NOISE * b * one:
            return f"a block of {b} ({ms_b:g} ms) against a one-token step of {one:g} ms"
    per_key = entry.get("attention_ms_per_key")
    if not finite(per_key) or per_key * LONG_CONTEXT > ATTENTION_STEPS * one:
        return f"an attention cost of {per_key} ms a cached key"
    return None


def impossible_choice(entry, candidates: list) -> str | None:
    """Why a kept layout choice is not a possible measurement here, or None: a layout this CPU
    times (layout_candidates), the fastest of its timed candidates, each a possible step."""
    if not isinstance(entry, dict) or entry.get("layout") not in candidates:
        return f"the layout {entry.get('layout') if isinstance(entry, dict) else None!r}, not a candidate here"
    ms = entry.get("ms")
    if not valid_ms(ms) or not set(ms) <= set(candidates) or entry["layout"] not in ms:
        return "timings of layouts that are not candidates here"
    if not all(STEP_MS[0] <= v <= STEP_MS[1] for v in ms.values()):
        return f"a one-token step of {min(ms.values()):g} to {max(ms.values()):g} ms"
    if ms[entry["layout"]] > min(ms.values()):
        return "a layout slower than another it was timed against"
    inexact, threads = entry.get("inexact"), entry.get("threads")
    if not isinstance(inexact, list) or not set(inexact) <= set(ms) or not isinstance(threads, int) or threads < 1:
        return "no exactness verdict"
    return None
