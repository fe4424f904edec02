"""train_vat.py: checkpoints survive kill -9 and refuse tampered state, bad settings fail before any
work, the VAT ablation parts, sampled labels, held-out prompts, machine-dependent defaults."""
import argparse
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model as M
import train_vat as TV
from draft import Eagle3, eagle3_target_layers

ROOT = Path(__file__).resolve().parent.parent
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


# Saves a checkpoint at step 2, then one at step 4 during which the K-th file-system operation
# (every write, rename, link and delete a save makes) is replaced by kill -9. K = 0: no kill.
KILLER = r"""
import os, shutil, signal, sys, tempfile, random
from pathlib import Path
import safetensors.torch, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import train_vat as TV
from test_train_vat import TARGET_ARGS, small_draft
out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
count = None
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
for step in (2, 4):
    net = small_draft(seed=step)
    opt = torch.optim.AdamW(net.parameters())
    if step == 4:
        count = 0
    TV.save_checkpoint(out, net, TARGET_ARGS, step, opt, random.Random(step), [{{"step": s}} for s in range(1, step + 1)],
                       {{"objective": "vat"}})
print(count)
"""


def start_killer(out: Path, kill_at: int):
    script = KILLER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    return subprocess.Popen([sys.executable, "-c", script, str(out), str(kill_at)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path):
    first = start_killer(tmp_path / "count", 0)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    n_ops = int(stdout.split()[-1])
    assert n_ops >= 8  # temp dir, weights, config, state, log, rename, link, swap, prune, log copy
    target = small_target()
    expected = {step: small_draft(seed=step).state_dict() for step in (2, 4)}
    runs = {}
    for kill_at in range(1, n_ops + 2):  # a few at a time: each is mostly importing torch
        runs[kill_at] = start_killer(tmp_path / f"kill-{kill_at}", kill_at)
        if len(runs) % 4 == 0:
            runs[kill_at].wait(timeout=120)
    for kill_at, proc in runs.items():
        out = tmp_path / f"kill-{kill_at}"
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == (-9 if kill_at <= n_ops else 0), (kill_at, stderr)
        net, state, log = TV.latest_checkpoint(out, target)
        step = state["step"]
        assert step == (4 if kill_at > n_ops else step) and step in (2, 4)
        assert [s["step"] for s in log] == list(range(1, step + 1))  # the log of that same step
        for key, value in net.state_dict().items():  # the weights of that same step
            assert torch.equal(value, expected[step][key].float()), (kill_at, key)
        assert (out / "checkpoint").resolve().name in (f"step-{step:06d}", "step-000002", "step-000004")
        # a resumed run carries on from there, and its next save cleans up what the kill left
        TV.save_checkpoint(out, net, TARGET_ARGS, 6, torch.optim.AdamW(net.parameters()), random.Random(0),
                           log + [{"step": 5}, {"step": 6}] if step == 4 else log, {"objective": "vat"})
        assert TV.latest_checkpoint(out, target)[1]["step"] == 6
        assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_tampered_training_state_is_refused_not_executed(tmp_path, capsys):
    target = small_target()
    for step in (2, 4):
        net = small_draft(seed=step)
        TV.save_checkpoint(tmp_path, net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()), random.Random(0),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"})
    marker = tmp_path / "pwned"
    exploit = Exploit()
    exploit.marker = marker
    (tmp_path / "step-000004" / "train_state.pt").write_bytes(pickle.dumps({"step": 4, "x": exploit}))
    net, state, log = TV.latest_checkpoint(tmp_path, target)
    assert not marker.exists()  # the payload never ran
    assert state["step"] == 2 and len(log) == 2  # the newest complete, untampered checkpoint
    assert "skipping checkpoint" in capsys.readouterr().err


def test_a_cut_off_log_does_not_stop_a_resume(tmp_path, capsys):
    net = small_draft(seed=1)
    TV.save_checkpoint(tmp_path, net, TARGET_ARGS, 3, torch.optim.AdamW(net.parameters()), random.Random(0),
                       [{"step": s} for s in (1, 2, 3)], {"objective": "vat"})
    log = tmp_path / "step-000003" / "log.jsonl"
    log.write_text(log.read_text()[:-8])  # cut inside the last line
    _, state, entries = TV.latest_checkpoint(tmp_path, small_target())
    assert state["step"] == 3 and [e["step"] for e in entries] == [1, 2]
    assert "cut off after 2 steps" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Settings: checked before any data is generated or weights are loaded

@pytest.mark.parametrize("argv,message", [
    (["--save-every", "0"], "--save-every must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--eval-prompts", "901"], "would hold out all 900 prompts"),
    (["--data", "data/gsm8k_test.jsonl", "--num-prompts", "5", "--eval-prompts", "5"], "hold out all 5"),
    (["--data", "nowhere.jsonl"], "prompt file not found"),
    (["--time-budget", "0"], "--time-budget must be > 0"),
    (["--lr", "nan"], "--lr > 0"),
    (["--objective", "baseline", "--vat-parts", "head"], "--vat-parts applies to --objective vat"),
    (["--vat-parts", "head,magic"], "subset of head,weighting,ce"),
])
def test_bad_settings_fail_at_start(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        TV.get_args(argv + ["--device", "cpu", "--out", "/nonexistent/run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_out_must_not_be_a_file_or_hold_checkpoints_unless_resuming(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        TV.get_args(["--out", str(tmp_path / "file")])
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "run" / "step-000010").mkdir(parents=True)
    with pytest.raises(SystemExit):
        TV.get_args(["--out", str(tmp_path / "run")])
    assert "already holds checkpoints" in capsys.readouterr().err
    assert TV.get_args(["--out", str(tmp_path / "run"), "--resume"]).resume


def test_machine_dependent_defaults():
    cpu = TV.get_args(["--device", "cpu"])
    assert {k: getattr(cpu, k) for k in TV.CPU_DEFAULTS} == TV.CPU_DEFAULTS
    gpu = TV.get_args(["--device", "cuda"])
    assert {k: getattr(gpu, k) for k in TV.GPU_DEFAULTS} == TV.GPU_DEFAULTS
    quick = TV.get_args(["--device", "cpu", "--quick", "--batch-size", "3"])
    assert quick.steps == 2 and quick.num_prompts == 12 and quick.batch_size == 3  # what the user set stays
    assert quick.out.name.endswith("-quick") and cpu.vat_parts == list(TV.VAT_PARTS)


def test_spec_bench_is_refused_by_content_under_any_name(tmp_path):
    rows = (ROOT / "data" / "spec_bench_questions.jsonl").read_text().splitlines()[100:103]
    renamed = tmp_path / "my_prompts.jsonl"
    renamed.write_text("\n".join([json.dumps({"question": "an honest prompt"})] +
                                 [json.dumps({"instruction": json.loads(r)["turns"][0]}) for r in rows]))
    with pytest.raises(ValueError, match="contains 3 Spec-Bench questions"):
        TV.read_prompt_files([renamed])
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"question": "an honest prompt"}) + "\n")
    assert TV.read_prompt_files([clean]) == ["an honest prompt"]


# -----------------------------------------------------------------------------
# The objective: VAT's parts one by one, and sampled verification labels

def hand_made_chains():
    torch.manual_seed(5)
    N, K, V = 5, 4, 9
    return torch.randn(N, K, V), torch.randn(N, K), F.log_softmax(torch.randn(N, K, V), -1), torch.rand(N, K) > 0.2


@pytest.mark.parametrize("parts", [["head"], ["weighting"], ["ce"], ["head", "weighting"], list(TV.VAT_PARTS)])
def test_each_vat_part_changes_only_its_own_term(parts):
    draft, head, tgt, valid = hand_made_chains()
    N, K = valid.shape
    args = argparse.Namespace(draft="eagle3", objective="vat", vat_label="greedy", vat_parts=parts, beta=0.5)
    loss, _ = TV.objective(draft, head, tgt, valid, args, native="soft")
    logq = F.log_softmax(draft, -1)
    soft = -(tgt.exp() * logq).sum(-1)
    hard = -logq.gather(-1, tgt.argmax(-1, keepdim=True))[..., 0]
    ce = (soft + hard if "ce" in parts else soft) * valid
    accepted = (draft.argmax(-1) == tgt.argmax(-1)) | ~valid
    kstar, labels, w_hat = TV.vat_targets(accepted, TV.eagle3_decay)
    weights = w_hat if "weighting" in parts else 0.8 ** torch.arange(K).float()
    expected = (weights * ce).sum() / N
    if "head" in parts:
        bce = F.binary_cross_entropy_with_logits(head, labels.float(), reduction="none")
        expected = expected + 0.5 * (bce * valid).sum() / valid.sum()
    assert torch.allclose(loss, expected)


def test_sampled_labels_do_not_force_rejection_outside_the_draft_vocabulary():
    # the draft's q equals the target's p on its vocabulary: min(1, p/q) = 1, every sampled token is kept;
    # the target's argmax lies outside that vocabulary, which only greedy verification cannot match
    N, K, V = 64, 3, 6
    logp = F.log_softmax(torch.randn(N, K, V), -1)
    outside = torch.zeros(N, K, dtype=torch.bool)
    valid = torch.ones(N, K, dtype=torch.bool)
    for label, sim_tau in (("sample", K + 1), ("greedy", 1)):
        args = argparse.Namespace(draft="eagle3", objective="vat", vat_label=label, vat_parts=list(TV.VAT_PARTS),
                                  beta=1.0)
        _, stats = TV.objective(logp.clone(), torch.zeros(N, K), logp, valid, args, native="soft",
                                target_in_vocab=outside)
        assert stats["sim_tau"] == pytest.approx(sim_tau), label
