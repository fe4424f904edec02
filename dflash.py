"""
DFlash: a block-diffusion draft that fills B-1 masked positions after the last token in one forward.

The network (DFlash) owns its forward over blocks and the fused target context; training
(dflash_blocks: many blocks per sequence, each seeing its own prefix) and inference (DFlashDraft:
one block after a cached context) both call it.
"""
import torch
import torch.nn as nn

import model as M
from draft import Draft, exit_probability, no_tokens
from verify import probs_from_logits, sample


def dflash_target_layers(n_target_layer: int, n_draft_layer: int) -> tuple:
    """DFlash's default: the outputs of evenly spaced layers j from the second to the fourth-last,
    one per draft layer; as hidden states (model.py's convention) those are hidden[j + 1]."""
    if n_draft_layer == 1:
        outputs = [n_target_layer // 2]
    else:
        lo, hi = 1, n_target_layer - 3
        outputs = [round(lo + i * (hi - lo) / (n_draft_layer - 1)) for i in range(n_draft_layer)]
    return tuple(j + 1 for j in outputs)


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
        # the block's rows query; the context's rows only give keys and values
        h = block + self.self_attn.attend(queries[:, :, n_context:], keys, values, mask)
        return h + self.mlp(self.post_attention_layernorm(h)), (keys, values)


class DFlash(nn.Module):
    """DFlash draft network. Keys as the released checkpoints: layers.*, fc, hidden_norm, norm;
    embeddings and lm_head are the target's. Plus ours: verify_head."""

    def __init__(self, args: M.ModelArgs, target_dim: int, target_layers, block_size: int,
                 mask_token_id: int):
        super().__init__()
        self.args, self.block_size, self.mask_token_id = args, block_size, mask_token_id
        self.target_layers = tuple(target_layers)  # model.py's convention, as every layer list
        self.layers = nn.ModuleList(DFlashLayer(args) for _ in range(args.n_layer))
        self.fc = nn.Linear(len(self.target_layers) * target_dim, args.dim, bias=False)
        self.hidden_norm = M.RMSNorm(args.dim, args.norm_eps)
        self.norm = M.RMSNorm(args.dim, args.norm_eps)
        self.verify_head = nn.Linear(args.dim, 1)

    def context(self, features):
        """Fused target states (..., n * target_dim) -> the context the blocks attend (..., dim)."""
        return self.hidden_norm(self.fc(features))

    def forward(self, block, context, cos, sin, mask, cached=None):
        """block (B, nq, dim): the embedded block rows (the known token, then masks); context (B,
        nc, dim) from context(); cos/sin for cat(context, block) positions; mask what each block row
        sees (None: everything). cached: per layer, the keys and values of earlier context to put in
        front (inference), or None. -> pre-norm block states (B, nq, dim) and, per layer, the keys
        and values of cat(cached, context, block)."""
        kvs = []
        for i, layer in enumerate(self.layers):
            block, kv = layer(block, context, cos, sin, mask, None if cached is None else cached[i])
            kvs.append(kv)
        return block, kvs

    def heads(self, h, lm_head):
        """Pre-norm block states (..., dim) -> logits (..., V) through the target's lm_head, and the
        verification logit (...)."""
        x = self.norm(h)
        return lm_head(x), self.verify_head(x)[..., 0]


def dflash_mask(anchors: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """Training attention, (nb*B, T + nb*B) bool: block j sees context positions < anchors[j]
    and every position of its own block (bidirectional), nothing of other blocks."""
    nb = len(anchors)
    ctx = torch.arange(T, device=anchors.device)[None, :] < anchors[:, None]  # (nb, T)
    own = torch.eye(nb, dtype=torch.bool, device=anchors.device)  # (nb, nb)
    rows = torch.cat([ctx, own.repeat_interleave(block_size, 1)], 1)  # (nb, T + nb*B)
    return rows.repeat_interleave(block_size, 0)


class DFlashDraft(Draft):
    """Drives a DFlash network inside speculative.py's loop. Context keys/values of each layer are
    cached at their positions; the block [last committed token, MASK x (B-1)] sits right after."""

    def __init__(self, net: DFlash, embed: nn.Embedding, lm_head: nn.Module, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None,
                 early_exit: float | None = None, exit_signal: str = "head"):
        self.net, self.embed, self.lm_head = net, embed, lm_head
        self.target_layers = net.target_layers
        self.max_tokens = net.block_size - 1  # a block's guesses (its first row is the anchor)
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.early_exit, self.exit_signal = early_exit, exit_signal  # (draft.EXIT_SIGNALS)
        weight, length = net.fc.weight, max_seq_len + net.block_size
        self.caches = [M.KVCache(1, net.args.n_kv_head, length, net.args.head_dim, weight.dtype,
                                 weight.device) for _ in net.layers]
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
        cached = [(cache.k[:, :, :self.context_len], cache.v[:, :, :self.context_len])
                  for cache in self.caches]
        cos, sin = self.cos[positions], self.sin[positions]
        h, kvs = net(self.embed(block), context, cos, sin, None, cached)  # (1, B, dim)
        new = slice(self.context_len, anchor_pos)
        for cache, (keys, values) in zip(self.caches, kvs):  # new context kept; blocks recomputed
            cache.update(positions[:n_new], keys[:, :, new], values[:, :, new])
        self.context_len, self.forwards = anchor_pos, self.forwards + 1
        self.pending = None
        # (k, V), (k,): position i predicts the token at anchor_pos + i
        logits, head_logits = net.heads(h[0, 1:k + 1], self.lm_head)
        n = k
        if self.early_exit is not None:  # stop where the head (or confidence) expects a rejection
            below = (exit_probability(self.exit_signal, logits, head_logits)
                     < self.early_exit).nonzero()
            n = int(below[0]) if len(below) else k
        self.proposal_head_logits = [head_logits[:n]]
        if n == 0:
            return no_tokens()
        if self.temperature <= 0:  # the argmax: q one-hot there (None)
            return logits[:n].argmax(-1), None
        probs = probs_from_logits(logits[:n], self.temperature, self.top_p)  # (n, V)
        return sample(probs, self.temperature, self.generator), probs

    def commit(self, new_ids, n_accepted, features=None):
        self.proposal_head_logits = ()
        self.anchor = new_ids[-1]
        # the positions after context_len not yet fed (more than one commit's after a step in
        # which another draft proposed: HybridDraft)
        self.pending = features if self.pending is None else torch.cat([self.pending, features])


# -----------------------------------------------------------------------------
# Training: many blocks per sequence


def dflash_blocks(net: DFlash, embed, lm_head, tokens, features, anchors):
    """tokens (B, T), features (B, T, n*dim_t), anchors (B, nb) -> logits (B, nb, bs-1, V) and
    head logits (B, nb, bs-1): block j position i predicts the token at anchors[j] + i."""
    B, T = tokens.shape
    bs, nb = net.block_size, anchors.shape[1]
    block_pos = (anchors[..., None] + torch.arange(bs, device=tokens.device)).view(B, nb * bs)
    block_tokens = torch.full((B, nb, bs), net.mask_token_id, dtype=torch.long,
                              device=tokens.device)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    h = embed(block_tokens.view(B, nb * bs))  # (B, nb*bs, dim)
    context = net.context(features)  # (B, T, dim)
    cos_table, sin_table = M.rope_table(net.args, T + bs, h.device, h.dtype)
    context_pos = torch.arange(T, device=tokens.device).expand(B, T)
    positions = torch.cat([context_pos, block_pos], 1)  # (B, T + nb*bs)
    # (B, 1, T + nb*bs, head_dim)
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
    mask = torch.stack([dflash_mask(a, T, bs) for a in anchors])[:, None]  # (B, 1, nb*bs, T+nb*bs)
    h, _ = net(h, context, cos, sin, mask)
    return net.heads(h.view(B, nb, bs, -1)[:, :, 1:], lm_head)  # (B, nb, bs-1, V), (B, nb, bs-1)
