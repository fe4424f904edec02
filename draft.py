"""
Drafts: cheap proposers of the next k tokens. Every draft speaks one interface (`Draft` below),
which decode.py's loop drives without knowing which draft it holds.

Layer indices: inside this project every list of target layers is in model.py's convention
(hidden[i] enters layer i). Released configs name *outputs* of layers instead (EAGLE-3's
eagle_aux_hidden_state_layer_ids, DFlash's target_layer_ids: output of layer j = hidden[j + 1]);
checkpoints.py converts at the checkpoint boundary and nowhere else.

This file holds prompt lookup (n-gram matching, training-free), an independent draft model (any
model.py checkpoint sharing the target's tokenizer), and the two trained drafts with their
verification heads: EAGLE-3 (one decoder layer over fused target features, drafting token by
token) and DFlash (a block-diffusion drafter filling B-1 masked positions in one forward), then
two wrappers of any draft: a hybrid with prompt lookup, and an adaptive draft length.
"""
import math
import time
from typing import Protocol

import torch
import torch.nn as nn

import model as M
from verify import probs_from_logits, sample


class Draft(Protocol):
    """What decode.py's loop needs of a draft."""
    target_layers: tuple  # the target hidden states it reads (model.py's indices); () for none
    forwards: int  # draft forwards run so far (lookups are none)
    max_tokens: float  # the most guesses one propose can return (a DFlash block's size - 1; else inf)

    def start(self, prompt_ids: list, features: torch.Tensor | None) -> None:
        """Sees the prompt; features (L-1, len(target_layers) * dim) are the target's states at
        positions 0..L-2, or None."""

    def propose(self, k: int) -> tuple:
        """(tokens (k',), q (k', V) or None): k' <= k guesses continuing the committed sequence, with
        the distributions they were drawn from (None: deterministic); fewer than k when the draft
        declines the rest."""

    def propose_tree(self, n: int, depth: int) -> tuple:
        """(tokens (n',), parents (n' ints, -1 for a child of the last committed token), q (n', V) or
        None): a draft tree of at most n nodes and depth, in topological order, siblings in the
        order verification tries them. q[i] is the distribution node i was drawn from given its
        earlier siblings; None: chosen deterministically (verify.py's tree section). Drafts with
        no tree of their own propose their chain (`as_tree`)."""

    def commit(self, new_ids: list, n_accepted: int, features: torch.Tensor | None) -> None:
        """The verifier kept n_accepted guesses and added one token of its own; new_ids are all of
        them, features the target's states at the n_accepted + 1 positions just committed (or
        None). A draft with a cache rewinds it to the part that is still valid."""


def no_tokens():
    return torch.tensor([], dtype=torch.long), None


def as_tree(tokens: torch.Tensor, q):
    """A chain as a tree: each guess the only child of the one before."""
    return tokens, list(range(-1, len(tokens) - 1)), q


class ChainAsTree:
    """propose_tree for drafts that only draft chains: their chain of min(n, depth) guesses."""

    def propose_tree(self, n: int, depth: int):
        return as_tree(*self.propose(min(n, depth)))


class NoDraft(ChainAsTree):
    """Plain decoding: proposes nothing, so every step is one ordinary decoding step."""
    target_layers = ()
    forwards = 0
    max_tokens = 0

    def start(self, prompt_ids, features=None):
        pass

    def propose(self, k: int):
        return no_tokens()

    def commit(self, new_ids, n_accepted, features=None):
        pass


class LookupDraft:
    """Prompt lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it. An index of
    every n-gram's positions makes a lookup cost the same at any context length."""
    target_layers = ()
    max_tokens = float("inf")
    free = True  # proposing costs nothing worth timing: AdaptiveDraft may watch its proposals unverified

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
                self.starts.setdefault(tuple(self.seq[end - n:]), []).append(end - n)

    def continuations(self, k: int):
        """What followed earlier occurrences of the last n tokens (at most k tokens each): longest
        n first, then the most recent match first."""
        seq = self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            for start in reversed(self.starts.get(tuple(seq[-n:]), [])[:-1]):  # (the last is the tail itself)
                follow = seq[start + n:start + n + k]
                if follow:
                    yield follow

    def propose(self, k: int):
        follow = next(self.continuations(k), None)
        return (torch.tensor(follow), None) if follow else no_tokens()

    def propose_tree(self, n: int, depth: int):
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


class ModelDraft(ChainAsTree):
    """A smaller model of the same family (e.g. qwen3-0.6b for qwen3-4b) drafting autoregressively.
    Its cache holds `cache_len` committed tokens; each propose first feeds the committed tokens it
    has not seen (one, or two after a fully accepted block) and then drafts k tokens."""
    target_layers = ()
    max_tokens = float("inf")

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, generator=None):
        self.model, self.temperature, self.top_p, self.generator = model, temperature, top_p, generator
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
        pending = self.seq[self.cache_len:]  # committed, not yet in the draft's cache
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
# EAGLE-3: fc fuses three target layers, one decoder layer drafts token by token

def eagle3_target_layers(n_layer: int) -> tuple:
    """The hidden states entering layers 2, L//2 and L-3 (model.py's index convention)."""
    return (2, n_layer // 2, n_layer - 3)


def dflash_target_layers(n_target_layer: int, n_draft_layer: int) -> tuple:
    """DFlash's default: the outputs of evenly spaced layers j from the second to the fourth-last,
    one per draft layer; as hidden states (model.py's convention) those are hidden[j + 1]."""
    if n_draft_layer == 1:
        outputs = [n_target_layer // 2]
    else:
        lo, hi = 1, n_target_layer - 3
        outputs = [round(lo + i * (hi - lo) / (n_draft_layer - 1)) for i in range(n_draft_layer)]
    return tuple(j + 1 for j in outputs)


class Eagle3Layer(nn.Module):
    """The decoder layer whose q/k/v read cat(input_layernorm(embedding), hidden_norm(hidden))."""

    def __init__(self, args: M.ModelArgs):
        super().__init__()
        self.input_layernorm = M.RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = M.RMSNorm(args.dim, args.norm_eps)
        self.self_attn = M.Attention(args, in_dim=2 * args.dim)
        self.post_attention_layernorm = M.RMSNorm(args.dim, args.norm_eps)
        self.mlp = M.MLP(args)

    def qkv(self, embeds, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # (..., 2 * dim)
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden, attn_out):
        h = hidden + attn_out  # the residual stream is the incoming hidden state
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3(nn.Module):
    """EAGLE-3 draft network. Keys as the released checkpoints: fc, midlayer.*, norm, lm_head,
    d2t (draft id i -> target id i + d2t[i]), t2d (bool over the target vocabulary), plus ours:
    verify_head (the verification head, a linear probe + sigmoid on the normed last state)."""

    def __init__(self, args: M.ModelArgs, target_dim: int, draft_vocab: int, target_layers):
        super().__init__()
        self.args = args
        # the target states fc fuses, in model.py's index convention (the input of those layers)
        self.target_layers = tuple(target_layers)
        self.fc = nn.Linear(3 * target_dim, args.dim, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = M.RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, draft_vocab, bias=False)
        self.verify_head = nn.Linear(args.dim, 1)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(args.vocab_size, dtype=torch.bool))

    def heads(self, h):
        """Pre-norm output (..., dim) -> draft-vocabulary logits (..., Vd), verification logit (...)."""
        x = self.norm(h)
        return self.lm_head(x), self.verify_head(x)[..., 0]

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def to_target_probs(self, draft_probs):
        """(..., Vd) -> (..., V): a draft-vocabulary distribution placed on target ids."""
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.args.vocab_size)
        return out.index_copy_(-1, self.draft_to_target(), draft_probs)


class HeadCalibration:
    """The verification head's record, for drafts that have one: with `calibration` a list (bench.py
    sets it), each chain step appends (the head's probability for a drafted token, whether the
    verifier kept it), the data of a reliability plot."""
    calibration = None
    last_head = ()  # the head's probabilities for the tokens of the last proposal

    def note_head(self, head_logits: torch.Tensor):
        if self.calibration is not None:
            self.last_head = list(self.last_head) + torch.sigmoid(head_logits.float()).flatten().tolist()

    def settle_head(self, n_accepted: int):
        if self.calibration is not None:
            self.calibration += [(prob, i < n_accepted) for i, prob in enumerate(self.last_head)]
        self.last_head = ()


TREE_TOP_K = 4  # children per expanded node and nodes expanded per depth (EAGLE-2 uses 10 on a GPU)


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


class Eagle3Draft(HeadCalibration):
    """Drives an Eagle3 network inside decode.py's loop (see the module docstring).

    Pairing, the one off-by-one of EAGLE: the draft places the target's fused state at position t
    together with the embedding of token t+1 (the token that state predicted) at position t of its
    own cache. So a prompt of L tokens gives L-1 pairs (states 0..L-2 with tokens 1..L-1), and each
    commit of n+1 tokens brings the states of the n+1 positions they were fed at. Drafted pairs
    (the draft's own output with its own token) go past the real ones and are overwritten."""

    def __init__(self, net: Eagle3, embed: nn.Embedding, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None,
                 early_exit: float | None = None):
        self.net, self.embed = net, embed
        self.target_layers = net.target_layers
        self.max_tokens = float("inf")  # one guess per forward, as many as asked
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.early_exit = early_exit
        weight = net.fc.weight
        self.cache = M.KVCache(1, net.args.n_kv_head, max_seq_len, net.args.head_dim,
                               weight.dtype, weight.device)
        self.cos, self.sin = M.rope_table(net.args, max_seq_len, weight.device, weight.dtype)
        self.forwards = 0

    def start(self, prompt_ids, features=None):
        self.cache_len = 0
        self.pending_tokens = list(prompt_ids[1:])
        self.pending_features = features  # (L-1, 3 * target_dim): states 0..L-2, paired with tokens 1..L-1

    def step(self, tokens, hidden, pos):
        """One forward at positions pos..pos+T-1; tokens (T,), hidden (T, dim) -> (T, dim)."""
        layer, T = self.net.midlayer, len(tokens)
        positions = torch.arange(pos, pos + T, device=hidden.device)
        queries, keys, values = layer.qkv(self.embed(tokens)[None], hidden[None], self.cos[positions],
                                          self.sin[positions])
        keys, values = self.cache.update(positions, keys, values)
        visible = torch.arange(pos + T, device=hidden.device) <= positions[:, None]  # (T, pos+T)
        attended = layer.self_attn.attend(queries, keys[:, :, :pos + T], values[:, :, :pos + T], visible)
        self.forwards += 1
        return layer.finish(hidden[None], attended)[0]  # pre-norm: what the next draft step feeds back

    def feed_pending(self):
        """Feed the pairs committed since the last draft forward; returns the last one's output
        (1, dim), the state the next guess is drafted from."""
        net = self.net
        device, dtype = net.fc.weight.device, net.fc.weight.dtype
        tokens_in = torch.tensor(self.pending_tokens, dtype=torch.long, device=device)
        fused = net.fc(self.pending_features.to(device, dtype))  # (n, dim)
        state = self.step(tokens_in, fused, self.cache_len)[-1:]  # (1, dim)
        self.cache_len += len(tokens_in)
        self.pending_tokens, self.pending_features = [], None
        return state

    @torch.no_grad()
    def propose(self, k: int):
        net = self.net
        if not self.pending_tokens:  # a one-token prompt: no target state to draft from yet
            return no_tokens()
        state = self.feed_pending()  # (1, dim)
        tokens, dists = [], []
        for j in range(k):
            logits, head_logit = net.heads(state[-1])
            if self.early_exit is not None and torch.sigmoid(head_logit).item() < self.early_exit:
                break  # the verification head expects this token rejected: stop drafting here
            self.note_head(head_logit)
            q = net.to_target_probs(probs_from_logits(logits, self.temperature, self.top_p))  # (V,)
            token = sample(q, self.temperature, self.generator)
            tokens.append(token)
            dists.append(q)
            if j + 1 < k:
                state = self.step(token.view(1), state[-1:], self.cache_len + j)
        if not tokens:
            return no_tokens()
        return torch.stack(tokens), torch.stack(dists)

    def tree_step(self, tokens, hidden, rope_pos, slots, visible):
        """One forward of a tree's rows: tokens (T,) with their parents' states hidden (T, dim),
        rotated at rope_pos (T,), written to slots (T,), each seeing the slots `visible` marks
        (T, kv_len). -> (T, dim)."""
        layer = self.net.midlayer
        queries, keys, values = layer.qkv(self.embed(tokens)[None], hidden[None], self.cos[rope_pos],
                                          self.sin[rope_pos])
        keys, values = self.cache.update(slots, keys, values)
        kv_len = visible.shape[1]
        attended = layer.self_attn.attend(queries, keys[:, :, :kv_len], values[:, :, :kv_len], visible)
        self.forwards += 1
        return layer.finish(hidden[None], attended)[0]

    def feed_nodes(self, expand: list, tokens: list, parents: list, slots: dict, state_of: dict, base: int,
                   d: int) -> torch.Tensor:
        """Feed the tree nodes `expand` (all at depth d + 1) in one draft forward, each into a new
        cache slot after `base` and seeing only the context and its own ancestors; records each
        node's slot and output state. -> (E, dim), the states their children are drawn from."""
        device = self.net.fc.weight.device
        for node in expand:
            slots[node] = base + len(slots)
        fed = torch.tensor([slots[i] for i in expand], device=device)
        visible = torch.zeros(len(expand), base + len(slots), dtype=torch.bool, device=device)
        visible[:, :base] = True
        for row, node in enumerate(expand):
            while node >= 0:  # the node and its ancestors, all fed at earlier depths
                visible[row, slots[node]] = True
                node = parents[node]
        hidden = torch.stack([state_of[parents[i]] for i in expand])  # (E, dim): each parent's output
        rope = torch.full((len(expand),), base + d, device=device)  # depth d + 1, as in a chain
        states = self.tree_step(torch.tensor([tokens[i] for i in expand], device=device), hidden, rope, fed,
                                visible)
        state_of.update(zip(expand, states))
        return states

    @torch.no_grad()
    def propose_tree(self, n: int, depth: int, top_k: int = TREE_TOP_K):
        """EAGLE-2's dynamic tree: at each depth, the top_k children of each expanded node become
        candidates scored by their cumulative draft log-probability, and the top_k best of the new
        candidates are expanded (one draft forward for all of them); finally the n best candidates
        are kept (a child never scores above its parent, so they form a tree). Children are the
        draft's top choices, so q is None (verified as one-hot).
        At T > 0 the children are drawn instead, without replacement from the draft's q, and every
        child drawn is kept (until n): pruning a drawn child for its value would bias what the
        verifier sees, so the budget is spent as the tree grows, best nodes expanded first, and
        q holds each child's distribution. Early exit skips the children of a node whose
        verification head expects them rejected."""
        sampled = self.temperature > 0
        if not self.pending_tokens or n < 1 or depth < 1:
            return torch.tensor([], dtype=torch.long), [], None
        expand_states = self.feed_pending()  # (1, dim): the root's
        base = self.cache_len
        tokens, parents, scores, slots, qs = [], [], [], {}, []  # candidates; draft cache slot of each fed node
        expand = [-1]  # nodes whose children come next (-1: the root)
        state_of = {-1: expand_states[0]}  # a fed node's output: what its children are fed with
        for d in range(min(depth, n)):
            new = []
            for node, children in zip(expand, self.tree_children(expand_states, top_k, lambda: n - len(tokens))):
                parent_score = scores[node] if node >= 0 else 0.0
                for lq, x, q_i in children:
                    new.append(len(tokens))
                    tokens.append(x)
                    parents.append(node)
                    scores.append(parent_score + lq)
                    qs.append(q_i)
            if not new or d + 1 == min(depth, n) or sampled and len(tokens) >= n:
                break
            expand = sorted(new, key=lambda i: -scores[i])[:top_k]
            if base + len(slots) + len(expand) > self.cache.k.shape[2]:
                break  # the draft's cache ends here (near the end of the context)
            expand_states = self.feed_nodes(expand, tokens, parents, slots, state_of, base, d)
        if sampled:
            return torch.tensor(tokens, dtype=torch.long), parents, torch.stack(qs) if qs else None
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:n])  # creation order
        index = {node: j for j, node in enumerate(keep)}
        return (torch.tensor([tokens[i] for i in keep], dtype=torch.long),
                [index[parents[i]] if parents[i] >= 0 else -1 for i in keep], None)

    def tree_children(self, expand_states, top_k: int, room):
        """Yields the children of each expanded node in turn (states (E, dim)), as
        [(log q, token, q or None)]: its top_k tokens, or at T > 0 up to min(top_k, room()) tokens
        drawn without replacement, room() being the nodes the tree may still take once the
        earlier nodes' children are in; [] for a node early exit prunes."""
        logits, head_logits = self.net.heads(expand_states)  # (E, Vd), (E,)
        if self.temperature > 0:
            q_expand = self.net.to_target_probs(probs_from_logits(logits, self.temperature, self.top_p))  # (E, V)
        else:
            to_target = self.net.draft_to_target()
            logq = torch.log_softmax(logits.float(), -1)
            top_logq, top_ids = logq.topk(min(top_k, logq.shape[-1]), -1)  # (E, top_k)
        for e in range(len(expand_states)):
            if self.early_exit is not None and torch.sigmoid(head_logits[e]).item() < self.early_exit:
                yield []  # the head expects this node's children rejected: prune the branch
            elif self.temperature > 0:
                drawn = draw_without_replacement(q_expand[e], min(top_k, room()), self.generator)
                yield [(math.log(q_expand[e, x].item()), x, q_i) for x, q_i, _ in drawn]
            else:
                yield [(lq, int(to_target[i]), None) for lq, i in zip(top_logq[e].tolist(), top_ids[e].tolist())]

    def commit(self, new_ids, n_accepted, features=None):
        self.settle_head(n_accepted)
        # pairs wait here until the next propose feeds them; a step in which another draft proposed
        # (HybridDraft) leaves them to be fed together with the next step's
        self.pending_tokens += list(new_ids)
        self.pending_features = features if self.pending_features is None else \
            torch.cat([self.pending_features, features])  # (pairs not yet fed, 3 * target_dim)


# -----------------------------------------------------------------------------
# DFlash: a block-diffusion drafter, B-1 masked positions filled in one forward

class DFlashLayer(nn.Module):
    """A Qwen3-style layer whose queries come from the block and whose keys/values are
    cat(context, block); the context is the fused target state, the same for every layer."""

    def __init__(self, args: M.ModelArgs):
        super().__init__()
        self.input_layernorm = M.RMSNorm(args.dim, args.norm_eps)
        self.self_attn = M.Attention(args)
        self.post_attention_layernorm = M.RMSNorm(args.dim, args.norm_eps)
        self.mlp = M.MLP(args)

    def forward(self, block, ctx, cos, sin, mask, ctx_kv=None):
        """block (B, nq, dim) after ctx (B, nc, dim); cos/sin for cat(ctx, block) positions.
        ctx_kv: earlier context keys/values to put in front (inference cache), or None."""
        n_context = ctx.shape[1]
        x = torch.cat([ctx, self.input_layernorm(block)], 1)  # (B, n_context + nq, dim)
        queries, keys, values = self.self_attn.project(x, cos, sin)
        if ctx_kv is not None:
            keys, values = torch.cat([ctx_kv[0], keys], 2), torch.cat([ctx_kv[1], values], 2)
        h = block + self.self_attn.attend(queries[:, :, n_context:], keys, values, mask)  # block queries
        return h + self.mlp(self.post_attention_layernorm(h)), (keys, values)


class DFlash(nn.Module):
    """DFlash draft network. Keys as the released checkpoints: layers.*, fc, hidden_norm, norm;
    embeddings and lm_head are the target's. Plus ours: verify_head."""

    def __init__(self, args: M.ModelArgs, target_dim: int, target_layers, block_size: int,
                 mask_token_id: int):
        super().__init__()
        self.args, self.block_size, self.mask_token_id = args, block_size, mask_token_id
        self.target_layers = tuple(target_layers)  # model.py's convention, like every layer list here
        self.layers = nn.ModuleList(DFlashLayer(args) for _ in range(args.n_layer))
        self.fc = nn.Linear(len(self.target_layers) * target_dim, args.dim, bias=False)
        self.hidden_norm = M.RMSNorm(args.dim, args.norm_eps)
        self.norm = M.RMSNorm(args.dim, args.norm_eps)
        self.verify_head = nn.Linear(args.dim, 1)

    def context(self, features):
        return self.hidden_norm(self.fc(features))


def dflash_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """Training attention, (nb*B, T + nb*B) bool: block j sees context positions < anchors[j]
    and every position of its own block (bidirectional), nothing of other blocks."""
    nb = len(anchors)
    ctx = torch.arange(T, device=anchors.device)[None, :] < anchors[:, None]  # (nb, T)
    own = torch.eye(nb, dtype=torch.bool, device=anchors.device)  # (nb, nb)
    rows = torch.cat([ctx, own.repeat_interleave(block_size, 1)], 1)  # (nb, T + nb*B)
    return rows.repeat_interleave(block_size, 0)


class DFlashDraft(ChainAsTree, HeadCalibration):
    """Drives a DFlash network inside decode.py's loop. Context keys/values of each layer are
    cached at their positions; the block [last committed token, MASK x (B-1)] sits right after."""

    def __init__(self, net: DFlash, embed: nn.Embedding, lm_head: nn.Module, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None,
                 early_exit: float | None = None):
        self.net, self.embed, self.lm_head = net, embed, lm_head
        self.target_layers = net.target_layers
        self.max_tokens = net.block_size - 1  # one block drafts at most this many (the anchor is known)
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.early_exit = early_exit
        weight, length = net.fc.weight, max_seq_len + net.block_size
        self.caches = [M.KVCache(1, net.args.n_kv_head, length, net.args.head_dim,
                                 weight.dtype, weight.device)
                       for _ in net.layers]
        self.cos, self.sin = M.rope_table(net.args, length, weight.device, weight.dtype)
        self.forwards = 0

    def start(self, prompt_ids, features=None):
        self.anchor, self.context_len = prompt_ids[-1], 0
        self.pending = features  # (L-1, n * target_dim): positions 0..L-2

    @torch.no_grad()
    def propose(self, k: int):
        net, device = self.net, self.net.fc.weight.device
        B = net.block_size
        context = net.context(self.pending.to(device, net.fc.weight.dtype))[None]  # (1, n_new, dim)
        n_new = context.shape[1]
        anchor_pos = self.context_len + n_new
        positions = torch.arange(self.context_len, anchor_pos + B, device=device)
        block = torch.tensor([[self.anchor] + [net.mask_token_id] * (B - 1)], device=device)
        h = self.embed(block)  # (1, B, dim)
        for layer, cache in zip(net.layers, self.caches):
            cached = (cache.k[:, :, :self.context_len], cache.v[:, :, :self.context_len])
            h, (keys, values) = layer(h, context, self.cos[positions], self.sin[positions], None, cached)
            # keep the new context keys/values; the block's are recomputed every time
            new = slice(self.context_len, anchor_pos)
            cache.update(positions[:n_new], keys[:, :, new], values[:, :, new])
        self.context_len, self.forwards = anchor_pos, self.forwards + 1
        self.pending = None
        x = net.norm(h[0, 1:k + 1])  # (k, dim): block position i predicts the token at anchor_pos + i
        probs = probs_from_logits(self.lm_head(x), self.temperature, self.top_p)  # (k, V)
        n = k
        if self.early_exit is not None:  # stop at the first position the head expects rejected
            below = (torch.sigmoid(net.verify_head(x)[:, 0]) < self.early_exit).nonzero()
            n = int(below[0]) if len(below) else k
        if self.calibration is not None:
            self.note_head(net.verify_head(x[:n])[:, 0])
        if n == 0:
            return no_tokens()
        return sample(probs[:n], self.temperature, self.generator), probs[:n]

    def commit(self, new_ids, n_accepted, features=None):
        self.settle_head(n_accepted)
        self.anchor = new_ids[-1]
        # the positions after context_len not yet fed (more than one commit's after a step in
        # which another draft proposed: HybridDraft)
        self.pending = features if self.pending is None else torch.cat([self.pending, features])


# -----------------------------------------------------------------------------
# Hybrid: prompt lookup where the context repeats, the model draft elsewhere

class HybridDraft:
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

    def propose_tree(self, n: int, depth: int):
        self.steps += 1
        tree = self.lookup.propose_tree(n, depth)
        if len(tree[0]):
            self.looked_up += 1
            return tree
        return self.model_draft.propose_tree(n, depth)

    def commit(self, new_ids, n_accepted, features=None):
        self.lookup.commit(new_ids, n_accepted)
        self.model_draft.commit(new_ids, n_accepted, features)


# -----------------------------------------------------------------------------
# Adaptive draft length: draft long where guesses are kept, pause where none are

class AdaptiveDraft:
    """Wraps any draft and drafts, each step, the number of tokens that pays: the n maximizing
    expected tokens per unit of time, (1 + a + ... + a^n) / cost(n, context), where a is the
    recent acceptance rate of a drafted token (decayed counts from a prior of one half) and
    cost(n, context) what a forward verifying n drafted tokens costs in one-token steps on this
    machine at this context length (layouts.block_cost_model), plus the draft's own time. n = 0 is
    a plain decoding step: where no length pays, the run decodes plainly. It keeps learning
    whether drafting pays again: a free draft (prompt lookup) is watched, its proposals compared
    with the tokens plain decoding commits, at no cost; any other drafts one token after 1, 2, 4
    ... 16 plain steps. cost None (a GPU, where a block costs about a step) counts every block as
    one step. The draft still sees every commit."""

    MAX_PAUSE = 16
    DECAY = 0.9  # weight of the past in the acceptance estimate, per drafted token seen

    def __init__(self, draft, cost=None, step_seconds: float | None = None):
        self.draft = draft
        self.target_layers = draft.target_layers
        self.max_tokens = draft.max_tokens
        self.cost, self.step_seconds = cost, step_seconds
        self.draft_step = 0.0  # the draft's time per proposed token, in one-token target steps
        self.steps = self.drafting_steps = 0
        self.reset(0)

    @property
    def forwards(self):
        return self.draft.forwards

    def start(self, prompt_ids, features=None):
        self.draft.start(prompt_ids, features)
        self.reset(len(prompt_ids))

    def reset(self, context: int):
        """A new sequence: what was learned of the last one's acceptance is dropped."""
        self.kept, self.tried = 1.0, 2.0
        self.context = context
        self.paused, self.next_pause = 0, 1
        self.proposed, self.watched = 0, []

    def learn(self, kept: bool):
        self.kept = self.DECAY * self.kept + kept
        self.tried = self.DECAY * self.tried + 1

    def best_length(self, k: int) -> int:
        """The draft length in 0..k with the most expected tokens per one-token step of time."""
        a = min(self.kept / self.tried, 0.999)

        def rate(n):
            cost = (self.cost(n, self.context) if self.cost else 1.0) + n * self.draft_step
            return (1 - a ** (n + 1)) / (1 - a) / cost
        return max(range(k + 1), key=rate)

    def propose(self, k: int):
        self.proposed = 0
        self.steps += 1
        n = self.best_length(k)
        if n == 0 and getattr(self.draft, "free", False):
            if not self.watched:  # what it would draft, checked against what plain decoding commits
                self.watched = self.draft.propose(k)[0].tolist()
            return no_tokens()
        if n == 0:
            if self.paused:
                self.paused -= 1
                return no_tokens()
            n, self.paused, self.next_pause = 1, self.next_pause, min(2 * self.next_pause, self.MAX_PAUSE)
        else:
            self.next_pause = 1
        self.watched = []
        start = time.perf_counter()
        tokens, q = self.draft.propose(n)
        self.proposed = len(tokens)
        if self.proposed and self.step_seconds:
            per_token = (time.perf_counter() - start) / self.proposed / self.step_seconds
            self.draft_step = self.DECAY * self.draft_step + (1 - self.DECAY) * per_token
        self.drafting_steps += self.proposed > 0
        return tokens, q

    def commit(self, new_ids, n_accepted, features=None):
        self.draft.commit(new_ids, n_accepted, features)
        self.context += len(new_ids)
        if self.proposed:  # verified: n_accepted kept, then one rejected unless all were kept
            for _ in range(n_accepted):
                self.learn(True)
            if n_accepted < self.proposed:
                self.learn(False)
        elif self.watched:  # a plain step commits one token: the watched proposal's next one?
            kept = new_ids[0] == self.watched[0]
            self.learn(kept)
            self.watched = self.watched[1:] if kept else []
