"""results.py: results files are written whole, stamped, and survive a failing write."""
import json

from harness import results


def test_results_survive_a_failing_write(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = tmp_path / "removed-meanwhile" / "results.json"  # its folder vanished during the run
    where = results.write_results(gone, {"speed": {"x": 1}})
    assert where.parent == tmp_path and json.loads(where.read_text()) == {"speed": {"x": 1}}
    assert str(where) in capsys.readouterr().err
    ok = tmp_path / "ok.json"
    assert results.write_results(ok, {"a": 2}) == ok and json.loads(ok.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_results_files_round_to_significant_digits_and_keep_lists_on_a_line(tmp_path):
    """Five significant digits (a timing's noise is larger), lists of scalars on one line, strings
    untouched, and the file reads back as the rounded values."""
    result = {"seconds": 4.187141260000317, "tiny": 2.1059086241274547e-06, "count": 7, "nan": float("nan"),
              "tokens": [2068, 803, 216], "texts": ["two  spaces", "a]b"], "nested": {"curve": [1.234567, None]}}
    out = results.write_results(tmp_path / "r.json", result)
    text = out.read_text()
    assert '"tokens": [2068,803,216]' in text and '"nested": {"curve": [1.2346,null]}' in text
    back = json.loads(text)
    assert back["seconds"] == 4.1871 and back["tiny"] == 2.1059e-06 and back["count"] == 7
    assert back["texts"] == ["two  spaces", "a]b"] and back["nan"] != back["nan"]
    assert results.rounded({"a": [0.123456789, (1.0000049,)]}) == {"a": [0.12346, [1.0]]}
