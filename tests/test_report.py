"""report.py: README's summary and the results page's tables are what docs/results.json renders
to, and the report runs."""
import json
import re

import pytest

from harness import speed
import report
from engine.files import ROOT


def between_markers(text: str) -> str:
    return text[text.index(report.BEGIN):text.index(report.END) + len(report.END)]


def test_readme_and_the_results_page_show_what_the_results_file_renders_to():
    results = json.loads(report.RESULTS.read_text())
    stale = "stale: run python experiments/report.py --render-only"
    readme = between_markers(report.README.read_text())
    assert readme == report.render_summary(results), f"README's summary is {stale}"
    assert between_markers(report.PAGE.read_text()) == report.render(results), f"docs/results' tables are {stale}"
    # README's summary: each run's row holds its median speedup and tau, for each task and temperature
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in readme.splitlines() if line.startswith("| ")}
    exact = tried = 0
    for task, table in results["tasks"].items():
        for name, s in table["summary"].items():
            cell = f"{s['speedup_median']:.2f}x" + (f", tau {s['tau']:.2f}" if s["drafted_tokens"] else "")
            assert f"| {cell} |" in rows[table["labels"][name].rsplit(" T=", 1)[0]], (task, name)
            if s["temperature"] == 0 and s["drafted_tokens"]:
                exact, tried = exact + s["prompts_with_the_baseline_tokens"], tried + table["prompts"]
    assert f"tokens on {exact} of {tried} prompts" in readme
    machine = results["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["threads"] >= 1 and machine["torch"]
    assert not machine["uncommitted_changes"], "measure a committed tree, so that the commit names the code"
    # every run of a task measured every prompt, and the baselines are plain decoding, not greedy at T > 0
    for task in results["tasks"].values():
        runs = speed.records_from_file(task["runs"])
        for name, rs in runs.items():
            assert len(rs) == task["prompts"], name
        sampled = runs["baseline T=1"]
        assert len({tuple(r["tokens"]) for r in sampled} | {tuple(r["tokens"]) for r in runs["baseline T=0"]}) \
            > len(sampled), "plain decoding at T = 1 gave greedy decoding's tokens"


def test_render_only_replaces_the_tables_between_the_markers(tmp_path):
    """--render-only writes README's summary, the page's tables and the figure beside the results
    file, nothing else; where either file lacks its markers, neither is touched."""
    readme, page, results = tmp_path / "README.md", tmp_path / "page.md", tmp_path / "results.json"
    results.write_text(report.RESULTS.read_text())  # (a copy: the committed figure stays as it is)
    render_only = ["--render-only", "--readme", str(readme), "--page", str(page), "--out", str(results)]
    for path in (readme, page):
        path.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\nrest\n")
    report.main(render_only)
    for path, render in ((readme, report.render_summary), (page, report.render)):
        text = path.read_text()
        assert text.startswith("intro\n") and text.endswith("\nrest\n") and "old table" not in text
        assert render(json.loads(results.read_text())) in text
    assert (tmp_path / "results.png").stat().st_size > 0
    shown = page.read_text()
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        report.main(render_only)
    assert readme.read_text() == "no markers\n" and page.read_text() == shown
    assert sorted(tmp_path.iterdir()) == sorted([readme, page, results, tmp_path / "results.png"])


@pytest.mark.slow  # loads the target three times and transformers once: about a minute
def test_a_small_report_runs_end_to_end(tmp_path):
    readme, page, out = tmp_path / "README.md", tmp_path / "page.md", tmp_path / "results.json"
    for path in (readme, page):
        path.write_text(f"{report.BEGIN}\n{report.END}\n")
    report.main(["--spec-bench", "2", "--gsm8k", "1", "--max-new-tokens", "8", "--out", str(out),
                 "--readme", str(readme), "--page", str(page)])
    results = json.loads(out.read_text())
    assert readme.read_text() == report.render_summary(results) + "\n"
    assert page.read_text() == report.render(results) + "\n"
    # at T = 0 every speculative run emits the tokens of plain decoding in its own layout
    for task in results["tasks"].values():
        runs, layouts = speed.records_from_file(task["runs"]), task["layouts"]
        plain = {layouts[name]: runs[name] for name in runs if name.endswith("T=0") and "plain" in
                 task["labels"][name] and "transformers" not in name}
        checked = [name for name in runs if name.endswith("T=0") and layouts[name] in plain]
        assert len(checked) >= 4
        assert all(r["tokens"] == b["tokens"] for name in checked for r, b in zip(runs[name], plain[layouts[name]]))


def test_results_files_name_only_files_that_exist_and_no_machine_paths():
    for path in (ROOT / "docs").rglob("*.json"):
        text = path.read_text()
        assert not any(root in text for root in ('"/home/', '"/root/', '"/work/', '"/tmp/', str(ROOT))), path
        for plot in json.loads(text).get("plots") or []:
            assert (ROOT / plot).is_file(), f"{path.name} names {plot}, which does not exist"


def docs_pages() -> list:
    return [ROOT / "README.md", ROOT / "docs" / "README.md", *sorted((ROOT / "docs").glob("*/README.md"))]


def named_docs_files(page) -> set:
    """The docs files a page names: repository paths (docs/...) and links relative to the page."""
    text = page.read_text()
    named = {ROOT / p for p in re.findall(r"docs/[\w./-]+\.(?:json|png|md)", text)}
    named |= {(page.parent / p).resolve() for p in re.findall(r"\]\(([\w./-]+\.(?:json|png|md))\)", text)}
    return named


def test_docs_is_an_index_of_experiments_whose_pages_name_every_file():
    """docs/: one folder per experiment, its page naming its JSON and the figures it shows; every
    committed file is named by a page, and every file a page names exists."""
    named = set()
    for page in docs_pages():
        files = named_docs_files(page)
        missing = sorted(str(f.relative_to(ROOT)) for f in files if not f.is_file())
        assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
        named |= files
        if page.parent.parent == ROOT / "docs":
            assert len(page.read_text().splitlines()) <= 150, f"{page.relative_to(ROOT)} is longer than a page"
    committed = {p.resolve() for p in (ROOT / "docs").rglob("*") if p.is_file() and p.name != "README.md"}
    unnamed = sorted(str(p.relative_to(ROOT)) for p in committed - named)
    assert not unnamed, f"docs files no page names: {unnamed}"
    index = (ROOT / "docs" / "README.md").read_text()
    for folder in (p for p in (ROOT / "docs").iterdir() if p.is_dir()):
        assert f"({folder.name}/README.md)" in index, f"docs/README.md does not list {folder.name}"


def test_the_commands_experiment_divides_by_plain_decoding_prompt_by_prompt(monkeypatch, tmp_path):
    """experiments/commands.py: each row's ratio is to the plain row of its temperature on the same
    prompt, a T = 0 row counts the prompts on which it printed plain decoding's tokens, and the
    tables render from the results file alone."""
    import commands as CM
    old, new = "drafts/smollm2-135m-eagle3-vat", "drafts/smollm2-135m-eagle3-gsm8k"
    rows = CM.rows(old, new)
    assert rows[:2] == [(CM.PLAIN[0], 0), (CM.PLAIN[1], 1)]
    speeds = {0: [50.0, 40.0], 1: [60.0, 30.0]}

    def fake_run(command, prompt, seed, max_new_tokens):  # plain at its temperature's speed; drafts 1.5x
        t = dict(rows)[command]
        i = 0 if prompt == "first" else 1
        plain = command == CM.PLAIN[t]
        tokens = [1, 2, 3] if t == 0 and (plain or i == 0) else [seed, 9]
        return {"tokens": tokens, "tokens_per_s": speeds[t][i] * (1 if plain else 1.5), "tau": 1.0 if plain else 2.0,
                "new_tokens": len(tokens), "drafted_tokens": 0}
    monkeypatch.setattr(CM, "run_once", fake_run)
    monkeypatch.setattr(CM, "load_prompts", lambda *a: [("writing", "first"), ("math", "second")])
    out = tmp_path / "commands.json"
    CM.main(["--old", old, "--new", new, "--out", str(out)])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary[CM.PLAIN[1]]["median_ratio"] == 1.0
    assert summary["decode.py --verifier overshoot"]["ratios"] == [1.5, 1.5]
    assert summary[f"decode.py --draft {new}"]["exact_prompts"] == 1  # the second prompt's tokens differ
    table = CM.render(result)
    assert "| writing | 2.00 / 2.00 |" in table and "| 1.50x / 1.50x |" in table
