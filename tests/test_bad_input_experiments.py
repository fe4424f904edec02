"""Bad input to the experiments: a torn or foreign problems log, a results file report.py did not
write, a thread count it cannot use. Each is refused in one line, and no log is damaged."""
import json
from pathlib import Path

import pytest

import lossy


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


@pytest.mark.parametrize("threads", ["abc", "0", "100000"])
def test_report_refuses_a_thread_count_it_cannot_use(tmp_path, threads, capsys):
    import report
    with pytest.raises(SystemExit) as e:
        report.main(["--threads", threads, "--out", str(tmp_path / "r.json"), "--readme", str(tmp_path / "README.md")])
    assert e.value.code == 2 and "--threads takes auto or a whole number" in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


DRAFTS = Path(__file__).resolve().parent.parent / "drafts"
DFLASH, EAGLE3 = str(DRAFTS / "smollm2-135m-dflash-gsm8k"), str(DRAFTS / "smollm2-135m-eagle3-chat")


@pytest.mark.parametrize("script,argv,message", [
    ("draft_cost", ["--draft", DFLASH], "holds a DFlash draft, not an EAGLE-3 one"),
    ("draft_cost", ["--dflash-draft", EAGLE3], "holds an EAGLE-3 draft, not a DFlash one"),
    ("draft_cost", ["--draft", "no-such-draft"], "'no-such-draft' is neither a directory nor a known model"),
    ("draft_cost", ["--dtype", "int9"], "invalid choice: 'int9'"),
    ("draft_cost", ["--context", "100000"], "--context from 8 to 4096"),
    ("train_compile", ["--draft", DFLASH], "holds a DFlash draft, not an EAGLE-3 one"),
    ("train_compile", ["--seq-len", "100000"], "--seq-len from 16 to 4096"),
])
def test_the_cost_experiments_refuse_a_draft_of_the_other_kind_and_sizes_out_of_range(tmp_path, script, argv,
                                                                                       message, capsys):
    """Told in one line before the target loads, not a traceback from inside the timed code."""
    experiment = __import__(script)
    with pytest.raises(SystemExit) as e:
        experiment.get_args(argv + ["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
