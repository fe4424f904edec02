"""
EAGLE-3: a draft of one decoder layer over three fused target layers, drafting token by token.

The network (Eagle3) owns its one forward: a step over rows of (token, state) pairs, where an
`attend` callable says which keys each row sees. Training (the training-time test over whole
batches, eagle3_chains) and inference (Eagle3Draft: chains and EAGLE-2's dynamic trees, over a
cache) differ only in that callable.

Layer indices are model.py's (hidden[i] enters layer i); checkpoints.py converts the released
configs' layer outputs at the checkpoint boundary.
"""
import math

import torch
import torch.nn as nn

import model as M
from draft import Draft, draw_without_replacement, exit_probability, no_tokens
from verify import probs_from_logits, sample


def eagle3_target_layers(n_layer: int) -> tuple:
    """The hidden states entering layers 2, L//2 and L-3 (model.py's index convention)."""
    return (2, n_layer // 2, n_layer - 3)


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
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # (.., 2 * dim)
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

    def forward(self, embeds, hidden, cos, sin, attend):
        """One draft step over rows of (token, state) pairs: embeds (B, T, dim) of the tokens fed,
        hidden (B, T, dim) the states paired with them (fc-fused target states, or the draft's own
        last output), cos/sin (T, head_dim) at their positions. attend(q, k, v) says which keys each
        row sees (a cache at inference, the training-time test's pattern in training) and returns
        (B, T, heads * head_dim). -> the next pre-norm states (B, T, dim), which heads() reads."""
        layer = self.midlayer
        # q (B, heads, T, head_dim), k and v (B, kv_heads, T, head_dim)
        q, k, v = layer.qkv(embeds, hidden, cos, sin)
        return layer.finish(hidden, layer.self_attn.o_proj(attend(q, k, v)))

    def heads(self, h):
        """Pre-norm output (..., dim) -> draft-vocabulary logits (..., Vd), verification logit
        (...)."""
        x = self.norm(h)
        return self.lm_head(x), self.verify_head(x)[..., 0]

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def to_target_probs(self, draft_probs):
        """(..., Vd) -> (..., V): a draft-vocabulary distribution placed on target ids."""
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.args.vocab_size)
        return out.index_copy_(-1, self.draft_to_target(), draft_probs)


TREE_TOP_K = 4  # children per expanded node and nodes expanded per depth (EAGLE-2 uses 10 on a GPU)


class Eagle3Draft(Draft):
    """Drives an Eagle3 network inside speculative.py's loop (see the module docstring).

    Pairing, the one off-by-one of EAGLE: the draft places the target's fused state at position t
    together with the embedding of token t+1 (the token that state predicted) at position t of its
    own cache. So a prompt of L tokens gives L-1 pairs (states 0..L-2 with tokens 1..L-1), and each
    commit of n+1 tokens brings the states of the n+1 positions they were fed at. Drafted pairs
    (the draft's own output with its own token) go past the real ones and are overwritten."""
    sizes_trees = True  # propose_tree ranks its nodes

    def __init__(self, net: Eagle3, embed: nn.Embedding, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None,
                 early_exit: float | None = None, exit_signal: str = "head"):
        self.net, self.embed = net, embed
        self.target_layers = net.target_layers
        self.max_tokens = float("inf")  # one guess per forward, as many as asked
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.early_exit, self.exit_signal = early_exit, exit_signal  # (draft.EXIT_SIGNALS)
        weight = net.fc.weight
        self.cache = M.KVCache(1, net.args.n_kv_head, max_seq_len, net.args.head_dim,
                               weight.dtype, weight.device)
        self.cos, self.sin = M.rope_table(net.args, max_seq_len, weight.device, weight.dtype)
        self.forwards = 0
        self.row_graph = None  # a chain's one-row step compiled (engine.compiled.compile_draft)
        # (a slice of it carries a compiled graph's key count)
        self.slots = torch.arange(max_seq_len, device=weight.device)
        self.target_ids = net.draft_to_target()  # (Vd,): draft id -> target id

    def start(self, prompt_ids, features=None):
        self.cache_len = 0
        self.pending_tokens = list(prompt_ids[1:])
        # (L-1, 3 * target_dim): states 0..L-2, paired with tokens 1..L-1; each commit adds its rows
        self.pending_features = [] if features is None else [features]

    def step(self, tokens, hidden, rope_pos, slots, visible):
        """One draft forward: tokens (T,) with the states they pair with, hidden (T, dim), rotated
        at rope_pos (T,), written to cache slots (T,), each row seeing the slots `visible` marks
        (T, kv_len): a chain's causal rows, or a tree's context and ancestors. -> (T, dim)."""
        self.forwards += 1
        return self.rows(tokens, hidden, rope_pos, slots, visible)

    def rows(self, tokens, hidden, rope_pos, slots, visible):
        """step() without its count: what a compiled graph of the draft traces."""
        def attend(q, k, v):
            keys, values = self.cache.update(slots, k, v)
            kv_len = visible.shape[1]
            keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
            mixed = self.net.midlayer.self_attn.mix(q, keys, values, visible)
            # (1, T, heads * head_dim), in the draft's dtype (attention runs in the cache's)
            return mixed.transpose(1, 2).flatten(2).to(hidden.dtype)
        cos, sin = self.cos[rope_pos], self.sin[rope_pos]
        return self.net(self.embed(tokens)[None], hidden[None], cos, sin, attend)[0]

    def chain_step(self, tokens, hidden, pos: int):
        """step() for rows at positions pos..pos+T-1, each seeing what precedes it."""
        positions = torch.arange(pos, pos + len(tokens), device=hidden.device)
        slots = torch.arange(pos + len(tokens), device=hidden.device)
        visible = slots <= positions[:, None]  # (T, pos+T)
        return self.step(tokens, hidden, positions, positions, visible)

    def chain_guess(self, tokens, hidden, pos: int):
        """chain_step's last state and its heads, the next guess's logits: (1, dim), (Vd,), ().
        One row runs the compiled graph where the run compiled one (engine.compiled's
        compile_draft)."""
        if len(tokens) == 1 and self.row_graph is not None and pos >= 1:
            self.forwards += 1
            return self.row_graph(self, tokens, hidden, self.slots[:pos + 1])
        state = self.chain_step(tokens, hidden, pos)[-1:]
        return (state, *self.net.heads(state[-1]))

    def take_pending(self) -> tuple:
        """The pairs committed since the last draft forward, to be fed from the first free cache
        slot: (tokens (n,), their fused states (n, dim), that slot)."""
        net = self.net
        device, dtype = net.fc.weight.device, net.fc.weight.dtype
        tokens_in = torch.tensor(self.pending_tokens, dtype=torch.long, device=device)
        # (n, 3 * target_dim) -> (n, dim)
        fused = net.fc(torch.cat(self.pending_features).to(device, dtype))
        pos = self.cache_len
        self.cache_len += len(tokens_in)
        self.pending_tokens, self.pending_features = [], []
        return tokens_in, fused, pos

    @torch.no_grad()
    def propose(self, k: int):
        net = self.net
        if not self.pending_tokens:  # a one-token prompt: no target state to draft from yet
            return no_tokens()
        state, logits, head_logit = self.chain_guess(*self.take_pending())  # (1, dim), (Vd,), ()
        tokens, dists, self.proposal_head_logits = [], [], []
        for j in range(k):
            if self.early_exit is not None and \
                    exit_probability(self.exit_signal, logits, head_logit).item() < self.early_exit:
                break  # the head (or the draft's confidence) expects this token rejected: stop here
            self.proposal_head_logits.append(head_logit)
            if self.temperature <= 0:  # the argmax, on its target id: q one-hot there (None)
                token = self.target_ids[logits.argmax()]
            else:
                q = net.to_target_probs(probs_from_logits(logits, self.temperature, self.top_p))
                token = sample(q, self.temperature, self.generator)  # q (V,)
                dists.append(q)
            tokens.append(token)
            if j + 1 < k:
                state, logits, head_logit = self.chain_guess(token.view(1), state,
                                                             self.cache_len + j)
        if not tokens:
            return no_tokens()
        return torch.stack(tokens), torch.stack(dists) if dists else None

    def feed_nodes(self, expand: list, tokens: list, parents: list, slots: dict, state_of: dict,
                   base: int, d: int) -> torch.Tensor:
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
        hidden = torch.stack([state_of[parents[i]] for i in expand])  # (E, dim): parents' outputs
        rope = torch.full((len(expand),), base + d, device=device)  # depth d + 1, as in a chain
        fed_tokens = torch.tensor([tokens[i] for i in expand], device=device)
        states = self.step(fed_tokens, hidden, rope, fed, visible)
        state_of.update(zip(expand, states))
        return states

    @torch.no_grad()
    def propose_tree(self, n: int, depth: int, top_k: int = TREE_TOP_K, size=None):
        """EAGLE-2's dynamic tree: at each depth, the top_k children of each expanded node become
        candidates scored by their cumulative draft log-probability, and the top_k best of the new
        candidates are expanded (one draft forward for all of them); finally the n best candidates
        are kept (a child never scores above its parent, so they form a tree). Children are the
        draft's top choices, so q is None (verified as one-hot).
        At T > 0 the children are drawn instead, without replacement from the draft's q, and every
        child drawn is kept (until n): pruning a drawn child for its value would bias what the
        verifier sees, so the budget is spent as the tree grows, best nodes expanded first, and
        q holds each child's distribution. Early exit skips the children of a node whose
        verification head expects them rejected. size (T = 0 only), given the candidates' values
        best first (each the draft's probability of its path, exp of the score), returns how many
        of them to keep: draft.AdaptiveDraft sizes trees by what their blocks cost."""
        sampled = self.temperature > 0
        if not self.pending_tokens or n < 1 or depth < 1:
            return torch.tensor([], dtype=torch.long), [], None
        expand_states = self.chain_step(*self.take_pending())[-1:]  # (1, dim): the root's
        base = self.cache_len
        # the candidates, and slots: the draft cache slot of each fed node
        tokens, parents, scores, slots, qs = [], [], [], {}, []
        expand = [-1]  # nodes whose children come next (-1: the root)
        state_of = {-1: expand_states[0]}  # a fed node's output: what its children are fed with
        for d in range(min(depth, n)):
            new = []
            children_of = self.tree_children(expand_states, top_k, lambda: n - len(tokens))
            for node, children in zip(expand, children_of):
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
        # (a parent before its children)
        ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
        n = n if size is None else size([math.exp(scores[i]) for i in ranked[:n]])
        keep = sorted(ranked[:n])  # creation order
        index = {node: j for j, node in enumerate(keep)}
        return (torch.tensor([tokens[i] for i in keep], dtype=torch.long),
                [index[parents[i]] if parents[i] >= 0 else -1 for i in keep], None)

    def tree_children(self, expand_states, top_k: int, room):
        """Yields the children of each expanded node in turn (states (E, dim)), as
        [(log q, token, q or None)]: its top_k tokens, or at T > 0 up to min(top_k, room()) tokens
        drawn without replacement, room() being the nodes the tree may still take once the
        earlier nodes' children are in; [] for a node early exit prunes."""
        logits, head_logits = self.net.heads(expand_states)  # (E, Vd), (E,)
        go_on = None if self.early_exit is None else \
            (exit_probability(self.exit_signal, logits, head_logits) >= self.early_exit).tolist()
        if self.temperature > 0:
            q_draft = probs_from_logits(logits, self.temperature, self.top_p)  # (E, Vd)
            q_expand = self.net.to_target_probs(q_draft)  # (E, V)
        else:
            to_target = self.net.draft_to_target()
            logq = torch.log_softmax(logits.float(), -1)
            top_logq, top_ids = logq.topk(min(top_k, logq.shape[-1]), -1)  # (E, top_k)
        for e in range(len(expand_states)):
            if go_on is not None and not go_on[e]:
                yield []  # the head (or the confidence) expects its children rejected: prune
            elif self.temperature > 0:
                drawn = draw_without_replacement(q_expand[e], min(top_k, room()), self.generator)
                yield [(math.log(q_expand[e, x].item()), x, q_i) for x, q_i, _ in drawn]
            else:
                ranked = zip(top_logq[e].tolist(), top_ids[e].tolist())
                yield [(lq, int(to_target[i]), None) for lq, i in ranked]

    def commit(self, new_ids, n_accepted, features=None):
        self.proposal_head_logits = ()
        # pairs wait here until the next propose feeds them; a step in which another draft proposed
        # (HybridDraft) leaves them to be fed together with the next step's
        self.pending_tokens += list(new_ids)
        self.pending_features.append(features)  # (n_accepted + 1, 3 * target_dim), joined when fed




# -----------------------------------------------------------------------------
# Training: the training-time test over whole batches

def eagle3_chains(net: Eagle3, embed, tokens, features, b, t, K: int):
    """Training-time test, computed only for the chains that carry loss: the N chains at base
    positions (b, t) (each (N,)) of tokens (B, T) and features (B, T, 3*dim_t). Returns draft
    logits (N, K, Vd) and head logits (N, K). Step s of the chain at base t feeds (state, embedding
    of token t+1+s) at position t+s and predicts token t+2+s; its query sees the step-0 keys of
    positions <= t (the real prefix) and its own chain's keys of steps 1..s: exactly what drafting
    from t sees at inference."""
    B, T = tokens.shape
    cos, sin = M.rope_table(net.args, T + K, features.device, features.dtype)
    # (B, T+K+1): room for the last chains
    padded = torch.cat([tokens, tokens.new_zeros(B, K + 1)], 1)
    # step 0 everywhere: its keys and values are every chain's prefix
    grid_state = net.fc(features)  # (B, T, dim)
    _, prefix_k, prefix_v = net.midlayer.qkv(embed(padded[:, 1:1 + T]), grid_state, cos[:T],
                                             sin[:T])
    state = grid_state[b, t]  # (N, dim)
    own_k, own_v, logits, heads = [], [], [], []
    for s in range(K):
        def attend(q, k, v):  # q (1, heads, N, head_dim): each chain's row at step s
            if s > 0:  # the chain's own keys from step 1 on (step 0's are in the prefix)
                own_k.append(k[0].transpose(0, 1))  # (N, kv_heads, head_dim)
                own_v.append(v[0].transpose(0, 1))
            rows = q[0].transpose(0, 1)  # (N, heads, head_dim)
            return chain_attention(rows, prefix_k, prefix_v, own_k, own_v, b, t)[None]
        fed = embed(padded[b, t + 1 + s])[None]
        state = net(fed, state[None], cos[t + s], sin[t + s], attend)[0]  # (N, dim)
        step_logits, step_heads = net.heads(state)
        logits.append(step_logits)
        heads.append(step_heads)
    return torch.stack(logits, 1), torch.stack(heads, 1)


def chain_attention(q, prefix_k, prefix_v, own_k: list, own_v: list, b, t):
    """Attention of N chain queries q (N, H, hd) over their sequence's prefix, prefix_k/v
    (B, Hkv, T, hd) at positions <= t, and over their own keys own_k/v (s of (N, Hkv, hd)).
    Returns (N, H*hd). The prefix part runs on the (B, T) grid as one batched matmul (queries
    scattered to their rows), because a gathered copy of every chain's prefix would cost N*T
    rows."""
    N, H, hd = q.shape
    B, Hkv, T, _ = prefix_k.shape
    g = H // Hkv  # query heads per key head (grouped-query attention)
    scale = hd ** -0.5
    grid_q = q.new_zeros(B, T, H, hd).index_put((b, t), q)  # (B, T, H, hd): chains at their rows
    grid_q = grid_q.view(B, T, Hkv, g, hd).permute(0, 2, 3, 1, 4)  # (B, Hkv, g, T, hd)
    prefix = grid_q @ prefix_k[:, :, None].transpose(-1, -2)  # (B, Hkv, g, T, T)
    prefix = prefix.permute(0, 3, 1, 2, 4)[b, t]  # (N, Hkv, g, T)
    later = torch.arange(T, device=q.device) > t[:, None, None, None]  # keys past the chain's base
    scores = [prefix.masked_fill(later, float("-inf")) * scale]
    qn = q.view(N, Hkv, g, hd)
    if own_k:
        own = torch.einsum("nkgd,nskd->nkgs", qn, torch.stack(own_k, 1))  # (N, Hkv, g, s)
        scores.append(own * scale)
    weights = torch.cat(scores, -1).softmax(-1)  # (N, Hkv, g, T + s)
    grid_w = weights.new_zeros(B, T, Hkv, g, T).index_put((b, t), weights[..., :T])
    grid_w = grid_w.permute(0, 2, 3, 1, 4)  # (B, Hkv, g, T, T)
    out = (grid_w @ prefix_v[:, :, None]).permute(0, 3, 1, 2, 4)[b, t]  # (N, Hkv, g, hd)
    if own_v:
        out = out + torch.einsum("nkgs,nskd->nkgd", weights[..., T:], torch.stack(own_v, 1))
    return out.reshape(N, H * hd)
