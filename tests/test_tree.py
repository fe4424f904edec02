"""Tree verification: the chain rule as its one-child case (bit for bit), lossless exactness by
enumeration over children drawn without replacement, every verifier's sampler against its closed
form given the children."""
import itertools

import pytest
import torch

from verify import Verifier, induced, induced_children, verify, verify_tree

V = 5
SETTINGS = [Verifier("greedy"), Verifier("lossless"), Verifier("minp", p_base=0.3), Verifier("eta", eps=0.2),
            Verifier("cos", lam=0.3), Verifier("lenience", lenience=0.4), Verifier("overshoot", lam=0.2, ceiling=1.5)]


def dist(g, scale=2.0, size=V):
    return torch.softmax(scale * torch.randn(size, generator=g), -1)


def without(q: torch.Tensor, removed: list) -> torch.Tensor:
    """q with the tokens drawn before removed, renormalized: a child's q when sampling without replacement."""
    q = q.clone()
    q[removed] = 0
    return q / q.sum()


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_one_child_tree_is_the_chain_bit_for_bit(v, deterministic):
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        k = trial % 5  # k = 0 is plain decoding: no node at all
        p = torch.stack([dist(g, 3.0) for _ in range(k + 1)])
        q = None if deterministic or k == 0 else torch.stack([dist(g, 3.0) for _ in range(k)])
        tokens = torch.multinomial(q, 1)[:, 0] if q is not None else torch.randint(V, (k,), generator=g)
        seed = 1000 + trial
        n, chain_next = verify(p[None], None if q is None else q[None], tokens[None], v,
                               torch.Generator().manual_seed(seed))
        path, tree_next = verify_tree(p, q, tokens, list(range(-1, k - 1)), v, torch.Generator().manual_seed(seed))
        assert path == list(range(int(n))) and tree_next == int(chain_next), (trial, v)


def ordered_draws(q: torch.Tensor, m: int):
    """Every ordered draw of m distinct tokens without replacement from q, with its probability
    and the q each child was drawn from."""
    for xs in itertools.permutations(range(len(q)), m):
        prob, qs = 1.0, []
        for i, x in enumerate(xs):
            q_i = without(q, list(xs[:i]))
            prob *= float(q_i[x])
            qs.append(q_i)
        yield xs, prob, qs


@pytest.mark.parametrize("m", [1, 2, 3])
def test_lossless_with_children_sampled_without_replacement_is_p(m):
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        p, q = dist(g).double(), dist(g, 1.0).double()
        q[int(torch.randint(V, (1,), generator=g))] = 0  # a token the draft never proposes
        q = q / q.sum()
        out = torch.zeros(V, dtype=torch.double)
        for xs, prob, qs in ordered_draws(q, m):
            if prob > 0:
                out += prob * induced_children(p, list(xs), qs, Verifier("lossless"))
        assert torch.allclose(out, p, atol=1e-12)


def test_lossless_with_deterministic_children_is_p_whatever_they_are():
    g = torch.Generator().manual_seed(2)
    for m in range(V + 1):
        for _ in range(5):
            p = dist(g).double()
            xs = torch.randperm(V, generator=g)[:m].tolist()
            assert torch.allclose(induced_children(p, xs, [None] * m, Verifier("lossless")), p, atol=1e-12)


@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_one_sampled_child_averages_to_the_chain_closed_form(v):
    g = torch.Generator().manual_seed(3)
    p, q = dist(g).double(), dist(g, 1.0).double()
    out = sum(q[x] * induced_children(p, [x], [q], v) for x in range(V))
    assert torch.allclose(out, induced(p, q, v), atol=1e-12)


SAMPLES = 20_000


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_sampler_matches_the_closed_form_given_the_children(v, deterministic):
    """A root with three children (leaves): the token verify_tree emits first, accepted or drawn,
    against induced_children, within 5 standard errors per token."""
    g = torch.Generator().manual_seed(4)
    p_root, q = dist(g), dist(g, 1.0)
    tokens = [int(t) for t in torch.multinomial(q, 3, replacement=False, generator=g)]
    qs = [None] * 3 if deterministic else [without(q, tokens[:i]) for i in range(3)]
    p = torch.stack([p_root] + [dist(g) for _ in range(3)])
    expected = induced_children(p_root, tokens, qs, v).double()
    counts = torch.zeros(V, dtype=torch.double)
    sampler = torch.Generator().manual_seed(5)
    q_nodes = None if deterministic else torch.stack(qs)
    for _ in range(SAMPLES):
        path, nxt = verify_tree(p, q_nodes, torch.tensor(tokens), [-1, -1, -1], v, sampler)
        counts[tokens[path[0]] if path else nxt] += 1
    empirical = counts / SAMPLES
    bound = 5 * (expected * (1 - expected) / SAMPLES).sqrt() + 1e-3
    assert ((empirical - expected).abs() <= bound).all(), (empirical, expected)


def test_a_rejected_child_never_comes_out_as_the_correction():
    g = torch.Generator().manual_seed(6)
    for _ in range(200):
        p, q = dist(g), dist(g, 1.0)
        tokens = torch.multinomial(q, 2, replacement=False, generator=g)
        qs = torch.stack([q, without(q, [int(tokens[0])])])
        path, nxt = verify_tree(torch.stack([p, p, p]), qs, tokens, [-1, -1], Verifier("lossless"), g)
        if not path:
            assert nxt not in tokens.tolist()


def test_greedy_follows_the_argmax_down_the_tree():
    # root -> {a, b}; b -> {c, d}: the argmax at the root is b, at b it is d
    p = torch.full((5, V), 0.1)
    p[0, 1] = p[2, 3] = p[4, 0] = 0.6
    tokens = torch.tensor([0, 1, 2, 3])  # a=0, b=1, c=2, d=3
    path, nxt = verify_tree(p, None, tokens, [-1, -1, 1, 1], Verifier("greedy"))
    assert path == [1, 3] and nxt == 0
