"""Bad input on decode.py's (and the other scripts') command line: machine flags, prompt files and
records, flags that cannot run together, temperatures at the edge of underflow, and --help that
stays short. Each is refused in one line before any weights load."""
import subprocess
import sys

import pytest
import torch

from engine import weights as WT
from engine.files import ROOT


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


def raises(error):
    raise error


@pytest.mark.parametrize("error,status,line", [
    (ValueError("-k is too long"), "error: -k is too long", None),
    (FileNotFoundError(2, "No such file or directory", "x.json"),
     "error: x.json: No such file or directory (nothing was left half-written)", None),
    (KeyboardInterrupt(), 130, "interrupted: the last checkpoint stands"),
])
def test_a_script_ends_in_one_line_without_a_traceback(error, status, line, capsys):
    """What every script's __main__ runs: a refusal or a file problem in one line and status 1
    (sys.exit with the line), Ctrl-C in the script's own line and status 130."""
    from engine.machine import run_script
    with pytest.raises(SystemExit) as exit_:
        run_script(lambda: raises(error), "interrupted: the last checkpoint stands")
    assert exit_.value.code == status
    assert capsys.readouterr().err.strip() == (line or "")


def test_ctrl_c_in_a_benchmark_says_what_was_kept(tmp_path):
    """Ctrl-C while bench.py loads and runs: no traceback, status 130, one line saying nothing was
    written, and no results file."""
    out = tmp_path / "bench.json"
    code = ("import os, signal, sys, threading, runpy; sys.path.insert(0, '.'); import bench; "
            "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start(); "
            "sys.argv = ['bench.py'] + sys.argv[1:]; runpy.run_path('bench.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "--quick", "--drafts", "lookup", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("interrupted: no results written")
    assert not out.exists()


def test_a_prompt_file_that_is_not_text_is_named(tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"\xff\xfe\x00binary")
    r = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--prompt-file", str(bad)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and f"{bad} is not UTF-8 text" in r.stderr.strip().splitlines()[-1]


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


@pytest.mark.parametrize("argv,message", [
    (["--tree", "8", "--verifier", "none"], "with --verifier none nothing is drafted"),
    (["--draft", "drafts/smollm2-135m-eagle3-chat", "--verifier", "none"], "--verifier none decodes plainly"),
    (["--tree", "100000"], "+ up to 100000 drafted a step needs"),
    (["--early-exit", "abc"], "--early-exit: invalid threshold value"),
    (["--early-exit-signal", "entropy"], "--early-exit-signal: invalid choice: 'entropy'"),
    (["--seed", "99999999999999999999999"], "--seed must lie in [0, 2^63)"),
    (["--seed", "-1"], "--seed must lie in [0, 2^63)"),
    (["--max-seq-len", "-5"], "--max-seq-len must be >= 2, got -5"),
    (["--prompt-file", "/dev/null"], "is not a regular file (a device or a pipe)"),
    (["--prompt-file", "data"], "prompt file data is a directory"),
    (["--prompt", "word " * 9000, "--max-seq-len", "30000"], "the context holds 8192 (the model's "
                                                             "max_position_embeddings: a shorter prompt"),
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

