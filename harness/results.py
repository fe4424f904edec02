"""
Results files: every number the project reports is written with the machine it was measured on
(CPU model and features, cores, threads, torch, commit, date), whole, and with no machine's paths.
"""
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.files import ROOT, repo_relative, write_atomically
from engine.timing_cache import cpu_description


def machine_stamp(device: str) -> dict:
    """What a result was measured on: which CPU (model and the features that decide the fastest
    weight layout), how many cores and threads, which torch and which commit, and when.
    uncommitted_changes: whether the code differs from that commit (results and the README table,
    which runs write, do not count)."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()  # noqa: E731
    return {**cpu_description(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "device": device,
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                            ":!docs", ":!README.md")),
            "date": time.strftime("%Y-%m-%d")}


def unwritable(path: Path) -> str | None:
    """Why results could not be written to `path`, checked before the hours of work; None if they can."""
    if path.is_dir():
        return "it is a directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


SIGNIFICANT_DIGITS = 5  # a timing varies by a percent or more from run to run: more digits are noise


def rounded(value, digits: int = SIGNIFICANT_DIGITS):
    """value with every float in it rounded to `digits` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def results_text(result: dict) -> str:
    """JSON a reader can scan and a repository can hold: a list or dict that holds only numbers and
    strings (token ids, a learning curve, one prompt's record) or is short stays on one line; the
    others put each item on its own line."""
    return json_layout(rounded(result), 0) + "\n"


def json_layout(value, level: int) -> str:
    one_line = json.dumps(value, default=str, separators=(",", ": "))
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None or len(one_line) <= 100 or not any(isinstance(v, (dict, list)) for v in items):
        return one_line
    pad = " " * (level + 1)
    if isinstance(value, dict):  # (keys as JSON writes them: strings, others as their JSON text)
        lines = [f"{pad}{json.dumps(k if isinstance(k, str) else json.dumps(k))}: {json_layout(v, level + 1)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(lines) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(pad + json_layout(v, level + 1) for v in value) + "\n" + " " * level + "]"


def write_results(out: Path, result: dict) -> Path:
    """Write the results atomically; if that fails now (disk full, folder gone), keep them in the
    temporary directory and say where, rather than lose hours of measurements."""
    text = results_text(result)
    try:
        write_atomically(out, text)
        return out
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / f"vat-bench-{os.getpid()}-{out.name}"
        fallback.write_text(text)
        print(f"warning: could not write {out} ({e.strerror or e}); results saved to {fallback}",
              file=sys.stderr)
        return fallback


def shown(value):
    """Paths inside the repository as relative ones, so results files name no machine's folders."""
    if isinstance(value, Path) or isinstance(value, str) and value.startswith("/"):
        return repo_relative(value)
    if isinstance(value, list):
        return [shown(v) for v in value]
    return value


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """A matplotlib figure as a PNG of 64 colours, written atomically: bars, lines and text need no
    more, and the file is a quarter the size (docs/ holds dozens)."""
    from PIL import Image  # (matplotlib's own dependency)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    packed = io.BytesIO()
    image.save(packed, format="PNG", optimize=True)
    write_atomically(path, packed.getvalue())
    return path


def figures_beside(draw, summary: dict, out: Path) -> list:
    """The figures of a results file, drawn by draw(summary, folder, stem) beside it; one that cannot
    be written is a warning, not an error: the numbers matter more than the pictures."""
    try:
        return draw(summary, out.parent, out.stem)
    except OSError as e:
        print(f"warning: could not write the figures beside {out} ({e.strerror or e})", file=sys.stderr)
        return []
