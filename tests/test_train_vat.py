"""train_vat.py: the VAT objective on hand-made logits and its ablation parts, training end to end
(simulated and real tau rise, resume, DDP), checkpoints that survive kill -9 and refuse tampered
state, settings checked before any work, held-out prompts, machine-dependent defaults."""
import argparse
import json
import math
import subprocess
import sys

import pytest

from harness import learning_curves as LC

import serving_layouts as SL
import torch
from conftest import dflash_net, eagle3_net, tiny_chat_target
from test_corpus import corpus_recipe

from data import corpus as C
from engine import checkpoints as CK
from engine import training_runs as TR
from engine import weights as WT
from engine import linear_forms as LF
import model as M
from engine.checkpoints import load_draft
from engine.files import ROOT
import objectives as OB
import train_vat as TV
from speculative import generate
from eagle3 import Eagle3Draft
from tokenizer import load_tokenizer
from verify import Verifier

TARGET_ARGS = M.ModelArgs(model_type="llama", vocab_size=50, dim=32, n_layer=4, n_head=4, n_kv_head=2, head_dim=8,
                          intermediate_size=48)


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
    (["--draft", "dflash", "--draft-layers", "-1"], "--draft-layers must be >= 1, got -1"),
    (["--draft", "dflash", "--draft-layers", "0"], "--draft-layers must be >= 1, got 0"),
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
# The objective and training end to end, on tiny targets

def tiny_training(target, objective, steps, seed=0):
    """Train an EAGLE-3 draft on the tiny target's own greedy continuations for a few steps."""
    torch.manual_seed(seed)
    prompts = [torch.randint(0, 97, (6,)).tolist() for _ in range(16)]
    data = []
    for p in prompts:
        out = generate(target, p, max_new_tokens=26)["tokens"]
        data.append((p + out, len(p), "prompt"))
    settings = TV.loss_settings(argparse.Namespace(objective=objective, vat_label="greedy",
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
    # a resumed run trains the checkpoint's draft with its objective, or refuses and writes nothing
    before = (tmp_path / "run" / "log.jsonl").read_text()
    other = "dflash" if kind == "eagle3" else "eagle3"
    with pytest.raises(ValueError, match=f"trains a {kind} draft, not {other}: pass --draft {kind}"):
        TV.main([other if a == kind else a for a in common] + ["--steps", "6", "--resume"])
    with pytest.raises(ValueError, match="trains with --objective vat --vat-parts .*: pass --objective vat"):
        TV.main(common + ["--steps", "6", "--resume", "--objective", "baseline"])
    with pytest.raises(ValueError, match="not --objective vat --vat-parts head"):
        TV.main(common + ["--steps", "6", "--resume", "--vat-parts", "head"])
    assert (tmp_path / "run" / "log.jsonl").read_text() == before
    assert sorted((tmp_path / "cache").glob("corpus-*/shard-*.pt" if kind == "eagle3" else "responses-*.pt")) \
        == sorted(cache)
    found, net = load_draft(tmp_path / "run" / "checkpoint", WT.load_model(tmp_path / "target"))
    assert found == kind and json.loads((tmp_path / "run" / "checkpoint" / "vat" / "config.json").read_text())["step"] == 4
    # the record of the run: its curve as logged, what it trained, the machine; refused for a non-run
    TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "run")])
    record = json.loads((tmp_path / "curves.json").read_text())
    run = record["runs"]["run"]
    assert run["draft"] == kind and run["objective"] == "vat" and "cpu" in record["machine"]
    assert run["curve"]["step"] == [1, 2, 3, 4] and run["curve"]["real_tau"][1] is not None
    assert run["curve"]["response_tokens"] == [s["response_tokens"] for s in log]  # the plot's x axis
    assert (tmp_path / "curves.png").stat().st_size > 0
    from harness.results import rounded
    assert run["curve"]["real_tau"] == rounded([s.get("real_tau") for s in log])  # (5 significant digits)
    with pytest.raises(ValueError, match="two runs named run"):
        TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "run"),
                 str(tmp_path / "run")])
    with pytest.raises(ValueError, match="not a train_vat.py --out directory"):
        TV.main(["--learning-curves", str(tmp_path / "curves.json"), "--runs", str(tmp_path / "cache")])
    # shipping it: bf16 tensors equal to the checkpoint's rounded, what it trained, the threshold,
    # in the layout vLLM and SGLang load unchanged (their loaders' mapping: serving_layouts.py)
    shipped = tmp_path / "shipped"
    TV.main(["--export", str(tmp_path / "run" / "checkpoint"), str(shipped), "--target", str(tmp_path / "target"),
             "--early-exit-threshold", "0.2"])
    config, record = (json.loads((shipped / f).read_text()) for f in ("config.json", "vat/config.json"))
    assert config["torch_dtype"] == "bfloat16" and record["early_exit_threshold"] == 0.2
    assert record["step"] == 4 and not (shipped / "train_state.pt").exists()
    target_layers = load_draft(shipped, WT.load_model(tmp_path / "target"))[1].target_layers
    for engine in SL.ENGINES:
        assert SL.served_problems(shipped, engine) == [], engine
        assert SL.engine_aux_layers(engine, shipped, WT.read_config(tmp_path / "target")["num_hidden_layers"]) \
            == target_layers, engine
    assert sorted(p.name for p in shipped.glob("*.safetensors")) == ["model.safetensors"]
    bf16_target = WT.load_model(tmp_path / "target", dtype=torch.bfloat16)
    _, trained = load_draft(tmp_path / "run" / "checkpoint", bf16_target)
    found, exported = load_draft(shipped, bf16_target)
    assert found == kind
    for (name, a), (_, b) in zip(trained.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
    # round trip: decoding with the shipped draft, head and early exit included, is decoding with
    # the checkpoint's draft (in bf16): the same tokens, drafts, declines and forwards
    bf16_target.setup_caches(1, 256)
    tokenizer = load_tokenizer(tmp_path / "target")
    prompt = tokenizer.encode_chat([{"role": "user", "content": "question 3 about numbers"}])
    fields = ("tokens", "target_forwards", "drafted_tokens", "declined_tokens", "accepted_per_position")
    drafted = declined = 0
    for threshold in (0.2, 0.35, 0.5):  # thresholds at which the head lets more or fewer drafts through
        before, after = (generate(bf16_target, prompt, CK.build_draft(str(folder), bf16_target, tokenizer,
                                                                    early_exit=threshold),
                                  Verifier("greedy"), k=3, max_new_tokens=24, stop_ids=tokenizer.stop_ids)
                         for folder in (tmp_path / "run" / "checkpoint", shipped))
        assert {f: before[f] for f in fields} == {f: after[f] for f in fields}, threshold
        drafted, declined = drafted + after["drafted_tokens"], declined + after["declined_tokens"]
    assert drafted > 0 and declined > 0  # both of the head's decisions were taken
    with pytest.raises(SystemExit):  # an export never overwrites a draft
        TV.get_args(["--export", str(tmp_path / "run" / "checkpoint"), str(shipped)])
    # a baseline run's checkpoint written when every part was recorded for it reads as training none
    written = tmp_path / "run" / "checkpoint" / "vat" / "config.json"
    config = json.loads(written.read_text())
    config.update(objective="baseline", vat_parts=list(TV.VAT_PARTS))
    written.write_text(json.dumps(config))
    assert LC.learning_curves([tmp_path / "run"])["run"]["vat_parts"] == []


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_draft_gradients_through_a_packed_target_equal_the_plain_ones(tiny_dir, kind):
    grads = []
    for pack in (False, True):
        target = WT.load_model(tiny_dir("qwen3_untied"))
        if pack:
            LF.pack_for_cpu(target)
        target.setup_caches(2, 40)
        net = (eagle3_net(target) if kind == "eagle3" else dflash_net(target, block=4)).train()
        torch.manual_seed(0)  # the same tokens and DFlash anchors both times
        tokens = torch.randint(0, 96, (2, 24))
        mask = torch.zeros(2, 24)
        mask[:, 6:] = 1
        loss, _ = OB.DraftLoss(net, target, OB.LossSettings(frozenset(TV.VAT_PARTS)), ttt_steps=3,
                               blocks_per_seq=2, head_weight=LF.dense_weight(target.lm_head))(tokens, mask)
        loss.backward()
        assert all(p.grad is None for p in target.parameters())  # the target stays frozen
        grads.append({n: p.grad for n, p in net.named_parameters()})
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        assert torch.allclose(grads[1][name], g, rtol=1e-3, atol=1e-5), name


@pytest.mark.slow  # (a minute where inductor's cache is cold, as on a fresh machine)
def test_a_compiled_training_time_test_trains_the_eager_numbers(tiny_dir):
    """train_vat.py --compile: EAGLE-3's training-time test compiled gives the eager loss and
    gradients to rounding, on batches of two lengths (one graph with dynamic shapes: no
    recompile for the second)."""
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(2, 40)
    net = eagle3_net(target).train()
    batches = []
    for T in (24, 31):
        torch.manual_seed(T)
        tokens, mask = torch.randint(0, 96, (2, T)), torch.zeros(2, T)
        mask[:, 6:] = 1
        batches.append((tokens, mask))
    settings = OB.LossSettings(frozenset(TV.VAT_PARTS))
    eager, compiled = (OB.DraftLoss(net, target, settings, ttt_steps=3, blocks_per_seq=2, compiled=c) for c in (False, True))
    torch._dynamo.utils.counters.clear()
    for batch in batches:
        results = []
        for loss_of in (eager, compiled):
            net.zero_grad(set_to_none=True)
            loss, stats = loss_of(*batch)
            loss.backward()
            results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in net.named_parameters()}))
        (want, want_stats, want_grads), (got, got_stats, got_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got_stats["sim_tau"] == want_stats["sim_tau"] and got_stats["head_acc"] == want_stats["head_acc"]
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["recompiles"], dict(counters)


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
    assert TR.latest_checkpoint(tmp_path / "midway", target)[1]["step"] == 3


@pytest.mark.slow
def test_train_vat_under_torchrun_ddp(tmp_path):
    """Two CPU processes (gloo) train one draft; rank 0 writes the checkpoint."""
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
    loss = OB.DraftLoss(net, target, OB.LossSettings(frozenset(TV.VAT_PARTS)), ttt_steps=3, blocks_per_seq=2,
                        captured_layers=corpus.layers)
    batch = next(C.corpus_batches(corpus, range(2, 10), 200, 64, random.Random(0)))
    target.setup_caches(len(batch[0]), batch[0].shape[1])
    torch.manual_seed(1)
    fly, fly_stats = loss(batch[0], batch[1])
    torch.manual_seed(1)
    captured, stats = loss(*batch)
    assert captured.item() == pytest.approx(fly.item(), rel=2e-3)
    assert stats["sim_tau"] == pytest.approx(fly_stats["sim_tau"], rel=1e-3)


def test_an_interrupted_training_says_where_it_stands_in_one_line(tmp_path):
    """Ctrl-C during training: no traceback, a non-zero exit, one line saying --resume continues."""
    tiny_chat_target(tmp_path / "target")
    code = ("import os, signal, sys, threading, runpy; sys.path.insert(0, '.'); import train_vat; "
            "threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start(); "
            "sys.argv = ['train_vat.py'] + sys.argv[1:]; runpy.run_path('train_vat.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "--quick", "--target", str(tmp_path / "target"), "--steps", "100000",
                        "--save-every", "1", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "interrupted: --resume continues from the last checkpoint written"
