"""Every verifier's sampler against its closed-form induced distribution; lossless against p."""
import pytest
import torch

from verify import VERIFIERS, Verifier, acceptance_probability, induced, probs_from_logits, verify

V = 8
N = 200_000  # samples per case: the bound below is 5 standard errors per token


def cases():
    g = torch.Generator().manual_seed(0)
    rand = lambda scale: torch.softmax(scale * torch.randn(V, generator=g), -1)  # noqa: E731
    p_peak, q_flat = rand(4.0), torch.full((V,), 1.0 / V)
    disjoint_p = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0.0])
    disjoint_q = torch.tensor([0, 0, 0, 0.1, 0.2, 0.3, 0.4, 0.0])
    return {
        "peaked": (p_peak, rand(4.0)),
        "flat_q": (rand(1.0), q_flat),
        "flat_p": (q_flat.clone(), rand(3.0)),
        "disjoint": (disjoint_p, disjoint_q),
        "q_equals_p": (p_peak, p_peak.clone()),
        "one_hot_q": (rand(1.5), torch.eye(V)[3]),
    }


SETTINGS = [Verifier("greedy"), Verifier("lossless"), Verifier("minp", p_base=0.3), Verifier("eta", eps=0.2),
            Verifier("eta", eps=0.05, delta=0.9), Verifier("cos", lam=0.3), Verifier("lenience", lenience=0.4),
            Verifier("lenience", lenience=2.0), Verifier("overshoot", lam=0.0, ceiling=1.5),
            Verifier("overshoot", lam=0.6, ceiling=1.2), Verifier("overshoot", lam=0.2, ceiling=3.0)]


def one_step_samples(p, q, v, seed=0, deterministic=False):
    """Verify N independent one-token blocks drafted from q; the first output token of each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)  # (N, 1)
    pp = torch.stack([p, torch.full((V,), 1.0 / V)]).expand(N, 2, V)  # p[1] is the bonus position
    qq = None if deterministic else q.expand(N, 1, V)
    n, nxt = verify(pp, qq, x, v, g)
    return torch.where(n == 1, x[:, 0], nxt)


def assert_matches(samples, expected):
    empirical = torch.bincount(samples, minlength=V).double() / N
    expected = expected.double()
    bound = 5 * (expected * (1 - expected) / N).sqrt() + 1e-4
    assert ((empirical - expected).abs() <= bound).all(), (empirical, expected)


@pytest.mark.parametrize("case", list(cases()))
@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: f"{v.name}")
def test_sampler_matches_closed_form(case, v):
    p, q = cases()[case]
    expected = induced(p, q, v)
    assert torch.allclose(expected.sum(), torch.tensor(1.0), atol=1e-6)
    assert_matches(one_step_samples(p, q, v), expected)


@pytest.mark.parametrize("case", list(cases()))
def test_lossless_is_p(case):
    p, q = cases()[case]
    assert torch.allclose(induced(p, q, Verifier("lossless")), p, atol=1e-6)
    assert_matches(one_step_samples(p, q, Verifier("lossless"), seed=1), p)


def test_deterministic_draft_is_one_hot_q():
    p, _ = cases()["peaked"]
    for v in SETTINGS:
        for token in (int(p.argmax()), int(p.argmin())):
            q = torch.eye(V)[token]
            assert_matches(one_step_samples(p, q, v, seed=2, deterministic=True), induced(p, q, v))


def test_overshoot_ceiling_caps_overshot_tokens():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        p = torch.softmax(3 * torch.randn(V, generator=g), -1)
        q = torch.softmax(3 * torch.randn(V, generator=g), -1)
        c = 1 + 3 * torch.rand(1, generator=g).item()
        lam = torch.rand(1, generator=g).item()
        out = induced(p, q, Verifier("overshoot", lam=lam, ceiling=c))
        over = q > p
        assert (out[over] <= c * p[over] + 1e-6).all()
        # lam = 0 is lenience with l = 1/c
        assert torch.allclose(induced(p, q, Verifier("overshoot", lam=0.0, ceiling=c)),
                              induced(p, q, Verifier("lenience", lenience=1 / c)), atol=1e-6)


@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_accepted_count_is_product_of_acceptance_probabilities(v):
    k, B = 4, N
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(k, V, generator=g), -1)
    x = torch.stack([torch.multinomial(q[i].expand(B, V), 1, replacement=True, generator=g)[:, 0] for i in range(k)], 1)
    n, _ = verify(p.expand(B, k + 1, V), q.expand(B, k, V), x, v, g)
    alpha = acceptance_probability(p[:k], q, v).double()
    reach = torch.cat([torch.ones(1, dtype=torch.double), alpha.cumprod(0)])  # P(n >= j)
    expected = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.double)])
    assert_matches_counts(n, expected)


def assert_matches_counts(n, expected):
    empirical = torch.bincount(n, minlength=len(expected)).double() / len(n)
    bound = 5 * (expected * (1 - expected) / len(n)).sqrt() + 1e-4
    assert ((empirical - expected).abs() <= bound).all(), (empirical, expected)


@pytest.mark.parametrize("edge", [Verifier("lenience", lenience=1.0), Verifier("cos", lam=1.0),
                                  Verifier("overshoot", lam=0.3, ceiling=1.0),
                                  Verifier("overshoot", lam=1.0, ceiling=2.5)], ids=lambda v: v.name)
def test_edge_identities_reproduce_lossless_bit_for_bit(edge):
    k, B = 5, 20_000
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(B, k, V, generator=g), -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    a = verify(p, q, x, Verifier("lossless"), torch.Generator().manual_seed(9))
    b = verify(p, q, x, edge, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_greedy_is_argmax():
    k, B = 5, 1000
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=g), -1)
    best = p.argmax(-1)
    x = torch.where(torch.rand(B, k, generator=g) < 0.7, best[:, :k], torch.randint(0, V, (B, k), generator=g))
    n, nxt = verify(p, None, x, Verifier("greedy"))
    matches = (x == best[:, :k]).long().cumprod(-1).sum(-1)
    assert torch.equal(n, matches) and torch.equal(nxt, best[torch.arange(B), n])


def test_temperature_zero_and_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    assert probs_from_logits(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    full = torch.softmax(logits, -1)[0]
    kept = probs_from_logits(logits, 1.0, top_p=0.8)[0]
    order = full.argsort(descending=True)
    assert kept[order[0]] > 0 and kept[order[1]] > 0 and kept[order[3]] == 0  # 0.63 + 0.23 >= 0.8
    assert torch.allclose(kept.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("bad,match", [(dict(name="magic"), "unknown verifier"),
                                       (dict(name="lenience", lenience=0.0), "l must be > 0"),
                                       (dict(name="cos", lam=1.5), r"lam must lie in \[0, 1\]"),
                                       (dict(name="overshoot", ceiling=0.9), "c >= 1"),
                                       (dict(name="eta", eps=0.0), "eps > 0"),
                                       (dict(name="minp", p_base=1.2), r"p_base must lie in \[0, 1\]")])
def test_out_of_range_parameters(bad, match):
    with pytest.raises(ValueError, match=match):
        Verifier(**bad)


def test_every_verifier_is_covered():
    assert {v.name for v in SETTINGS} == set(VERIFIERS)


@pytest.mark.parametrize("v", [Verifier("minp", p_base=0.3), Verifier("eta", eps=0.2)])
def test_truncation_output_never_leaves_the_allowed_set_bonus_included(v):
    from verify import allowed_set
    p = torch.softmax(2.0 * torch.randn(2, V, generator=torch.Generator().manual_seed(3)), -1)
    k, n_blocks = 1, 20_000
    drafted = p[0].argmax().expand(n_blocks, 1)  # always allowed, so every block reaches the bonus
    n, bonus = verify(p.expand(n_blocks, 2, V), None, drafted, v, torch.Generator().manual_seed(0))
    assert (n == k).all()
    allowed = allowed_set(p[1], v)
    assert allowed.sum() < V and allowed[bonus].all()  # some tokens are outside, and none is drawn
    # and inside the set the bonus follows p restricted to it
    expected = p[1] * allowed / (p[1] * allowed).sum()
    empirical = torch.bincount(bonus, minlength=V).double() / n_blocks
    assert torch.allclose(empirical, expected.double(), atol=5 * (0.25 / n_blocks) ** 0.5)


# p = (0.5, 0.2, 0.15, 0.1, 0.05): entropy H = 1.3331 nats, exp(-H) = 0.2637
@pytest.mark.parametrize("v,allowed", [
    (Verifier("minp", p_base=0.3), [0, 1, 2]),  # p >= 0.3 * 0.5 = 0.15
    (Verifier("minp", p_base=0.5), [0]),  # p >= 0.25
    # eta: p >= min(eps, delta * exp(-H)); eps 0.2, delta sqrt(0.2): min(0.2, 0.1179) = 0.1179
    (Verifier("eta", eps=0.2), [0, 1, 2]),
    (Verifier("eta", eps=0.06, delta=0.9), [0, 1, 2, 3]),  # min(0.06, 0.2373) = 0.06
])
def test_truncation_sets_are_their_papers_definitions(v, allowed):
    """Min-p keeps p(x) >= p_base max p; eta keeps p(x) >= min(eps, delta exp(-H(p))) (Hewitt et al.
    2022): the sets worked out by hand, so a wrong rule cannot pass as its own closed form."""
    from verify import allowed_set
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    assert allowed_set(p, v).nonzero()[:, 0].tolist() == allowed


def test_eta_default_is_eta_samplings_setting():
    assert Verifier("eta").eps == 3e-4 and Verifier("eta").delta is None  # delta = sqrt(eps) at use
