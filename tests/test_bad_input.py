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
import weights as WT
import files as FL
import linear_forms as LF
import model as M
from checkpoints import load_draft, save_draft
from files import ROOT
import objectives as OB
import train_vat as TV
from conftest import eagle3_net
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


def test_non_finite_drafts_are_neither_saved_nor_loaded(tmp_path, tiny_dir):
    target = WT.load_model(tiny_dir("qwen3_untied"))
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
    target = WT.load_model(tiny_dir("qwen3_untied"))
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
    ("bench", ["--dtype", "int8", "--compile", "on", "--device", "cpu"], "--dtype int8 runs uncompiled"),
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


# -----------------------------------------------------------------------------
# Second round: the newer surfaces (each item refuses in one line, writes nothing half)

@pytest.mark.parametrize("line,message", [
    ('{"turns": []}', "line 1: its 'turns' must be a non-empty list"),
    ('{"turns": "abc"}', "line 1: its 'turns' must be a non-empty list"),
    ('{"conversations": [{"from": "gpt", "value": "x"}]}', "line 1: its 'conversations' hold no turn from"),
    ('{"instruction": 5, "input": "x"}', "line 1: its instruction is int"),
])
def test_prompt_records_of_the_wrong_shape_are_named(tmp_path, line, message, decode_failure):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    status, last = decode_failure(["--prompt-file", str(path)])
    assert status != 0 and message in last and str(path) in last


@pytest.fixture
def tiny_drafts(tmp_path, tiny_dir):
    """(target, an EAGLE-3 draft folder, a DFlash draft folder) on a tiny target."""
    from conftest import dflash_net
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(1, 128)
    eagle = save_draft(eagle3_net(target), tmp_path / "eagle", target.args)
    dflash = save_draft(dflash_net(target, block=4), tmp_path / "dflash", target.args)
    return target, eagle, dflash


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_draft_configs_out_of_range_are_refused(tiny_drafts):
    target, eagle, dflash = tiny_drafts
    (eagle / "config.json").write_text("[]")
    with pytest.raises(M.CheckpointError, match="holds a list, not a JSON object"):
        load_draft(eagle, target)
    mask = json.loads((dflash / "config.json").read_text())["dflash_config"]["mask_token_id"]
    edit_config(dflash, dflash_config={**json.loads((dflash / "config.json").read_text())["dflash_config"],
                                       "mask_token_id": 999999})
    with pytest.raises(M.CheckpointError, match="mask_token_id 999999 lies outside the vocabulary"):
        load_draft(dflash, target)
    edit_config(dflash, dflash_config={**json.loads((dflash / "config.json").read_text())["dflash_config"],
                                       "mask_token_id": mask})
    for size in (1, 0, "4"):
        edit_config(dflash, block_size=size)
        with pytest.raises(M.CheckpointError, match="block_size must be a whole number >= 2"):
            load_draft(dflash, target)


@pytest.mark.parametrize("threshold", [5, "abc", -0.1])
def test_a_recorded_early_exit_threshold_is_checked_like_the_command_lines(tiny_drafts, threshold):
    target, eagle, _ = tiny_drafts
    edit_config(eagle, early_exit_threshold=threshold)
    with pytest.raises(M.CheckpointError, match=r"early_exit_threshold must be a number in \[0, 1\]"):
        CK.build_draft(str(eagle), target, None, early_exit="auto")


def test_int4_knows_which_models_it_can_take(tmp_path):
    import layouts as LY
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "intermediate_size": 100, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2}))
    assert "--dtype int4 needs layer widths in multiples of 32" in LY.layout_problem(tmp_path, "int4")
    assert LY.layout_problem(tmp_path, "float32") is None
    linear = torch.nn.Linear(64, 200)  # 200 outputs: not a multiple of 16, stays bf16 (packed)
    model = torch.nn.Sequential(linear, torch.nn.Linear(64, 64))
    LF.quantize_int4(model)
    assert not isinstance(model[0], LF.Int4Linear) and isinstance(model[1], LF.Int4Linear)


@pytest.mark.parametrize("temperature", [1e-45, 1e-42, 1e-30])
def test_tiny_temperatures_sample_the_argmax_without_overflow(temperature):
    from verify import probs_from_logits
    logits = torch.tensor([[3.0, 2.9, -1.0, float("-inf")]])
    p = probs_from_logits(logits, temperature)
    assert torch.isfinite(p).all() and p.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    tied = probs_from_logits(torch.tensor([[1.0, 1.0, 0.0]]), temperature)
    assert tied.tolist() == [[0.5, 0.5, 0.0]]


def test_a_tiny_temperature_decodes_with_a_tree_end_to_end(tiny_dir):
    from speculative import generate
    from draft import LookupDraft
    from verify import Verifier
    target = WT.load_model(tiny_dir("llama3"))
    target.setup_caches(1, 128)
    prompt = [5, 17, 3, 5, 17, 3, 5, 17]
    for tree in (0, 4):
        out = generate(target, prompt, LookupDraft(), Verifier("lossless"), k=3, max_new_tokens=12,
                       temperature=1e-42, tree=tree, generator=torch.Generator().manual_seed(0))
        assert out["tokens"] == generate(target, prompt, max_new_tokens=12)["tokens"]


@pytest.mark.parametrize("content,message", [
    (None, "results file .* not found"), ("[1, 2]", "holds a list, not a JSON object"), ("{}", "holds no 'machine'"),
    ("not json", "is not JSON"),
])
def test_render_only_refuses_what_report_py_did_not_write(tmp_path, content, message):
    import report
    out, readme = tmp_path / "results.json", tmp_path / "README.md"
    readme.write_text(f"{report.BEGIN}\nold\n{report.END}\n")
    if content is not None:
        out.write_text(content)
    with pytest.raises(ValueError, match=message):
        report.main(["--render-only", "--out", str(out), "--readme", str(readme)])
    assert readme.read_text() == f"{report.BEGIN}\nold\n{report.END}\n"


@pytest.mark.parametrize("line", ["5", '{"loss": 1.0}', '"text"'])
def test_learning_curves_name_a_log_that_is_not_one(tmp_path, line):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "log.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match="line 1 is not a training step's statistics"):
        TV.learning_curves([run])


def test_writing_a_folder_through_a_dangling_link_is_refused(tmp_path, tiny_drafts):
    target, eagle, _ = tiny_drafts
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    kind, net = load_draft(eagle, target)
    with pytest.raises(M.CheckpointError, match="is a link to .*nowhere, which is no directory"):
        save_draft(net, link, target.args)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_written_folders_are_readable_by_others(tmp_path):
    with FL.directory_written_atomically(tmp_path / "out") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        (tmp / "model.safetensors").chmod(0o600)  # as some writers create their files
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_an_unreadable_weights_file_is_named_as_such(tmp_path, tiny_dir, monkeypatch):
    import builtins
    import shutil
    shutil.copytree(tiny_dir("llama3"), tmp_path / "m")
    real_open = builtins.open

    def denied(path, *a, **k):
        if str(path).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(M.CheckpointError, match="cannot read .*model.safetensors: permission denied"):
        WT.load_model(tmp_path / "m")


def test_the_problems_log_refuses_a_foreign_file_before_touching_it(tmp_path):
    log = tmp_path / "run.json.problems.jsonl"
    foreign = "my notes\nmore notes without a newline"
    log.write_text(foreign)
    with pytest.raises(ValueError, match="holds a run with other settings"):
        lossy.read_partial(log, {"configs": ["lossless"]})
    assert log.read_text() == foreign  # untouched
    header = json.dumps({"config": {"configs": ["lossless"]}}) + "\n"
    log.write_text(header + json.dumps({"id": "a #0", "runs": {}}) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a problem's record with a run of each of --configs"):
        lossy.read_partial(log, {"configs": ["lossless"]})


@pytest.mark.parametrize("argv,message", [
    (["--tree", "8", "--verifier", "none"], "with --verifier none nothing is drafted"),
    (["--tree", "100000"], "--tree 100000 drafts up to 100000 tokens a step"),
    (["--early-exit", "abc"], "--early-exit: invalid threshold value"),
])
def test_decode_flags_that_cannot_run_are_refused_before_loading(argv, message, decode_failure, monkeypatch):
    import decode

    def no_loading(*_, **__):
        raise AssertionError("weights loaded before the flags were checked")
    monkeypatch.setattr(decode, "load_target", no_loading)
    status, last = decode_failure(argv)
    assert status != 0 and message in last


def test_every_option_help_is_short():
    """The why lives in README and the docstrings; a --help line says what the option does."""
    import argparse
    import importlib
    for script in ("decode", "bench", "lossy", "train_vat", "report"):
        module = importlib.import_module(script)
        parsers = []
        real = argparse.ArgumentParser.parse_args

        def capture(self, *a, **k):
            parsers.append(self)
            raise SystemExit(0)
        argparse.ArgumentParser.parse_args = capture
        try:
            (module.get_args if hasattr(module, "get_args") else module.main)([])
        except SystemExit:
            pass
        finally:
            argparse.ArgumentParser.parse_args = real
        assert parsers, script
        long = [(a.option_strings, len(a.help)) for a in parsers[0]._actions if a.help and len(a.help) > 200]
        assert not long, f"{script}: {long}"


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


@pytest.mark.parametrize("threads", ["abc", "0", "100000"])
def test_report_refuses_a_thread_count_it_cannot_use(tmp_path, threads, capsys):
    import report
    with pytest.raises(SystemExit) as e:
        report.main(["--threads", threads, "--out", str(tmp_path / "r.json"), "--readme", str(tmp_path / "README.md")])
    assert e.value.code == 2 and "--threads takes auto or a whole number" in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
