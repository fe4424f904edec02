"""Bad input found by fuzzing: damaged corpus shards, non-finite weights, drafts for another target,
a torn results log, and machine flags. Each ends in a one-line error or a correct rebuild, and
nothing non-finite is saved or loaded."""
import json
import subprocess
import sys

import pytest
import torch

import corpus as C
import lossy
import checkpoints as CK
import model as M
from checkpoints import ROOT, load_draft, save_draft
import train_vat as TV
from conftest import eagle3_net
from test_train_vat import corpus_recipe, tiny_chat_target
from tokenizer import load_tokenizer



@pytest.fixture
def chat_target(tmp_path):
    tiny_chat_target(tmp_path / "target")
    target = CK.load_model(tmp_path / "target")
    target.setup_caches(4, 64)
    return target, load_tokenizer(tmp_path / "target")


def test_a_damaged_corpus_shard_is_named_and_generated_again(tmp_path, chat_target, capsys):
    target, tokenizer = chat_target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(9)))
    recipe = corpus_recipe(tmp_path, data=str(prompts))
    folder, _ = C.build_corpus(target, tokenizer, recipe)
    whole = C.Corpus(folder)
    shards = sorted(folder.glob("shard-*.pt"))
    overwritten, cut = shards[1], shards[3]
    raw = bytearray(overwritten.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = b"\x7f" * 64  # same length, other bytes
    overwritten.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"corpus shard .*{overwritten.name} is damaged"):
        C.Corpus(folder)  # never trained on
    capsys.readouterr()
    C.build_corpus(target, tokenizer, recipe)
    err = capsys.readouterr().err
    assert f"{overwritten.name} is damaged" in err and f"{cut.name} is damaged" in err
    again = C.Corpus(folder)
    assert again.tokens.tolist() == whole.tokens.tolist() and torch.equal(again.features, whole.features)


def test_a_corpus_shard_with_non_finite_values_is_refused(tmp_path, chat_target):
    target, tokenizer = chat_target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(5)))
    folder, _ = C.build_corpus(target, tokenizer, corpus_recipe(tmp_path, data=str(prompts)))
    shard = sorted(folder.glob("shard-*.pt"))[-1]
    rows = torch.load(shard, weights_only=True)
    rows["features"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite features"):
        C.save_shard(rows, shard)  # the writer refuses it
    torch.save(rows, shard)  # and a reader refuses one made behind its back, checksum and all
    shard.with_name(shard.name + ".sha256").write_text(C.file_digest(shard))
    with pytest.raises(ValueError, match=f"{shard.name} holds non-finite features"):
        C.Corpus(folder)


def test_training_stops_at_the_first_non_finite_loss_and_saves_nothing(tmp_path, monkeypatch):
    tiny_chat_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(8)))
    real_loss = TV.eagle3_loss

    def poisoned(*a):
        loss, stats = real_loss(*a)
        return loss * float("nan"), stats
    monkeypatch.setattr(TV, "eagle3_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the loss is nan at step 1"):
        TV.main(["--target", str(tmp_path / "target"), "--data", str(prompts), "--num-prompts", "8",
                 "--response-tokens", "8", "--gen-batch", "4", "--batch-size", "2", "--seq-len", "32",
                 "--eval-prompts", "2", "--eval-every", "0", "--save-every", "1", "--ttt-steps", "2",
                 "--draft-vocab", "200", "--warmup", "0", "--steps", "3", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"])
    assert not list(out.glob("step-*")) and not (out / "checkpoint").exists()


def test_non_finite_drafts_are_neither_saved_nor_loaded(tmp_path, tiny_dir):
    target = CK.load_model(tiny_dir("qwen3_untied"))
    net = eagle3_net(target)
    good = save_draft(net, tmp_path / "good", target.args)
    from safetensors.torch import load_file, save_file
    tensors = load_file(good / "model.safetensors")
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name][0] = float("inf")
    save_file(tensors, str(good / "model.safetensors"))
    with pytest.raises(M.CheckpointError, match="non-finite"):
        load_draft(good, target)
    with torch.no_grad():
        net.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight holds non-finite"):
        save_draft(net, tmp_path / "bad", target.args)
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["good"]


def test_a_draft_trained_for_another_target_loads_with_a_warning(tmp_path, tiny_dir, capsys):
    target = CK.load_model(tiny_dir("qwen3_untied"))
    net = eagle3_net(target)
    save_draft(net, tmp_path / "other", target.args, {"vat": {"target": str(tiny_dir("llama3"))}})
    save_draft(net, tmp_path / "own", target.args, {"vat": {"target": str(tiny_dir("qwen3_untied"))}})
    capsys.readouterr()
    load_draft(tmp_path / "own", target)
    assert capsys.readouterr().err == ""
    load_draft(tmp_path / "other", target)
    err = capsys.readouterr().err
    assert "warning" in err and str(tiny_dir("llama3")) in err and str(tiny_dir("qwen3_untied")) in err


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.mark.parametrize("script,argv,message", [
    ("decode", ["--threads", "100000"], "--threads takes auto or a whole number from 1 to the"),
    ("decode", ["--threads", "1000"], "--threads takes auto or a whole number from 1 to the"),
    pytest.param("decode", ["--device", "cuda"], "has no CUDA device", marks=NO_CUDA),
    ("decode", ["--device", "foo"], "--device takes cpu, cuda or cuda:N"),
    pytest.param("bench", ["--dtype", "int8", "--device", "cuda"], "has no CUDA device", marks=NO_CUDA),
    ("bench", ["--dtype", "int8", "--compile", "on", "--device", "cpu"], "--dtype int8 runs on the CPU"),
    ("bench", ["--temperatures", "nan"], "--temperatures must be a finite number >= 0"),
    ("bench", ["--speed-off", "--temperatures", "0,-1"], "--temperatures must be a finite number >= 0"),
    ("bench", ["--temperatures", "one"], "--temperatures takes comma-separated numbers"),
    ("bench", ["--threads", "-1"], "--threads takes auto or a whole number"),
    ("bench", ["--speed-off", "--limit", "0"], "--limit must be >= 1"),
    ("lossy", ["--device", "foo"], "--device takes cpu, cuda or cuda:N"),
    ("train_vat", ["--device", "foo"], "--device takes cpu, cuda or cuda:N"),
])
def test_bad_machine_flags_fail_in_one_line_before_loading(script, argv, message, capsys):
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).get_args(argv)
    assert e.value.code != 0 and message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_thread_count_past_the_cores_exits_cleanly():
    """The command line end to end: once a segfault inside OpenMP, now one line and exit status 2."""
    r = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--threads", "100000"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--threads" in r.stderr.strip().splitlines()[-1]


def test_a_prompt_file_that_is_not_text_is_named(tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"\xff\xfe\x00binary")
    r = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--prompt-file", str(bad)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and f"{bad} is not UTF-8 text" in r.stderr.strip().splitlines()[-1]


def test_the_problems_log_heals_a_torn_line_and_names_lines_that_are_not_records(tmp_path):
    log = tmp_path / "run.json.problems.jsonl"
    fingerprint = {"target": "t", "seed": 0}
    header = json.dumps({"config": fingerprint}) + "\n"
    record = json.dumps({"id": "a #0", "level": "a", "runs": {"lossless": {"correct": True}}}) + "\n"
    log.write_text(header + record + '{"id": "a #1", "lev')  # stopped while writing the second
    assert list(lossy.read_partial(log, fingerprint)) == ["a #0"]
    assert log.read_text() == header + record  # healed: the next record starts its own line
    log.write_text(header[:20])  # stopped while writing the settings
    assert lossy.read_partial(log, fingerprint) == {} and log.read_text() == ""
    for bad in ('{"foo": 1}\n', "42\n", "not json\n"):
        log.write_text(header + record + bad)
        with pytest.raises(ValueError, match="line 3 is not a problem's record"):
            lossy.read_partial(log, fingerprint)
    log.write_bytes(header.encode() + b"\xff\xfe\n")
    with pytest.raises(ValueError, match=f"{log} is not a problems log"):
        lossy.read_partial(log, fingerprint)
    log.write_text("garbage\n" + record)
    with pytest.raises(ValueError, match=f"{log} holds a run with other settings"):
        lossy.read_partial(log, fingerprint)
