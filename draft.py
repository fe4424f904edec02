"""
Drafts: cheap proposers of the next k tokens. Every draft speaks one interface (`Draft` below),
which speculative.py's loop drives without knowing which draft it holds.

Layer indices: inside this project every list of target layers is in model.py's convention
(hidden[i] enters layer i). Released configs name *outputs* of layers instead (EAGLE-3's
eagle_aux_hidden_state_layer_ids, DFlash's target_layer_ids: output of layer j = hidden[j + 1]);
checkpoints.py converts at the checkpoint boundary and nowhere else.

This file holds prompt lookup (n-gram matching, training-free), an independent draft model (any
model.py checkpoint sharing the target's tokenizer), what the two trained drafts with verification
heads share (their networks live in eagle3.py and dflash.py), and two wrappers of any draft: a
hybrid with prompt lookup, and an adaptive draft length that drafts where it pays.
"""
import torch

from verify import probs_from_logits, sample


class Draft:
    """What speculative.py's loop needs of a draft: every draft derives from this class and
    declares what differs. Shapes: V is the target's vocabulary, dim its hidden size."""
    target_layers: tuple = ()  # the target hidden states it reads (model.py's indices); () for none
    forwards: int = 0  # draft forwards run so far (lookups are none)
    max_tokens: float = float("inf")  # the most guesses one propose returns (DFlash: its block - 1)
    # proposing costs nothing worth timing: AdaptiveDraft may watch its proposals unverified
    free: bool = False
    # propose_tree ranks its nodes and takes size=: AdaptiveDraft can size its trees (T = 0)
    sizes_trees: bool = False
    # drafts with a verification head: its logits for the tokens of the last propose, in order (a
    # list of tensors, one or more logits each); () for drafts without one
    proposal_head_logits: list = ()

    def start(self, prompt_ids: list, features: torch.Tensor | None) -> None:
        """Sees the prompt; features (L-1, len(target_layers) * dim) are the target's states at
        positions 0..L-2, or None."""
        raise NotImplementedError

    def propose(self, k: int) -> tuple:
        """(tokens (k',), q (k', V) or None): k' <= k guesses continuing the committed sequence,
        with the distributions they were drawn from (None: deterministic); fewer than k when the
        draft declines the rest."""
        raise NotImplementedError

    def propose_tree(self, n: int, depth: int, size=None) -> tuple:
        """(tokens (n',), parents (n' ints, -1 for a child of the last committed token), q (n', V)
        or None): a draft tree of at most n nodes and depth, in topological order, siblings in the
        order verification tries them. q[i] is the distribution node i was drawn from given its
        earlier siblings; None: chosen deterministically (verify.py's tree section). size, for
        drafts that size their trees (sizes_trees): given the candidate nodes' values best first,
        how many to keep. By default a draft proposes its chain of min(n, depth) guesses."""
        return as_tree(*self.propose(min(n, depth)))

    def commit(self, new_ids: list, n_accepted: int, features: torch.Tensor | None) -> None:
        """The verifier kept n_accepted guesses and added one token of its own; new_ids are all of
        them, features (n_accepted + 1, len(target_layers) * dim) the target's states at the
        positions just committed (or None). A draft with a cache rewinds it to what is still
        valid."""
        raise NotImplementedError


# What a trained draft's early exit reads, for each drafted token, to decide whether to go on:
# 'head', VAT's verification head (its probability that the token is kept), or 'confidence', the
# draft's own probability of its most likely token (EAGLE-2's signal, which needs no head)
EXIT_SIGNALS = ("head", "confidence")


def exit_probability(signal: str, logits: torch.Tensor, head_logits: torch.Tensor) -> torch.Tensor:
    """Draft logits (..., Vd) and head logits (...) -> the early-exit signal (...) in [0, 1];
    drafting stops at the first token whose signal falls below the threshold. The confidence is read
    before temperature or top-p, so one threshold means the same at every temperature."""
    if signal == "head":
        return torch.sigmoid(head_logits)
    return torch.softmax(logits.float(), -1).amax(-1)


def no_tokens():
    return torch.tensor([], dtype=torch.long), None


def tree_depths(parents: list) -> list:
    """Depth of each node of a draft tree (1 for a child of the root)."""
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def as_tree(tokens: torch.Tensor, q):
    """A chain as a tree: each guess the only child of the one before."""
    return tokens, list(range(-1, len(tokens) - 1)), q


class NoDraft(Draft):
    """Plain decoding: proposes nothing, so every step is one ordinary decoding step."""

    max_tokens = 0

    def start(self, prompt_ids, features=None):
        pass

    def propose(self, k: int):
        return no_tokens()

    def commit(self, new_ids, n_accepted, features=None):
        pass


class LookupDraft(Draft):
    """Prompt lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it. An index of
    every n-gram's positions makes a lookup cost the same at any context length."""

    free = True  # a lookup costs no forward

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list = []
        self.starts: dict = {}  # n-gram (a tuple) -> the positions it starts at, increasing
        self.forwards = 0  # no network: lookups are not forwards

    def start(self, prompt_ids, features=None):
        self.seq, self.starts = [], {}
        self.extend(prompt_ids)

    def extend(self, ids):
        for token in ids:
            self.seq.append(token)
            end = len(self.seq)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.starts.setdefault(tuple(self.seq[end - n :]), []).append(end - n)

    def continuations(self, k: int):
        """What followed earlier occurrences of the last n tokens (at most k tokens each): longest
        n first, then the most recent match first."""
        seq = self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            starts = self.starts.get(tuple(seq[-n:]), [])[:-1]  # (the last is the tail itself)
            for start in reversed(starts):
                follow = seq[start + n:start + n + k]
                if follow:
                    yield follow

    def propose(self, k: int):
        follow = next(self.continuations(k), None)
        return (torch.tensor(follow), None) if follow else no_tokens()

    def propose_tree(self, n: int, depth: int, size=None):
        """Several matches as branches: the continuations merged into a trie (a prefix two of
        them share is one path), best match first, until n nodes."""
        tokens, parents, child = [], [], {}  # child[(parent, token)] = node
        for follow in self.continuations(depth):
            parent = -1
            for token in follow:
                if (parent, token) not in child:
                    if len(tokens) == n:
                        break
                    child[parent, token] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = child[parent, token]
            if len(tokens) == n:
                break
        if not tokens:
            return torch.tensor([], dtype=torch.long), [], None
        return torch.tensor(tokens), parents, None

    def commit(self, new_ids, n_accepted, features=None):
        self.extend(new_ids)


class ModelDraft(Draft):
    """A smaller model of the same family (e.g. qwen3-0.6b for qwen3-4b) drafting autoregressively.
    Its cache holds `cache_len` committed tokens; each propose first feeds the committed tokens it
    has not seen (one, or two after a fully accepted block) and then drafts k tokens."""

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, generator=None):
        self.model, self.generator = model, generator
        self.temperature, self.top_p = temperature, top_p
        self.device = model.embed_tokens.weight.device
        self.seq: list = []
        self.cache_len = 0
        self.drafted = 0
        self.forwards = 0

    def start(self, prompt_ids, features=None):
        self.seq = list(prompt_ids)
        self.cache_len = self.drafted = 0

    @torch.no_grad()
    def propose(self, k: int):
        pending = self.seq[self.cache_len :]  # committed, not yet in the draft's cache
        tokens, dists = [], []
        x = torch.tensor([pending], device=self.device)
        pos = torch.arange(self.cache_len, len(self.seq), device=self.device)
        for _ in range(k):
            logits, _ = self.model(x, pos, last_logits_only=True)
            self.forwards += 1
            q = probs_from_logits(logits[0, -1], self.temperature, self.top_p)  # (V,)
            token = sample(q, self.temperature, self.generator)
            tokens.append(token)
            dists.append(q)
            x, pos = token.view(1, 1), pos[-1:] + 1
        # the cache now holds the committed sequence plus all drafted tokens but the last
        self.cache_len = len(self.seq)
        self.drafted = len(tokens)
        if not tokens:
            return no_tokens()
        return torch.stack(tokens), torch.stack(dists)  # (k,), (k, V)

    def commit(self, new_ids, n_accepted, features=None):
        # drafted tokens 0..drafted-2 went through the cache; keep the accepted ones among them
        self.cache_len += min(n_accepted, max(self.drafted - 1, 0))
        self.seq += list(new_ids)
        self.drafted = 0  # a step this draft sits out (HybridDraft, AdaptiveDraft) drafts nothing


# -----------------------------------------------------------------------------
# Shared by the trained drafts (eagle3.py, dflash.py)


def draw_without_replacement(q: torch.Tensor, m: int, generator=None) -> list:
    """Up to m distinct tokens drawn in turn from q (V,), each from q with the earlier ones removed:
    [(token, the distribution it was drawn from (V,), q(token))]. Fewer where q has fewer tokens."""
    drawn = []
    for _ in range(m):
        if q.sum() <= 0:
            break
        q = q / q.sum()
        x = int(torch.multinomial(q, 1, generator=generator))
        drawn.append((x, q, float(q[x])))
        q = q.clone()
        q[x] = 0
    return drawn


# -----------------------------------------------------------------------------
# Hybrid: prompt lookup where the context repeats, the model draft elsewhere


class HybridDraft(Draft):
    """Prompt lookup first, the model draft when lookup finds no match of at least two tokens.
    A lookup costs no forward and is right where the answer copies its context (extraction,
    rewriting, repeated phrases); the trained draft takes every other step. Both see every commit,
    so either can propose at the next step."""

    def __init__(self, model_draft, lookup: LookupDraft | None = None):
        # single-token matches are mostly coincidence: they would crowd out the better guesser
        self.lookup = lookup or LookupDraft(max_ngram=3, min_ngram=2)
        self.model_draft = model_draft
        self.target_layers = model_draft.target_layers
        self.max_tokens = model_draft.max_tokens  # a DFlash block's limit
        self.looked_up = self.steps = 0

    @property
    def forwards(self):
        return self.model_draft.forwards

    def start(self, prompt_ids, features=None):
        self.lookup.start(prompt_ids)
        self.model_draft.start(prompt_ids, features)

    def propose(self, k: int):
        self.steps += 1
        tokens, q = self.lookup.propose(k)
        if len(tokens):
            self.looked_up += 1
            return tokens, q
        return self.model_draft.propose(k)

    def propose_tree(self, n: int, depth: int, size=None):
        self.steps += 1
        tree = self.lookup.propose_tree(n, depth)
        if len(tree[0]):
            self.looked_up += 1
            return tree
        return self.model_draft.propose_tree(n, depth)

    def commit(self, new_ids, n_accepted, features=None):
        self.lookup.commit(new_ids, n_accepted)
        self.model_draft.commit(new_ids, n_accepted, features)

    def adapted(self, wrap):
        """The hybrid with each source wrapped apart (wrap: a draft -> its AdaptiveDraft). A lookup
        match is kept far more often than a model guess and costs no forward: one acceptance rate
        and one draft time for both would draft the model where only lookup pays, or pause lookup's
        free matches where only the model does not pay. Apart, lookup drafts or is watched by its
        own record, and the model drafts by its own on the steps lookup leaves it."""
        return HybridDraft(wrap(self.model_draft), wrap(self.lookup))


# -----------------------------------------------------------------------------
# Adaptive draft length: draft long where guesses are kept, pause where none are


class AdaptiveDraft(Draft):
    """Wraps any draft and drafts, each step, the number of tokens that pays: the n maximizing
    expected tokens per unit of time, (1 + a + ... + a^n) / cost(n, context), where a is the recent
    acceptance rate of a drafted token (decayed counts from a prior) and cost(n, context) what a
    forward verifying n drafted tokens costs in one-token steps on this machine at this context
    length (layouts.block_cost_model), plus the draft's own time. n = 0 is a plain decoding step:
    where no length pays, the run decodes plainly. It keeps learning whether drafting pays again: a
    free draft (prompt lookup) is watched, its proposals compared with the tokens plain decoding
    commits, at no cost; any other drafts one token after 4, 8, 16 and then every 32 plain steps.
    cost None (a GPU, where a block costs about a step) counts every block as one step. The draft
    still sees every commit. Trees are sized by the same rule (propose_tree). clock: the caller's (a
    callable giving seconds), with which the draft's own time is learned; without one the draft is
    taken to cost nothing."""

    # plain steps between one-token probes of a draft that does not pay, doubling from FIRST_PAUSE
    # to MAX_PAUSE: a probe costs a block of two tokens and a draft forward, and a draft that
    # never pays costs its probes over a run (a few in a short answer)
    FIRST_PAUSE, MAX_PAUSE = 4, 32
    # what a drafting step must gain over a plain one: its own work (the proposal, the verifier,
    # the bookkeeping) is not in the block table, and the estimate of a is noisy
    MARGIN = 1.04
    DECAY = 0.9  # weight of the past in the acceptance estimate, per drafted token seen

    def __init__(self, draft, cost=None, step_seconds: float | None = None, clock=None):
        self.draft, self.clock = draft, clock
        self.target_layers = draft.target_layers
        self.max_tokens = draft.max_tokens
        self.cost, self.step_seconds = cost, step_seconds
        self.draft_step = 0.0  # the draft's time per proposed token, in one-token target steps
        self.reset(0)

    @property
    def forwards(self):
        return self.draft.forwards

    def start(self, prompt_ids, features=None):
        self.draft.start(prompt_ids, features)
        self.reset(len(prompt_ids))

    def reset(self, context: int):
        """A new sequence: what was learned of the last one's acceptance is dropped."""
        # a prior worth two drafted tokens: one half, or a quarter for a free draft, which learns
        # by being watched at no cost and need not draft to find out
        prior = 0.25 if self.draft.free else 0.5
        self.kept, self.tried = 2.0 * prior, 2.0
        self.context = context
        self.paused = self.next_pause = self.FIRST_PAUSE
        self.proposed, self.watched = 0, []
        # trees: tokens kept against the tokens their nodes' values expected (decayed, a prior of
        # one tree that kept what it expected), and the last tree's expectation until its verdict
        self.tree_kept, self.tree_valued, self.tree_expected, self.tree_depth = 1.0, 1.0, None, 0

    def learn(self, kept: bool):
        self.kept = self.DECAY * self.kept + kept
        self.tried = self.DECAY * self.tried + 1

    def best_length(self, k: int) -> int:
        """The draft length in 0..k with the most expected tokens per one-token step of time."""
        a = min(self.kept / self.tried, 0.999)

        def rate(n):
            cost = (self.cost(n, self.context) if self.cost else 1.0) + n * self.draft_step
            return (1 - a ** (n + 1)) / (1 - a) / cost

        return max(range(k + 1), key=lambda n: rate(n) / (self.MARGIN if n else 1.0))

    def paced(self, n: int) -> int:
        """The best length n, except that where none pays (n = 0), one token is drafted after 4, 8,
        16, then every 32 plain steps, to find out whether drafting pays again. 0: a plain step
        now."""
        if n:
            self.paused = self.next_pause = self.FIRST_PAUSE
            return n
        if self.paused:
            self.paused -= 1
            return 0
        self.paused, self.next_pause = self.next_pause, min(2 * self.next_pause, self.MAX_PAUSE)
        return 1

    def propose(self, k: int):
        self.proposed, self.tree_depth = 0, 0
        n = self.best_length(k)
        if n == 0 and self.draft.free:
            if not self.watched:  # what it would draft, checked against what plain decoding commits
                self.watched = self.draft.propose(k)[0].tolist()
            return no_tokens()
        n = self.paced(n)
        if n == 0:
            return no_tokens()
        self.watched = []
        start = self.clock() if self.clock else None
        tokens, q = self.draft.propose(n)
        self.proposed = len(tokens)
        self.time_draft(start, len(tokens))
        return tokens, q

    def time_draft(self, start: float, forwards: int):
        """Learn the draft's time per forward (one token of a chain, one depth of a tree), in
        one-token target steps."""
        if forwards and self.step_seconds and self.clock:
            per_forward = (self.clock() - start) / forwards / self.step_seconds
            self.draft_step = self.DECAY * self.draft_step + (1 - self.DECAY) * per_forward

    def propose_tree(self, n: int, depth: int, size=None):
        """A tree of the size that pays, for drafts that rank their nodes (EAGLE-3 at T = 0). Its
        depth is the chain length that pays at the acceptance rate of the kept paths (paced:
        so a tree costs the draft about what that chain would), and of the draft's tree of at most
        n nodes, ranked best first, the first m are kept (tree_size; m = 0 is a plain step)."""
        self.proposed, self.watched, self.tree_depth = 0, [], 0
        depth = self.paced(self.best_length(depth))
        if depth == 0:
            return no_tokens()[0], [], None
        start = self.clock() if self.clock else None
        size = lambda values: self.tree_size(values, depth)  # noqa: E731
        tokens, parents, q = self.draft.propose_tree(n, depth, size=size)
        self.time_draft(start, depth)
        self.proposed = len(tokens)
        self.tree_depth = max(tree_depths(parents), default=0)
        return tokens, parents, q

    def tree_size(self, values: list, depth: int) -> int:
        """How many of a tree's nodes to keep, given their values best first (the draft's
        probability that a node's whole path is kept; a parent comes before its children): the m
        maximizing expected tokens per unit of time, (1 + c (v_1 + ... + v_m)) / (cost(m, context)
        + the draft's time for the tree's `depth` forwards), c the learned ratio of tokens kept to
        tokens the values expected (a draft's confidence is not its acceptance rate)."""
        c = self.tree_kept / self.tree_valued

        def rate(m):
            drafting = depth * self.draft_step if m else 0.0
            cost = (self.cost(m, self.context) if self.cost else 1.0) + drafting
            return (1 + c * sum(values[:m])) / cost

        m = max(range(len(values) + 1), key=lambda m: rate(m) / (self.MARGIN if m else 1.0))
        self.tree_expected = sum(values[:m]) if m else None
        return m

    def commit(self, new_ids, n_accepted, features=None):
        self.draft.commit(new_ids, n_accepted, features)
        self.context += len(new_ids)
        if self.tree_expected is not None:  # a tree's verdict: kept, against what was expected
            self.tree_kept = self.DECAY * self.tree_kept + n_accepted
            self.tree_valued = self.DECAY * self.tree_valued + self.tree_expected
            self.tree_expected = None
        # verified: n_accepted kept, then one rejected unless all were kept (for a tree: unless
        # its kept path reached the tree's depth)
        if self.proposed:
            for _ in range(n_accepted):
                self.learn(True)
            if n_accepted < (self.tree_depth or self.proposed):
                self.learn(False)
            self.proposed = 0  # learned once: in a hybrid, the next step may go to the other source
        else:  # the watched proposal against what was committed (a token or another's block)
            for token in new_ids:
                if not self.watched:
                    break
                kept = token == self.watched[0]
                self.learn(kept)
                self.watched = self.watched[1:] if kept else []
