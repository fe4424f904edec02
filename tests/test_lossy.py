"""lossy.py: the tasks are fixed and graded right, the statistics are the textbook ones (checked by
simulation), the distortion is the closed form's, one seed couples the verifiers, and a run is
consistent, resumable and refuses to mix settings."""
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.files import ROOT
from conftest import needs_bwrap

import lossy
import tasks
from engine import weights as WT
import model as M
from speculative import generate
from draft import ModelDraft
from verify import Verifier, induced, own_distribution, verify



def test_arithmetic_problems_are_fixed_graded_levels():
    problems = tasks.arithmetic_problems(5, seed=3)
    assert problems == tasks.arithmetic_problems(5, seed=3)
    assert problems != tasks.arithmetic_problems(5, seed=4)
    # a larger run extends a smaller one: its first problems are the same, so it can resume from it
    assert tasks.arithmetic_problems(3, seed=3) == [p for p in problems if int(p["id"].split("#")[1]) < 3]
    assert [p["level"] for p in problems] == [lv for lv in tasks.LEVELS for _ in range(5)]
    for p in problems:
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", p["prompt"]).groups())
        assert p["answer"] == str(a + b)
        digits = {"1-digit + 1-digit": (1, 1), "tens + tens": (2, 2), "2-digit + 1": (2, 1),
                  "2-digit + 2-digit": (2, 2)}[p["level"]]
        assert (len(str(a)), len(str(b))) == digits
    assert len({p["id"] for p in problems}) == len(problems)


def test_last_number_grader():
    assert tasks.last_number_correct("So she pays 3 * 6 = 18 dollars. The answer is 18.", "18")
    assert tasks.last_number_correct("Total: 1,234 apples", "1234")
    assert tasks.last_number_correct("7 + 5 = 12", "12")
    assert not tasks.last_number_correct("The answer is 17.", "18")
    assert not tasks.last_number_correct("no numbers here", "18")


@needs_bwrap
def test_humaneval_grader_runs_tests_in_the_sandbox():
    with gzip.open(tasks.DATA / "HumanEval.jsonl.gz", "rt") as f:
        row = json.loads(f.readline())
    problem = tasks.humaneval_problems(1)[0]
    assert problem["entry_point"] == row["entry_point"]
    assert tasks.humaneval_passes(problem, f"```python\n{row['canonical_solution']}```")  # a body only
    whole = row["prompt"] + row["canonical_solution"]
    assert tasks.humaneval_passes(problem, f"Here it is:\n```python\n{whole}\n```")
    assert not tasks.humaneval_passes(problem, "```python\n    return None\n```")
    assert not tasks.humaneval_passes(problem, "```python\n    while True: pass\n```", timeout=2)


@pytest.mark.parametrize("name,params", [("lossless", {}), ("minp", {"p_base": 0.2}), ("eta", {"eps": 0.05}),
                                         ("cos", {"lam": 0.5}), ("overshoot", {"lam": 0.25, "ceiling": 2.0})])
def test_distortion_meter_is_the_closed_form_at_each_committed_token(name, params):
    torch.manual_seed(0)
    v = Verifier(name, **params)
    p = torch.softmax(torch.randn(5, 11) * 2, -1)  # 4 drafted positions and the bonus one
    q = torch.softmax(torch.randn(4, 11) * 2, -1)
    guesses = q.argmax(-1)
    for n in (0, 2, 4):  # a rejection at the first, at the third, and every guess kept
        meter = lossy.DistortionMeter(v)
        meter(p, q, guesses, n)
        assert len(meter.tv) == len(meter.kl) == n + 1
        for i in range(n + 1):
            out = induced(p[i], q[i], v) if i < 4 else own_distribution(p[i], v)
            assert meter.tv[i] == pytest.approx(0.5 * (out - p[i]).abs().sum().item(), abs=1e-6)
            kl = (out * (out / p[i]).log()).nan_to_num().sum().item()
            assert meter.kl[i] == pytest.approx(kl, abs=1e-5)
        if name == "lossless":
            assert max(meter.tv) < 1e-6
        assert meter.per_token(2) == (pytest.approx(sum(meter.tv[:2])), pytest.approx(sum(meter.kl[:2])))


def test_every_sampling_rule_draws_the_same_random_numbers():
    """What couples runs of different verifiers from one seed: after verifying the same block, the
    generator is in the same state whatever the rule decided."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(1, 5, 50), -1)
    q = torch.softmax(torch.randn(1, 4, 50), -1)
    guesses = q[0].argmax(-1)[None]
    states = []
    for v in (Verifier("lossless"), Verifier("minp", p_base=0.5), Verifier("eta"), Verifier("cos", lam=0.2),
              Verifier("lenience", lenience=0.3), Verifier("overshoot")):
        g = torch.Generator().manual_seed(5)
        verify(p, q, guesses, v, g)
        states.append(torch.rand(3, generator=g))
    assert all(torch.equal(s, states[0]) for s in states)


def test_one_seed_couples_verifiers_that_decide_alike(tiny_dir):
    """Lossless, CoS with lam = 1 and the overshoot ceiling with c = 1 are one rule: from one seed
    they must produce the same tokens, draft samples and all."""
    target, draft_net = WT.load_model(tiny_dir("qwen3_untied")), WT.load_model(tiny_dir("qwen3_tied"))
    target.setup_caches(1, 128)
    draft_net.setup_caches(1, 128)
    g = torch.Generator()
    draft = ModelDraft(draft_net, temperature=1.0, generator=g)
    outs = []
    for v in (Verifier("lossless"), Verifier("cos", lam=1.0), Verifier("overshoot", lam=0.5, ceiling=1.0),
              Verifier("lossless")):
        g.manual_seed(11)
        outs.append(generate(target, [3, 1, 4, 1, 5], draft, v, k=3, max_new_tokens=30, temperature=1.0,
                             generator=g)["tokens"])
    assert all(o == outs[0] for o in outs)
    g.manual_seed(12)
    other = generate(target, [3, 1, 4, 1, 5], draft, Verifier("lossless"), k=3, max_new_tokens=30,
                     temperature=1.0, generator=g)["tokens"]
    assert other != outs[0]  # the seed matters: the equality above is not a constant output


def run_lossy(*extra, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "lossy.py"), *extra], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


@pytest.mark.slow  # (the parts it puts together are tested apart above and below, in the default suite)
def test_quick_run_is_consistent_and_resumes(tmp_path, capsys):
    """The real default target and GSM8K draft on one problem per level: the summary is the
    per-problem records', exact configurations show no distortion, the tree versions pair with
    their chains, and a rerun resumes (the trees share the chains' run: each run loads the target)."""
    out = tmp_path / "lossy.json"
    configs = "plain sampling,lossless,overshoot lam=0.5 c=2"  # (one of each kind of row)
    capsys.readouterr()
    lossy.main(["--quick", "--workers", "1", "--configs", configs, "--tree", "6", "--out", str(out)])
    stdout = capsys.readouterr().out  # (in this process: the script's own start is tested below)
    result = json.loads(out.read_text())
    records, summary = result["problems"], result["summary"]
    assert [p["level"] for p in records] == list(tasks.LEVELS)
    assert set(summary) == set(tasks.LEVELS) | {"all"}
    for level, rows in summary.items():
        mine = [p for p in records if level in ("all", p["level"])]
        for label, s in rows.items():
            runs = [p["runs"][label] for p in mine]
            close = dict(rel=3e-4, abs=1e-12)  # (a results file keeps five significant digits)
            assert s["accuracy"] == pytest.approx(sum(x["correct"] for x in runs) / len(runs), **close)
            tokens = sum(x["new_tokens"] for x in runs)
            assert s["block_efficiency"] == pytest.approx(tokens / sum(x["target_forwards"] for x in runs), **close)
            if label.endswith(lossy.TREE_SUFFIX):  # no closed form for a tree's distortion
                assert s["tv"] is None
            else:
                assert s["tv"] == pytest.approx(sum(x["tv_sum"] for x in runs) / tokens, **close)
            assert all(0 < x["new_tokens"] <= 8 for x in runs)
    pooled = summary["all"]
    assert list(pooled) == configs.split(",") + ["lossless tree", "overshoot lam=0.5 c=2 tree"]
    assert pooled["plain sampling"]["tv"] == 0 and pooled["plain sampling"]["block_efficiency"] == 1
    assert pooled["lossless"]["tv"] < 1e-5 and pooled["overshoot lam=0.5 c=2"]["tv"] > 0.01
    assert pooled["lossless"]["block_efficiency"] > 1
    for label in ("lossless tree", "overshoot lam=0.5 c=2 tree"):  # each tree against its own chain
        chain = label.removesuffix(lossy.TREE_SUFFIX)
        s = pooled[label]
        assert s["family"] == pooled[chain]["family"]
        assert s["vs_chain"]["block_efficiency_ratio"] == pytest.approx(
            s["block_efficiency"] / pooled[chain]["block_efficiency"], rel=3e-4)
        assert all(p["runs"][label]["target_forwards"] > 0 for p in records)
    assert "draft trees of 6 tokens against their chains" in stdout
    printed = json.loads(stdout.strip().splitlines()[-1])["tv"]
    assert printed.keys() == pooled.keys()
    for label, s in pooled.items():  # a tree row measures no tv: None, which approx refuses
        if s["tv"] is None:
            assert printed[label] is None
        else:
            assert printed[label] == pytest.approx(s["tv"], rel=3e-4, abs=1e-12)
    assert all(Path(p).is_file() for p in result["plots"])

    # the rerun and the refusal in this process: neither loads the target
    log = out.with_name(out.name + ".problems.jsonl")
    before = log.read_text()
    capsys.readouterr()
    lossy.main(["--quick", "--workers", "1", "--configs", configs, "--tree", "6", "--out", str(out)])
    assert "4 of 4 problems done" in capsys.readouterr().err
    assert json.loads(out.read_text())["summary"] == summary and log.read_text() == before
    # other settings never mix into the same log: a one-line refusal, the log untouched
    with pytest.raises(ValueError, match="holds a run with other settings") as refusal:
        lossy.main(["--quick", "--workers", "1", "--configs", "lossless", "--out", str(out)])
    assert "\n" not in str(refusal.value) and log.read_text() == before


@pytest.mark.parametrize("bad,message", [(["--tasks", "chess"], "--tasks"), (["--configs", "minp p_base=0.7"],
                                         "unknown configuration"), (["--temperature", "0"], "--temperature"),
                                         (["--problems", "0"], "--problems"), (["--tree", "-2"], "--tree"),
                                         # --quick fills in only what the user left out
                                         (["--quick", "--problems", "-1"], "--problems"),
                                         (["--quick", "--max-new-tokens", "0"], "--max-new-tokens")])
def test_bad_arguments_fail_in_one_line(bad, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        lossy.get_args(bad)
    assert exit_.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


def test_missing_weights_and_drafts_fail_in_one_line_and_keep_the_log_usable(tmp_path):
    out = tmp_path / "r.json"
    missing = tmp_path / "no-such-model"
    # a missing target is refused before any worker starts: in this process
    with pytest.raises(M.CheckpointError, match=re.escape(str(missing))) as refusal:
        lossy.main(["--target", str(missing), "--draft", "lookup", "--workers", "2", "--problems", "1",
                    "--out", str(out)])
    assert "\n" not in str(refusal.value)
    # a missing draft fails inside the workers: the script's one line, from its own process
    r = run_lossy("--draft", str(missing), "--workers", "2", "--problems", "1", "--out", str(out))
    assert r.returncode == 1 and str(missing) in r.stderr.strip().splitlines()[-1], r.stderr[-500:]
    assert lossy.read_partial(out.with_name(out.name + ".problems.jsonl"), {"config": 1}) == {}


@pytest.mark.slow  # (the graders, the closed forms and the refusals are tested apart in the default suite)
@needs_bwrap
def test_gsm8k_and_humaneval_run_through_the_same_experiment(tmp_path):
    out = tmp_path / "hard.json"
    r = run_lossy("--quick", "--tasks", "gsm8k,humaneval", "--workers", "1", "--configs", "lossless,eta eps=0.09",
                  "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"gsm8k", "humaneval", "all"}
    assert summary["all"]["eta eps=0.09"]["vs_lossless"]["n"] == 2


def test_the_arithmetic_data_script_draws_the_problems_lossy_grades():
    """data/arithmetic.py (a script) finds the levels it shares with the experiment, and the files
    it wrote keep the experiment's own problems out."""
    import runpy
    from engine.files import DATA, read_jsonl
    script = runpy.run_path(str(ROOT / "data" / "arithmetic.py"), run_name="imported")  # (main not run)
    assert script["LEVELS"].keys() == tasks.LEVELS.keys()
    evaluation = {p["prompt"].split("?")[0] + "?" for p in tasks.arithmetic_problems(100, seed=0)}
    written = [r["prompt"] for name in ("arithmetic_train.jsonl", "arithmetic_test.jsonl")
               for _, r in read_jsonl(DATA / name)]
    assert len(written) > 3000 and not evaluation & set(written)
