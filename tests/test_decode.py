"""The speculative loop end to end: greedy equals plain decoding, lossless reproduces the target's
sequence distribution, stop tokens and token budgets are exact, and the CLI reports tau."""
import json
import subprocess
import sys

import pytest
import torch

from engine import weights as WT
from engine import linear_forms as LF
from engine.compiled import COMPILED_K
from engine.files import ROOT
from speculative import generate
from draft import LookupDraft, ModelDraft
from verify import Verifier, probs_from_logits



def load(path, batch=1, int8=False):
    m = WT.load_model(path)
    m.setup_caches(batch, 256)
    return LF.quantize_int8(m) if int8 else m


class WrongDraft(ModelDraft):
    """The target's own greedy guesses, shifted by one token id: never the argmax."""

    def propose(self, k):
        tokens, q = super().propose(k)
        return (tokens + 1) % self.model.args.vocab_size, None


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("qwen3_untied")


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    from conftest import write_tiny_checkpoint
    d = tmp_path_factory.mktemp("other")
    write_tiny_checkpoint(d, "qwen3_untied", seed=7, layers=2)
    return d


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("which", ["wrong", "right", "lookup", "independent"])
@pytest.mark.parametrize("int8", [False, True])
def test_greedy_speculative_equals_plain(tiny, other_tiny, k, which, int8):
    target = load(tiny, int8=int8)  # an int8 target is its own model: spec must equal its plain decoding
    prompt = [5, 17, 3, 5, 17, 3, 5, 17, 3, 42, 8]
    plain = generate(target, prompt, max_new_tokens=40)
    draft = {"wrong": lambda: WrongDraft(load(tiny, int8=int8)), "right": lambda: ModelDraft(load(tiny, int8=int8)),
             "lookup": LookupDraft, "independent": lambda: ModelDraft(load(other_tiny))}[which]()
    spec = generate(target, prompt, draft, Verifier("greedy"), k=k, max_new_tokens=40)
    assert spec["tokens"] == plain["tokens"]
    assert spec["new_tokens"] == 40
    if which == "wrong":
        assert spec["tau"] == 1.0
    if which == "right":  # every block keeps all k guesses, except the budget-trimmed last ones
        assert spec["accepted_per_position"] == [1.0] * k
        assert spec["target_forwards"] <= -(-40 // (k + 1)) + k


def sequence_distribution(target, prompt, n_new, temperature, V=16):
    """Exact P(continuation) over all V**n_new continuations, by enumeration."""
    seqs, probs = [[]], torch.ones(1, dtype=torch.double)
    for _ in range(n_new):
        rows = torch.tensor([prompt + s for s in seqs])
        target.setup_caches(len(rows), rows.shape[1])
        with torch.no_grad():
            logits, _ = target(rows, torch.arange(rows.shape[1]))
            p = probs_from_logits(logits[:, -1], temperature)  # (rows, V)
        probs = (probs[:, None] * p.double()).flatten()
        seqs = [s + [t] for s in seqs for t in range(V)]
    target.setup_caches(1, 64)
    return probs


@pytest.mark.slow  # test_emits checks two-token continuations of every path; this, three tokens at 20k runs
@pytest.mark.parametrize("n_new,runs,int8", [(3, 20000, False)])
def test_lossless_reproduces_the_target_sequence_distribution(tmp_path_factory, n_new, runs, int8):
    """Enumerate every continuation of a 16-token vocabulary and compare frequencies."""
    from conftest import write_tiny_checkpoint
    d_t, d_q = tmp_path_factory.mktemp("t16"), tmp_path_factory.mktemp("q16")
    write_tiny_checkpoint(d_t, "llama3", seed=1, vocab=16)
    write_tiny_checkpoint(d_q, "llama3", seed=2, vocab=16, layers=1)
    target, draft_model, temperature = load(d_t, int8=int8), load(d_q), 0.04  # random weights: flat logits
    prompt = [1, 2, 3, 4]
    exact = sequence_distribution(target, prompt, n_new, temperature)

    g = torch.Generator().manual_seed(0)
    draft = ModelDraft(draft_model, temperature=temperature, generator=g)
    counts = torch.zeros(len(exact), dtype=torch.double)
    for _ in range(runs):
        out = generate(target, prompt, draft, Verifier("lossless"), k=n_new, max_new_tokens=n_new,
                       temperature=temperature, generator=g)["tokens"]
        counts[sum(t * 16 ** (n_new - 1 - i) for i, t in enumerate(out))] += 1
    # Pearson chi-square over cells with enough expected mass; 6 standard deviations above df
    keep = exact * runs >= 5
    chi2 = ((counts[keep] - runs * exact[keep]) ** 2 / (runs * exact[keep])).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)
    # and the test has power: the draft's own distribution is clearly different
    assert (sequence_distribution(draft_model, prompt, n_new, temperature) - exact).abs().sum() > 0.2


def test_stop_token_inside_a_block_and_exact_budget(tiny):
    target = load(tiny)
    prompt = [5, 17, 3, 42]
    plain = generate(target, prompt, max_new_tokens=30)["tokens"]
    stop = plain[7]
    first = plain.index(stop)
    for k in (1, 4, 8):
        spec = generate(target, prompt, ModelDraft(load(tiny)), Verifier("greedy"), k=k, max_new_tokens=30,
                        stop_ids={stop})["tokens"]
        assert spec == plain[:first + 1]
        for budget in (1, 2, 5, 13):
            out = generate(target, prompt, ModelDraft(load(tiny)), Verifier("greedy"), k=k, max_new_tokens=budget)
            assert out["tokens"] == plain[:budget]


@pytest.mark.slow  # (the default suite checks the default's tokens on this target in test_every_command_line...)
def test_default_target_prompt_lookup(default_int4):
    """On SmolLM2, decode.py's default (prompt lookup + greedy verification at T = 0) from the command
    line gives plain decoding's tokens, with tau > 1, and says what it did. Plain decoding runs in this
    process on the session's int4 target (one layout for both: by default each run would take the
    layout timed fastest for its own forwards, and two layouts are two models)."""
    import decode
    target, tokenizer = default_int4
    prompt = ("Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, "
              "elderberries, figs, grapes.")
    s = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--prompt", prompt, "--max-new-tokens", "48",
                        "--json", "-k", "6", "--dtype", "int4"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert s.returncode == 0, s.stderr
    spec = json.loads(s.stdout.splitlines()[-1])
    plain = generate(target, tokenizer.encode_chat([{"role": "user", "content": prompt}]), max_new_tokens=48,
                     stop_ids=tokenizer.stop_ids)
    assert spec["tokens"] == plain["tokens"]
    assert spec["tau"] > 1.0 and spec["target_forwards"] < plain["target_forwards"]
    assert spec["text"] in s.stdout  # the streamed text is the final text
    assert (spec["draft"], spec["verifier"], spec["temperature"]) == ("lookup", "greedy", 0.0)
    # every answer ends with what speculation did, on stderr
    summary = s.stderr.strip().splitlines()[-1]
    assert summary.startswith("[lookup draft, greedy verifier, k=6, T=0, int4 weights]")
    assert f"{spec['new_tokens']} tokens" in summary and f"tau {spec['tau']:.2f}" in summary
    assert f"{spec['target_forwards']} target forwards" in summary and f"{spec['drafted_tokens']} drafted" in summary
    args = decode.get_args(["--verifier", "none", "--dtype", "int4"])
    plain_line = decode.summary_line({**plain, "tokens_per_s": 20.0}, args, speculative=False, layout="int4")
    assert plain_line.startswith(f"[plain decoding, T=0, int4 weights] {plain['new_tokens']} tokens at 20.0 tok/s")


# int8 is opt-in and its exactness is also enumerated on the tiny models (tests/test_emits.py): its
# quantization of the default target is the slowest load, so it runs with --runslow
@pytest.mark.parametrize("layout", [pytest.param("int8", marks=pytest.mark.slow), "bfloat16-packed", "int4"])
def test_default_target_in_coarse_layouts_decodes_exactly_like_itself(smollm2_dir, layout, request):
    """The default target in int8, bf16 and int4: greedy lookup speculation reproduces its own plain
    decoding bit for bit (verification blocks attend row by row, and the matmuls are exact per row;
    with blocks attending at once, bf16 parted from plain decoding on 8 of 13 Spec-Bench questions).
    bf16's matmuls are the CPU's: where they are not exact per row, auto never verifies in bf16."""
    from engine.layouts import blocks_match_steps, load_target
    from tokenizer import load_tokenizer
    target, tokenizer = request.getfixturevalue("default_int4") if layout == "int4" else \
        load_target(str(smollm2_dir), "cpu", layout, 512)[:2]
    if layout.startswith("bfloat16") and not blocks_match_steps(target, 8):
        pytest.skip("this CPU's bf16 kernels give a row other bits in a block (checkpoints.EXACT_LAYOUTS)")
    ids = tokenizer.encode_chat([{"role": "user", "content": "Repeat the following list exactly, one item per "
                                  "line: apples, bananas, cherries, dates, elderberries, figs, grapes."}])
    plain = generate(target, ids, max_new_tokens=48, stop_ids=tokenizer.stop_ids)
    spec = generate(target, ids, LookupDraft(), Verifier("greedy"), k=7, max_new_tokens=48,
                    stop_ids=tokenizer.stop_ids)
    assert spec["tokens"] == plain["tokens"] and spec["target_forwards"] < plain["target_forwards"]
    assert load_tokenizer(smollm2_dir).decode(plain["tokens"]).strip()  # and it says something


def test_cli_defaults_and_lossy_verifiers_at_temperature_zero(capsys):
    from engine.checkpoints import DEFAULT_DRAFTS
    from verify import VERIFIERS
    from decode import get_args
    a = get_args([])
    assert (a.draft, a.verifier, a.temperature, a.adaptive) == ("lookup", "greedy", 0.0, True)
    assert not get_args(["--no-adaptive"]).adaptive and not get_args(["--draft", "lookup", "--tree", "4"]).adaptive
    for verifier in VERIFIERS:  # any draft, any verifier: adaptive chains
        assert get_args(["--draft", str(DEFAULT_DRAFTS["smollm2-135m"]), "--verifier", verifier]).adaptive
    capsys.readouterr()  # (the lossy verifiers' notes on the temperature they default to)
    a = get_args(["--temperature", "1"])
    assert (a.draft, a.verifier) == ("lookup", "lossless")  # exact, and ahead of plain sampling in the report
    assert get_args(["--temperature", "1", "--verifier", "none"]).draft is None
    assert capsys.readouterr().err == ""
    a = get_args(["--verifier", "overshoot"])  # the chat draft, behind prompt lookup
    assert a.temperature == 1.0 and a.draft == f"lookup+{DEFAULT_DRAFTS[WT.DEFAULT_TARGET]}"
    exits_at_zero = get_args(["--draft", f"eagle3:{DEFAULT_DRAFTS[WT.DEFAULT_TARGET]}", "--early-exit", "0"])
    assert a.early_exit == "auto" and exits_at_zero.early_exit == 0.0
    assert "--temperature defaults to 1" in capsys.readouterr().err
    a = get_args(["--verifier", "minp", "--temperature", "0", "--draft", "lookup"])
    assert a.temperature == 0.0 and "is greedy verification" in capsys.readouterr().err
    assert get_args(["--draft", "lookup", "--temperature", "0.7"]).verifier == "lossless"


def test_a_compiled_run_refuses_blocks_whose_rows_attend_together(decode_failure):
    """Past ROWS_APART_MAX a block's rows attend in one call and cannot give the compiled steps'
    bits: refused in one line, before minutes of compiling a graph no block could use."""
    status, line = decode_failure(["--compile", "on", "-k", "32"])
    assert status == 2 and "--compile on verifies blocks of up to 32 tokens (-k up to 31)" in line


@pytest.mark.parametrize("argv,content,message", [
    (["--prompt", ""], None, "--prompt is empty"),
    (["--prompt", "   "], None, "--prompt is empty"),
    (["--temperature", "nan"], None, "--temperature must be a finite number"),
    (["--lam", "inf", "--verifier", "cos"], None, "--lam must be a finite number"),
    (["--prompt-file", "{file}"], "", "holds no prompt"),
    (["--prompt-file", "{file}.txt"], "", "is empty"),
    (["--prompt-file", "{file}"], '{"question": null}\n', "line 1: the prompt is None"),
    (["--prompt-file", "{file}"], '{"question": "fine"}\n{"turns": [""]}\n', "line 2: the prompt is empty"),
    (["--prompt-file", "{file}"], "not json\n", "line 1 is not valid JSON"),
    (["--draft", "drafts/none-such"], None, "--draft drafts/none-such: 'drafts/none-such' is neither a directory"),
    (["--draft", "lookup+{file}"], None, "holds no config.json"),  # (a folder that is not a draft)
    (["--draft", "eagle3:"], None, "names no draft"),
])
def test_bad_prompts_and_drafts_fail_in_one_line_before_loading(tmp_path, argv, content, message, monkeypatch,
                                                                capsys, decode_failure):
    import decode

    def no_loading(*_, **__):
        raise AssertionError("weights loaded before the prompts were checked")
    monkeypatch.setattr(decode, "load_target", no_loading)
    path = tmp_path / "prompts.jsonl"
    if "lookup+{file}" in argv:
        path = tmp_path
    if content is not None:
        path.write_text(content)
        path.with_suffix(".jsonl.txt").write_text(content)
    status, line = decode_failure([a.format(file=path) for a in argv])
    assert status != 0 and message in line and "\n" not in line
    assert capsys.readouterr().out == ""


def test_a_bad_prompt_file_fails_in_one_line_from_the_command_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("not json\n")
    r = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--prompt-file", str(path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {path} line 1 is not valid JSON"), r.stderr
    assert r.stdout == ""


@pytest.mark.slow  # the default target's step and block compile (minutes the first time)
def test_decode_compile_on_drafts_and_prints_compiled_plain_decodings_text():
    def run(*extra):
        r = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--compile", "on", "--max-new-tokens", "40",
                            "--prompt", "Repeat after me: one two three, one two three.", *extra],
                           capture_output=True, text=True, timeout=1200, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        return r
    plain, default = run("--verifier", "none"), run()
    assert "--compile on: the one-token step (" in plain.stderr and "verification block" not in plain.stderr
    assert f"--compile on: the verification block of {COMPILED_K + 1} (" in default.stderr
    assert "decoding plainly" not in default.stderr
    assert default.stdout == plain.stdout and default.stdout.strip()


def test_a_run_whose_blocks_are_not_exact_decodes_plainly_by_default(tiny, capsys, monkeypatch):
    """Where the run's blocks do not give its steps' bits, the default does not draft (and says
    so), and a draft asked for runs with a warning."""
    import decode
    target = load(tiny)
    monkeypatch.setattr(decode, "drafting_is_exact", lambda *a: False)
    args = decode.get_args([])
    assert decode.exact_draft(args, target, {}, LookupDraft()) is None
    assert "blocks of 6 tokens do not give the bits of one-token steps, so drafting changes the output: decoding plainly " \
           "(--dtype float32 drafts exactly)" in capsys.readouterr().err
    args = decode.get_args(["--draft", "lookup", "--no-adaptive", "--compile", "on"])
    draft = LookupDraft()
    class Compiled:  # (what exact_draft reads of a compiled target: checks it keeps)
        def kept_check(self, what, check):
            return check()
    assert decode.exact_draft(args, target, {}, draft, compiled=Compiled()) is draft
    assert "changes the output (--compile off drafts exactly)" in capsys.readouterr().err


def test_auto_threads_leave_a_busy_core_alone():
    """--threads auto counts the cores nothing else uses: a busy process beside us takes one away."""
    import os
    from engine.machine import pick_threads
    assert pick_threads("3") == 3
    if (os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2:
        pytest.skip("needs two cores")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time
        time.sleep(0.5)
        assert pick_threads("auto") <= torch.get_num_threads() - 1
    finally:
        busy.kill()
        busy.wait()


BLOCK_COSTS = [1.0, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3]  # a CPU's: a block of n + 1 tokens in one-token steps


def block_cost(n, context):
    return BLOCK_COSTS[n]


@pytest.mark.parametrize("which", ["wrong", "right"])
def test_adaptive_draft_length_pauses_where_nothing_is_kept(tiny, which):
    """The adaptive wrapper changes nothing but how much is drafted: greedy still equals plain;
    a draft that is never right soon drafts nothing but a probe after 4, 8, 16, 32 ... plain steps,
    a draft that is always right drafts the full k."""
    from draft import AdaptiveDraft
    target = load(tiny)
    prompt = [5, 17, 3, 5, 17, 3, 5, 17, 3, 42, 8]
    plain = generate(target, prompt, max_new_tokens=60)
    inner = WrongDraft(load(tiny)) if which == "wrong" else ModelDraft(load(tiny))
    spec = generate(target, prompt, AdaptiveDraft(inner, block_cost), Verifier("greedy"), k=6, max_new_tokens=60)
    assert spec["tokens"] == plain["tokens"]
    if which == "wrong":
        # 2 (the prior's best length), 1, then a one-token probe after 4, 8, 16, 32 plain steps
        assert spec["drafted_tokens"] <= 2 + 1 + 3 and spec["tau"] == 1.0
        assert spec["target_forwards"] == 60
    else:
        assert spec["accepted_per_position"] == [1.0] * 6
        assert spec["target_forwards"] <= -(-60 // 7) + 4  # (a few short blocks while it learns)


def test_adaptive_length_weighs_acceptance_against_what_a_block_costs():
    """The best length maximizes expected tokens per one-token step of time: nothing when blocks
    cost more than acceptance returns, longer blocks as acceptance rises or blocks get cheaper."""
    from draft import AdaptiveDraft, LookupDraft
    adaptive = AdaptiveDraft(LookupDraft(), block_cost)
    for kept, tried, best in ((0.1, 1.0, 0), (0.5, 1.0, 2), (0.9, 1.0, 6)):
        adaptive.kept, adaptive.tried = kept, tried
        assert adaptive.best_length(6) == best
    adaptive.cost = None  # a block costs a step (a GPU): any acceptance pays for the full k
    adaptive.kept, adaptive.tried = 0.1, 1.0
    assert adaptive.best_length(6) == 6
    adaptive.cost, adaptive.draft_step = block_cost, 0.5  # a slow draft pays for its own time too
    adaptive.kept, adaptive.tried = 0.5, 1.0
    assert adaptive.best_length(6) == 0


def test_adaptive_lookup_learns_from_what_plain_decoding_commits(tiny):
    """Prompt lookup costs nothing to ask: while drafting does not pay, its proposals are watched
    against the tokens plain steps commit, so it starts drafting as soon as they would be kept,
    without verifying a single block to learn it (and greedy still equals plain)."""
    from draft import AdaptiveDraft
    target = load(tiny)
    prompt = [5, 17, 3, 5, 17, 3, 5, 17, 3, 42, 8]
    plain = generate(target, prompt, max_new_tokens=60)
    adaptive = AdaptiveDraft(LookupDraft(), block_cost)
    adaptive.start(prompt[:8])  # ends in 5 17, seen before: lookup proposes 3 5 17 ...
    adaptive.kept, adaptive.tried = 0.0, 10.0  # as if it had missed ten times: nothing pays now
    assert adaptive.best_length(6) == 0
    assert adaptive.propose(6)[0].numel() == 0 and adaptive.watched  # watched, not drafted
    adaptive.commit([adaptive.watched[0]], 0)  # plain decoding committed what it would have drafted
    assert adaptive.kept > 0 and adaptive.proposed == 0
    spec = generate(target, prompt, AdaptiveDraft(LookupDraft(), block_cost), Verifier("greedy"), k=6,
                    max_new_tokens=60)
    assert spec["tokens"] == plain["tokens"]


def test_at_long_context_a_block_costs_more_steps_where_rows_attend_apart():
    from engine import layouts as LY
    from engine import timing_cache as TC
    table = {"blocks_ms": {str(b): 10.0 + b for b in TC.BLOCKS}, "attention_ms_per_key": 0.01}
    apart, together = LY.block_cost_model(table, True), LY.block_cost_model(table, False)
    assert apart(0, 5000) == pytest.approx(1.0) and together(0, 5000) == pytest.approx(1.0)
    assert apart(5, 64) == pytest.approx(16 / 11) == together(5, 64)
    assert apart(5, 4096) > apart(5, 1024) > apart(5, 64)  # six rows each attend over the context
    assert together(5, 4096) < together(5, 64)  # one attention, over a step made longer by it
    assert apart(20, 64) > apart(15, 64)  # past the largest block timed: extrapolated


LIST_PROMPT = ("Repeat this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, "
               "kappa.")


def decode_json(argv, capsys) -> dict:
    """decode.py's main in this process: its JSON line."""
    import decode
    capsys.readouterr()
    decode.main(["--prompt", LIST_PROMPT, "--max-new-tokens", "40", "--json"] + argv)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain_default():
    """`decode.py --verifier none` on the default target with default settings: the tokens every
    other command line must print at T = 0."""
    import contextlib
    import io

    import decode
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        decode.main(["--prompt", LIST_PROMPT, "--max-new-tokens", "40", "--json", "--verifier", "none"])
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    [],  # the default: adaptive prompt lookup
    pytest.param(["--no-adaptive"], marks=pytest.mark.slow),  # (lookup every step: in the report's runs too)
    ["--tree", "8"],
    # (the bare flag is the default: test_a_trained_draft_drafts_adaptively_and_exits_early_by_default)
    pytest.param(["--draft", "drafts/smollm2-135m-eagle3-vat", "--early-exit"], marks=pytest.mark.slow),
    ["--draft", "drafts/smollm2-135m-eagle3-gsm8k-2ep", "--early-exit-signal", "confidence", "--no-adaptive"],
    ["--draft", "drafts/smollm2-135m-eagle3-chat"],  # the lossy verifiers' default draft, adaptive
    ["--draft", "drafts/smollm2-135m-eagle3-gsm8k-2ep", "--tree", "16"],
    pytest.param(["--draft", "drafts/smollm2-135m-eagle3-gsm8k", "--adaptive"], marks=pytest.mark.slow),  # (as -chat)
    ["--draft", "drafts/smollm2-135m-dflash-gsm8k"],
    ["--draft", "lookup+drafts/smollm2-135m-eagle3-gsm8k-2ep", "--early-exit", "--adaptive"],
], ids=lambda argv: " ".join(argv) or "default")
def test_every_command_line_prints_plain_decodings_tokens(argv, plain_default, capsys):
    """A run has one model: with default settings decode.py, with any committed draft, chains or
    trees, prints at T = 0 the tokens `decode.py --verifier none` prints, in the same layout."""
    result = decode_json(argv, capsys)
    assert result["layout"] == plain_default["layout"]
    assert result["tokens"] == plain_default["tokens"], result["text"]
    assert result["target_forwards"] <= plain_default["target_forwards"]


def test_a_trained_draft_drafts_adaptively_and_exits_early_by_default(plain_default, capsys):
    """Any draft's chain is adaptive unless --no-adaptive, and stops where its head expects a
    rejection unless --early-exit 0: the same tokens as plain decoding, a head that declines some
    of what the fixed k would draft, and a draft that is seldom kept (the general draft on this list
    prompt) drafting far less than the -k tokens a step it drafts with a fixed k."""
    fixed = decode_json(["--draft", "drafts/smollm2-135m-eagle3-vat", "--no-adaptive", "--early-exit", "0"], capsys)
    heads = decode_json(["--draft", "drafts/smollm2-135m-eagle3-vat", "--no-adaptive"], capsys)
    default = decode_json(["--draft", "drafts/smollm2-135m-eagle3-vat"], capsys)
    assert default["tokens"] == fixed["tokens"] == heads["tokens"] == plain_default["tokens"]
    assert fixed["drafted_tokens"] > 0.8 * fixed["k"] * fixed["target_forwards"]  # (less only near the end)
    assert fixed["declined_tokens"] == 0 < heads["declined_tokens"], (fixed, heads)
    assert default["drafted_tokens"] < fixed["drafted_tokens"] / 2, (default, fixed)
