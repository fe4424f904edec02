"""layouts.py: one weight layout per machine and model, chosen on probes, kept whole and quiet."""
import json
import shutil

import pytest
import torch

import layouts as LY
import linear_forms as LF
import weights as WT
from files import ROOT
from tokenizer import load_tokenizer


@pytest.fixture
def six_layers(tmp_path):
    """A tiny checkpoint with more layers than a probe holds, and a tokenizer."""
    from conftest import write_tiny_checkpoint
    path = tmp_path / "tiny6"
    write_tiny_checkpoint(path, "llama3", layers=6, vocab=49152)  # (the tokenizer copied beside it is SmolLM2's)
    shutil.copy(WT.resolve_model(WT.DEFAULT_TARGET) / "tokenizer.json", path)
    return path


def fake_timing(monkeypatch, ms_per_layer: dict, timed: list):
    """step_seconds that says a forward costs (layers + 1) * ms_per_layer[(layout, block)] (or
    [layout]) and notes what it timed."""
    def step_seconds(target, block, seconds=0.3, cold=False, context=64):
        timed.append((target.layout, block, len(target.layers)))
        per = ms_per_layer.get((target.layout, block), ms_per_layer.get(target.layout, 5.0))
        return (len(target.layers) + 1) * per * block ** 0.5 / 1e3
    monkeypatch.setattr(LY, "step_seconds", step_seconds)


def counting_builds(monkeypatch) -> list:
    """The n_layer of every model load_model builds from here on."""
    built, real = [], LY.load_model

    def load_model(path, dtype, device, n_layer=None):
        model = real(path, dtype, device, n_layer)
        built.append(model.args.n_layer)
        return model
    monkeypatch.setattr(LY, "load_model", load_model)
    return built


def test_auto_chooses_one_layout_on_probes_and_keeps_it(six_layers, tmp_path, monkeypatch, capsys):
    """--dtype auto: each candidate is timed on a probe of PROBE_LAYERS layers (never a copy of the
    whole model), the one-token step decides, one model is built in the chosen layout, and the
    decision (with its block table) is kept in a cache folder made when missing and read back."""
    cache = tmp_path / "not-yet" / "layouts.json"
    monkeypatch.setattr(LY, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    timed, built = [], counting_builds(monkeypatch)
    # float32 has the fastest one-token step; float32-packed the cheapest blocks: one-token steps decide
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0, ("float32-packed", 8): 0.1}, timed)
    target, _ = LY.load_target(str(six_layers), "cpu", "auto", 64)
    assert target.layout == "float32" and target.choice["layout"] == "float32"
    candidates = LY.layout_candidates(six_layers)
    # a probe per candidate, the chosen one's again for its block table, then the one model that runs
    assert built == [LY.PROBE_LAYERS] * (len(candidates) + 1) + [6]
    assert {layout for layout, block, _ in timed if block == 1} == set(candidates)
    assert "int4" not in candidates  # its weights are not 4-bit at their source
    assert {n for _, _, n in timed} == {0, LY.PROBE_LAYERS}  # head alone, and head + probe layers
    entry = json.loads(cache.read_text()).popitem()[1]
    assert entry["layout"] == "float32" and set(entry["blocks_ms"]) == {str(b) for b in LY.BLOCKS}
    # estimated whole-model forward = head + n_layer * one layer
    assert entry["ms"]["float32"] == pytest.approx(7 * 1.0, rel=1e-3)
    timed.clear(), built.clear()
    assert LY.load_target(str(six_layers), "cpu", "auto", 64)[0].layout == "float32"
    assert not timed and built == [6]
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:  # another thread count: another decision
        LY.load_target(str(six_layers), "cpu", "auto", 64)
        assert timed
    finally:
        torch.set_num_threads(before)


def test_where_the_fastest_layout_drafts_inexactly_the_default_decodes_plainly(six_layers, tmp_path, monkeypatch,
                                                                                capsys):
    """Where the fastest layout's blocks do not give the bits of one-token steps here, greedy
    speculation in it would part from plain decoding: auto still runs it (every run of the model
    does), the choice says so, and decode.py's default then decodes plainly, saying why."""
    import decode
    monkeypatch.setattr(LY, "LAYOUT_CACHE", tmp_path / "layouts.json")
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    fake_timing(monkeypatch, {"bfloat16-packed": 0.5, "bfloat16": 1.0, "float32-packed": 2.0}, [])
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: target.layout != "bfloat16-packed")
    choice = LY.choose_layout(six_layers)
    if not LF.packable(torch.bfloat16):
        assert choice["layout"] == "float32-packed" and choice["inexact"] == []
        return
    assert choice["layout"] == "bfloat16-packed" and choice["inexact"] == ["bfloat16-packed"]
    capsys.readouterr()
    decode.main(["--target", str(six_layers), "--raw", "--prompt", "1 2 3 1 2 3", "--max-new-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    assert "drafting changes the output: decoding plainly" in err
    default = json.loads(out.strip().splitlines()[-1])
    assert default["draft"] is None and default["layout"] == "bfloat16-packed"
    decode.main(["--target", str(six_layers), "--raw", "--prompt", "1 2 3 1 2 3", "--max-new-tokens", "4", "--json",
                 "--verifier", "none"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == default["tokens"]


@pytest.mark.parametrize("damage", ["not json", "no ms", "a directory", "unwritable", "busy"])
def test_the_layout_cache_holds_only_whole_quiet_decisions(six_layers, tmp_path, monkeypatch, capsys, damage):
    """A damaged cache is measured again (named where it cannot be read or kept, and the run goes
    on); a decision timed beside a busy core is used but not kept."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(LY, "LAYOUT_CACHE", cache)
    quiet = [True]
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: quiet[0])
    timed = []
    fake_timing(monkeypatch, {"float32": 1.0}, timed)
    LY.choose_layout(six_layers)
    key, entry = json.loads(cache.read_text()).popitem()
    timed.clear()
    if damage == "not json":
        cache.write_text("{not json")
    elif damage == "no ms":
        cache.write_text(json.dumps({key: {k: v for k, v in entry.items() if k != "ms"}}))
    elif damage == "a directory":
        cache.unlink()
        cache.mkdir()
    elif damage == "unwritable":
        monkeypatch.setattr(LY, "write_atomically", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
        cache.unlink()
    else:
        cache.unlink()
        quiet[0] = False
    capsys.readouterr()
    assert LY.choose_layout(six_layers)["layout"] == "float32" and timed
    err = capsys.readouterr().err
    if damage in ("not json", "a directory"):
        assert "is unreadable" in err
    if damage in ("a directory", "unwritable"):
        assert "could not be kept" in err and "\n" not in err.strip().splitlines()[-1]
    if damage == "busy":
        assert not cache.exists() and "used for this run only" in err
    if damage == "no ms":
        assert "ms" in json.loads(cache.read_text())[key]


def test_the_probe_estimates_a_whole_forward(six_layers):
    """head + n_layer * one layer, from a probe, is near the whole model's own timing."""
    probe = LY.build_target(six_layers, "float32", "cpu", 128, n_layer=LY.PROBE_LAYERS)
    whole = LY.build_target(six_layers, "float32", "cpu", 128)
    assert len(probe.layers) == LY.PROBE_LAYERS and len(whole.layers) == 6
    estimate = LY.estimated_ms(probe, 6, 1)
    measured = 1e3 * LY.step_seconds(whole, 1, seconds=0.3, cold=True)  # (the probe is timed cold too)
    assert 0.6 < estimate / measured < 1.6


def test_block_costs_interpolate_and_never_fall():
    costs = LY.block_costs({"1": 10.0, "2": 13.0, "3": 12.0, "4": 16.0, "8": 24.0}, 10)
    assert costs[0] == 1.0 and costs[1] == 1.3 and costs[2] == 1.3  # (3's noise does not undercut 2)
    assert costs[5] == pytest.approx(2.0) and costs[7] == pytest.approx(2.4)
    assert costs[9] > costs[7] and all(b >= a for a, b in zip(costs, costs[1:]))


class SumsBlocksInAnotherOrder(torch.nn.Module):
    """A matmul whose rows depend on how many rows it is given, as oneDNN's bf16 kernels' can."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        y = self.linear(x)
        return y if x.shape[-2] == 1 else y + 1e-3 * y.abs().max()


def test_the_probe_sees_a_block_that_parts_from_one_token_steps(tiny_dir):
    target = LY.build_target(tiny_dir("llama3"), "bfloat16", "cpu", 128)
    assert LY.blocks_match_steps(target, 8)
    mlp = target.layers[1].mlp
    mlp.down_proj = SumsBlocksInAnotherOrder(mlp.down_proj)
    assert not LY.blocks_match_steps(target, 8)


def test_a_coarse_layout_asked_for_by_name_is_checked_before_drafting(tiny_dir, monkeypatch):
    """A bf16 layout asked for by name (auto's choice carries its probe's verdict) is checked on the
    run's block size; fp32's steps are trusted."""
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: False)
    assert not LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "bfloat16", "cpu", 64), 8)
    assert LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "float32", "cpu", 64), 8)
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: True)
    assert LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "bfloat16", "cpu", 64), 8)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_every_layout_auto_may_verify_in_speculates_exactly_on_the_default_target(threads):
    """Each layout --dtype auto may take for 8-token blocks at this thread count (every candidate
    but a coarse one the probe rejects) emits plain decoding's tokens under greedy prompt lookup, on
    the default target's real shapes (on one AMD EPYC, bf16-packed at one thread did not)."""
    from speculative import generate
    from draft import LookupDraft
    path = WT.resolve_model(WT.DEFAULT_TARGET)
    tok = load_tokenizer(path)
    prompts = [json.loads(line)["prompt"] for line in
               (ROOT / "data" / "arithmetic_test.jsonl").read_text().splitlines()[:3]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layout in LY.layout_candidates(path):
            target = LY.build_target(path, layout, "cpu", 512)
            if layout in LY.EXACT_LAYOUTS and not LY.blocks_match_steps(target, 8):
                continue  # timed, never chosen for verification
            for prompt in prompts:
                ids = tok.encode_chat([{"role": "user", "content": prompt}])
                plain = generate(target, ids, max_new_tokens=64)["tokens"]
                assert generate(target, ids, LookupDraft(), k=7, max_new_tokens=64)["tokens"] == plain, layout
    finally:
        torch.set_num_threads(before)


def test_layout_flags(tiny_dir):
    """--dtype as load_target takes it; int4 is a candidate where the weights are 4-bit at source."""
    assert LY.target_layout(None, "cpu", False) == "auto"
    assert LY.target_layout("auto", "cpu", True) == "auto"  # auto's layout, unpacked by compile_step
    assert LY.target_layout("float32", "cpu", False) == "float32-packed"
    assert LY.target_layout("float32", "cpu", True) == "float32"  # inductor packs its own
    assert LY.target_layout("float32", "cpu", False, pack=False) == "float32"
    assert LY.target_layout("int4", "cpu", False) == "int4"
    assert LY.target_layout("int4", "cpu", True) == "int4"
    with pytest.raises(ValueError, match="int8 runs uncompiled"):
        LY.target_layout("int8", "cpu", True)
    config = json.loads((tiny_dir("llama3") / "config.json").read_text())
    assert "source_quantization" not in config
    if LF.packable(torch.bfloat16):
        converted = WT.resolve_model(WT.DEFAULT_TARGET)
        assert "int4" in LY.layout_candidates(converted)
