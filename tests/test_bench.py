"""bench.py: the quick run is internally consistent; the decode table and paired ratios are right."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
from harness import speed
from harness import step_table
from harness import stats
from harness import peers
import model as M
from engine.files import ROOT
from engine.timing_cache import CPU_FEATURES



def test_quick_run_is_consistent(tmp_path):
    out = tmp_path / "quick.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--quick", "--drafts", "lookup", "--dtype", "float32",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    headline = json.loads(r.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert headline["results"] == str(out)
    summaries, runs = result["speed"], speed.records_from_file(result["runs"])
    columns = result["runs"]["lookup greedy T=0"]  # as the file keeps it: a column per field
    # at T=0 lossless keeps what greedy keeps, so it is left out when greedy runs
    assert set(summaries) == {"baseline T=0", "lookup greedy T=0", "baseline T=1", "lookup lossless T=1"}
    for name, s in summaries.items():
        rs = runs[name]
        assert len(rs) == 2  # one writing and one translation prompt
        close = dict(rel=3e-4)  # (a results file keeps five significant digits)
        assert s["tau"] == pytest.approx(sum(r["new_tokens"] for r in rs) / sum(r["target_forwards"] for r in rs), **close)
        base = runs[f"baseline T={s['temperature']:g}"]
        ratios = [r["wall_tokens_per_s"] / b["wall_tokens_per_s"] for r, b in zip(rs, base)]
        assert s["speedup_median"] == pytest.approx(statistics.median(ratios), **close)
        assert s["speedup_median_per_category"] == pytest.approx(  # one prompt per category here
            {r["category"]: ratio for r, ratio in zip(rs, ratios)}, **close)
        for r in rs:  # the speedup counts the prompt's prefill, as a peer's generate does; the decode rate does not
            assert r["wall_tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"], **close)
            assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / (r["seconds"] - r["prefill_seconds"]),
                                                      rel=1e-3)
        # the process holds the fp32 target (0.54 GB) during every run, whatever else it drafts with
        assert s["peak_memory_mb"] == max(r["peak_memory_mb"] for r in rs) > 0.54e9 / 2**20
    assert summaries["baseline T=0"]["tau"] == 1.0
    # greedy speculative decoding changes nothing but summaries: the same tokens as the baseline, which
    # the file records once
    assert columns["tokens_as_baseline"] == [True, True] and columns["tokens"] == [None, None]
    assert [r["tokens"] for r in runs["lookup greedy T=0"]] == [r["tokens"] for r in runs["baseline T=0"]]
    assert summaries["lookup greedy T=0"]["prompts_with_the_baseline_tokens"] == 2
    assert result["config"]["layout"] == "float32-packed" and result["config"]["layout_choice"] == {}
    assert all(len(r["tokens"]) == r["new_tokens"] > 0 for rs in runs.values() for r in rs)
    assert all(Path(p).is_file() for p in result["plots"])
    machine = result["machine"]  # what it was measured on
    assert machine["torch"] == torch.__version__ and set(machine["cpu_features"]) <= set(CPU_FEATURES)
    assert machine["cpu"] and machine["cores"] >= 1 and machine["threads"] >= 1 and len(machine["commit"]) >= 7
    # results name files relative to the repository, never this machine's folders
    assert str(ROOT) not in out.read_text() and result["config"]["prompt_file"] == "data/spec_bench_questions.jsonl"


def test_named_shapes_have_the_published_parameter_counts():
    # the counts on the model cards: the shapes in the decode-speed table are the real ones
    published = {"smollm2-135m": 134_515_008, "qwen3-4b": 4_022_468_096, "llama-3.1-8b": 8_030_261_248}
    for name, count in published.items():
        with torch.device("meta"):
            net = M.Transformer(M.ModelArgs.from_hf_config(step_table.SHAPES[name]))
        assert sum(p.numel() for p in net.parameters()) == count, name


@pytest.mark.parametrize("tied,compiled", [(True, False), (False, False),
                                           pytest.param(True, True, marks=pytest.mark.slow)])  # ~40 s compile
def test_decode_speed_table_counts_the_bytes_a_step_reads(monkeypatch, tied, compiled):
    shape = dict(model_type="qwen3", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, tie_word_embeddings=tied)
    monkeypatch.setitem(step_table.SHAPES, "tiny", shape)
    net = step_table.random_target(shape, "cpu", torch.float32)
    assert (net.lm_head.weight.data_ptr() == net.embed_tokens.weight.data_ptr()) == tied
    assert all(p.isfinite().all() for p in net.parameters())
    rows = step_table.decode_speed_table(["tiny"], "cpu", ["float32"], compile_modes=(compiled,),
                                    verify_k=(3, 7), context=32, reps=3, copy_bytes=1 << 24)
    (row,) = rows
    assert row["compiled"] == compiled and (row["compile_mode"] == "freezing") == compiled
    # by hand: per layer q, k, v, o, gate, up, down, two norms and the q/k head norms; then the final
    # norm and the lm_head; the embedding table is read once per step only as the tied lm_head
    d, f, hd = 64, 96, 16
    per_layer = d * (4 * hd) + 2 * d * (2 * hd) + (4 * hd) * d + 3 * d * f + 2 * d + 2 * hd
    floats = 2 * per_layer + d + 320 * d
    assert row["weight_gb_per_step"] * 1e9 == 4 * floats
    assert row["floor_ms"] == pytest.approx(1e3 * 4 * floats / (row["bandwidth_gb_s"] * 1e9))
    assert row["fraction_of_floor"] == pytest.approx(row["floor_ms"] / row["ms_per_token"])
    assert row["tokens_per_s"] == pytest.approx(1e3 / row["ms_per_token"])
    assert set(row["verify_cost"]) == {4, 8} and all(v > 0 for v in row["verify_cost"].values())
    assert row["params_b"] * 1e9 == pytest.approx(floats + (0 if tied else 320 * d))
    if compiled:
        return
    # the other layouts, by hand: packed fp32 the same bytes; int8 one byte a Linear weight (the
    # lm_head too) and an fp32 scale per output; int4 half a byte a weight and two bf16 per group of
    # 32, its lm_head and norms bf16
    rows = step_table.decode_speed_table(["tiny"], "cpu", ["float32-packed", "int8", "int4"], compile_modes=(False,),
                                    verify_k=(3,), context=32, reps=3, copy_bytes=1 << 24)
    assert [r["layout"] for r in rows] == ["float32-packed", "int8", "int4"]
    norms = 2 * (2 * d + 2 * hd) + d
    linear_rows = 2 * (4 * hd + 2 * 2 * hd + d + 2 * f + d) + 320  # output features of every Linear
    assert rows[0]["weight_gb_per_step"] == row["weight_gb_per_step"]
    assert rows[1]["weight_gb_per_step"] * 1e9 == (floats - norms) + 4 * norms + 4 * linear_rows
    head = 320 * d
    assert rows[2]["weight_gb_per_step"] * 1e9 == (floats - norms - head) / 2 + (floats - norms - head) / 32 * 4 \
        + 2 * (norms + head)


def test_unwritable_out_fails_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refusals = [(["--drafts", "lookup", "--out", str(blocker / "results.json")], "cannot write --out"),  # under a file
                (["--drafts", "lookup", "--out", str(tmp_path)], "cannot write --out"),  # a directory
                (["--prompt-file", str(tmp_path / "missing.jsonl")], "prompt file not found"),
                (["--weights-quality", "-1", "--speed-off"], "--weights-quality takes a number of texts >= 1"),
                (["--max-new-tokens", "0"], "-k, --max-new-tokens and --limit must be >= 1"),  # not replaced by --quick
                (["--limit", "-3"], "-k, --max-new-tokens and --limit must be >= 1"),
                (["--speed-off"], "--speed-off leaves nothing to measure"),  # (else an empty results file)
                (["--speed-off", "--weights-quality", "1", "--drafts", "lookup,lookup@adapt",
                  "--paired", "lookup,lookup@adapt"], "--paired compares timed runs, which --speed-off skips")]
    for argv, message in refusals:  # main in this process: a refusal must come before anything loads
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--quick", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err.strip().splitlines()[-1] and "speed runs" not in err, err


def test_paired_ratio_is_a_ratio_of_sums_with_a_paired_interval():
    """tau over prompts is new tokens over forwards, summed; the interval resamples prompts, both
    runs together: a constant ratio on every prompt has a zero-width interval however spread the
    prompts are, and unpaired noise widens it."""
    a = [{"new_tokens": n, "target_forwards": f, "wall_tokens_per_s": s} for n, f, s in
         [(100, 50, 30.0), (100, 20, 60.0), (40, 40, 10.0), (128, 32, 40.0)]]
    b = [{"new_tokens": r["new_tokens"], "target_forwards": 2 * r["target_forwards"],
          "wall_tokens_per_s": r["wall_tokens_per_s"] / 2} for r in a]
    r = stats.paired_ratio(a, b)
    assert r["prompts"] == 4
    assert r["tau"]["ratio"] == pytest.approx(2.0) and r["tau"]["ci95"] == pytest.approx([2.0, 2.0])
    assert r["tokens_per_s"]["ratio"] == pytest.approx(2.0) and r["tokens_per_s"]["ci95"] == pytest.approx([2.0, 2.0])
    # overall tau is 368 / 142 against 368 / 150: not the mean of the per-prompt ratios
    c = [dict(r, target_forwards=f) for r, f in zip(a, (50, 20, 40, 40))]
    mixed = stats.paired_ratio(c, a)
    assert mixed["tau"]["ratio"] == pytest.approx((368 / 150) / (368 / 142))
    lo, hi = mixed["tau"]["ci95"]
    assert lo < mixed["tau"]["ratio"] < hi or lo == pytest.approx(mixed["tau"]["ratio"])
    assert lo >= (128 / 40) / (128 / 32) - 1e-9 and hi <= 1.0 + 1e-9  # inside the per-prompt extremes
    # what the comparison detects: nothing but the ratio itself where every prompt agrees, and a
    # ratio away from 1 by 2.8 bootstrap standard errors of the log ratio where they do not
    assert r["tau"]["detectable_ratio"] == pytest.approx(1.0)
    assert mixed["tau"]["detectable_ratio"] > 1 + (hi - lo) / 2 * 2.8 / 1.96 / 1.2


def test_drafts_of_one_name_are_refused_and_kept_checkpoints_are_named_by_run_and_step():
    """Runs are keyed by a draft's name: two drafts of one name would overwrite each other's results."""
    assert speed.draft_label("runs/vat/checkpoint") == "vat"
    assert speed.draft_label("runs/vat/step-000500@ee0.1") == "vat@500 +early-exit 0.1"
    with pytest.raises(SystemExit):
        bench.get_args(["--drafts", "runs/a/checkpoint,other/a"])
    args = bench.get_args(["--drafts", "runs/vat/step-000500,runs/base/step-000500", "--speed-off",
                           "--profile-step"])
    assert [speed.draft_label(d) for d in args.drafts] == ["vat@500", "base@500"]


def test_paired_runs_pair_only_runs_with_a_twin():
    """--paired A,B compares A's runs with B's runs of the same verifier and temperature; A's
    runs that B has no twin for (A with early exit) are left out, not a crash after the runs; each
    repeated --paired gives its own comparisons."""
    run = [{"new_tokens": 10, "target_forwards": 5, "wall_tokens_per_s": 20.0}]
    records = {"baseline T=0": run, "a greedy T=0": run, "b greedy T=0": run,
               "a +early-exit 0.05 greedy T=0": run, "a greedy T=1": run}
    paired = [["runs/a/checkpoint", "runs/b/checkpoint"]]
    pairs = speed.paired_runs(paired, records)
    assert list(pairs) == ["a greedy T=0 vs b"]
    paired.append(["runs/b/checkpoint", "runs/a/checkpoint"])
    assert list(speed.paired_runs(paired, records)) == ["a greedy T=0 vs b", "b greedy T=0 vs a"]
    assert pairs["a greedy T=0 vs b"]["tau"]["ratio"] == 1.0


def test_weights_quality_compares_int8_bf16_and_int4_with_fp32(tmp_path):
    """--weights-quality: teacher-forced agreement and perplexity of each cheaper layout against fp32."""
    from conftest import tiny_chat_target
    tiny_chat_target(tmp_path / "target")
    q = step_table.weights_quality(str(tmp_path / "target"), n_texts=2, max_tokens=48)
    assert set(q) == {"int8", "bfloat16", "int4"}
    for r in q.values():
        assert r["tokens"] == 2 * 47 and 0.5 <= r["top1_agreement"] <= 1
        assert r["perplexity"] == pytest.approx(r["perplexity_fp32"], rel=0.2)  # random weights: close, not equal


def test_llama_cpp_is_an_optional_peer(smollm2_dir, monkeypatch, capsys):
    """--peers adds llama.cpp on the same GGUF file when llama-cpp-python is installed, and says how
    to get it when it is not; its runs emit tokens of the target's vocabulary, stopping on time."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    names = [r.name for r in speed.peer_runs("smollm2-135m", 0.0, 5)]
    assert names == ["transformers generate T=0", "transformers assisted lookup T=0"]
    assert "pip install llama-cpp-python" in capsys.readouterr().err
    monkeypatch.undo()
    pytest.importorskip("llama_cpp")
    from tokenizer import load_tokenizer
    long = "Summarize: " + "the sea is calm and the sky is blue. " * 80  # longer than llama.cpp's 512-token batch
    tokenizer = load_tokenizer(smollm2_dir)
    for kind in ("plain", "lookup"):
        run = peers.llama_cpp_peer(kind, 5)
        for text in ("List three colours.", long):
            out = run(tokenizer.encode_chat([{"role": "user", "content": text}]), 12, 0.0, {2})
            assert 1 <= out["new_tokens"] <= 12 and all(0 <= t < 49152 for t in out["tokens"])


def test_step_profile_counts_the_matmuls_and_attention_of_a_forward(tiny_dir):
    """--profile-step: per block size, one matmul per Linear (4 a layer, and the head), one
    attention per layer, or one per query where blocks attend row by row (int4)."""
    from engine import layouts as LY
    for layout, rows in (("float32", 1), ("int4", 8)):
        target = LY.build_target(tiny_dir("llama3"), layout, "cpu", 128)
        profile = step_table.step_profile(target, blocks=(1, 8), context=16)
        assert set(profile) == {1, 8}
        for n, r in profile.items():
            assert r["matmul_calls"] == 3 * 4 + 1 and r["attention_calls"] == 3 * (rows if n > 1 else 1)
            assert r["profiled_ms"] == pytest.approx(r["matmul_ms"] + r["attention_ms"] + r["other_ms"])
            assert r["other_calls"] > 0 and r["matmul_ms"] > 0


def test_the_decode_table_shows_autos_choice_and_what_a_block_costs(capsys):
    choice = {"layout": "int4", "ms": {"int4": 8.0, "bfloat16-packed": 12.0, "float32-packed": 17.0},
              "inexact": ["bfloat16-packed"], "blocks_ms": {str(b): 8.0 + 2 * (b - 1) for b in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)},
              "attention_ms_per_key": 0.002}
    step_table.print_auto_choice("smollm2-135m", choice, 3)
    out = capsys.readouterr().out
    assert "--dtype auto for smollm2-135m here: int4" in out and "drafting exact" in out
    assert "| bfloat16-packed | 12.0 | no |" in out and "| int4 | 8.0 | yes |" in out
    assert "| 64 | 1.25 | 1.50 | 1.75 |" in out  # (8 + 2n) / 8 at a short context
    step_table.print_auto_choice("x", {}, 3)
    assert capsys.readouterr().out == ""


def test_a_results_file_records_tokens_equal_to_the_baselines_once():
    """A run's record keeps its tokens where they part from its baseline's on that prompt, and says
    it matched where they do not; the baseline keeps its own; columns read back as the records."""
    from harness.speed import records_for_file, records_from_file
    base = [{"tokens": [1, 2, 3], "seconds": 1.0}, {"tokens": [4, 5], "seconds": 1.0}]
    ours = [{"tokens": [1, 2, 3], "seconds": 0.5}, {"tokens": [4, 6], "seconds": 0.5}]
    sampled = [{"tokens": [1, 2, 3], "seconds": 0.5}]
    records = {"baseline T=0": base, "lookup greedy T=0": ours, "lookup lossless T=1": sampled}
    out = records_for_file(records, {"baseline T=0": 0, "lookup greedy T=0": 0, "lookup lossless T=1": 1})
    assert out["baseline T=0"] == {"tokens": [[1, 2, 3], [4, 5]], "seconds": [1.0, 1.0]}
    assert out["lookup greedy T=0"] == {"tokens": [None, [4, 6]], "seconds": [0.5, 0.5],
                                        "tokens_as_baseline": [True, False]}
    assert out["lookup lossless T=1"] == {"tokens": [[1, 2, 3]], "seconds": [0.5]}  # no baseline at T = 1 here
    back = records_from_file(json.loads(json.dumps(out)))
    assert [r["tokens"] for r in back["lookup greedy T=0"]] == [[1, 2, 3], [4, 6]] and back["baseline T=0"] == base


def test_compiled_runs_refuse_trees(capsys):
    """Compiled runs verify chains in one static block shape; a tree would run eagerly, apart from the
    compiled steps' bits."""
    with pytest.raises(SystemExit):
        bench.get_args(["--compile", "on", "--drafts", "lookup@tree8", "--limit", "1"])
    assert "--compile off" in capsys.readouterr().err
    bench.get_args(["--compile", "on", "--drafts", "lookup", "--limit", "1"])


def test_compiled_runs_refuse_blocks_whose_rows_attend_together(capsys):
    """Past ROWS_APART_MAX a block's rows attend in one call: no compiled block of them gives the
    compiled steps' bits, so a compiled bench refuses such a -k in one line."""
    with pytest.raises(SystemExit):
        bench.get_args(["--compile", "on", "--drafts", "lookup", "-k", "32", "--limit", "1"])
    assert "--compile on verifies blocks of up to 32 tokens" in capsys.readouterr().err
    bench.get_args(["--compile", "on", "--drafts", "lookup", "-k", "31", "--limit", "1"])


@pytest.mark.slow
def test_draft_cost_experiment_writes_what_it_prints(tmp_path):
    """experiments/draft_cost.py times a drafted token against the target's step, eager and
    compiled, fp32, bf16 and int8, the token decode.py drafts eager and compiled, and a DFlash block:
    every row positive and in both units, stamped with the machine."""
    out = tmp_path / "draft-cost.json"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "draft_cost.py"), "--repeats", "5",
                        "--context", "32", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["draft_token"]
    product = [name for name in rows if name.startswith("decode.py")]
    assert set(rows) - set(product) == {f"{form} {mode}" for form in ("float32", "bfloat16", "int8")
                                        for mode in ("eager", "compiled")}
    assert sorted(name.split(" (")[0] for name in product) == ["decode.py", "decode.py --compile on"]
    step = result["target_step_ms"]["compiled"]
    for row in rows.values():
        assert row["ms"] > 0 and row["compiled_target_steps"] == pytest.approx(row["ms"] / step, rel=1e-3)
    dflash = result["dflash_block"]
    for key in ("eager", "compiled", "compiled_forward", "target_head"):
        assert dflash[f"{key}_ms"] > 0
        assert dflash[f"{key}_compiled_target_steps"] == pytest.approx(dflash[f"{key}_ms"] / step, rel=1e-3)
    anatomy = result["compiled_anatomy_ms"]
    assert set(anatomy) == {"step", "block_of_4"}
    assert all(anatomy[call]["int4_matmuls"] > 0 and anatomy[call]["output_head"] > 0 for call in anatomy)
    assert result["machine"]["torch"] == torch.__version__
