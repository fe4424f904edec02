"""training_runs.py: training checkpoints survive a kill at any point, refuse tampered state, keep
the newest and those asked for, and resume past a cut-off log."""
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from engine import training_runs as TR
import model as M
from engine.files import ROOT
from eagle3 import Eagle3, eagle3_target_layers

TARGET_ARGS = M.ModelArgs(model_type="llama", vocab_size=50, dim=32, n_layer=4, n_head=4, n_kv_head=2, head_dim=8,
                          intermediate_size=48)


def small_target():
    torch.manual_seed(0)
    return M.Transformer(TARGET_ARGS)  # only its shapes matter to checkpoint loading


def small_draft(seed):
    torch.manual_seed(seed)
    t = TARGET_ARGS
    args = M.ModelArgs(model_type="llama", vocab_size=t.vocab_size, dim=t.dim, n_layer=1, n_head=t.n_head,
                       n_kv_head=t.n_kv_head, head_dim=t.head_dim, intermediate_size=t.intermediate_size)
    net = Eagle3(args, t.dim, 20, eagle3_target_layers(t.n_layer))
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return net


# One process imports torch once, then forks a child per kill point: each child saves a checkpoint at
# step 2, then one at step 4 during which the K-th file-system operation (every write, rename, link
# and delete a save makes) is replaced by kill -9. K = 0: no kill; that child writes the count of
# operations. The parent runs no torch kernel before forking (no thread pool is forked); it only makes
# an optimizer, whose lazy imports would otherwise cost each child seconds.
KILLER = r"""
import json, os, shutil, signal, sys, tempfile, random
from pathlib import Path
import safetensors.torch, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from engine import training_runs as TR
from test_checkpoints import TARGET_ARGS, small_draft
runs = Path(sys.argv[1])
count = kill_at = None
def wrap(owner, name):
    real = getattr(owner, name)
    def op(*a, **k):
        global count
        if count is not None:
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    setattr(owner, name, op)
for owner, name in [(os, "rename"), (os, "replace"), (os, "symlink"), (os, "unlink"), (shutil, "rmtree"),
                    (tempfile, "mkdtemp"), (safetensors.torch, "save_file"), (torch, "save"),
                    (Path, "write_text"), (Path, "rename"), (Path, "symlink_to"), (Path, "unlink")]:
    wrap(owner, name)
def saves(out):
    global count
    for step in (2, 4):
        net = small_draft(seed=step)
        opt = torch.optim.AdamW(net.parameters())
        if step == 4:
            count = 0
        TR.save_checkpoint(out, net, TARGET_ARGS, step, opt,
                           [{{"step": s}} for s in range(1, step + 1)], {{"objective": "vat"}})
    n, count = count, None  # the count file below is not part of the save
    return n
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its lazy imports, once, before forking
def child(k):
    pid = os.fork()
    if pid == 0:
        global kill_at
        kill_at = k
        n = saves(runs / f"kill-{{k}}")
        (runs / f"kill-{{k}}.count").write_text(str(n))
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
assert child(0) == 0
n_ops = int((runs / "kill-0.count").read_text())
print(json.dumps({{"n_ops": n_ops, "exit": {{k: child(k) for k in range(1, n_ops + 2)}}}}))
"""


def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path):
    """Killed at each file operation of a save, the directory holds a whole checkpoint of one step
    or the other."""
    script = KILLER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    n_ops = report["n_ops"]
    assert n_ops >= 8  # temp dir, weights, config, state, log, rename, link, swap, prune, log copy
    assert len(report["exit"]) == n_ops + 1
    target = small_target()
    expected = {step: small_draft(seed=step).state_dict() for step in (2, 4)}
    for kill_at, code in report["exit"].items():
        kill_at, out = int(kill_at), tmp_path / f"kill-{kill_at}"
        assert code == (-9 if kill_at <= n_ops else 0), (kill_at, code)
        net, state, log = TR.latest_checkpoint(out, target)
        step = state["step"]
        assert step == (4 if kill_at > n_ops else step) and step in (2, 4)
        assert [s["step"] for s in log] == list(range(1, step + 1))  # the log of that same step
        for key, value in net.state_dict().items():  # the weights of that same step
            assert torch.equal(value, expected[step][key].float()), (kill_at, key)
        assert (out / "checkpoint").resolve().name in (f"step-{step:06d}", "step-000002", "step-000004")
        # a resumed run carries on from there, and its next save cleans up what the kill left
        TR.save_checkpoint(out, net, TARGET_ARGS, 6, torch.optim.AdamW(net.parameters()),
                           log + [{"step": 5}, {"step": 6}] if step == 4 else log, {"objective": "vat"})
        assert TR.latest_checkpoint(out, target)[1]["step"] == 6
        assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_tampered_training_state_is_refused_not_executed(tmp_path, capsys):
    target = small_target()
    for step in (2, 4):
        net = small_draft(seed=step)
        TR.save_checkpoint(tmp_path, net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"})
    marker = tmp_path / "pwned"
    exploit = Exploit()
    exploit.marker = marker
    (tmp_path / "step-000004" / "train_state.pt").write_bytes(pickle.dumps({"step": 4, "x": exploit}))
    net, state, log = TR.latest_checkpoint(tmp_path, target)
    assert not marker.exists()  # the payload never ran
    assert state["step"] == 2 and len(log) == 2  # the newest complete, untampered checkpoint
    assert "skipping checkpoint" in capsys.readouterr().err


def test_only_the_newest_checkpoints_and_those_at_keep_every_remain(tmp_path):
    net = small_draft(seed=1)
    for step in range(1, 8):
        TR.save_checkpoint(tmp_path / "plain", net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"})
        TR.save_checkpoint(tmp_path / "kept", net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"},
                           keep_every=3)
    assert [p.name for p in TR.checkpoint_dirs(tmp_path / "plain")] == ["step-000006", "step-000007"]
    assert [p.name for p in TR.checkpoint_dirs(tmp_path / "kept")] == ["step-000003", "step-000006", "step-000007"]
    assert (tmp_path / "kept" / "checkpoint").resolve().name == "step-000007"


def test_a_cut_off_log_does_not_stop_a_resume(tmp_path, capsys):
    net = small_draft(seed=1)
    TR.save_checkpoint(tmp_path, net, TARGET_ARGS, 3, torch.optim.AdamW(net.parameters()),
                       [{"step": s} for s in (1, 2, 3)], {"objective": "vat"})
    log = tmp_path / "step-000003" / "log.jsonl"
    log.write_text(log.read_text()[:-8])  # cut inside the last line
    _, state, entries = TR.latest_checkpoint(tmp_path, small_target())
    assert state["step"] == 3 and [e["step"] for e in entries] == [1, 2]
    assert "cut off after 2 steps" in capsys.readouterr().err
