"""
Speculative decoding's loop: plain autoregressive sampling and speculative decoding in one.

Each step feeds the target the last committed token plus the draft's k guesses at positions
[L-1, L+k-1], one forward. The verifier keeps n guesses and appends one more token, so a step
commits n+1 tokens; the target's KV cache needs no rewind beyond starting the next step at the new
position (stale entries past it are masked, then overwritten). With no draft, k = 0 and the loop is
ordinary autoregressive decoding: the baseline every speedup is measured against. decode.py is its
command line; bench.py, train_vat.py and the experiments decode through it too.
"""
from dataclasses import dataclass, field

import torch

from draft import AdaptiveDraft, Draft, HybridDraft, NoDraft, tree_depths
from verify import Verifier, probs_from_logits, verify, verify_tree

DECODE_K = 5  # tokens drafted per step by default (report.py measures the same)


@dataclass
class Stats:
    """What one generation's speculation did: the counters behind tau and the speed tables."""
    k: int
    forwards: int = 0  # target forwards, one per step
    drafted: int = 0  # tokens the draft proposed
    declined: int = 0  # positions the draft chose not to propose (early exit, no lookup match)
    draft_seconds: float | None = None  # with a clock: the time spent drafting
    drafted_at: list = field(default_factory=list)  # per draft position: blocks that drafted it
    kept_at: list = field(default_factory=list)  # per draft position: blocks in which it was kept

    def __post_init__(self):
        self.drafted_at, self.kept_at = [0] * self.k, [0] * self.k

    def result(self, new: list, seconds: float | None, prefill_seconds: float | None,
               draft_forwards: int) -> dict:
        """The counts, and where the time went when the run had a clock (None where it had not)."""
        return {
            "tokens": new,
            "new_tokens": len(new),
            "seconds": seconds,
            "prefill_seconds": prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "tokens_per_s": None if seconds is None else len(new) / max(seconds - prefill_seconds,
                                                                         1e-9),
            "target_forwards": self.forwards,
            "draft_forwards": draft_forwards,
            "drafted_tokens": self.drafted,
            "declined_tokens": self.declined,  # early exits and lookup misses alike
            "tau": len(new) / max(self.forwards, 1),
            # fraction of blocks that drafted position i in which the token at i was kept
            "accepted_per_position": [a / d if d else 0.0
                                      for a, d in zip(self.kept_at, self.drafted_at)],
        }

    def count(self, asked: int, drafted: int, kept: int, depth: int | None = None):
        """One step: `asked` guesses wanted, `drafted` proposed, `kept` accepted; a tree also says
        its depth (acceptance by position is then by depth)."""
        self.forwards += 1
        self.drafted += drafted
        self.declined += asked - drafted
        for i in range(drafted if depth is None else depth):
            self.drafted_at[i] += 1
            self.kept_at[i] += i < kept


@dataclass
class Step:
    """What one speculative step decided: the tokens it commits (the `kept` guesses, then the
    verifier's own token), the target's hidden states at the positions fed (the last committed
    token's, then each verified guess's), and what the verifier saw: the guesses, the target's
    probabilities p over them (rows: the fed token's, then each guess's) and the draft's q. For a
    tree, guesses, p, q and hidden are the accepted path's; drafted counts every node."""
    tokens: list
    kept: int
    hidden: list
    guesses: torch.Tensor
    p: torch.Tensor
    q: torch.Tensor | None
    drafted: int
    depth: int | None = None  # a tree's depth (acceptance by position is then by depth)


def speculative_step(step_fn, seq: list, draft, k: int, verifier: Verifier,
                     temperature: float = 0.0, top_p: float = 1.0, generator=None) -> Step:
    """The algorithm: the draft guesses k tokens; one target forward (step_fn) scores the last
    committed token and the k guesses at positions [L-1, L+k-1]; the verifier keeps n guesses and
    adds one token of its own. k = 0 is a plain step."""
    guesses, q = draft.propose(k) if k > 0 else (torch.tensor([], dtype=torch.long), None)
    logits, hidden = score(step_fn, seq, guesses, draft.target_layers)
    p = probs_from_logits(logits[0], temperature, top_p)  # (k + 1, V)
    q = None if q is None else q.to(p.device)  # (k, V)
    n, next_token = verify(p[None], None if q is None else q[None], guesses.to(p.device)[None],
                           verifier, generator)  # (a batch of one)
    n = int(n)  # the one host sync of the step
    return Step(guesses[:n].tolist() + [int(next_token)], n, hidden, guesses, p, q, len(guesses))


def tree_step(target, seq: list, draft, size: int, depth: int, verifier: Verifier,
              temperature: float = 0.0, top_p: float = 1.0, generator=None) -> Step:
    """speculative_step with a tree: the draft proposes at most `size` nodes, at most `depth` deep;
    the forward scores every node against its own ancestors (model.tree_attention), the verifier
    walks down one path, and the target's cache keeps that path (target.keep_path)."""
    guesses, parents, q = draft.propose_tree(size, depth)
    chain = parents == list(range(-1, len(guesses) - 1))  # (a chain is verified as one)
    logits, hidden = score(target, seq, guesses, draft.target_layers, None if chain else parents)
    p = probs_from_logits(logits[0], temperature, top_p)  # (nodes + 1, V)
    q = None if q is None else q.to(p.device)
    path, next_token = verify_tree(p, q, guesses.to(p.device), parents, verifier, generator)
    target.keep_path([len(seq) + i for i in path], len(seq))
    rows = [0] + [i + 1 for i in path]  # the root's row and the accepted nodes'
    return Step(guesses[path].tolist() + [int(next_token)], len(path), [h[:, rows] for h in hidden],
                guesses[path], p[rows], None if q is None else q[path], len(guesses),
                depth=max(tree_depths(parents), default=0))


def score(step_fn, seq: list, guesses: torch.Tensor, hidden_layers, tree_parents=None):
    """The target's forward over the last committed token and the guesses, at positions [L-1,
    L-1+len(guesses)]: (logits (1, len(guesses) + 1, V), hidden states at hidden_layers)."""
    device = step_fn.embed_tokens.weight.device
    x = torch.cat([torch.tensor([seq[-1]]), guesses.cpu()]).to(device)[None]  # (1, guesses + 1)
    positions = torch.arange(len(seq) - 1, len(seq) + len(guesses), device=device)
    return step_fn(x, positions, hidden_layers=hidden_layers, tree_parents=tree_parents)


class TimedDraft:
    """What a step reads of a draft (its proposals and target_layers), the proposals timed by a
    clock (seconds: their sum): how a run with a clock learns what drafting cost, from outside
    the algorithm."""

    def __init__(self, draft, clock):
        self.draft, self.clock, self.seconds = draft, clock, 0.0
        self.target_layers = draft.target_layers

    def timed(self, propose, *args):
        t0 = self.clock()
        out = propose(*args)
        self.seconds += self.clock() - t0
        return out

    def propose(self, k):
        return self.timed(self.draft.propose, k)

    def propose_tree(self, size, depth):
        return self.timed(self.draft.propose_tree, size, depth)


def exact_verifier(temperature: float) -> Verifier:
    """The rule that keeps the output the target's own: greedy at T = 0, lossless speculative
    sampling at T > 0 (with no draft, k = 0, that is plain sampling from the warped p)."""
    return Verifier("greedy" if temperature <= 0 else "lossless")


@torch.inference_mode()  # (decoding never needs autograd's version and view tracking)
def generate(target, prompt_ids: list, draft=None, verifier: Verifier | None = None, k: int = 0,
             max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, stop_ids=(),
             generator: torch.Generator | None = None, on_tokens=None, step_fn=None, on_verify=None,
             tree: int = 0, clock=None) -> dict:
    """Generate up to max_new_tokens tokens after prompt_ids, speculatively when a draft is given
    (plain decoding is the case of no draft, k = 0). The verifier defaults to the exact rule for the
    temperature; greedy at T > 0 is refused, as it would emit the argmax whatever T says. Returns
    the new ids and statistics: tau (new tokens per target forward, bonus included), forwards,
    per-position acceptance. tree > 0 drafts trees of at most `tree` nodes and depth k instead of
    chains of k. clock: the caller's, a callable giving seconds after the device's queued work is
    done (engine.machine.wall_clock); with it the result says where the time went (the prefill,
    the drafting, tokens/s after the prefill), without it those are None."""
    verifier = exact_verifier(temperature) if verifier is None else verifier
    step_fn = target if step_fn is None else step_fn  # (a compiled module has no truth value)
    draft, k = (NoDraft(), 0) if draft is None else (draft, k)
    check_request(target.max_seq_len, len(prompt_ids), max_new_tokens, max(k, tree if k else 0),
                  verifier, temperature)
    t_start = clock() if clock else None
    draft_forwards_before = draft.forwards
    prefill(target, prompt_ids, draft)
    t_prefill = clock() - t_start if clock else None
    seq, new, stats = list(prompt_ids), [], Stats(k)
    drafting = TimedDraft(draft, clock) if clock else draft
    sampling = (temperature, top_p, generator)
    while len(new) < max_new_tokens:
        # guesses past the token budget are wasted; a DFlash block holds at most block_size - 1
        budget = min(k, max_new_tokens - len(new) - 1, draft.max_tokens)
        if tree and budget > 0:
            step = tree_step(target, seq, drafting, tree, budget, verifier, *sampling)
        else:
            step = speculative_step(step_fn, seq, drafting, budget, verifier, *sampling)
        stats.count(tree if step.depth is not None else budget, step.drafted, step.kept, step.depth)
        if on_verify is not None:
            on_verify(step.p, step.q, step.guesses, step.kept)
        out, n = step.tokens, step.kept
        # a stop token, even inside a kept block, ends generation there
        stop = next((j for j, t in enumerate(out) if t in stop_ids), None)
        out = out[:min(len(out) if stop is None else stop + 1, max_new_tokens - len(new))]
        seq += out
        new += out
        if on_tokens is not None:
            on_tokens(out, min(n, len(out)))  # (the first n came from the draft)
        if stop is not None or len(new) >= max_new_tokens:
            break
        # the target's states at the committed positions: the token fed and the n kept
        draft.commit(out, n, torch.cat(step.hidden, -1)[0, :n + 1] if step.hidden else None)
    stats.draft_seconds = drafting.seconds if clock else None
    seconds = clock() - t_start if clock else None
    return stats.result(new, seconds, t_prefill, draft.forwards - draft_forwards_before)


def prefill(target, prompt_ids: list, draft):
    """The target fed every prompt token but the last (each step starts by feeding that one), and
    the draft started on the prompt and the target's hidden states there."""
    device, L = target.embed_tokens.weight.device, len(prompt_ids)
    hidden = []
    if L > 1:
        _, hidden = target(torch.tensor([prompt_ids[:-1]], device=device),
                           torch.arange(L - 1, device=device), hidden_layers=draft.target_layers,
                           last_logits_only=True)
    draft.start(prompt_ids, torch.cat(hidden, -1)[0] if hidden else None)  # (L-1, n_layers * dim)


REQUEST_REMEDY = "lower --max-new-tokens, -k or --tree, or raise --max-seq-len"


def check_request(max_seq_len: int, L: int, max_new_tokens: int, k: int, verifier: Verifier,
                  temperature: float, remedy: str = REQUEST_REMEDY):
    """A one-line error for what generate cannot do: an empty prompt, more positions than the
    cache holds (remedy: what the caller's user can change), greedy verification at T > 0 (it
    would emit the argmax whatever T says)."""
    if verifier.name == "greedy" and temperature > 0:
        raise ValueError(f"the greedy verifier keeps the target's argmax, which is temperature 0; "
                         f"at temperature {temperature:g} use lossless (or a lossy verifier)")
    if L == 0:
        raise ValueError("empty prompt")
    if L + max_new_tokens + k > max_seq_len:
        raise ValueError(f"prompt of {L} tokens + {max_new_tokens} new + up to {k} drafted a step "
                         f"needs {L + max_new_tokens + k} positions; the context holds "
                         f"{max_seq_len} ({remedy})")


def adaptive(draft, block_costs: tuple, tree: int = 0, temperature: float = 0.0,
             clock=None) -> Draft:
    """The draft with its length (or with tree > 0, its tree's size) chosen each step by what a
    block costs (draft.AdaptiveDraft). block_costs: (cost(n, context) of a forward verifying n
    drafted tokens, in one-token steps, and the seconds of one step), as the caller measured them
    for the run's target (the CPU engine's engine.layouts.run_block_costs); (None, None) counts
    every block as one step, as on a GPU. clock: the caller's (generate's), with which the
    adaptive draft learns what its draft's own forwards cost; without one, they cost nothing. A
    hybrid adapts its two sources apart (HybridDraft.adapted)."""
    problem = adaptive_tree_problem(tree, temperature, draft.sizes_trees)
    if problem:
        raise ValueError(problem)
    if isinstance(draft, HybridDraft):
        return draft.adapted(lambda part: AdaptiveDraft(part, *block_costs, clock=clock))
    return AdaptiveDraft(draft, *block_costs, clock=clock)


def adaptive_tree_problem(tree: int, temperature: float,
                          sizes_trees: bool = True) -> str | None:
    """Why an adaptive draft cannot size trees of `tree` nodes here, or None: it sizes them at
    temperature 0 only, for drafts whose nodes come ranked (EAGLE-3). Scripts ask it before
    loading anything, with what they know of the draft yet."""
    if tree and temperature > 0:
        return ("adaptive trees are sized at temperature 0 only: at T > 0 a tree's nodes are "
                "drawn, and pruning drawn nodes by their value would bias what the verifier sees "
                "(drop --adaptive or --tree)")
    if tree and not sizes_trees:
        return ("adaptive trees are sized for EAGLE-3 drafts, whose tree nodes come ranked: drop "
                "--adaptive or --tree")
    return None
