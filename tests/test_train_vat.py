"""train_vat.py: the VAT objective on hand-made logits and its ablation parts, training end to end
(simulated and real tau rise, resume, DDP), checkpoints that survive kill -9 and refuse tampered
state, settings checked before any work, held-out prompts, machine-dependent defaults."""
import argparse
import json
import math
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_draft import dflash_net, eagle3_net

import corpus as C
import checkpoints as CK
import weights as WT
import model as M
from checkpoints import load_draft
from files import ROOT
import objectives as OB
import train_vat as TV
from decode import generate
from eagle3 import Eagle3, Eagle3Draft, eagle3_target_layers
from tokenizer import load_tokenizer
from verify import Verifier

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
import checkpoints as CK
from test_train_vat import TARGET_ARGS, small_draft
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
        CK.save_checkpoint(out, net, TARGET_ARGS, step, opt,
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
        net, state, log = CK.latest_checkpoint(out, target)
        step = state["step"]
        assert step == (4 if kill_at > n_ops else step) and step in (2, 4)
        assert [s["step"] for s in log] == list(range(1, step + 1))  # the log of that same step
        for key, value in net.state_dict().items():  # the weights of that same step
            assert torch.equal(value, expected[step][key].float()), (kill_at, key)
        assert (out / "checkpoint").resolve().name in (f"step-{step:06d}", "step-000002", "step-000004")
        # a resumed run carries on from there, and its next save cleans up what the kill left
        CK.save_checkpoint(out, net, TARGET_ARGS, 6, torch.optim.AdamW(net.parameters()),
                           log + [{"step": 5}, {"step": 6}] if step == 4 else log, {"objective": "vat"})
        assert CK.latest_checkpoint(out, target)[1]["step"] == 6
        assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_tampered_training_state_is_refused_not_executed(tmp_path, capsys):
    target = small_target()
    for step in (2, 4):
        net = small_draft(seed=step)
        CK.save_checkpoint(tmp_path, net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"})
    marker = tmp_path / "pwned"
    exploit = Exploit()
    exploit.marker = marker
    (tmp_path / "step-000004" / "train_state.pt").write_bytes(pickle.dumps({"step": 4, "x": exploit}))
    net, state, log = CK.latest_checkpoint(tmp_path, target)
    assert not marker.exists()  # the payload never ran
    assert state["step"] == 2 and len(log) == 2  # the newest complete, untampered checkpoint
    assert "skipping checkpoint" in capsys.readouterr().err


def test_only_the_newest_checkpoints_and_those_at_keep_every_remain(tmp_path):
    net = small_draft(seed=1)
    for step in range(1, 8):
        CK.save_checkpoint(tmp_path / "plain", net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"})
        CK.save_checkpoint(tmp_path / "kept", net, TARGET_ARGS, step, torch.optim.AdamW(net.parameters()),
                           [{"step": s} for s in range(1, step + 1)], {"objective": "vat"},
                           keep_every=3)
    assert [p.name for p in CK.checkpoint_dirs(tmp_path / "plain")] == ["step-000006", "step-000007"]
    assert [p.name for p in CK.checkpoint_dirs(tmp_path / "kept")] == ["step-000003", "step-000006", "step-000007"]
    assert (tmp_path / "kept" / "checkpoint").resolve().name == "step-000007"


def test_a_cut_off_log_does_not_stop_a_resume(tmp_path, capsys):
    net = small_draft(seed=1)
    CK.save_checkpoint(tmp_path, net, TARGET_ARGS, 3, torch.optim.AdamW(net.parameters()),
                       [{"step": s} for s in (1, 2, 3)], {"objective": "vat"})
    log = tmp_path / "step-000003" / "log.jsonl"
    log.write_text(log.read_text()[:-8])  # cut inside the last line
    _, state, entries = CK.latest_checkpoint(tmp_path, small_target())
    assert state["step"] == 3 and [e["step"] for e in entries] == [1, 2]
    assert "cut off after 2 steps" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Settings: checked before any data is generated or weights are loaded

@pytest.mark.parametrize("argv,message", [
    (["--save-every", "0"], "--save-every must be >= 1"),
    (["--keep-every", "-1"], "--keep-every must be >= 0"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--eval-prompts", "901"], "would hold out all 900 prompts"),
    (["--data", "data/gsm8k_test.jsonl", "--num-prompts", "5", "--eval-prompts", "5"], "hold out all 5"),
    (["--data", "self", "--self-prompts", "5", "--eval-prompts", "5"], "hold out all 5"),
    (["--data", "nowhere.jsonl"], "prompt file not found"),
    (["--time-budget", "0"], "--time-budget must be > 0"),
    (["--steps", "10", "--stop-at", "11"], "--stop-at must be a step from 1 to --steps (10)"),
    (["--stop-at", "0"], "--stop-at must be a step from 1"),
    (["--lr", "nan"], "--lr > 0"),
    (["--objective", "baseline", "--vat-parts", "head"], "--vat-parts applies to --objective vat"),
    (["--vat-parts", "head,magic"], "subset of head,weighting,ce"),
    (["--early-exit-threshold", "0.1"], "goes with --export"),
    (["--export", "/nonexistent/run/checkpoint", "/tmp/x"], "no checkpoint directory"),
    (["--export", "drafts/smollm2-135m-eagle3-vat", "drafts/smollm2-135m-eagle3-gsm8k"], "nothing is overwritten"),
    (["--export", "drafts/smollm2-135m-eagle3-vat", "/tmp/x", "--early-exit-threshold", "1.5"], "in (0, 1)"),
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


def test_machine_dependent_defaults(monkeypatch):
    cpu = TV.get_args(["--device", "cpu"])
    assert {k: getattr(cpu, k) for k in TV.CPU_DEFAULTS} == TV.CPU_DEFAULTS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the settings only; nothing runs on it
    gpu = TV.get_args(["--device", "cuda"])
    assert {k: getattr(gpu, k) for k in TV.GPU_DEFAULTS} == TV.GPU_DEFAULTS
    quick = TV.get_args(["--device", "cpu", "--quick", "--batch-size", "3"])
    assert quick.steps == 2 and quick.num_prompts == 12 and quick.batch_size == 3  # what the user set stays
    assert quick.out.name.endswith("-quick") and cpu.vat_parts == list(TV.VAT_PARTS)
    assert TV.get_args(["--device", "cpu", "--objective", "baseline"]).vat_parts == []  # what its checkpoints record


def test_spec_bench_is_refused_by_content_under_any_name(tmp_path):
    rows = (ROOT / "data" / "spec_bench_questions.jsonl").read_text().splitlines()[100:103]
    renamed = tmp_path / "my_prompts.jsonl"
    renamed.write_text("\n".join([json.dumps({"question": "an honest prompt"})] +
                                 [json.dumps({"instruction": json.loads(r)["turns"][0]}) for r in rows]))
    with pytest.raises(ValueError, match="contains 3 Spec-Bench questions"):
        C.read_prompt_files([renamed])
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"question": "an honest prompt"}) + "\n")
    assert C.read_prompt_files([clean]) == ["an honest prompt"]


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
    settings = OB.LossSettings(frozenset(parts), "greedy", 0.5)
    loss, _ = OB.objective(draft, head, tgt, valid, settings, OB.eagle3_decay, native="soft")
    logq = F.log_softmax(draft, -1)
    soft = -(tgt.exp() * logq).sum(-1)
    hard = -logq.gather(-1, tgt.argmax(-1, keepdim=True))[..., 0]
    ce = (soft + hard if "ce" in parts else soft) * valid
    accepted = (draft.argmax(-1) == tgt.argmax(-1)) | ~valid
    kstar, labels, w_hat = OB.vat_targets(accepted, OB.eagle3_decay)
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
        settings = OB.LossSettings(frozenset(TV.VAT_PARTS), label)
        _, stats = OB.objective(logp.clone(), torch.zeros(N, K), logp, valid, settings, OB.eagle3_decay,
                                native="soft", target_in_vocab=outside)
        assert stats["sim_tau"] == pytest.approx(sim_tau), label


# -----------------------------------------------------------------------------
# The objective and training end to end, on tiny targets

def test_vat_targets_on_hand_made_rows():
    accepted = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    kstar, labels, w = OB.vat_targets(accepted, OB.eagle3_decay)
    assert kstar.tolist() == [3, 5, 1]
    assert labels.tolist() == [[True, True, False, False], [True] * 4, [False] * 4]
    assert torch.allclose(w, torch.tensor([[1, 1, 1, 0.8], [1, 1, 1, 1], [1, 0.8, 0.64, 0.512]]))
    _, _, wd = OB.vat_targets(accepted, OB.dflash_decay)
    assert torch.allclose(wd[2], torch.exp(-torch.arange(4.0) / 7))


def test_baseline_objective_is_the_plain_loss():
    torch.manual_seed(3)
    N, K, V = 6, 4, 11
    draft, tgt = torch.randn(N, K, V), F.log_softmax(torch.randn(N, K, V), -1)
    valid = torch.rand(N, K) > 0.2
    # the baseline objective: --vat-parts is ignored, no part of VAT applies
    baseline = OB.LossSettings.from_args(argparse.Namespace(objective="baseline", vat_label="greedy",
                                                            vat_parts=TV.VAT_PARTS, beta=1.0))
    assert baseline.parts == frozenset()
    loss, _ = OB.objective(draft, torch.zeros(N, K), tgt, valid, baseline, OB.eagle3_decay, native="soft")
    soft = -(tgt.exp() * F.log_softmax(draft, -1)).sum(-1) * valid
    assert torch.allclose(loss, (0.8 ** torch.arange(K) * soft).sum() / N)
    loss, _ = OB.objective(draft, torch.zeros(N, K), tgt, valid, baseline, OB.dflash_decay, native="hard")
    hard = F.cross_entropy(draft.flatten(0, 1), tgt.argmax(-1).flatten(), reduction="none").view(N, K) * valid
    assert torch.allclose(loss, (torch.exp(-torch.arange(K) / 7) * hard).sum() / N)


def test_vat_objective_on_hand_made_logits():
    # K = 3 positions, V = 2; the draft agrees with the target at k = 1 and 3, not at 2: k* = 2
    tgt = F.log_softmax(torch.tensor([[[2.0, 0], [2.0, 0], [2.0, 0]]]), -1)
    draft = torch.tensor([[[1.0, 0], [0, 1.0], [1.0, 0]]])
    head = torch.tensor([[3.0, -3.0, 0.0]])
    settings = OB.LossSettings(frozenset(TV.VAT_PARTS))
    loss, stats = OB.objective(draft, head, tgt, torch.ones(1, 3, dtype=torch.bool), settings, OB.eagle3_decay,
                               native="soft")
    ce = -(tgt.exp() * F.log_softmax(draft, -1)).sum(-1) - F.log_softmax(draft, -1)[..., 0]
    weights = torch.tensor([1.0, 1.0, 0.8])  # 1 before k*, then the decay restarts at k*
    bce = F.binary_cross_entropy_with_logits(head, torch.tensor([[1.0, 0, 0]]))
    assert torch.allclose(loss, (weights * ce).sum() + bce)
    assert stats["sim_tau"] == 2.0 and stats["weighting_changes"] == 1.0  # k* = 2: the weights differ
    draft[0, 0] = torch.tensor([0, 1.0])  # now rejected at k = 1: VAT's weights are the baseline's
    _, stats = OB.objective(draft, head, tgt, torch.ones(1, 3, dtype=torch.bool), settings, OB.eagle3_decay,
                            native="soft")
    assert stats["sim_tau"] == 1.0 and stats["weighting_changes"] == 0.0


def tiny_training(target, objective, steps, seed=0):
    """Train an EAGLE-3 draft on the tiny target's own greedy continuations for a few steps."""
    torch.manual_seed(seed)
    prompts = [torch.randint(0, 97, (6,)).tolist() for _ in range(16)]
    data = []
    for p in prompts:
        out = generate(target, p, max_new_tokens=26)["tokens"]
        data.append((p + out, len(p), "prompt"))
    settings = OB.LossSettings.from_args(argparse.Namespace(objective=objective, vat_label="greedy",
                                                            vat_parts=TV.VAT_PARTS, beta=1.0))
    net = eagle3_net(target, draft_vocab=97).train()
    net.d2t.zero_()
    net.t2d.fill_(True)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    stream = C.batches(data, 16, 32, __import__("random").Random(0))
    target.setup_caches(16, 40)
    batch = next(stream)
    _, before = OB.eagle3_loss(net, target, batch, settings, K=4)
    for _ in range(steps):
        loss, _ = OB.eagle3_loss(net, target, next(stream), settings, K=4)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, after = OB.eagle3_loss(net, target, batch, settings, K=4)
    target.setup_caches(1, 128)
    return net.eval(), before, after, prompts


def test_tiny_training_raises_simulated_tau_and_decodes_exactly(tiny_dir):
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(1, 128)
    net, before, after, prompts = tiny_training(target, "vat", steps=40)
    assert after["sim_tau"] > before["sim_tau"] + 0.3, (before, after)
    # the head beats every constant guess on the same batch: in accuracy, the majority label, and in
    # BCE, the best constant probability (the labels' entropy)
    share = after["kept_share"]
    assert after["head_acc"] > max(share, 1 - share) + 0.02, after
    assert after["head_loss"] < -(share * math.log(share) + (1 - share) * math.log(1 - share)) - 0.05, after
    # greedy speculative decoding with the trained draft is plain greedy decoding, with tau > 1
    prompt = prompts[0]
    plain = generate(target, prompt, max_new_tokens=30)
    drafter = Eagle3Draft(net, target.embed_tokens, 128)
    spec = generate(target, prompt, drafter, Verifier("greedy"), k=4, max_new_tokens=30)
    assert spec["tokens"] == plain["tokens"] and spec["tau"] > 1.2
    # early exit at a threshold no head reaches drafts nothing and still decodes exactly
    never = Eagle3Draft(net, target.embed_tokens, 128, early_exit=1.01)
    out = generate(target, prompt, never, Verifier("greedy"), k=4, max_new_tokens=30)
    assert out["tokens"] == plain["tokens"] and out["tau"] == 1.0
    assert out["drafted_tokens"] == 0 and out["declined_tokens"] == sum(min(4, 30 - i - 1) for i in range(30))


def tiny_chat_target(path):
    """A tiny Qwen3 checkpoint with a real (small) byte-level BPE chat tokenizer beside it."""
    from conftest import write_tiny_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    write_tiny_checkpoint(path, "qwen3_untied", vocab=320, layers=4)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["user assistant system question answer numbers 12345"] * 50, trainer)
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_train_vat_end_to_end_and_resume(tmp_path, kind):
    tiny_chat_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i} about numbers"}) + "\n" for i in range(10)))
    common = ["--target", str(tmp_path / "target"), "--draft", kind, "--data", str(prompts), "--num-prompts", "10",
              "--response-tokens", "12", "--gen-batch", "4", "--batch-size", "2", "--seq-len", "32",
              "--eval-prompts", "2", "--eval-every", "2", "--save-every", "2", "--block-size", "4",
              "--ttt-steps", "3", "--draft-vocab", "200", "--warmup", "0", "--out", str(tmp_path / "run"),
              "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"] + (["--features", "on-the-fly"] if kind == "dflash" else [])
    TV.main(common + ["--steps", "2"])
    # eagle3 trains from the captured corpus (the CPU default), dflash with target forwards
    cache = list((tmp_path / "cache").glob("corpus-*/shard-*.pt" if kind == "eagle3" else "responses-*.pt"))
    assert len(cache) == (2 + 2 if kind == "eagle3" else 1)  # held-out prompts alone, then batches of 4
    if kind == "eagle3":
        corpus = C.Corpus(cache[0].parent)
        data = [corpus.sequence(i) for i in range(len(corpus))]
    else:
        data = torch.load(cache[0])
    # each sequence keeps its prompt's text, so held-out prompts are evaluated as written
    target_tok = load_tokenizer(tmp_path / "target")
    written = {f"question {i} about numbers" for i in range(10)}
    assert len(data) == 10
    for ids, start, text in data:
        assert text in written and ids[:start] == target_tok.encode_chat([{"role": "user", "content": text}])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in log] == [1, 2] and "real_tau" in log[-1]
    TV.main(common + ["--steps", "4", "--resume"])  # continues at step 3, reusing the cached data
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in log] == [1, 2, 3, 4]
    assert sorted((tmp_path / "cache").glob("corpus-*/shard-*.pt" if kind == "eagle3" else "responses-*.pt")) \
        == sorted(cache)
    found, net = load_draft(tmp_path / "run" / "checkpoint", WT.load_model(tmp_path / "target"))
    assert found == kind and json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["vat"]["step"] == 4
    # the record of the run: its curve as logged, what it trained, the machine; refused for a non-run
    TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "run")])
    record = json.loads((tmp_path / "curves.json").read_text())
    run = record["runs"]["run"]
    assert run["draft"] == kind and run["objective"] == "vat" and "cpu" in record["machine"]
    assert [s["step"] for s in run["curve"]] == [1, 2, 3, 4] and "real_tau" in run["curve"][1]
    assert [s.get("real_tau") for s in run["curve"]] == [s.get("real_tau") for s in log]
    with pytest.raises(ValueError, match="two runs named run"):
        TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "run"),
                 str(tmp_path / "run")])
    with pytest.raises(ValueError, match="not a train_vat.py --out directory"):
        TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "cache")])
    # shipping it: bf16 tensors equal to the checkpoint's rounded, what it trained, the threshold
    shipped = tmp_path / "shipped"
    TV.main(["--export", str(tmp_path / "run" / "checkpoint"), str(shipped), "--target", str(tmp_path / "target"),
             "--early-exit-threshold", "0.2"])
    config = json.loads((shipped / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["early_exit_threshold"] == 0.2
    assert config["vat"]["step"] == 4 and not (shipped / "train_state.pt").exists()
    bf16_target = WT.load_model(tmp_path / "target", dtype=torch.bfloat16)
    _, trained = load_draft(tmp_path / "run" / "checkpoint", bf16_target)
    found, exported = load_draft(shipped, bf16_target)
    assert found == kind
    for (name, a), (_, b) in zip(trained.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit):  # an export never overwrites a draft
        TV.get_args(["--export", str(tmp_path / "run" / "checkpoint"), str(shipped)])
    # a baseline run's checkpoint written when every part was recorded for it reads as training none
    written = tmp_path / "run" / "checkpoint" / "config.json"
    config = json.loads(written.read_text())
    config["vat"].update(objective="baseline", vat_parts=list(TV.VAT_PARTS))
    written.write_text(json.dumps(config))
    assert TV.learning_curves([tmp_path / "run"])["run"]["vat_parts"] == []


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_draft_gradients_through_a_packed_target_equal_the_plain_ones(tiny_dir, kind):
    grads = []
    for pack in (False, True):
        target = WT.load_model(tiny_dir("qwen3_untied"))
        if pack:
            M.pack_for_cpu(target)
        target.setup_caches(2, 40)
        net = (eagle3_net(target) if kind == "eagle3" else dflash_net(target, block=4)).train()
        torch.manual_seed(0)  # the same tokens and DFlash anchors both times
        tokens = torch.randint(0, 96, (2, 24))
        mask = torch.zeros(2, 24)
        mask[:, 6:] = 1
        loss, _ = OB.DraftLoss(net, target, OB.LossSettings(frozenset(TV.VAT_PARTS)), ttt_steps=3,
                               blocks_per_seq=2)(tokens, mask)
        loss.backward()
        assert all(p.grad is None for p in target.parameters())  # the target stays frozen
        grads.append({n: p.grad for n, p in net.named_parameters()})
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        assert torch.allclose(grads[1][name], g, rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("draft", ["eagle3", "dflash"])
def test_a_resumed_run_is_the_uninterrupted_run(tmp_path, monkeypatch, draft):
    """Training in chunks (stopped mid-epoch after a save, continued with --resume) gives the
    uninterrupted run: its batches, its losses step by step and its draft bit for bit (long trainings
    run in chunks, and their pairs are compared as if they had not been cut). DFlash also draws its
    block anchors from torch's generator, which the checkpoint carries."""
    tiny_chat_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i} about numbers"}) + "\n" for i in range(10)))
    common = ["--target", str(tmp_path / "target"), "--draft", draft, "--data", str(prompts), "--num-prompts",
              "10", "--response-tokens", "12", "--gen-batch", "4", "--batch-size", "2", "--seq-len", "32",
              "--eval-prompts", "2", "--eval-every", "0", "--save-every", "2", "--ttt-steps", "3",
              "--draft-vocab", "200", "--warmup", "1", "--steps", "6", "--cache-dir", str(tmp_path / "cache"),
              "--device", "cpu"]
    TV.main(common + ["--out", str(tmp_path / "whole")])

    saved = TV.save_checkpoint

    def save_then_stop(out, net, target_args, step, *rest, **kw):
        saved(out, net, target_args, step, *rest, **kw)
        if step == 2:
            raise KeyboardInterrupt  # the chunk ends here
    monkeypatch.setattr(TV, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        TV.main(common + ["--out", str(tmp_path / "chunks")])
    monkeypatch.setattr(TV, "save_checkpoint", saved)
    TV.main(common + ["--out", str(tmp_path / "chunks"), "--resume"])

    def log(run):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
    assert log("chunks") == log("whole") and [s["step"] for s in log("whole")] == list(range(1, 7))
    target = WT.load_model(tmp_path / "target")
    whole, chunks = load_draft(tmp_path / "whole" / "checkpoint", target)[1], \
        load_draft(tmp_path / "chunks" / "checkpoint", target)[1]
    for (name, a), (_, b) in zip(whole.state_dict().items(), chunks.state_dict().items()):
        assert torch.equal(a, b), name

    # --stop-at ends a run between saves on the uninterrupted run's schedule, and saves there
    TV.main(common + ["--out", str(tmp_path / "midway"), "--stop-at", "3"])
    assert log("midway") == log("whole")[:3]
    assert CK.latest_checkpoint(tmp_path / "midway", target)[1]["step"] == 3


# -----------------------------------------------------------------------------
# Fast training: chains that carry loss only, and the captured corpus

def ttt_mask(T: int, step: int) -> torch.Tensor:
    """EAGLE-3's training-time-test attention for every base at once, (T, (step+1)*T): the real
    prefix (step-0 keys at positions <= t) and, of steps 1..step, only the own chain's key."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * step, dim=1)


def dense_eagle3_loss(net, target, tokens, response, settings, K):
    """The reference: EAGLE-3's training-time test unrolled over every base position of the
    padded batch with SDPA and ttt_mask (train_vat's code before it trained only the chains that
    carry loss). Its loss is a mean over all B*T chains."""
    B, T = tokens.shape
    layer = net.midlayer
    with torch.no_grad():
        target_logits, hidden = target(tokens, torch.arange(T), hidden_layers=net.target_layers)
    features = torch.cat(hidden, -1)
    cos, sin = M.rope_table(net.args, T + K)
    padded = torch.cat([tokens, tokens.new_zeros(B, K + 1)], 1)
    state, keys, values, logits, heads = net.fc(features), [], [], [], []
    for s in range(K):
        q, k, v = layer.qkv(target.embed_tokens(padded[:, 1 + s:1 + s + T]), state, cos[s:s + T], sin[s:s + T])
        keys.append(k)
        values.append(v)
        attended = layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(T, s))
        state = layer.finish(state, attended)
        step_logits, step_heads = net.heads(state)
        logits.append(step_logits)
        heads.append(step_heads)
    logits, heads = torch.stack(logits, 1), torch.stack(heads, 1)  # (B, K, T, Vd), (B, K, T)
    base, step = torch.arange(T), torch.arange(K)
    source = base[None, :] + 1 + step[:, None]  # (K, T)
    valid = (source + 1 < T)[None] & response.bool()[:, (source + 1).clamp(max=T - 1)]
    source = source.clamp(max=T - 1)
    in_vocab = net.t2d[target_logits.argmax(-1)][:, source]
    target_logp = F.log_softmax(target_logits.float(), -1)[..., net.draft_to_target()][:, source]

    def chains(x):
        return x.transpose(1, 2).flatten(0, 1)
    return OB.objective(chains(logits), chains(heads), chains(target_logp), chains(valid), settings, OB.eagle3_decay,
                        native="soft", target_in_vocab=chains(in_vocab))


def test_ttt_mask_sees_prefix_and_own_chain():
    T, s = 5, 2
    m = ttt_mask(T, s)
    assert m.shape == (T, 3 * T)
    for t in range(T):
        assert m[t, :T].tolist() == [j <= t for j in range(T)]  # the real prefix up to t
        for step in (1, 2):  # of each later step, only the same chain
            assert m[t, step * T:(step + 1) * T].tolist() == [j == t for j in range(T)]


def prompt_response_batch(vocab, lengths, starts, seed=0):
    """A right-padded batch: random tokens, the response from starts[b] to lengths[b]."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T)
    for b, (n, start) in enumerate(zip(lengths, starts)):
        tokens[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, start:n] = 1
    return tokens, mask


@pytest.mark.parametrize("parts", [("weighting", "ce"), ("head", "weighting", "ce")])
def test_chain_training_equals_the_dense_reference(tiny_dir, parts):
    """Training only the chains that carry loss gives the dense reference's loss terms and
    gradients (up to its normalization: a mean over all B*T chains, padding and prompt included)."""
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(3, 40)
    net = eagle3_net(target).train()
    settings, K = OB.LossSettings(frozenset(parts)), 4
    tokens, mask = prompt_response_batch(96, [30, 17, 24], [9, 5, 14])
    B, T = tokens.shape
    dense, dense_stats = dense_eagle3_loss(net, target, tokens, mask, settings, K)
    dense_grads = torch.autograd.grad(dense, list(net.parameters()), allow_unused=True)
    fast, fast_stats = OB.eagle3_loss(net, target, (tokens, mask), settings, K)
    fast_grads = torch.autograd.grad(fast, list(net.parameters()), allow_unused=True)
    # the chains kept: every base t whose predictions t+2 .. t+K+1 reach a response token
    kept = sum((n - 3) - max(start - 1 - K, 0) + 1 for n, start in zip([30, 17, 24], [9, 5, 14]))
    head = fast_stats["head_loss"]
    assert head == pytest.approx(dense_stats["head_loss"], rel=1e-5)
    assert (fast.item() - head) * kept == pytest.approx((dense.item() - head) * B * T, rel=1e-5)
    for key in ("sim_tau", "head_acc", "kept_share"):
        assert fast_stats[key] == pytest.approx(dense_stats[key], rel=1e-6), key
    if "head" not in parts:  # the same objective up to the constant factor kept / (B*T)
        for (name, _), g_dense, g_fast in zip(net.named_parameters(), dense_grads, fast_grads):
            if g_dense is None:
                assert g_fast is None or not g_fast.any(), name
                continue
            scaled_fast, scaled_dense = g_fast * kept, g_dense * B * T
            assert (scaled_fast - scaled_dense).abs().max() <= 1e-5 * scaled_dense.abs().max(), name


def corpus_recipe(tmp_path, **over):
    args = dict(target="tiny", data="prompts", num_prompts=0, self_prompts=0, response_tokens=12,
                max_prompt_tokens=32, gen_batch=4, eval_prompts=2, corpus_batches=None,
                cache_dir=str(tmp_path / "cache"))
    args.update(over)
    return C.Recipe(**args)


def test_captured_rows_equal_a_full_forward(tmp_path):
    """What generation captures for each token is what a full forward over the finished
    sequence computes: the layers' states, the final-normed state, logsumexp and argmax."""
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(3, 64)
    layers = C.corpus_layers(target.args.n_layer)
    prompts = [[1, 5, 9, 40, 41], [2, 7], [3, 60, 61, 62, 70, 80, 90]]  # left padding differs per row
    responses, captured = C.batch_generate(target, prompts, 10, stop_ids={0}, capture_layers=layers)
    target.setup_caches(1, 64)
    for ids, response, rows in zip(prompts, responses, captured):
        seq = ids + response
        n = len(seq)
        assert all(len(x) == n for x in rows.values())
        logits, hidden = target(torch.tensor([seq]), torch.arange(n), hidden_layers=layers + (target.args.n_layer,))
        features = torch.cat(hidden[:-1], -1)[0, :n - 1]
        assert torch.allclose(rows["features"][:n - 1].float(), features, rtol=2e-3, atol=2e-3)
        final = target.norm(hidden[-1])[0, :n - 1]
        assert torch.allclose(rows["final"][:n - 1].float(), final, rtol=2e-3, atol=2e-3)
        assert torch.allclose(rows["lse"][:n - 1], torch.logsumexp(logits[0, :n - 1], -1), atol=1e-4)
        assert rows["argmax"][:n - 1].tolist() == logits[0, :n - 1].argmax(-1).tolist()
        # greedy generation: the argmax at each position from the prompt's last on is the next token
        assert rows["argmax"][len(ids) - 1:n - 1].tolist() == response
        assert not rows["features"][n - 1].any()  # the last token was never read


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_from_the_corpus_equals_training_on_the_fly(tmp_path, kind):
    """A batch of the captured corpus gives the loss a target forward on its tokens gives."""
    import random
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(4, 64)
    tokenizer = load_tokenizer(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i} about numbers " * (1 + i % 3)}) + "\n"
                               for i in range(10)))
    recipe = corpus_recipe(tmp_path, data=str(prompts))
    corpus = C.Corpus(*C.build_corpus(target, tokenizer, recipe))
    assert len(corpus) == 10 and corpus.layers == C.corpus_layers(target.args.n_layer)
    net = eagle3_net(target, draft_vocab=97) if kind == "eagle3" else dflash_net(target, block=4)
    loss = OB.DraftLoss(net, target, OB.LossSettings(frozenset(TV.VAT_PARTS)), ttt_steps=3, blocks_per_seq=2)
    batch = next(C.corpus_batches(corpus, range(2, 10), 200, 64, random.Random(0)))
    target.setup_caches(len(batch[0]), batch[0].shape[1])
    torch.manual_seed(1)
    fly, fly_stats = loss(batch[0], batch[1])
    torch.manual_seed(1)
    captured, stats = loss(*batch)
    assert captured.item() == pytest.approx(fly.item(), rel=2e-3)
    assert stats["sim_tau"] == pytest.approx(fly_stats["sim_tau"], rel=1e-3)


def test_corpus_batches_cover_every_sequence_once_an_epoch_with_little_padding(tmp_path):
    import random

    class Fake:  # a corpus's layout without the target
        lengths = torch.tensor([5, 40, 7, 33, 12, 12, 90, 3, 61, 20])
        starts = lengths // 3
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tokens = torch.arange(int(lengths.sum()))
        features = torch.zeros(int(lengths.sum()), 4, dtype=torch.float16)
        final = torch.zeros(int(lengths.sum()), 2, dtype=torch.float16)
        lse = torch.zeros(int(lengths.sum()))
        argmax = torch.zeros(int(lengths.sum()), dtype=torch.int32)
    stream = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0))
    seen, padded, real = [], 0, 0
    while len(seen) < 9:
        tokens, mask, *_ = next(stream)
        assert tokens.numel() <= 100 or len(tokens) == 1
        for row, m in zip(tokens, mask):
            i = int((Fake.offsets[:-1] == row[0]).nonzero())  # a sequence starts with its offset
            seen.append(i)
            n = min(64, int(Fake.lengths[i]))
            assert row[:n].tolist() == list(range(int(Fake.offsets[i]), int(Fake.offsets[i]) + n))
            assert m.nonzero()[:, 0].tolist() == list(range(int(Fake.starts[i]), n))
            real += n
        padded += tokens.numel()
    assert sorted(seen) == list(range(1, 10))  # each once, the held-out 0 never
    # sorted by length, a batch pads to a neighbour's length: [3 7 12 12 20] [33 40] [61] [64],
    # 252 real tokens in 305
    assert (padded, real) == (305, 252)
    # from batch `start` (a resumed run): the uninterrupted stream's batches from there, epochs of
    # 4 batches, stopped mid-epoch and past a whole one; the same for the regenerated data's batches
    whole = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0))
    first = [next(whole)[0].tolist() for _ in range(11)]
    for start in (2, 6):
        resumed = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0), start)
        assert [next(resumed)[0].tolist() for _ in range(11 - start)] == first[start:]
    data = [(list(range(n)), 1, "") for n in (3, 5, 8, 13)]
    whole = C.batches(data, 2, 16, random.Random(0))
    first = [next(whole)[0].tolist() for _ in range(6)]
    assert [next(C.batches(data, 2, 16, random.Random(0), 4))[0].tolist()] == first[4:5]


def test_an_interrupted_corpus_build_continues_where_it_stopped(tmp_path):
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(4, 64)
    tokenizer = load_tokenizer(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(9)))
    recipe = corpus_recipe(tmp_path, data=str(prompts))
    folder, n_shards = C.build_corpus(target, tokenizer, recipe)
    shards = sorted(folder.glob("shard-*.pt"))
    assert n_shards == len(shards)
    assert len(shards) == 2 + 2  # two held-out prompts alone, then 7 prompts in batches of 4
    whole = C.Corpus(folder)
    stamps = {f.name: f.stat().st_mtime_ns for f in shards}
    shards[-1].unlink()  # as if killed while writing the last one (a shard is written whole or not at all)
    C.build_corpus(target, tokenizer, recipe)
    again = C.Corpus(folder)
    assert [f.stat().st_mtime_ns for f in shards[:-1]] == [stamps[f.name] for f in shards[:-1]]
    assert again.tokens.tolist() == whole.tokens.tolist()
    assert torch.equal(again.features, whole.features)
    assert [again.sequence(i) for i in range(len(again))] == [whole.sequence(i) for i in range(len(whole))]
    # a prefix: the held-out prompts and the first batch, nothing generated beyond it
    assert C.build_corpus(target, tokenizer, recipe._replace(corpus_batches=1)) == (folder, 3)
    prefix = C.Corpus(folder, 3)
    assert len(prefix) == 2 + 4 and prefix.tokens.tolist() == whole.tokens[:len(prefix.tokens)].tolist()


@pytest.mark.slow
def test_train_vat_under_torchrun_ddp(tmp_path):
    """Two CPU processes (gloo) train one draft; rank 0 writes the checkpoint."""
    import subprocess
    import sys
    from pathlib import Path
    tiny_chat_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i} about numbers"}) + "\n" for i in range(12)))
    root = Path(__file__).resolve().parent.parent
    # --standalone: a free rendezvous port; with the fixed default (29500) one of three runs failed
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(root / "train_vat.py"),
                        "--target", str(tmp_path / "target"), "--data", str(prompts), "--num-prompts", "12",
                        "--response-tokens", "12", "--gen-batch", "4", "--batch-size", "2", "--seq-len", "32",
                        "--eval-prompts", "2", "--eval-every", "3", "--save-every", "3", "--ttt-steps", "3",
                        "--draft-vocab", "200", "--steps", "3", "--out", str(tmp_path / "run"),
                        "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 3
    assert load_draft(tmp_path / "run" / "checkpoint", WT.load_model(tmp_path / "target"))[0] == "eagle3"
