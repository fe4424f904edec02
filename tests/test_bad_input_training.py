"""Bad input to training: damaged or non-finite corpus shards, a diverging loss, sequences past
--seq-len, logs that are not logs. Each ends in a one-line error or a correct rebuild, and nothing
non-finite is saved."""
import json

import pytest

from harness import learning_curves as LC
import torch

from data import corpus as C
from engine import weights as WT
import objectives as OB
import train_vat as TV
from conftest import tiny_chat_target
from test_corpus import corpus_recipe
from tokenizer import load_tokenizer


@pytest.fixture
def chat_target(tmp_path):
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(4, 64)
    return target, load_tokenizer(tmp_path / "target")


def test_a_damaged_corpus_shard_is_named_and_generated_again(tmp_path, chat_target, capsys):
    target, tokenizer = chat_target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(9)))
    recipe = corpus_recipe(tmp_path, data=str(prompts))
    folder, _ = C.build_corpus(target, tokenizer, recipe)
    whole = C.Corpus(folder)
    spans = list(zip(whole.offsets[:-1].tolist(), whole.lengths.tolist()))
    features = [whole.rows("features", lo, n).clone() for lo, n in spans]  # (the shards are mapped, not copied)
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
    assert again.tokens.tolist() == whole.tokens.tolist()
    assert all(torch.equal(again.rows("features", lo, n), f) for (lo, n), f in zip(spans, features))


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
    real_loss = OB.eagle3_loss

    def poisoned(*a):
        loss, stats = real_loss(*a)
        return loss * float("nan"), stats
    monkeypatch.setattr(OB, "eagle3_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the loss is nan at step 1"):
        TV.main(["--target", str(tmp_path / "target"), "--data", str(prompts), "--num-prompts", "8",
                 "--response-tokens", "8", "--gen-batch", "4", "--batch-size", "2", "--seq-len", "32",
                 "--eval-prompts", "2", "--eval-every", "0", "--save-every", "1", "--ttt-steps", "2",
                 "--draft-vocab", "200", "--warmup", "0", "--steps", "3", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"])
    assert not list(out.glob("step-*")) and not (out / "checkpoint").exists()


@pytest.mark.parametrize("line", ["5", '{"loss": 1.0}', '"text"'])
def test_learning_curves_name_a_log_that_is_not_one(tmp_path, line):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "log.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match="line 1 is not a training step's statistics"):
        LC.learning_curves([run])


def test_sequences_whose_response_lies_past_seq_len_are_skipped_or_refused(capsys):
    assert C.fitting([(10, 50), (63, 100), (30, 32)], 64) == [0, 2]
    assert "1 of 3 training sequences have their response past --seq-len 64" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no training sequence has a response inside --seq-len 8 .*shortest prompt "
                                         "takes 10 tokens"):
        C.fitting([(10, 50), (60, 100)], 8)


def tiny_training(tmp_path, *extra):
    tiny_chat_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i} " + "numbers " * (3 * i)}) + "\n"
                               for i in range(8)))
    return ["--target", str(tmp_path / "target"), "--data", str(prompts), "--num-prompts", "8",
            "--response-tokens", "8", "--gen-batch", "4", "--batch-size", "2", "--eval-prompts", "2",
            "--eval-every", "0", "--save-every", "1", "--ttt-steps", "2", "--draft-vocab", "200",
            "--warmup", "0", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu", *extra]


def test_a_small_seq_len_trains_on_what_fits_and_refuses_when_nothing_does(tmp_path, capsys):
    """Long prompts' responses past --seq-len are skipped (said once), so no batch divides 0 by 0."""
    TV.main(tiny_training(tmp_path, "--seq-len", "24", "--steps", "2"))
    err = capsys.readouterr().err
    assert "have their response past --seq-len 24: skipped" in err
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(s["loss"] == s["loss"] for s in log)  # finite, no NaN
    with pytest.raises(ValueError, match="no training sequence has a response inside --seq-len 4"):
        TV.main(tiny_training(tmp_path / "b", "--seq-len", "4", "--steps", "2"))
    with pytest.raises(ValueError, match="--stop-at 1 lies behind the checkpoint's step 2"):
        TV.main(tiny_training(tmp_path, "--seq-len", "24", "--steps", "3", "--resume", "--stop-at", "1"))

