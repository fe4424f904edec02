"""What every decoding path emits, whatever it was configured with.

Each path a user can reach from decode.py or bench.py (plain decoding; prompt lookup, an
independent model, EAGLE-3, DFlash, the hybrid and the adaptive draft; early exit; fp32 and int8
targets) is run and its output checked against the claim of its verifier:
  greedy (T = 0)   the tokens of plain greedy decoding, token for token;
  exact (T > 0)    the target's temperature- and top-p-warped distribution over whole
                   continuations, enumerated exactly on a 16-token vocabulary and compared with
                   the emitted frequencies (Pearson chi-square);
  lossy            the first emitted token follows verify.induced(p, q) in closed form.
Then the same claims on the real default target (a goodness-of-fit test of the first token) and
through the command line and the benchmark, whose baselines are what every speedup divides by.
"""
import json
from unittest import mock

import pytest
import torch

import dflash
import eagle3

from conftest import dflash_net, eagle3_net
from speculative import adaptive, exact_verifier, generate
from draft import AdaptiveDraft, HybridDraft, LookupDraft, ModelDraft, exit_probability
from eagle3 import Eagle3Draft
from dflash import DFlashDraft
from verify import Verifier, induced, probs_from_logits

V = 16  # small enough to enumerate every continuation
T = 0.2  # the random tiny target's top token then has ~0.36 of the mass: many outcomes are likely
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup (and the hybrid's lookup) finds a match here
FRESH = [4, 9, 7, 11, 5, 14, 2, 6]  # no repeated n-gram: the hybrid falls back on its model draft


def make_draft(kind: str, models, target, temperature, top_p, generator):
    """A fresh draft of each kind decode.py builds, over `target`."""
    sampling = dict(temperature=temperature, top_p=top_p, generator=generator)
    independent = lambda: ModelDraft(models["load"](models["draft_dir"]), **sampling)  # noqa: E731
    eagle3 = lambda early_exit=None, exit_signal="head": Eagle3Draft(  # noqa: E731
        eagle3_net(target, draft_vocab=12), target.embed_tokens, target.max_seq_len, early_exit=early_exit,
        exit_signal=exit_signal, **sampling)
    dflash = lambda early_exit=None, exit_signal="head": DFlashDraft(  # noqa: E731
        dflash_net(target, block=4), target.embed_tokens, target.lm_head, target.max_seq_len,
        early_exit=early_exit, exit_signal=exit_signal, **sampling)
    confident = dict(exit_signal="confidence")
    return {"plain": lambda: None,
            "lookup": LookupDraft,
            "independent": independent,
            "eagle3": eagle3,
            "eagle3 early exit": lambda: eagle3(early_exit=median_exit_probability(eagle3(), target)),
            "eagle3 confidence exit": lambda: eagle3(early_exit=median_exit_probability(eagle3(**confident), target),
                                                     **confident),
            "dflash": dflash,
            "dflash early exit": lambda: dflash(early_exit=median_exit_probability(dflash(), target)),
            "dflash confidence exit": lambda: dflash(early_exit=median_exit_probability(dflash(**confident), target),
                                                     **confident),
            "hybrid": lambda: HybridDraft(eagle3()),
            "adaptive": lambda: AdaptiveDraft(independent()),
            # decode.py's lossy default: each source adapted apart, at block costs where drafting
            # pays on some steps only (lookup watched, the model probed)
            "adaptive hybrid": lambda: adaptive(HybridDraft(eagle3()), (lambda n, context: 1.0 + 0.3 * n, None)),
            }[kind]()


def median_exit_probability(draft, target) -> float:
    """The median early-exit signal (the draft's exit_signal: its head's probability or its own
    confidence) a random draft meets on sampled continuations: as a threshold it stops some blocks
    early and lets others draft on."""
    seen = []

    def recorded(*args):
        signal = exit_probability(*args)
        seen.extend(signal.flatten().tolist())
        return signal
    generator = torch.Generator().manual_seed(123)
    draft.generator, draft.early_exit = generator, 0.0  # threshold 0: the signal is read, never obeyed
    with mock.patch.object(eagle3, "exit_probability", recorded), mock.patch.object(dflash, "exit_probability", recorded):
        for _ in range(20):
            generate(target, FRESH, draft, None, k=3, max_new_tokens=6, temperature=T, generator=generator)
    return float(torch.tensor(seen).median())


def continuation_distribution(target, prompt, n_new, temperature, top_p=1.0):
    """Exact P(continuation) of the warped target over all V**n_new continuations, (V**n_new,)."""
    seqs, probs = [[]], torch.ones(1, dtype=torch.double)
    for _ in range(n_new):
        rows = torch.tensor([prompt + s for s in seqs])  # (V**i, len(prompt) + i)
        target.setup_caches(len(rows), rows.shape[1])
        with torch.no_grad():
            logits, _ = target(rows, torch.arange(rows.shape[1]))
        p = probs_from_logits(logits[:, -1], temperature, top_p)  # (V**i, V)
        probs = (probs[:, None] * p.double()).flatten()
        seqs = [s + [t] for s in seqs for t in range(V)]
    target.setup_caches(1, 64)
    return probs


def assert_fits(counts: torch.Tensor, expected: torch.Tensor, what: str):
    """Pearson chi-square over the cells with enough expected mass (the rest pooled), at 6
    standard deviations above its degrees of freedom; and the draws are not all one outcome."""
    runs = counts.sum()
    keep = expected * runs >= 5
    cells_c = torch.cat([counts[keep], counts[~keep].sum()[None]])
    cells_e = torch.cat([expected[keep], expected[~keep].sum()[None]]) * runs
    cells_c, cells_e = cells_c[cells_e > 0], cells_e[cells_e > 0]
    chi2 = ((cells_c - cells_e) ** 2 / cells_e).sum().item()
    df = len(cells_e) - 1
    assert df >= 3, f"{what}: too few likely outcomes to test"
    assert chi2 < df + 6 * (2 * df) ** 0.5, f"{what}: chi2 {chi2:.0f} on {df} df"
    assert (counts > 0).sum() > 1, f"{what}: every run emitted the same tokens"


def index_of(tokens):
    return sum(t * V ** (len(tokens) - 1 - i) for i, t in enumerate(tokens))


# -----------------------------------------------------------------------------
# T = 0: every path is plain greedy decoding, token for token

GREEDY_PATHS = ["lookup", "independent", "eagle3", "eagle3 early exit", "eagle3 confidence exit", "dflash",
                "dflash early exit", "dflash confidence exit", "hybrid", "adaptive", "adaptive hybrid"]


SLOW = pytest.mark.slow  # the same code path as a default-suite case; --runslow adds it
GREEDY_MATRIX = [(kind, False, "greedy") for kind in GREEDY_PATHS] + \
                [(kind, True, "greedy") if kind in ("lookup", "independent") else
                 pytest.param(kind, True, "greedy", marks=SLOW) for kind in GREEDY_PATHS] + \
                [pytest.param(kind, False, "lossless", marks=SLOW) for kind in GREEDY_PATHS]  # lossless at T = 0


@pytest.mark.parametrize("kind,int8,verifier", GREEDY_MATRIX,
                         ids=[f"{k}-fp32-greedy" for k in GREEDY_PATHS] + [f"{k}-int8-greedy" for k in GREEDY_PATHS] +
                         [f"{k}-fp32-lossless" for k in GREEDY_PATHS])
def test_greedy_paths_emit_plain_greedy_decoding(models, kind, int8, verifier):
    target = models["int8" if int8 else "target"]
    for prompt in (REPEATING, FRESH):
        plain = generate(target, prompt, max_new_tokens=16)["tokens"]
        draft = make_draft(kind, models, target, 0.0, 1.0, torch.Generator().manual_seed(0))
        spec = generate(target, prompt, draft, Verifier(verifier), k=3, max_new_tokens=16,
                        generator=torch.Generator().manual_seed(0))
        assert spec["tokens"] == plain, (kind, prompt)


@pytest.mark.parametrize("kind", ["eagle3 confidence exit", "dflash confidence exit"])
def test_confidence_exit_drafts_up_to_the_first_token_the_draft_doubts(models, kind):
    """With --early-exit-signal confidence, each step's block holds exactly the drafted tokens
    before the first whose probability under the draft (its top token's) falls below the
    threshold; the threshold (the median) stops some blocks early and lets others run full."""
    target = models["target"]
    draft = make_draft(kind, models, target, 0.0, 1.0, None)
    signals, blocks = [], []

    def recorded(signal, logits, head_logits):
        seen = exit_probability(signal, logits, head_logits)
        assert signal == "confidence"
        assert torch.allclose(seen, torch.softmax(logits.float(), -1).amax(-1))
        signals.extend(seen.flatten().tolist())
        return seen

    def on_verify(p, q, guesses, n):
        blocks.append((list(signals), len(guesses)))
        signals.clear()
    with mock.patch.object(eagle3, "exit_probability", recorded), mock.patch.object(dflash, "exit_probability", recorded):
        out = generate(target, FRESH, draft, None, k=3, max_new_tokens=24, on_verify=on_verify)
    assert out["tokens"] == generate(target, FRESH, max_new_tokens=24)["tokens"]
    for seen, drafted in blocks:
        doubted = [i for i, s in enumerate(seen) if s < draft.early_exit]
        assert drafted == (doubted[0] if doubted else len(seen)), (seen, drafted)
    assert any(d == 0 or d < len(s) for s, d in blocks) and any(d == 3 for _, d in blocks)


# -----------------------------------------------------------------------------
# T > 0: plain sampling and lossless verification emit the target's warped distribution

SAMPLING_PATHS = [("plain", False, 1.0, REPEATING), ("plain", False, 0.8, REPEATING), ("plain", True, 1.0, REPEATING),
                  ("lookup", False, 1.0, REPEATING), ("lookup", True, 1.0, REPEATING),
                  ("independent", False, 1.0, REPEATING), ("independent", False, 0.8, REPEATING),
                  ("independent", True, 1.0, REPEATING),
                  ("eagle3", False, 1.0, FRESH), ("eagle3 early exit", False, 1.0, FRESH),
                  ("eagle3 confidence exit", False, 1.0, FRESH),
                  ("dflash", False, 1.0, FRESH), ("dflash early exit", False, 1.0, FRESH),
                  ("dflash confidence exit", False, 1.0, FRESH),
                  ("hybrid", False, 1.0, REPEATING), ("hybrid", False, 1.0, FRESH),
                  ("adaptive", False, 1.0, FRESH), ("adaptive hybrid", False, 1.0, REPEATING)]
SAMPLING_IDS = [f"{k}-{'int8' if i else 'fp32'}-top_p{p:g}-{'rep' if pr is REPEATING else 'fresh'}"
                for k, i, p, pr in SAMPLING_PATHS]
SAMPLING_SLOW = {"independent-fp32-top_p0.8-rep", "hybrid-fp32-top_p1-rep", "lookup-int8-top_p1-rep",
                 "independent-int8-top_p1-rep", "dflash early exit-fp32-top_p1-fresh",
                 "dflash confidence exit-fp32-top_p1-fresh"}  # their parts run apart


@pytest.mark.parametrize("kind,int8,top_p,prompt",
                         [pytest.param(*p, marks=SLOW) if i in SAMPLING_SLOW else p
                          for p, i in zip(SAMPLING_PATHS, SAMPLING_IDS)], ids=SAMPLING_IDS)
def test_sampling_paths_emit_the_target_distribution(models, kind, int8, top_p, prompt):
    """Two new tokens (the first step drafts one: its acceptance, correction and bonus token all
    count), 300 runs from one generator, against the exact two-token distribution; three with
    early exit, so that its head sees sampled states and exits in some blocks and not others."""
    target, runs, n_new = models["int8" if int8 else "target"], 300, 3 if "early exit" in kind else 2
    exact = continuation_distribution(target, prompt, n_new, T, top_p)
    generator = torch.Generator().manual_seed(0)
    draft = make_draft(kind, models, target, T, top_p, generator)
    counts = torch.zeros(len(exact), dtype=torch.double)
    drafted = declined = 0
    for _ in range(runs):
        out = generate(target, prompt, draft, None, k=3 if draft else 0, max_new_tokens=n_new,
                       temperature=T, top_p=top_p, generator=generator)
        counts[index_of(out["tokens"])] += 1
        drafted, declined = drafted + out["drafted_tokens"], declined + out["declined_tokens"]
    if n_new == 2:
        assert_fits(counts, exact, f"{kind} top_p {top_p}")
    else:  # 4,096 continuations are too many cells for 300 runs: test both two-token marginals
        counts, exact = counts.view(V, V, V), exact.view(V, V, V)
        assert_fits(counts.sum(2).flatten(), exact.sum(2).flatten(), f"{kind}, tokens 1-2")
        assert_fits(counts.sum(0).flatten(), exact.sum(0).flatten(), f"{kind}, tokens 2-3")
    if draft is not None:  # the path really speculated (and an early exit really exited sometimes)
        assert drafted > 0
        assert declined > 0 if "early exit" in kind else True


# -----------------------------------------------------------------------------
# Lossy verifiers: the first token follows the closed form verify.induced(p, q)

LOSSY = [Verifier("minp", p_base=0.1), Verifier("eta", eps=0.05), Verifier("cos", lam=0.5),
         Verifier("lenience", lenience=0.25), Verifier("overshoot", lam=0.5, ceiling=4.0)]


LOSSY_PATHS = [(kind, v) if kind == "independent" or v.family == "truncation" else pytest.param(kind, v, marks=SLOW)
               for kind in ("lookup", "independent") for v in LOSSY] + \
              [pytest.param(kind, v, marks=SLOW) for kind in ("eagle3", "dflash") for v in (LOSSY[0], LOSSY[4])]


@pytest.mark.parametrize("kind,verifier", LOSSY_PATHS,
                         ids=[f"{k}-{v.name}" for k in ("lookup", "independent") for v in LOSSY] +
                         [f"{k}-{v.name}" for k in ("eagle3", "dflash") for v in (LOSSY[0], LOSSY[4])])
def test_lossy_paths_emit_their_closed_form(models, kind, verifier):
    target, runs = models["target"], 300
    prompt = REPEATING
    with torch.no_grad():
        target.setup_caches(1, 64)
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt)))
    p = probs_from_logits(logits[0, -1], T)  # (V,) the target at the first new position, computed apart
    generator = torch.Generator().manual_seed(0)
    draft = make_draft(kind, models, target, T, 1.0, generator)
    first_q = []

    def seen(p_block, q_block, guesses, n):  # the draft's first distribution (one-hot for lookup)
        if not first_q:
            first_q.append(torch.zeros(V).scatter_(0, guesses[:1], 1.0) if q_block is None else q_block[0])

    counts = torch.zeros(V, dtype=torch.double)
    for _ in range(runs):
        first_q.clear()
        out = generate(target, prompt, draft, verifier, k=1, max_new_tokens=2, temperature=T,
                       generator=generator, on_verify=seen)
        counts[out["tokens"][0]] += 1
    want = induced(p, first_q[0], verifier).double()
    assert (want - p).abs().sum() > 0.05, "the verifier must change the distribution here, or the test has no power"
    assert_fits(counts, want, verifier.name)


def test_greedy_verification_at_temperature_above_zero_is_refused(models):
    with pytest.raises(ValueError, match="greedy verifier"):
        generate(models["target"], REPEATING, LookupDraft(), Verifier("greedy"), k=2, max_new_tokens=4,
                 temperature=1.0)
    assert exact_verifier(0.0).name == "greedy" and exact_verifier(0.7).name == "lossless"


# -----------------------------------------------------------------------------
# The benchmark's runs, baselines included, emit what they claim

@pytest.mark.parametrize("spec", [None, "lookup"])
def test_bench_runs_sample_at_temperature_above_zero(models, spec):
    """The baseline every T > 0 speedup divides by is plain sampling, and a lookup run samples."""
    from harness import speed
    target, runs = models["target"], 300
    exact = continuation_distribution(target, REPEATING, 2, T)
    generator = torch.Generator().manual_seed(0)
    run = speed.Run("x", T, target, draft=LookupDraft() if spec else None,
                    verifier=Verifier("lossless") if spec else None)
    counts = torch.zeros(len(exact), dtype=torch.double)
    for _ in range(runs):
        out = speed.emit(run, REPEATING, k=3, max_new_tokens=2, stop_ids=(), generator=generator)
        counts[index_of(out["tokens"])] += 1
    assert_fits(counts, exact, f"bench {spec or 'baseline'}")


# -----------------------------------------------------------------------------
# The real default target

def test_default_target_samples_its_own_distribution(default_int4):
    """Plain sampling at T = 1 on SmolLM2 (the session's int4 target): 100 first tokens against its
    softmax (goodness of fit; a few tokens carry most of the mass here)."""
    target, tokenizer = default_int4
    prompt = tokenizer.encode("The best thing about the sea is")
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt)))
    p = probs_from_logits(logits[0, -1], 1.0).double()  # (49152,)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(p)
    for _ in range(100):
        counts[generate(target, prompt, max_new_tokens=1, temperature=1.0, generator=generator)["tokens"][0]] += 1
    assert_fits(counts, p, "default target, plain sampling")


def test_cli_seeds_differ_at_temperature_above_zero(capsys):
    """decode.py's plain decoding at T = 1: two seeds give two answers (greedy decoding, one)."""
    import decode

    def tokens(*extra):
        decode.main(["--prompt", "Write a short poem about the sea.", "--max-new-tokens", "12", "--json",
                     "--dtype", "int4", *extra])  # (one layout, not the one timed fastest here)
        return json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"]
    plain = ("--verifier", "none", "--temperature", "1")  # plain sampling: the path that once was greedy
    assert tokens(*plain, "--seed", "1") != tokens(*plain, "--seed", "2")
