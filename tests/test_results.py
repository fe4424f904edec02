"""results.py: results files are written whole, stamped, and survive a failing write."""
import json

import results


def test_results_survive_a_failing_write(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = tmp_path / "removed-meanwhile" / "results.json"  # its folder vanished during the run
    where = results.write_results(gone, {"speed": {"x": 1}})
    assert where.parent == tmp_path and json.loads(where.read_text()) == {"speed": {"x": 1}}
    assert str(where) in capsys.readouterr().err
    ok = tmp_path / "ok.json"
    assert results.write_results(ok, {"a": 2}) == ok and json.loads(ok.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
