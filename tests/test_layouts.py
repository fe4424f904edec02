"""layouts.py: one weight layout per machine and model, chosen on probes, kept whole and quiet."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import layouts as LY
from engine import timing_cache as TC
from engine import linear_forms as LF
from engine import weights as WT
from engine.files import ROOT
from engine.rows_apart import ROWS_APART_MAX
from engine.timing_cache import BLOCKS
import model as M
from tokenizer import load_tokenizer


@pytest.fixture(autouse=True)
def a_new_process(monkeypatch):
    """Each test starts as a new process does: no decision of this process's, nothing set aside."""
    monkeypatch.setattr(LY, "CHOSEN", {})
    monkeypatch.setattr(TC, "FORGOTTEN", set())
    monkeypatch.setattr(TC, "NOTED", set())


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
    [layout]) and notes what it timed. (A probe's layout is remembered as it is built, by its head:
    the head-alone probe shares it, and has no layers to read the layout off.)"""
    layout_of, real_build = {}, LY.build_target

    def build_target(path, layout, *args, **kwargs):
        model = real_build(path, layout, *args, **kwargs)
        layout_of[id(model.lm_head)] = layout
        return model

    def step_seconds(target, block, seconds=0.3, cold=False, context=64):
        layout = layout_of[id(target.lm_head)]
        timed.append((layout, block, len(target.layers)))
        per = ms_per_layer.get((layout, block), ms_per_layer.get(layout, 5.0))
        return (len(target.layers) + 1) * per * block ** 0.5 / 1e3
    monkeypatch.setattr(LY, "build_target", build_target)
    monkeypatch.setattr(LY, "step_seconds", step_seconds)


def counting_builds(monkeypatch) -> list:
    """The n_layer of every model load_model builds from here on."""
    built, real = [], LY.load_model

    def load_model(path, dtype, device, n_layer=None, vocab=None):
        model = real(path, dtype, device, n_layer, vocab)
        built.append(model.args.n_layer)
        return model
    monkeypatch.setattr(LY, "load_model", load_model)
    return built


def test_auto_chooses_one_layout_on_probes_and_keeps_it(six_layers, tmp_path, monkeypatch, capsys):
    """--dtype auto: each candidate is timed on a probe of PROBE_LAYERS layers (never a copy of the
    whole model), the one-token step decides, one model is built in the chosen layout, and the
    decision and its block table are kept in a cache folder made when missing and read back. The
    choice stands for the model on this machine at any thread count; block costs are per count."""
    cache = tmp_path / "not-yet" / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    timed, built = [], counting_builds(monkeypatch)
    # float32 has the fastest one-token step; float32-packed the cheapest blocks: one-token steps decide
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0, ("float32-packed", 8): 0.1}, timed)
    target, _, choice = LY.load_target(str(six_layers), "cpu", "auto", 64)
    assert LY.layout_of(target) == "float32" and choice["layout"] == "float32"
    candidates = LY.layout_candidates(six_layers)
    # a probe per candidate, the chosen one's again (its repeat) and for its block table, then the model
    assert built == [0, LY.PROBE_LAYERS] * (len(candidates) + 2) + [6]  # (the head alone, then the layers)
    assert {layout for layout, block, _ in timed if block == 1} == set(candidates)
    assert "int4" not in candidates  # its weights are not 4-bit at their source
    assert {n for _, _, n in timed} == {0, LY.PROBE_LAYERS}  # head alone, and head + probe layers
    kept = json.loads(cache.read_text())
    entry = kept[TC.cache_key(six_layers, "layout", threads=False)]
    blocks = kept[TC.cache_key(six_layers, "blocks float32")]
    assert entry["layout"] == "float32" and set(blocks["blocks_ms"]) == {str(b) for b in TC.BLOCKS}
    # estimated whole-model forward = head + n_layer * one layer
    assert entry["ms"]["float32"] == pytest.approx(7 * 1.0, rel=1e-3)
    LY.CHOSEN.clear()  # (a new process)
    timed.clear(), built.clear()
    assert LY.layout_of(LY.load_target(str(six_layers), "cpu", "auto", 64)[0]) == "float32"
    assert not timed and built == [6]
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:  # another thread count: the same layout, its block costs timed at this count
        LY.CHOSEN.clear()
        assert LY.choose_layout(six_layers)["layout"] == "float32"
        assert timed and {layout for layout, _, _ in timed} == {"float32"}
    finally:
        torch.set_num_threads(before)


def test_where_the_fastest_layout_drafts_inexactly_the_default_decodes_plainly(six_layers, tmp_path, monkeypatch,
                                                                                capsys):
    """Where the fastest layout's blocks do not give the bits of one-token steps here, greedy
    speculation in it would part from plain decoding: auto still runs it (every run of the model
    does), the choice says so, and decode.py's default then decodes plainly, saying why."""
    import decode
    monkeypatch.setattr(TC, "LAYOUT_CACHE", tmp_path / "layouts.json")
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    fake_timing(monkeypatch, {"bfloat16-packed": 0.5, "bfloat16": 1.0, "float32-packed": 2.0}, [])
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: LY.layout_of(target) != "bfloat16-packed")
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


SLOW = pytest.mark.slow  # the same code path as a default-suite case; --runslow adds it


@pytest.mark.parametrize("damage", ["not json", pytest.param("no ms", marks=SLOW), "layout not timed",
                                    pytest.param("block 1.5", marks=SLOW), pytest.param("a directory", marks=SLOW),
                                    "unwritable"])
def test_the_layout_cache_holds_only_whole_quiet_decisions(six_layers, tmp_path, monkeypatch, capsys, damage):
    """A damaged cache is measured again (named where it cannot be read or kept, and the run goes
    on)."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    quiet = [True]
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: quiet[0])
    timed = []
    fake_timing(monkeypatch, {"float32": 1.0}, timed)
    LY.choose_layout(six_layers)
    key = TC.cache_key(six_layers, "layout", threads=False)
    entry = json.loads(cache.read_text())[key]
    timed.clear(), LY.CHOSEN.clear()
    if damage == "not json":
        cache.write_text("{not json")
    elif damage == "no ms":
        cache.write_text(json.dumps({key: {k: v for k, v in entry.items() if k != "ms"}}))
    elif damage == "layout not timed":  # its chosen layout absent from its own timings
        cache.write_text(json.dumps({key: {**entry, "ms": {"bfloat16": 1.0}}}))
    elif damage == "block 1.5":
        blocks_key = TC.cache_key(six_layers, "blocks float32")
        blocks = json.loads(cache.read_text())[blocks_key]
        cache.write_text(json.dumps({blocks_key: {**blocks, "blocks_ms": {**blocks["blocks_ms"], "1.5": 1.0}}}))
    elif damage == "a directory":
        cache.unlink()
        cache.mkdir()
    elif damage == "unwritable":
        monkeypatch.setattr(TC, "write_atomically", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
        cache.unlink()
    capsys.readouterr()
    assert LY.choose_layout(six_layers)["layout"] == "float32" and timed
    err = capsys.readouterr().err
    if damage in ("not json", "a directory"):
        assert "is unreadable" in err
    if damage in ("a directory", "unwritable"):
        assert "could not be written" in err and "used for this run only" in err
    if damage in ("no ms", "layout not timed"):  # measured again, kept whole
        assert TC.impossible_choice(json.loads(cache.read_text())[key], LY.layout_candidates(six_layers)) is None
    if damage == "block 1.5":
        assert TC.impossible_blocks(json.loads(cache.read_text())[TC.cache_key(six_layers, "blocks float32")]) is None


def test_timings_that_disagree_between_repeats_are_not_kept(six_layers, tmp_path, monkeypatch, capsys):
    """The fastest layout's one-token step is timed again after the others: where the repeats part,
    the machine was disturbed between them, and the timing is neither kept nor used: the fixed
    order decides, as it does for every run that has no trusted timing."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)  # (bursts between the quiet checks)
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: True)
    timed = []
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0}, timed)
    real = LY.step_seconds

    def disturbed(target, block, *args, **kwargs):  # the later one-token timings of float32 run 3x slower
        slow = block == 1 and sum(1 for layout, b, _ in timed if b == 1 and layout == "float32") > 3
        return real(target, block, *args, **kwargs) * (3.0 if slow else 1.0)
    monkeypatch.setattr(LY, "step_seconds", disturbed)
    capsys.readouterr()
    choice = LY.choose_layout(six_layers)
    assert choice["layout"] == [x for x in LY.FIXED_ORDER if x in LY.layout_candidates(six_layers)][0]
    assert choice["ms"] == {} and "timed twice disagreed" in choice["fixed"]
    assert TC.cache_key(six_layers, "layout", threads=False) not in TC.read_cache()
    assert "fixed order" in capsys.readouterr().err


def test_a_kept_timing_that_a_run_outpaces_is_timed_again(six_layers, tmp_path, monkeypatch):
    """A kept decision timed on a busy machine makes every later run weigh blocks wrongly: a run
    whose forwards are much faster than the kept step (RUN_MARGIN) marks it stale, and the next
    quiet start times the layouts again; --retime (forget_timings) drops them on demand. A run
    about as fast as the kept timing leaves it alone."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    timed = []
    fake_timing(monkeypatch, {"float32": 20.0, "float32-packed": 40.0, "bfloat16-packed": 40.0, "bfloat16": 40.0},
                timed)
    kept = LY.choose_layout(six_layers)
    step = kept["blocks_ms"]["1"]
    keys = TC.cache_key(six_layers, "layout", threads=False), TC.cache_key(six_layers, "blocks float32")
    assert not TC.recheck_kept_timing(six_layers, "float32", True, step / 1.2, 64)  # within the margin
    assert not any("stale" in json.loads(cache.read_text())[key] for key in keys)
    assert TC.recheck_kept_timing(six_layers, "float32", True, step / 3, 64)
    assert all("stale" in json.loads(cache.read_text())[key] for key in keys)
    timed.clear(), LY.CHOSEN.clear()
    LY.choose_layout(six_layers)
    assert timed and not any("stale" in json.loads(cache.read_text())[key] for key in keys)  # timed again, kept
    timed.clear(), LY.CHOSEN.clear()
    LY.choose_layout(six_layers)
    assert not timed
    assert LY.forget_timings(six_layers) == 2 and LY.forget_timings(six_layers) == 0
    assert json.loads(cache.read_text()) == {}  # (so the next start times again)


def test_a_cache_that_is_a_link_is_written_through_it(six_layers, tmp_path, monkeypatch):
    """A layouts cache linked to a shared file stays a link; the shared file takes the decision."""
    shared = tmp_path / "elsewhere" / "layouts.json"
    shared.parent.mkdir()
    shared.write_text("{}")
    link = tmp_path / "layouts.json"
    link.symlink_to(shared)
    monkeypatch.setattr(TC, "LAYOUT_CACHE", link)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    fake_timing(monkeypatch, {"float32": 1.0}, [])
    LY.choose_layout(six_layers)
    assert link.is_symlink() and json.loads(shared.read_text())[TC.cache_key(six_layers, "layout", threads=False)]


def test_the_probe_estimates_a_whole_forward(six_layers, monkeypatch):
    """A whole forward is estimated as the head alone + n_layer * what one probe layer adds: the
    head is timed on a model of just the embedding, norm and head; a layer on the first
    PROBE_LAYERS layers with a cut vocabulary, its tiny head timed apart and taken off. (What the
    estimate is worth against a real forward is a measurement: bench.py's, not a test's.)"""
    timed = []

    def step_seconds(target, block, seconds=0.3, cold=False, context=64):
        timed.append((len(target.layers), target.args.vocab_size, block, cold))
        head = 2.0 if target.args.vocab_size > LY.PROBE_VOCAB else 0.1  # ms: the vocabulary's share
        return (head + 3.0 * len(target.layers)) * block / 1e3  # and 3 ms a layer, per token
    monkeypatch.setattr(LY, "step_seconds", step_seconds)
    ms, probe, probe_ms = LY.estimated_ms(six_layers, "float32", 128, 30, (1, 2))
    assert ms == {1: pytest.approx(2.0 + 30 * 3.0), 2: pytest.approx(2 * (2.0 + 30 * 3.0))}
    assert len(probe.layers) == LY.PROBE_LAYERS and probe.args.vocab_size == LY.PROBE_VOCAB
    assert LY.layout_of(probe) == "float32" and probe_ms[1] == pytest.approx(0.1 + 3.0 * LY.PROBE_LAYERS)
    assert [t[:2] for t in timed] == [(0, 49152)] * 2 + [(LY.PROBE_LAYERS, LY.PROBE_VOCAB), (0, LY.PROBE_VOCAB)] * 2
    assert all(cold for *_, cold in timed)


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
    assert not LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "bfloat16", "cpu", 64), {}, 8)
    assert LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "float32", "cpu", 64), {}, 8)
    monkeypatch.setattr(LY, "blocks_match_steps", lambda target, block, trials=3, step=None: True)
    assert LY.drafting_is_exact(LY.build_target(tiny_dir("llama3"), "bfloat16", "cpu", 64), {}, 8)


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


def test_kept_decisions_key_on_the_step_code_not_its_text(tmp_path, monkeypatch):
    """A forker's comment or docstring edit to model.py keeps the timed decisions; a change to
    what the step computes times them again."""
    source = Path(M.__file__).read_text()
    copy = tmp_path / "model.py"
    monkeypatch.setattr(M, "__file__", str(copy))
    copy.write_text(source)
    before = TC.step_code_digest()
    copy.write_text(source.replace('"""\nThe target model', '"""\nA forker\'s note.\nThe target model', 1)
                    .replace("import math\n", "import math  # a new comment\n", 1))
    assert copy.read_text() != source and TC.step_code_digest() == before
    copy.write_text(source.replace("return self.norm(x), [hidden[i] for i in hidden_layers]",
                                   "return self.norm(x * 1), [hidden[i] for i in hidden_layers]", 1))
    assert copy.read_text() != source and TC.step_code_digest() != before


def test_a_layouts_blocks_are_timed_once_whoever_asks_first(six_layers, tmp_path, monkeypatch):
    """A layout's block table is kept once: auto's choice of it and a run that names it read the
    same entry, whichever timed it first."""
    monkeypatch.setattr(TC, "LAYOUT_CACHE", tmp_path / "layouts.json")
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    timed = []
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0}, timed)
    choice = LY.choose_layout(six_layers)
    timed.clear()
    assert LY.block_table(six_layers, "float32")["blocks_ms"] == choice["blocks_ms"] and not timed
    LY.forget_timings(six_layers)
    table = LY.block_table(six_layers, "float32")
    timed.clear()
    TC.FORGOTTEN.clear()  # (a new process)
    assert LY.choose_layout(six_layers)["blocks_ms"] == table["blocks_ms"]
    assert {block for _, block, _ in timed} == {1}  # the candidates' one-token steps only


def first_exact_of_the_fixed_order(path) -> str:
    """The layout FIXED_ORDER gives the model at `path` here: its probe's verdicts are bits, not times."""
    for layout in [x for x in LY.FIXED_ORDER if x in LY.layout_candidates(path)]:
        probe = LY.build_target(path, layout, "cpu", 80, n_layer=LY.PROBE_LAYERS, vocab=LY.PROBE_VOCAB)
        if not LY.inexact_blocks(probe, layout):
            return layout


def test_a_busy_machine_runs_the_kept_choice_or_the_fixed_order(six_layers, tmp_path, monkeypatch, capsys):
    """A run's layout does not depend on how busy the machine was when it started: with nothing
    trusted kept, every busy run takes the fixed order's layout whatever its timings say (here they
    are random); once a quiet run kept a choice, busy runs take it, stale or not; block costs timed
    on a busy machine steer that run only."""
    import random
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    quiet = [False]
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: quiet[0])
    timed = []
    fake_timing(monkeypatch, {}, timed)
    real = LY.step_seconds
    monkeypatch.setattr(LY, "step_seconds", lambda *a, **k: real(*a, **k) * random.uniform(0.2, 5))
    fixed = first_exact_of_the_fixed_order(six_layers)
    for _ in range(3):
        LY.CHOSEN.clear()
        choice = LY.choose_layout(six_layers)
        assert choice["layout"] == fixed and choice["ms"] == {} and "busy" in choice["fixed"]
        assert {block for _, block, _ in timed} == set(TC.BLOCKS)  # (its block costs only, for this run)
        assert not cache.exists()
        timed.clear()
    assert "fixed order" in capsys.readouterr().err
    quiet[0] = True
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0}, timed)
    LY.CHOSEN.clear()
    assert LY.choose_layout(six_layers)["layout"] == "float32"
    quiet[0] = False
    fake_timing(monkeypatch, {"float32": 9.0, "float32-packed": 1.0}, timed)  # (a quiet run would now say packed)
    TC.recheck_kept_timing(six_layers, "float32", True, 0.01, 64)  # stale
    timed.clear(), LY.CHOSEN.clear()
    assert LY.choose_layout(six_layers)["layout"] == "float32" and not timed
    assert "the kept choice (float32) stands" in capsys.readouterr().err


def kept_float32_choice(six_layers, tmp_path, monkeypatch) -> tuple:
    """A quiet machine's kept choice of float32 (the fastest of the fake timings) in a fresh cache:
    (the cache, the list of what is timed from here on)."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    timed = []
    fake_timing(monkeypatch, {"float32": 1.0, "float32-packed": 2.0}, timed)
    LY.choose_layout(six_layers)
    return cache, timed


CANDIDATES = ["float32-packed", "float32", "bfloat16-packed", "bfloat16"]
POSSIBLE_CHOICE = {"layout": "float32", "ms": {"float32": 7.0, "float32-packed": 14.0, "bfloat16-packed": 9.0,
                                              "bfloat16": 8.0}, "inexact": [], "threads": 2}
POSSIBLE_BLOCKS = {"blocks_ms": {str(b): 7.0 * b ** 0.5 for b in TC.BLOCKS}, "attention_ms_per_key": 0.004}
ONE = POSSIBLE_BLOCKS["blocks_ms"]["1"]
IMPOSSIBLE = {  # rule broken: (which entry, the change)
    "a block of 2 dearer than one of 3": ("blocks", {"blocks_ms": {**POSSIBLE_BLOCKS["blocks_ms"], "2": 2.05 * ONE,
                                                                  "3": 1.27 * ONE}}),
    "a block cheaper than a one-token step": ("blocks", {"blocks_ms": {**POSSIBLE_BLOCKS["blocks_ms"], "2": ONE / 2}}),
    "a block dearer than its steps": ("blocks", {"blocks_ms": {**POSSIBLE_BLOCKS["blocks_ms"], "16": 40 * ONE}}),
    "a step of 1e30 ms": ("blocks", {"blocks_ms": {b: 1e30 for b in POSSIBLE_BLOCKS["blocks_ms"]}}),
    "a step of 1e-6 ms": ("blocks", {"blocks_ms": {b: 1e-6 for b in POSSIBLE_BLOCKS["blocks_ms"]}}),
    "attention of 1e9 ms a key": ("blocks", {"attention_ms_per_key": 1e9}),
    "float16, never a CPU candidate": ("choice", {"layout": "float16", "ms": {**POSSIBLE_CHOICE["ms"], "float16": 0.5}}),
    "a layout slower than one it beat": ("choice", {"ms": {**POSSIBLE_CHOICE["ms"], "float32": 99.0}}),
    "a step of 1e-6 ms among the layouts": ("choice", {"ms": {**POSSIBLE_CHOICE["ms"], "float32-packed": 1e-6}})}


@pytest.mark.parametrize("rule", list(IMPOSSIBLE))
def test_costs_no_forward_could_give_are_named(rule):
    """Costs must be possible: a block of n+1 no cheaper than a block of n, none cheaper than a
    one-token step nor dearer than a step a token, a finite bounded attention cost, a layout this
    CPU times and the fastest of those it was timed against."""
    assert TC.impossible_blocks(POSSIBLE_BLOCKS) is None
    assert TC.impossible_choice(POSSIBLE_CHOICE, CANDIDATES) is None
    which, change = IMPOSSIBLE[rule]
    if which == "blocks":
        assert TC.impossible_blocks({**POSSIBLE_BLOCKS, **change})
    else:
        assert TC.impossible_choice({**POSSIBLE_CHOICE, **change}, CANDIDATES)


@pytest.mark.parametrize("rule", ["a block of 2 dearer than one of 3", "float16, never a CPU candidate"])
def test_a_kept_timing_that_cannot_be_true_is_timed_again(six_layers, tmp_path, monkeypatch, capsys, rule):
    """A kept entry that breaks a rule (one of each kind here; every rule above) is timed again and
    never used as it is."""
    cache, timed = kept_float32_choice(six_layers, tmp_path, monkeypatch)
    kept = json.loads(cache.read_text())
    keys = {"choice": TC.cache_key(six_layers, "layout", threads=False),
            "blocks": TC.cache_key(six_layers, "blocks float32")}
    blocks = kept[keys["blocks"]]
    which, change = IMPOSSIBLE[rule]
    kept[keys[which]] = {**kept[keys[which]], **change}
    cache.write_text(json.dumps(kept))
    timed.clear(), LY.CHOSEN.clear()
    capsys.readouterr()
    again = LY.choose_layout(six_layers)
    assert timed and "cannot be a timing" in capsys.readouterr().err
    assert again["layout"] == "float32" and again["blocks_ms"] == blocks["blocks_ms"]  # (the fake timing's table)
    kept = json.loads(cache.read_text())
    assert TC.impossible_choice(kept[keys["choice"]], LY.layout_candidates(six_layers)) is None
    assert TC.impossible_blocks(kept[keys["blocks"]]) is None


def test_block_costs_stay_possible_whatever_a_busy_timing_said():
    """A table timed on a busy machine steers one run: its costs are made possible (a step a token
    at most, a longer block never cheaper)."""
    costs = LY.block_costs({"1": 10.0, "2": 30.0, "3": 12.0, "4": 200.0, "8": 24.0}, 8)
    assert costs[1] == 2.0 and costs[2] == 2.0 and costs[3] == 4.0  # (a block of 4: 20 steps' timing)
    assert all(1.0 <= c <= n + 1 for n, c in enumerate(costs)) and costs == sorted(costs)


def test_retime_with_a_cache_it_cannot_write_still_times_again(six_layers, tmp_path, monkeypatch, capsys):
    """decode.py --retime drops the model's kept timings; where the cache cannot be rewritten the
    run says so and still does not use them."""
    cache, timed = kept_float32_choice(six_layers, tmp_path, monkeypatch)
    monkeypatch.setattr(TC, "write_atomically", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    capsys.readouterr()
    assert LY.forget_timings(six_layers) == 2
    assert "could not be written" in capsys.readouterr().err
    timed.clear()
    LY.choose_layout(six_layers)
    assert {layout for layout, block, _ in timed if block == 1} == set(LY.layout_candidates(six_layers))


def test_layouts_chosen_beside_busy_processes_are_the_same_every_run(six_layers, tmp_path, monkeypatch):
    """The real thing: with every core kept busy by other processes, runs that each choose the
    layout anew (nothing kept) choose the fixed order's, and greedy speculation in it prints plain
    decoding's tokens. (Block costs, which steer speed only, are timed once here to save time.)"""
    import contextlib
    import io
    import os
    import subprocess
    import sys
    import decode
    monkeypatch.setattr(TC, "LAYOUT_CACHE", tmp_path / "layouts.json")
    real = LY.step_seconds  # (real timings, short: here their values only steer the block lengths)
    monkeypatch.setattr(LY, "step_seconds", lambda target, block, seconds=0.3, **k: real(target, block, 0.0, **k))

    def choose_anew():  # as a new process would, but for the block costs
        for memo in [memo for memo in LY.CHOSEN if " | layout | " in memo[1]]:
            del LY.CHOSEN[memo]
    argv = ["--target", str(six_layers), "--raw", "--prompt", "1 2 3 1 2 3 1 2", "--max-new-tokens", "12", "--json"]
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        runs = []
        for extra in (["--verifier", "none"], []):
            choose_anew()
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                decode.main(argv + extra)
            runs.append(json.loads(out.getvalue().strip().splitlines()[-1]))
    finally:
        for p in spin:
            p.kill()
    assert [r["layout"] for r in runs] == [first_exact_of_the_fixed_order(six_layers)] * len(runs)
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[1]["draft"] == "lookup"


def test_a_fresh_timing_that_cannot_be_true_is_measured_once_more(six_layers, tmp_path, monkeypatch, capsys):
    """A quiet machine's passing disturbance can still give a table no forward could (a block of 1
    dearer than one of 3): it is measured again at once, and kept only once it is possible."""
    monkeypatch.setattr(TC, "LAYOUT_CACHE", tmp_path / "layouts.json")
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    good = {"blocks_ms": {str(b): 10.0 + b for b in TC.BLOCKS}, "attention_ms_per_key": 0.001}
    bad = {"blocks_ms": {**good["blocks_ms"], "1": 27.7, "3": 18.6}, "attention_ms_per_key": 0.001}
    tables = [bad, good]
    monkeypatch.setattr(LY, "measure_blocks", lambda *a: (tables.pop(0), True))
    assert LY.block_table(six_layers, "float32")["blocks_ms"] == good["blocks_ms"] and not tables
    assert TC.impossible_blocks(TC.read_cache()[TC.cache_key(six_layers, "blocks float32")]) is None
    LY.CHOSEN.clear()
    tables += [bad, bad]  # never possible: used for this run, clamped, and not kept
    monkeypatch.setattr(TC, "LAYOUT_CACHE", tmp_path / "other.json")
    assert LY.block_table(six_layers, "float32")["blocks_ms"] == bad["blocks_ms"] and not tables
    assert "not possible" in capsys.readouterr().err and not (tmp_path / "other.json").exists()


def test_notes_on_a_cut_or_unwritable_cache_are_said_once_and_say_what_happened(six_layers, tmp_path, monkeypatch,
                                                                                capsys):
    """A cut layouts.json is named once however often the run reads it; a stale mark that cannot be
    written says so, not that a choice was made for this run only."""
    cache = tmp_path / "layouts.json"
    monkeypatch.setattr(TC, "LAYOUT_CACHE", cache)
    monkeypatch.setattr(LY, "machine_is_quiet", lambda: True)
    fake_timing(monkeypatch, {"float32": 20.0, "float32-packed": 40.0, "bfloat16-packed": 40.0, "bfloat16": 40.0}, [])
    LY.choose_layout(six_layers)
    whole = cache.read_text()
    cache.write_text(whole[:len(whole) // 2])
    capsys.readouterr()
    LY.CHOSEN.clear()
    LY.choose_layout(six_layers)
    assert capsys.readouterr().err.count("is unreadable") == 1
    monkeypatch.setattr(TC, "write_atomically", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    assert TC.recheck_kept_timing(six_layers, "float32", True, 0.01, 64)
    err = capsys.readouterr().err
    assert "could not be marked to be timed again" in err and "for this run only" not in err


def test_a_block_longer_than_the_probe_checked_is_checked_on_the_run(default_int4):
    """auto's probe vouches for blocks of up to max(BLOCKS) tokens; a longer one (here past
    ROWS_APART_MAX, whose rows attend together and part from one-token steps) is checked on the run's
    target, not taken on the probe's word: -k 40 would otherwise draft with inexact blocks."""
    target, _ = default_int4
    choice = {"layout": "int4", "inexact": [], "threads": torch.get_num_threads()}
    assert LY.drafting_is_exact(target, choice, max(BLOCKS))
    assert not LY.drafting_is_exact(target, choice, ROWS_APART_MAX + 1)
