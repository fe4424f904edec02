"""The compiled decode path (engine/compiled.py): a compiled step and a compiled, padded
verification block print compiled plain decoding's tokens, chains of any adaptive length meet
the same two graphs, and nothing recompiles once they are warm. On the default target's first
layer in int4 (its real weights, so real bf16 rounding), compiled as decode.py compiles it. A
second run loads the graphs the first one kept (engine/graph_cache.py) and prints the same tokens."""
import os

import pytest
import torch

from draft import AdaptiveDraft, LookupDraft
from engine import graph_cache as GC
from engine import linear_forms as LF
from conftest import eagle3_net
from eagle3 import Eagle3Draft
from engine.compiled import GRAPH_CODE, CompiledTarget, compile_draft, compile_target, start_compiler
from engine.files import ROOT
from engine.layouts import blocks_match_steps, build_target
from speculative import generate

K = 4
PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 504, 3458, 314, 253] * 3  # repeats: lookup drafts often


@pytest.fixture(scope="module")
def compiled(smollm2_dir):
    target = build_target(smollm2_dir, "int4", "cpu", 160, n_layer=1)
    return compile_target(target, K + 1, hidden_layers=(0, 1), compiler=start_compiler())  # (as decode.py does)


def decode(compiled, draft=None, k=0, temperature=0.0, generator=None, new=48):
    return generate(compiled.target, PROMPT, draft, None, k=k, max_new_tokens=new, temperature=temperature,
                    generator=generator or torch.Generator().manual_seed(0), step_fn=compiled)


def test_compiled_blocks_give_the_bits_of_compiled_steps(compiled):
    assert all(blocks_match_steps(compiled.target, n, step=compiled) for n in (2, K + 1))
    with torch.inference_mode():  # and the hidden states a draft reads are the eager forward's rows
        compiled.target(torch.tensor([PROMPT[:20]]), torch.arange(20))
        logits, hidden = compiled(torch.tensor([PROMPT[20:23]]), torch.arange(20, 23), hidden_layers=(1,))
        compiled.target(torch.tensor([PROMPT[:20]]), torch.arange(20))
        want_logits, want = compiled.target(torch.tensor([PROMPT[20:23]]), torch.arange(20, 23), hidden_layers=(1,))
    assert len(hidden) == 1 and hidden[0].shape == (1, 3, compiled.target.args.dim)
    torch.testing.assert_close(hidden[0].float(), want[0].float(), rtol=0.02, atol=0.05)
    torch.testing.assert_close(logits.float(), want_logits.float(), rtol=0.02, atol=0.1)


def test_compiled_speculation_prints_compiled_plain_tokens_and_never_recompiles(compiled):
    plain = decode(compiled)
    torch._dynamo.utils.counters.clear()
    fixed = decode(compiled, LookupDraft(), K)
    adaptive = decode(compiled, AdaptiveDraft(LookupDraft(), *compiled.block_costs()), K)
    assert fixed["tokens"] == plain["tokens"] and adaptive["tokens"] == plain["tokens"]
    assert fixed["target_forwards"] < plain["target_forwards"]  # it drafted, and kept some
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 0 and not counters["recompiles"], dict(counters)


def test_a_compiled_eagle3_draft_steps_as_its_eager_rows_and_speculation_prints_plain_tokens(compiled, capsys):
    """The draft's chain row compiled (bf16 activations and int8 weights, as build_draft loads a
    draft on a CPU): its state and heads are the eager forward's to bf16 rounding, speculation
    through it prints plain decoding's tokens, and a second draft loads the kept graph."""
    net = LF.quantize_int8(eagle3_net(compiled.target, draft_vocab=512).to(torch.bfloat16),
                           keep=("fc", "verify_head"))
    net.target_layers = (0, 1, 1)  # (the one-layer target's states the fixture's graphs return)
    def draft():
        return Eagle3Draft(net, compiled.target.embed_tokens, compiled.max_seq_len)
    eager, drafted = draft(), draft()
    assert compile_draft(drafted) is not None and "compiled; kept in" in capsys.readouterr().err
    graph, graph_calls = drafted.row_graph, []  # (counted: an eager fallback would pass the rest)
    drafted.row_graph = lambda *args: graph_calls.append(1) or graph(*args)
    dim = net.args.dim
    with torch.inference_mode():
        rows = torch.randn(6, dim, dtype=torch.bfloat16)
        for d in (eager, drafted):  # (a catch-up of five rows, eager in both, then one row)
            d.chain_step(torch.tensor(PROMPT[1:6]), rows[:5], 0)
        want, got = (d.chain_guess(torch.tensor(PROMPT[6:7]), rows[5:], 5) for d in (eager, drafted))
    assert eager.forwards == drafted.forwards == 2 and got[0].shape == want[0].shape == (1, dim)
    for g, w in zip(got, want):  # the state, the next guess's logits, the head's logit
        torch.testing.assert_close(g.float(), w.float(), rtol=0.02, atol=0.05)
    plain = decode(compiled)
    torch._dynamo.utils.counters.clear()
    speculative = decode(compiled, drafted, K)
    assert speculative["tokens"] == plain["tokens"] and drafted.forwards > 2 + plain["target_forwards"] // 2
    assert len(graph_calls) > plain["target_forwards"] // 2  # the chains' rows ran the graph
    assert not torch._dynamo.utils.counters["recompiles"]
    assert compile_draft(draft()) is not None and "loaded from" in capsys.readouterr().err


def test_compiled_block_costs_follow_the_context_each_row_reads(monkeypatch):
    """A compiled block's rows each read the whole context, so a block costs more steps at a long
    context: what block_costs gives an adaptive draft follows timings that grow so (a clock of
    known costs: a step 10 ms + 1 us a key, a block of 4 rows 13 ms + 4 us a key)."""
    import engine.compiled as EC
    clock = [0.0]

    class Timed:
        block_len, visible, max_seq_len = 4, True, 1024

        def __call__(self, tokens, input_pos):
            context = int(input_pos[0])
            clock[0] += (10 + 0.001 * context if tokens.shape[1] == 1 else 13 + 0.004 * context) / 1e3
    monkeypatch.setattr(EC.time, "perf_counter", lambda: clock[0])
    cost, step_seconds = CompiledTarget.block_costs(Timed(), repeats=3)
    assert step_seconds == pytest.approx(10.002e-3) and cost(0, 700) == 1.0
    for context in (2, 300, 1000, 3000):  # within the two contexts timed and past them
        assert cost(3, context) == pytest.approx((13 + 0.004 * context) / (10 + 0.001 * context))
    assert cost(1, 1000) == cost(3, 1000)  # (one graph: any chain pays its full block)


def test_a_block_past_the_graph_or_a_tree_runs_the_eager_forward(compiled):
    target = compiled.target
    before = dict(torch._dynamo.utils.counters["stats"])
    with torch.inference_mode():
        long, _ = compiled(torch.tensor([PROMPT[:K + 3]]), torch.arange(K + 3))
        want, _ = target(torch.tensor([PROMPT[:K + 3]]), torch.arange(K + 3))
    assert torch.equal(long, want) and dict(torch._dynamo.utils.counters["stats"]) == before


def test_compiled_sampling_keeps_the_compiled_targets_distribution(compiled):
    """At T = 1 lossless speculation through the compiled block draws the first token from the
    compiled step's softmax (a goodness-of-fit test over many seeds), where the lookup draft's own
    proposal, one token always, is far from it."""
    L, runs = len(PROMPT), 400
    with torch.inference_mode():
        compiled.target(torch.tensor([PROMPT[:-1]]), torch.arange(L - 1))
        logits, _ = compiled(torch.tensor([PROMPT[-1:]]), torch.tensor([L - 1]))
    exact = logits[0, -1].double().softmax(-1)
    counts, generator = torch.zeros_like(exact), torch.Generator().manual_seed(0)
    for _ in range(runs):  # (one stream: torch's draws from consecutive small seeds are not independent enough)
        counts[decode(compiled, LookupDraft(), K, temperature=1.0, generator=generator, new=2)["tokens"][0]] += 1
    keep = exact * runs >= 5
    chi2 = ((counts[keep] - runs * exact[keep]) ** 2 / (runs * exact[keep])).sum().item()
    df = int(keep.sum()) - 1
    assert df >= 2 and chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)
    proposed = LookupDraft()
    proposed.start(PROMPT)
    assert exact[int(proposed.propose(1)[0][0])] < 0.8  # (the test has power: the draft's token is no sure thing)


def prepared(target, block_len: int = K + 1) -> tuple:
    """A CompiledTarget of `target` as decode.py makes one, and whether each graph was loaded."""
    again = CompiledTarget(target, block_len, hidden_layers=(0, 1))
    return again, [prepare()[1] for _, prepare in again.graphs()]


def test_a_second_run_loads_the_kept_graphs_and_prints_the_same_tokens(compiled, smollm2_dir):
    want = decode(compiled, LookupDraft(), K)["tokens"]
    torch._dynamo.utils.counters.clear()
    again, loaded = prepared(build_target(smollm2_dir, "int4", "cpu", 160, n_layer=1))
    assert loaded == [True, True] and not torch._dynamo.utils.counters["stats"]  # nothing traced
    assert decode(again)["tokens"] == want and decode(again, LookupDraft(), K)["tokens"] == want


def test_a_check_of_the_kept_graphs_is_kept_beside_them(compiled, smollm2_dir, monkeypatch):
    calls = []
    def check(verdict):
        return lambda: calls.append(verdict) or verdict
    assert compiled.kept_check("a test's check", check(True))
    again, loaded = prepared(build_target(smollm2_dir, "int4", "cpu", 160, n_layer=1))
    assert loaded == [True, True] and again.kept_check("a test's check", check(False)) and calls == [True]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count: checked again
    assert not again.kept_check("a test's check", check(False)) and calls == [True, False]


def test_a_graph_is_kept_for_its_own_model_layout_cache_and_draft(smollm2_dir):
    def key(target, what="one-token step, hidden layers (0, 2)"):
        return GC.graph_key(target, what, GRAPH_CODE)
    target = build_target(smollm2_dir, "int4", "cpu", 160, n_layer=2)
    assert key(target) == key(build_target(smollm2_dir, "int4", "cpu", 160, n_layer=2))
    others = [build_target(smollm2_dir, "int4", "cpu", 192, n_layer=2),  # another cache length
              build_target(smollm2_dir, "float32", "cpu", 160, n_layer=2),  # another layout
              build_target(smollm2_dir, "int4", "cpu", 160, n_layer=3)]  # another model
    keys = {key(target), key(target, "one-token step, hidden layers (0,)"), *map(key, others)}
    assert len(keys) == 5
    assert GC.graph_key(target, "x", GRAPH_CODE) != GC.graph_key(target, "x", GRAPH_CODE[:-1])  # other code


def test_inductors_binaries_are_kept_beside_the_graphs_unless_placed_elsewhere(tmp_path):
    """(A kept graph holds its kernels' source; their binaries must outlast /tmp for it to load fast.)"""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    show = "import os, engine.graph_cache; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    shown = subprocess.run([sys.executable, "-c", show], env={**env, "SPECDEC_GRAPH_CACHE": str(tmp_path)},
                           capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
    assert shown == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] != str(GC.GRAPH_CACHE / "inductor")  # (this session's choice stands)


def test_a_graph_cache_that_cannot_be_written_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(GC, "GRAPH_CACHE", tmp_path / "a-file" / "graphs")
    GC.keep_graph(object(), "key")
    assert f"{tmp_path / 'a-file' / 'graphs'} could not be written" in capsys.readouterr().err


def test_a_kept_graph_that_cannot_be_read_is_compiled_and_kept_again(compiled, smollm2_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """(The step alone, a plain run's one graph, which the fixture kept: one compile in this test.)"""
    want = decode(compiled)["tokens"]
    step_key = compiled.graph_keys[0]
    (tmp_path / f"{step_key}.graph").write_bytes((GC.GRAPH_CACHE / f"{step_key}.graph").read_bytes()[:1000])
    monkeypatch.setattr(GC, "GRAPH_CACHE", tmp_path)  # (a copy cut short, as by a full disk)
    def build():
        return build_target(smollm2_dir, "int4", "cpu", 160, n_layer=1)
    again, loaded = prepared(build(), 1)
    assert loaded == [False] and "could not be read" in capsys.readouterr().err
    assert decode(again)["tokens"] == want
    assert prepared(build(), 1)[1] == [True]


def test_the_cuda_paths_whole_cache_graphs_print_their_plain_tokens_on_a_cpu(smollm2_dir):
    """The code a CUDA run compiles (graphs attending the whole static cache through a mask, fixed
    shapes), run on a CPU bar CUDA graphs: speculation, padded blocks and all, prints its plain
    decoding's tokens."""
    whole = CompiledTarget(build_target(smollm2_dir, "int4", "cpu", 160, n_layer=1), K + 1, whole_cache=True)
    assert [prepare()[1] for _, prepare in whole.graphs()] == [False, False] and not whole.graph_keys
    plain = decode(whole)
    assert decode(whole, LookupDraft(), K)["tokens"] == plain["tokens"]
    assert decode(whole, AdaptiveDraft(LookupDraft(), *whole.block_costs()), K)["tokens"] == plain["tokens"]
