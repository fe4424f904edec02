"""
Files: paths in the repository, and files written whole or not at all.

Every file that a later run reads is written under a temporary name beside its destination and
renamed into place, so a reader sees the old version or the new one, whole, even when the writer
is killed halfway; and no tensor holding a NaN or an infinity is written as data.
"""
import contextlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from model import CheckpointError

ROOT = Path(__file__).resolve().parent.parent  # the repository: data/, drafts/, docs/ and the default runs/
DATA = ROOT / "data"  # shipped with the repository (data/README.md: sources and licenses)


def os_error_text(e: OSError) -> str:
    """An OSError in one line, naming the file: what a script exits with where writing or reading
    failed (a full disk, a read-only folder). Files are written whole or not at all, so nothing is
    left half-written."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e} (nothing was left half-written)"


@contextmanager
def file_written_atomically(path: Path):
    """Yields a temporary name beside `path` to write; when the block ends without an error it is
    renamed to `path`, and either way nothing is left under the temporary name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # (where nothing could be written, nothing is left)
            tmp.unlink(missing_ok=True)


def write_atomically(path: Path, data: str | bytes):
    """Write text (or bytes) under a temporary name, then rename it to `path`."""
    with file_written_atomically(path) as tmp:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)


def save_atomically(obj, path: Path):
    """torch.save, whole or not at all (see write_atomically)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with file_written_atomically(path) as tmp:
        torch.save(obj, tmp)


def replace_directory(new: Path, path: Path):
    """Move the complete directory `new` to `path`. An older `path` is first renamed aside, so a
    kill in between leaves it under <path>.old, never half-deleted."""
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        new.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(path)


@contextmanager
def directory_written_atomically(path: Path):
    """Yields an empty temporary directory beside `path` to fill; when the block ends without an
    error it becomes `path` (an older one replaced whole), else it is removed."""
    if path.is_symlink() and not path.is_dir():
        raise CheckpointError(f"{path} is a link to {os.readlink(path)}, which is no directory: "
                              f"write elsewhere, or remove the link")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep it from other users
    try:
        yield tmp
        for file in tmp.rglob("*"):  # (some writers create files 0600: readable by their owner alone)
            file.chmod(0o644 if file.is_file() else 0o755)
        replace_directory(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None. Checked
    in slices of 16M values: isfinite over a whole vocabulary matrix at once would allocate
    several times its size in temporaries."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and \
                not all(torch.isfinite(part).all() for part in t.reshape(-1).split(1 << 24)):
            return name
    return None


def remove_stale_temporaries(folder: Path):
    """Delete the .tmp-<pid>-* directories of conversions whose process is gone (killed halfway);
    a live process's temporary directory is left alone."""
    for tmp in folder.glob(".tmp-*") if folder.is_dir() else []:
        pid = tmp.name.split("-")[1]
        if tmp.is_dir() and not (pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# -----------------------------------------------------------------------------
# Paths a user gives, and text files read whole

def repo_path(path) -> Path:
    """A path as given, or relative to the repository when it is not found from here (so the
    default data/... paths work from any working directory)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else ROOT / path


def repo_relative(path) -> str:
    """A path inside the repository as a relative one (what outputs and results files show)."""
    p = Path(path)
    inside = p.is_absolute() and p.resolve().is_relative_to(ROOT)
    return str(p.resolve().relative_to(ROOT)) if inside else str(path)


def read_text(path: Path) -> str:
    """A text file's contents; one that is not UTF-8 text is a one-line error naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): is it the file you meant?") from None


def read_json_object(path: Path, what: str, error=ValueError) -> dict:
    """A JSON file holding an object; a missing, unreadable or other file is a one-line `error`
    naming it as `what`."""
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{what} {path} holds a {type(value).__name__}, not a JSON object")
    return value


def read_jsonl(path) -> list:
    """[(line number, record)] of a jsonl file, skipping blank lines; a bad line is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"file not found: {path}")
    records = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number} is not valid JSON: {e}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} is not a JSON object")
        records.append((number, record))
    return records
