"""
Verifiers: given the target's distributions p over k+1 positions, the draft's distributions q over
k positions (None for a deterministic draft such as prompt lookup) and the k drafted tokens,
decide how many drafted tokens to keep and which token comes next (a correction on rejection, a
bonus token from p[k] when all k are kept).

Three families:
  exact         greedy (for T = 0) and lossless speculative sampling: the output is distributed
                exactly as the target's.
  truncation    minp, eta: keep a drafted token iff it lies in an allowed set of p; every token
                the verifier draws itself, the correction on rejection and the bonus token after
                a fully kept block, comes from p restricted to that set, as min-p and eta
                sampling draw every token. So the output never leaves the allowed set.
  collaborative cos, lenience, overshoot: accept with min(1, t(x)/q(x)) for a target t that
                mixes p and q, correct from the target's residual norm(max(0, p - q)).

Every verifier has its induced one-step output distribution in closed form (`induced`), which the
tests compare against the sampler (`verify`).

Shapes: p (B, k+1, V), q (B, k, V) or None, draft_tokens (B, k). Everything is batched over B
blocks and k positions; the caller pays one host sync per block to read the accepted count.
"""
import math
from dataclasses import dataclass

import torch

VERIFIERS = ("greedy", "lossless", "minp", "eta", "cos", "lenience", "overshoot")
LOSSY = VERIFIERS[2:]  # the truncation and collaborative families: output no longer the target's


@dataclass(frozen=True)
class Verifier:
    """A verification rule and its parameters (only those of `name` matter)."""
    name: str = "lossless"
    p_base: float = 0.1  # minp: keep x iff p(x) >= p_base * max p
    # eta: keep x iff p(x) >= min(eps, delta * exp(-H(p))). eps 3e-4 with delta = sqrt(eps) is
    # eta-sampling's own setting (Hewitt et al. 2022); Medusa's typical acceptance is eps 0.09
    eps: float = 3e-4
    delta: float | None = None
    lam: float = 0.5  # cos and overshoot: weight of p in the mixture lam * p + (1 - lam) * q
    lenience: float = 0.5  # lenience: accept with min(1, p / (l * q)); l < 1 is more lenient
    ceiling: float = 2.0  # overshoot: an overshot token (q > p) gets at most c * p(x)

    def __post_init__(self):
        if self.name not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.name!r}; choose from {', '.join(VERIFIERS)}")
        checks = {"minp": (0 <= self.p_base <= 1, f"p_base must lie in [0, 1], got {self.p_base}"),
                  "eta": (self.eps > 0 and (self.delta is None or 0 < self.delta <= 1),
                          f"eta needs eps > 0 and delta in (0, 1], got eps={self.eps} "
                          f"delta={self.delta}"),
                  "cos": (0 <= self.lam <= 1, f"lam must lie in [0, 1], got {self.lam}"),
                  "lenience": (self.lenience > 0, f"lenience l must be > 0, got {self.lenience}"),
                  "overshoot": (0 <= self.lam <= 1 and self.ceiling >= 1,
                                f"overshoot needs lam in [0, 1] and c >= 1, got lam={self.lam} "
                                f"c={self.ceiling}")}
        ok, message = checks.get(self.name, (True, ""))
        if not ok:
            raise ValueError(message)

    @property
    def family(self) -> str:
        families = {"greedy": "exact", "lossless": "exact", "minp": "truncation",
                    "eta": "truncation"}
        return families.get(self.name, "collaborative")


# -----------------------------------------------------------------------------
# Sampling controls, applied to p (and to the draft's q) the same way for every verifier

def check_temperature(value: float, flag: str = "--temperature") -> str | None:
    """What is wrong with a sampling temperature (one line, naming its flag), or None."""
    if not math.isfinite(value) or value < 0:
        return f"{flag} must be a finite number >= 0, got {value}"
    return None


def probs_from_logits(logits: torch.Tensor, temperature: float = 0.0,
                      top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities; temperature 0 is the one-hot argmax."""
    if temperature <= 0:
        one_hot = torch.zeros_like(logits, dtype=torch.float32)
        return one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.float()
    # shifted so the largest is 0 before dividing: a tiny temperature then sends the others to -inf
    # (probability 0) instead of overflowing them all to inf (NaN)
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, temperature: float,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per distribution, (..., V) -> (...,): drawn at T > 0, the argmax at T = 0."""
    if temperature <= 0:
        return probs.argmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# -----------------------------------------------------------------------------
# The pieces each rule is built from, elementwise so the sampler and the closed form share them

def allowed_set(p: torch.Tensor, v: Verifier) -> torch.Tensor:
    """Truncation family: (..., V) bool mask of the tokens p allows. The argmax is always in."""
    top = p.max(-1, keepdim=True).values
    if v.name == "minp":
        allowed = p >= v.p_base * top
    else:
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1, keepdim=True)
        delta = math.sqrt(v.eps) if v.delta is None else v.delta
        allowed = p >= torch.clamp(delta * torch.exp(-entropy), max=v.eps)
    return allowed | (p == top)


def own_distribution(p: torch.Tensor, v: Verifier) -> torch.Tensor:
    """What the verifier draws from when no drafted token is at stake: the bonus token after a
    fully kept block, and every token of plain decoding. (..., V) -> (..., V)."""
    if v.name == "greedy":
        return torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)
    if v.family == "truncation":  # min-p and eta sampling: p restricted to the allowed set
        kept = p * allowed_set(p, v)
        return kept / kept.sum(-1, keepdim=True)
    return p


def accept_target(p_x: torch.Tensor, q_x: torch.Tensor, v: Verifier) -> torch.Tensor:
    """Collaborative and lossless rules accept x with min(1, t(x) / q(x)); this is t."""
    if v.name == "lossless":
        return p_x
    if v.name == "lenience":
        return p_x / v.lenience
    mix = v.lam * p_x + (1 - v.lam) * q_x
    if v.name == "cos":
        return mix
    # overshoot ceiling: min(mix, c * p). The max() is an identity in exact arithmetic (mix >=
    # min(p, q)) that keeps rounding from breaking the c = 1 -> lossless identity bit for bit.
    return torch.minimum(v.ceiling * p_x, torch.maximum(mix, torch.minimum(p_x, q_x)))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), the mass the draft under-proposed; p itself where q covers p."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


# -----------------------------------------------------------------------------
# The sampler

def verify(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor, v: Verifier,
           generator: torch.Generator | None = None):
    """Returns (n_accepted (B,), next_token (B,)). p (B, k+1, V), q (B, k, V) or None, draft_tokens
    (B, k)."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    # every sampling rule draws the same uniforms, used or not, so that runs of different verifiers
    # from one seed consume the same random numbers and stay coupled until their tokens differ
    draws = k > 0 and v.name != "greedy"
    u = torch.rand(B, k, generator=generator, device=p.device) if draws else None  # (B, k)
    if k == 0:  # plain decoding: no draft, the next token comes straight from p
        accepted = torch.zeros(B, 0, dtype=torch.bool, device=p.device)
    elif v.name == "greedy":
        accepted = p[:, :k].argmax(-1) == draft_tokens
    elif v.family == "truncation":
        accepted = allowed_set(p[:, :k], v).gather(-1, draft_tokens[..., None])[..., 0]
    else:
        p_x = p[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # (B, k)
        q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft_tokens[..., None])[..., 0]
        accepted = u < (accept_target(p_x, q_x, v) / q_x).clamp(max=1.0)
    n = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the all-accepted prefix

    # the distribution of the next token: a correction at position n < k, or the bonus p[k]
    p_n = p[rows, n]  # (B, V)
    if v.name == "greedy":
        return n, p_n.argmax(-1)
    if v.family == "truncation":  # correction and bonus alike: p restricted to the allowed set
        return n, torch.multinomial(own_distribution(p_n, v), 1, generator=generator)[:, 0]
    rejected = (n < k)[:, None]
    if k > 0:
        n_clamped = n.clamp(max=k - 1)
        if q is None:  # deterministic draft: q is one-hot at the drafted token
            q_n = torch.zeros_like(p_n).scatter_(-1, draft_tokens[rows, n_clamped][:, None], 1.0)
        else:
            q_n = q[rows, n_clamped]
        fix = residual(p_n, q_n)
    else:
        fix = p_n
    dist = torch.where(rejected, fix, p_n)
    return n, torch.multinomial(dist, 1, generator=generator)[:, 0]


# -----------------------------------------------------------------------------
# Closed forms

def induced(p: torch.Tensor, q: torch.Tensor, v: Verifier) -> torch.Tensor:
    """The one-step output distribution (V,) (or batched (..., V)) of verifying one drafted token
    x ~ q against target p: P(out = y) = P(x = y accepted) + P(reject) * P(correction = y).
      greedy:     one-hot argmax p
      lossless:   min(q, p) + (1 - sum min(q, p)) * norm(max(0, p - q))   (= p)
      minp, eta:  q * 1_A + (1 - q(A)) * p_A,   A the allowed set, p_A = norm(p * 1_A)
      cos:        min(q, m) + (1 - sum min(q, m)) * r,  m = lam p + (1-lam) q,
                  r = norm(max(0, p - q))   (= m: the output is the mixture itself)
      lenience:   min(q, p / l) + (1 - sum min(q, p / l)) * r
      overshoot:  min(q, t) + (1 - sum min(q, t)) * r,  t = min(m, c p): an overshot token
                  (q > p, so r = 0 there) gets min(q, m, c p) <= c p; the rest is refilled from r
    A deterministic draft proposing x is the case q = one-hot(x)."""
    if v.name == "greedy":
        return own_distribution(p, v)
    if v.family == "truncation":
        allowed = allowed_set(p, v)
        q_in = (q * allowed).sum(-1, keepdim=True)
        return q * allowed + (1 - q_in) * own_distribution(p, v)
    kept = torch.minimum(q, accept_target(p, q, v))
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0) * residual(p, q)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, v: Verifier) -> torch.Tensor:
    """P(the drafted token x ~ q is kept), (...,) from (..., V)."""
    if v.name == "greedy":
        return q.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
    if v.family == "truncation":
        return (q * allowed_set(p, v)).sum(-1)
    return torch.minimum(q, accept_target(p, q, v)).sum(-1)


# -----------------------------------------------------------------------------
# Trees: each node a drafted token with a parent; siblings are alternatives tried in order
#
# A draft tree holds N nodes in topological order: tokens (N,), parents (N,) (-1: a child of the
# last committed token, the root) and q (N, V) or None: q[i] is the distribution node i was drawn
# from given its earlier siblings (a child sampled without replacement: q with the earlier
# siblings removed and renormalized). None means every child was chosen deterministically (top-k
# of a draft, lookup matches): q[i] is one-hot at tokens[i]. p (N+1, V) holds the target's
# distribution after the root (p[0]) and after each node (p[i + 1]).
#
# At a node, the children are tried in order with the chain's own rule and its acceptance target;
# after a rejected child x drawn from q_x the verifier carries on against the residual
# p <- norm(max(p - q_x, 0)) (which gives x nothing: x cannot come out twice), and when every child
# fails, it draws from what is left: the recursive rejection sampling of multi-candidate
# speculative decoding. With one-hot q this is EAGLE-2's rule (accept x with p(x), else zero x in
# p and renormalize). Truncation keeps the first child in the allowed set of the node's p, else
# draws from p restricted to that set; greedy follows the child equal to the argmax. A tree whose
# nodes each have one child is the chain, and verify_tree returns what verify does, bit for bit.

def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).scatter_(-1, torch.tensor([token], device=like.device), 1.0)


def children_of(parents: list) -> dict:
    """{node (-1 for the root): its children in sibling order}."""
    children = {-1: []}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
        children.setdefault(i, [])
    return children


def verify_tree(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, parents: list,
                v: Verifier, generator: torch.Generator | None = None):
    """Returns (the accepted path as node indices, root to leaf, next_token). p (N+1, V), q (N, V)
    or None, tokens (N,), parents: N ints."""
    N = len(tokens)
    children = children_of(parents)
    tokens = tokens.tolist()
    # the same uniforms as verify's, one per node, so a chain-shaped tree consumes what a chain does
    draws = N > 0 and v.name != "greedy"
    u = torch.rand(1, N, generator=generator, device=p.device)[0] if draws else None  # (N,)
    path, node = [], -1
    while True:
        p_node = p[node + 1]  # (V,)
        p_left = p_node  # the residual after this node's rejected children
        kept = None
        allowed = allowed_set(p_node, v) if v.family == "truncation" else None
        for child in children[node]:
            x = tokens[child]
            if v.name == "greedy":
                ok = x == int(p_node.argmax())
            elif allowed is not None:
                ok = bool(allowed[x])
            else:
                q_child = one_hot(x, p_node) if q is None else q[child]
                p_x, q_x = p_left[x], q_child[x]
                ok = bool(u[child] < (accept_target(p_x, q_x, v) / q_x).clamp(max=1.0))
                if not ok:
                    p_left = residual(p_left[None], q_child[None])[0]
            if ok:
                kept = child
                break
        if kept is None:
            if v.name == "greedy":
                return path, int(p_node.argmax())
            dist = own_distribution(p_node, v) if v.family == "truncation" else p_left
            return path, int(torch.multinomial(dist[None], 1, generator=generator)[0, 0])
        path.append(kept)
        node = kept


def induced_children(p: torch.Tensor, children_tokens: list, children_q: list,
                     v: Verifier) -> torch.Tensor:
    """The closed form of one node's output (V,) given its children: the distribution of the token
    verify_tree emits after the node (an accepted child, or a draw of its own) when the children
    are children_tokens in order, children_q their q (None: one-hot). Recursively, x the first
    child, q_x its q:
      greedy:      one-hot argmax p, whatever the children
      truncation:  one-hot x if x is in A(p), else the same over the remaining children;
                   p restricted to A(p) when none is left
      the others:  a one-hot x + (1 - a) out(residual(p, q_x), remaining children),
                   a = min(1, t(x) / q_x(x)) with t the verifier's acceptance target for (p, q_x);
                   p itself when none is left
    Averaged over one child x ~ q this is `induced`; averaged over children drawn without
    replacement, lossless gives p (tests/test_verify.py enumerates both)."""
    return _induced_children(p, p, children_tokens, children_q, v)


def _induced_children(p_node, p, tokens: list, qs: list, v: Verifier) -> torch.Tensor:
    if v.name == "greedy" or not tokens:
        return own_distribution(p_node if v.family == "truncation" else p, v)
    x, q_x = tokens[0], one_hot(tokens[0], p) if qs[0] is None else qs[0]
    if v.family == "truncation":
        if allowed_set(p_node, v)[x]:
            return one_hot(x, p)
        return _induced_children(p_node, p, tokens[1:], qs[1:], v)
    a = (accept_target(p[x], q_x[x], v) / q_x[x]).clamp(max=1.0)
    rest = _induced_children(p_node, residual(p[None], q_x[None])[0], tokens[1:], qs[1:], v)
    return a * one_hot(x, p) + (1 - a) * rest
