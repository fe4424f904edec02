"""
A training run on disk (train_vat.py --out): one directory per checkpoint, whole or absent.

    out/step-000150/   config.json + model.safetensors (the draft, released layout, step inside),
                       train_state.pt (optimizer and RNG, plain tensors: loads with weights_only),
                       log.jsonl (every step's statistics up to 150)
    out/checkpoint ->  step-000150, the newest (what decode.py --draft takes)
    out/log.jsonl      the same statistics, for reading while the run goes on

A checkpoint is written under a temporary name and renamed into place, so a kill at any moment
leaves every earlier checkpoint complete; --resume takes the newest one that loads.
"""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from engine.checkpoints import draft_record, load_draft, write_draft_files
from engine.files import directory_written_atomically, remove_stale_temporaries, write_atomically

KEEP_CHECKPOINTS = 2  # the newest ones a run keeps (besides --keep-every's)


def save_checkpoint(out: Path, net, target_args, step: int, opt, log: list, vat_info: dict,
                    keep_every: int = 0):
    """Write step-NNNNNN and point `checkpoint` at it; older ones are removed but the newest
    KEEP_CHECKPOINTS and, with keep_every, those at its multiples (a learning curve's points)."""
    with directory_written_atomically(out / f"step-{step:06d}") as tmp:
        write_draft_files(net, tmp, target_args, {**vat_info, "step": step}, dtype=torch.float32)
        # (the batch order needs no state: a resumed run replays it from the seed)
        torch.save({"step": step, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()},
                   tmp / "train_state.pt")
        (tmp / "log.jsonl").write_text("".join(json.dumps(s) + "\n" for s in log))
    link = out / ".checkpoint-link"
    link.unlink(missing_ok=True)
    link.symlink_to(f"step-{step:06d}")
    os.replace(link, out / "checkpoint")  # atomic: the link names the old checkpoint or the new one
    for old in checkpoint_dirs(out)[:-KEEP_CHECKPOINTS]:
        if not (keep_every and checkpoint_step(old) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)
    write_atomically(out / "log.jsonl", "".join(json.dumps(s) + "\n" for s in log))  # for reading


def latest_checkpoint(out: Path, target):
    """(draft, training state, log) of the newest checkpoint in `out` that loads completely, or None.
    A damaged or tampered one is skipped with a warning: train_state.pt loads with weights_only,
    so a file that would run code on unpickling is refused rather than executed."""
    remove_stale_temporaries(out)
    for folder in reversed(checkpoint_dirs(out)):
        try:
            _, net = load_draft(folder, target, dtype=torch.float32)
            state = torch.load(folder / "train_state.pt", weights_only=True)
            step = draft_record(folder)["step"]
            if not state["step"] == step == checkpoint_step(folder):
                raise ValueError(f"steps disagree: folder {folder.name}, weights {step}, "
                                 f"state {state['step']}")
            return net, state, read_log(folder / "log.jsonl")[:step]
        except Exception as e:  # any damage means: not this one
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"warning: skipping checkpoint {folder}: {reason}", file=sys.stderr)
    return None


def checkpoint_step(path: Path) -> int | None:
    """The training step a step-NNNNNN directory holds, or None for any other name."""
    return int(path.name[5:]) if re.fullmatch(r"step-\d{6}", path.name) else None


def checkpoint_dirs(out: Path) -> list:
    """The step-NNNNNN directories in `out`, oldest first."""
    return sorted(p for p in out.glob("step-*") if checkpoint_step(p) is not None and p.is_dir())


def read_log(path: Path) -> list:
    """The statistics of log.jsonl, up to the first line that does not parse (a cut-off write)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else [], 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            print(f"warning: {path} is cut off after {len(out)} steps", file=sys.stderr)
            break
        if not isinstance(entry, dict) or isinstance(entry.get("step"), bool) or not isinstance(entry.get("step"), int):
            raise ValueError(f"{path} line {number} is not a training step's statistics (a JSON object with a "
                             f"'step'): is it a train_vat.py log?")
        out.append(entry)
    return out
