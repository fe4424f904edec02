"""
Drafts: cheap proposers of the next k tokens. Every draft speaks the same three-call interface that
decode.py's loop drives:

    draft.start(prompt_ids)        sees the prompt (prefills its own cache, if it has one)
    draft.propose(k) -> (tokens (k,), q (k, V) or None)
                                   k guesses continuing the committed sequence, with the
                                   distributions they were drawn from (None: deterministic)
    draft.commit(new_ids, n_accepted)
                                   the verifier kept n_accepted drafted tokens and appended one
                                   more; new_ids are all of them. A draft with a cache rewinds it
                                   to the part that is still valid.

Drafts that read the target's hidden states (EAGLE-3, DFlash) also name the `target_layers` they
need (indices in model.py's convention) and receive those states, concatenated, for the committed
positions: start(prompt_ids, features) and commit(new_ids, n_accepted, features).

This file holds prompt lookup (n-gram matching, training-free), an independent draft model (any
model.py checkpoint sharing the target's tokenizer), and the two trained drafts with their
verification heads: EAGLE-3 (one decoder layer over fused target features, drafting token by
token) and DFlash (a block-diffusion drafter filling B-1 masked positions in one forward).
"""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

import model as M
from verify import probs_from_logits


class LookupDraft:
    """Prompt lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list = []
        self.forwards = 0  # no network: lookups are not forwards

    def start(self, prompt_ids):
        self.seq = list(prompt_ids)

    def propose(self, k: int):
        seq = self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # most recent match first
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return torch.tensor(follow), None
        return torch.tensor([], dtype=torch.long), None

    def commit(self, new_ids, n_accepted):
        self.seq += list(new_ids)


class ModelDraft:
    """A smaller model of the same family (e.g. qwen3-0.6b for qwen3-4b) drafting autoregressively.
    Its cache holds `cache_len` committed tokens; each propose first feeds the committed tokens it
    has not seen (one, or two after a fully accepted block) and then drafts k tokens."""

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, generator=None):
        self.model, self.temperature, self.top_p, self.generator = model, temperature, top_p, generator
        self.device = model.lm_head.weight.device if hasattr(model.lm_head, "weight") else "cpu"
        self.seq: list = []
        self.cache_len = 0
        self.drafted = 0
        self.forwards = 0

    def start(self, prompt_ids):
        self.seq = list(prompt_ids)
        self.cache_len = self.drafted = 0

    @torch.no_grad()
    def propose(self, k: int):
        pending = self.seq[self.cache_len:]  # committed, not yet in the draft's cache
        tokens, dists = [], []
        x = torch.tensor([pending], device=self.device)
        pos = torch.arange(self.cache_len, len(self.seq), device=self.device)
        for _ in range(k):
            logits = self.model(x, pos, last_logits_only=True)[0, -1]  # (V,)
            self.forwards += 1
            q = probs_from_logits(logits, self.temperature, self.top_p)
            token = torch.multinomial(q, 1, generator=self.generator) if self.temperature > 0 else q.argmax(-1, keepdim=True)
            tokens.append(token)
            dists.append(q)
            x, pos = token.view(1, 1), pos[-1:] + 1
        # the cache now holds the committed sequence plus all drafted tokens but the last
        self.cache_len = len(self.seq)
        self.drafted = len(tokens)
        if not tokens:
            return torch.tensor([], dtype=torch.long), None
        return torch.cat(tokens), torch.stack(dists)  # (k,), (k, V)

    def commit(self, new_ids, n_accepted):
        # drafted tokens 0..drafted-2 went through the cache; keep the accepted ones among them
        self.cache_len += min(n_accepted, max(self.drafted - 1, 0))
        self.seq += list(new_ids)


# -----------------------------------------------------------------------------
# EAGLE-3: fc fuses three target layers, one decoder layer drafts token by token

def eagle3_target_layers(n_layer: int) -> tuple:
    """The hidden states entering layers 2, L//2 and L-3 (model.py's index convention)."""
    return (2, n_layer // 2, n_layer - 3)


def dflash_target_layers(n_target_layer: int, n_draft_layer: int) -> list:
    """Evenly spaced target layers from the second to the fourth-last, one per draft layer."""
    if n_draft_layer == 1:
        return [n_target_layer // 2]
    lo, hi = 1, n_target_layer - 3
    return [round(lo + i * (hi - lo) / (n_draft_layer - 1)) for i in range(n_draft_layer)]


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
        return self.self_attn.project(torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1), cos, sin)

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


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time test attention, (T, (step+1)*T) bool: at unrolled step s the query of base
    position t sees the real prefix (step-0 keys at positions <= t) and, of every later step
    1..s, only the key of its own chain (same t): exactly what drafting from t sees at inference."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class Eagle3Drafter:
    """Drives an Eagle3 network inside decode.py's loop (see the module docstring).

    The draft pairs the target's fused state at position t with the embedding of token t+1 and
    places the pair at position t of its own cache. Real pairs arrive with each commit; drafted
    pairs (the draft's own output with its sampled token) go past them and are overwritten."""

    def __init__(self, net: Eagle3, embed: nn.Embedding, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None, early_exit: float | None = None):
        self.net, self.embed = net, embed
        self.target_layers = net.target_layers
        self.temperature, self.top_p, self.generator, self.early_exit = temperature, top_p, generator, early_exit
        p = net.fc.weight
        self.cache = M.KVCache(1, net.args.n_kv_head, max_seq_len, net.args.head_dim, p.dtype, p.device)
        cos, sin = M.rope_table(net.args, max_seq_len)
        self.cos, self.sin = cos.to(p.device, p.dtype), sin.to(p.device, p.dtype)
        self.forwards = 0
        self.head_probs: list = []  # verification-head probabilities of the last proposal

    def start(self, prompt_ids, features):
        self.cache_len = 0
        self.pending_tokens = list(prompt_ids[1:])
        self.pending_features = features  # (L-1, 3 * target_dim) for positions 0..L-2

    def step(self, tokens, hidden, pos):
        """One forward at positions pos..pos+T-1; tokens (T,), hidden (T, dim)."""
        layer, T = self.net.midlayer, len(tokens)
        positions = torch.arange(pos, pos + T, device=hidden.device)
        cos, sin = self.cos[positions], self.sin[positions]
        q, k, v = layer.qkv(self.embed(tokens)[None], hidden[None], cos, sin)
        k, v = self.cache.update(positions, k, v)
        mask = torch.arange(pos + T, device=hidden.device) <= positions[:, None]
        out = layer.finish(hidden[None], layer.self_attn.attend(q, k[:, :, :pos + T], v[:, :, :pos + T], mask))[0]
        self.forwards += 1
        return out  # (T, dim), pre-norm: what the next draft step feeds back

    @torch.no_grad()
    def propose(self, k: int):
        net = self.net
        device = net.fc.weight.device
        if not self.pending_tokens:  # a one-token prompt: no target state to draft from yet
            return torch.tensor([], dtype=torch.long), None
        tokens_in = torch.tensor(self.pending_tokens, dtype=torch.long, device=device)
        hidden = net.fc(self.pending_features.to(device=device, dtype=net.fc.weight.dtype))
        out = self.step(tokens_in, hidden, self.cache_len)[-1:]
        self.cache_len += len(tokens_in)
        tokens, dists, self.head_probs = [], [], []
        for j in range(k):
            logits, v_logit = net.heads(out[-1])
            head = torch.sigmoid(v_logit).item() if self.early_exit is not None else None
            if head is not None and head < self.early_exit:
                break  # the head predicts this token would be rejected: stop drafting here
            q = net.to_target_probs(probs_from_logits(logits, self.temperature, self.top_p))
            token = torch.multinomial(q, 1, generator=self.generator) if self.temperature > 0 else q.argmax(-1, keepdim=True)
            tokens.append(token)
            dists.append(q)
            self.head_probs.append(head)
            if j + 1 < k:
                out = self.step(token, out[-1:], self.cache_len + j)
        if not tokens:
            return torch.tensor([], dtype=torch.long), None
        return torch.cat(tokens), torch.stack(dists)

    def commit(self, new_ids, n_accepted, features):
        self.pending_tokens = list(new_ids)
        self.pending_features = features  # (n_accepted + 1, 3 * target_dim)


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
        nc = ctx.shape[1]
        q, k, v = self.self_attn.project(torch.cat([ctx, self.input_layernorm(block)], 1), cos, sin)
        if ctx_kv is not None:
            k, v = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)
        h = block + self.self_attn.attend(q[:, :, nc:], k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h)), (k, v)


class DFlash(nn.Module):
    """DFlash draft network. Keys as the released checkpoints: layers.*, fc, hidden_norm, norm;
    embeddings and lm_head are the target's. Plus ours: verify_head."""

    def __init__(self, args: M.ModelArgs, target_dim: int, target_layer_ids: list, block_size: int, mask_token_id: int):
        super().__init__()
        self.args, self.block_size, self.mask_token_id = args, block_size, mask_token_id
        self.target_layer_ids = list(target_layer_ids)
        self.layers = nn.ModuleList(DFlashLayer(args) for _ in range(args.n_layer))
        self.fc = nn.Linear(len(target_layer_ids) * target_dim, args.dim, bias=False)
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


class DFlashDrafter:
    """Drives a DFlash network inside decode.py's loop. Context keys/values of each layer are
    cached at their positions; the block [last committed token, MASK x (B-1)] sits right after."""

    def __init__(self, net: DFlash, embed: nn.Embedding, lm_head: nn.Module, max_seq_len: int,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None, early_exit: float | None = None):
        self.net, self.embed, self.lm_head = net, embed, lm_head
        self.target_layers = tuple(i + 1 for i in net.target_layer_ids)  # outputs of those layers
        self.max_tokens = net.block_size - 1  # one block drafts at most this many (the anchor is known)
        self.temperature, self.top_p, self.generator, self.early_exit = temperature, top_p, generator, early_exit
        p = net.fc.weight
        self.caches = [M.KVCache(1, net.args.n_kv_head, max_seq_len + net.block_size, net.args.head_dim, p.dtype, p.device)
                       for _ in net.layers]
        cos, sin = M.rope_table(net.args, max_seq_len + net.block_size)
        self.cos, self.sin = cos.to(p.device, p.dtype), sin.to(p.device, p.dtype)
        self.forwards = 0
        self.head_probs: list = []

    def start(self, prompt_ids, features):
        self.anchor, self.ctx_len = prompt_ids[-1], 0
        self.pending = features  # (L-1, n * target_dim): positions 0..L-2

    @torch.no_grad()
    def propose(self, k: int):
        net, device = self.net, self.net.fc.weight.device
        B = net.block_size
        ctx = net.context(self.pending.to(device=device, dtype=net.fc.weight.dtype))[None]  # (1, nc, dim)
        nc, a = ctx.shape[1], self.ctx_len + ctx.shape[1]  # a: the anchor's position
        positions = torch.arange(self.ctx_len, a + B, device=device)
        cos, sin = self.cos[positions], self.sin[positions]
        block = self.embed(torch.tensor([[self.anchor] + [net.mask_token_id] * (B - 1)], device=device))
        h = block
        for layer, cache in zip(net.layers, self.caches):
            cached = (cache.k[:, :, :self.ctx_len], cache.v[:, :, :self.ctx_len])
            h, (kk, vv) = layer(h, ctx, cos, sin, None, cached)
            # keep the new context keys/values; the block's are recomputed every time
            cache.update(positions[:nc], kk[:, :, self.ctx_len:a], vv[:, :, self.ctx_len:a])
        self.ctx_len, self.forwards = a, self.forwards + 1
        x = net.norm(h[0, 1:k + 1])  # (k, dim): block position i predicts the token at a + i
        probs = probs_from_logits(self.lm_head(x), self.temperature, self.top_p)
        head = torch.sigmoid(net.verify_head(x)[:, 0])
        n = k
        if self.early_exit is not None:  # stop at the first position the head expects rejected
            below = (head < self.early_exit).nonzero()
            n = int(below[0]) if len(below) else k
        self.head_probs = head[:n].tolist()
        if n == 0:
            return torch.tensor([], dtype=torch.long), None
        if self.temperature > 0:
            tokens = torch.multinomial(probs[:n], 1, generator=self.generator)[:, 0]
        else:
            tokens = probs[:n].argmax(-1)
        return tokens, probs[:n]

    def commit(self, new_ids, n_accepted, features):
        self.anchor = new_ids[-1]
        self.pending = features  # (n_accepted + 1, n * target_dim), the positions after ctx_len


# -----------------------------------------------------------------------------
# Checkpoints: the released layouts, both ways

def draft_kind(config: dict) -> str:
    archs = " ".join(config.get("architectures") or [])
    if "dflash_config" in config or "DFlash" in archs:
        return "dflash"
    if "draft_vocab_size" in config or "Eagle3" in archs:
        return "eagle3"
    raise M.CheckpointError(f"config.json names neither an EAGLE-3 nor a DFlash draft ({archs or 'no architectures'})")


def read_draft_tensors(path: Path) -> dict:
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return M.read_safetensors(path)
    if (path / "pytorch_model.bin").is_file():
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise M.CheckpointError(f"corrupt pytorch_model.bin in {path}: {str(e).splitlines()[0]}") from None
    raise M.CheckpointError(f"no model.safetensors or pytorch_model.bin in {path}")


def draft_args(config: dict) -> M.ModelArgs:
    cfg = dict(config)
    cfg.setdefault("model_type", "qwen3" if draft_kind(config) == "dflash" else "llama")
    if cfg["model_type"] not in M.SUPPORTED:
        cfg["model_type"] = "llama"
    return M.ModelArgs.from_hf_config(cfg)


# config flags of released drafts that change the network in ways this file does not implement:
# a draft carrying one would load and then run with wrong logits, so it is refused instead
UNSUPPORTED_FLAGS = {
    "eagle3": {"fc_norm": True, "norm_output": False, "use_fc_bias": True},
    "dflash": {"causal": True, "use_swa": True, "attention_sink_bias": True, "sample_from_anchor": True},
}


def check_supported(config: dict, kind: str, path: Path):
    sections = [config, config.get("eagle_config") or {}, config.get("dflash_config") or {}]
    for flag, bad in UNSUPPORTED_FLAGS[kind].items():
        if any(section.get(flag) == bad for section in sections):
            raise M.CheckpointError(f"draft {path} sets {flag}={json.dumps(bad)}, which this implementation "
                                    f"does not support")
    if config.get("hidden_act", "silu") != "silu":
        raise M.CheckpointError(f"draft {path} uses hidden_act={config['hidden_act']!r}; only silu is supported")
    if kind == "eagle3" and config.get("num_hidden_layers", 1) != 1:
        raise M.CheckpointError(f"draft {path} has {config['num_hidden_layers']} decoder layers; EAGLE-3 drafts "
                                f"with more than one are not supported")


def eagle3_layers_from_config(config: dict, n_target_layer: int) -> tuple:
    """The fused target states, in model.py's index convention. Released configs name the layers
    whose *output* is read (SpecForge's eagle_config.eagle_aux_hidden_state_layer_ids, read first,
    as SpecForge does), so each id j is our hidden[j + 1]; without them, EAGLE-3's default."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids")
    return tuple(j + 1 for j in ids) if ids else eagle3_target_layers(n_target_layer)


def dflash_settings(config: dict, n_draft_layer: int, path: Path):
    """(target layer ids, mask token id, number of target layers) from dflash_config or, as some
    released configs have them, the top level."""
    dc = config.get("dflash_config") or {}
    mask_id = dc.get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        raise M.CheckpointError(f"DFlash draft {path} names no mask_token_id (in dflash_config or at the top "
                                f"level): its blocks cannot be filled")
    n_target = config.get("num_target_layers")
    layer_ids = dc.get("target_layer_ids") or config.get("target_layer_ids")
    if not layer_ids:
        if not n_target:
            raise M.CheckpointError(f"DFlash draft {path} names neither target_layer_ids nor num_target_layers")
        layer_ids = dflash_target_layers(n_target, n_draft_layer)  # DFlash's own rule for the default
    return list(layer_ids), mask_id, n_target


def check_matches_target(path: Path, target: M.Transformer, target_dim: int, layers, n_target):
    """A draft trained for another target loads fine and then fails mid-run: compare what it
    recorded about its target (vocabulary is checked by the caller) before anything runs."""
    t = target.args
    if target_dim != t.dim:
        raise M.CheckpointError(f"draft {path} was trained on a target of hidden size {target_dim}; "
                                f"this target has {t.dim}")
    if n_target and n_target != t.n_layer:
        raise M.CheckpointError(f"draft {path} was trained on a target of {n_target} layers; this one has {t.n_layer}")
    if any(not 0 <= i <= t.n_layer for i in layers):
        raise M.CheckpointError(f"draft {path} reads target hidden states {list(layers)}; this target has "
                                f"only {t.n_layer} layers")


def load_draft(path, target: M.Transformer, dtype=None, device=None):
    """An EAGLE-3 or DFlash checkpoint directory -> (kind, network) matched to the target.
    Every tensor must be one the network uses, and every config flag one it implements."""
    path = Path(path)
    config = M.read_config(path)
    kind = draft_kind(config)
    check_supported(config, kind, path)
    args = draft_args(config)
    p = target.embed_tokens.weight
    dtype, device = dtype or p.dtype, device or p.device
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in read_draft_tensors(path).items()}
    sd = M.fuse_hf(sd)
    if args.vocab_size != target.args.vocab_size:
        raise M.CheckpointError(f"draft {path} is for a vocabulary of {args.vocab_size}, the target has "
                                f"{target.args.vocab_size}")
    with torch.device("meta"):
        if kind == "eagle3":
            target_dim = config.get("target_hidden_size", target.args.dim)
            layers = eagle3_layers_from_config(config, target.args.n_layer)
            check_matches_target(path, target, target_dim, layers, None)
            net = Eagle3(args, target_dim, config.get("draft_vocab_size") or args.vocab_size, layers)
        else:
            layer_ids, mask_id, n_target = dflash_settings(config, args.n_layer, path)
            check_matches_target(path, target, config.get("target_hidden_size", target.args.dim),
                                 [i + 1 for i in layer_ids], n_target)
            net = DFlash(args, target.args.dim, layer_ids, config.get("block_size", 16), mask_id)
    expected = net.state_dict()
    if "verify_head.weight" not in sd:  # released drafts have no verification head: start it neutral
        sd["verify_head.weight"] = torch.zeros(1, args.dim)
        sd["verify_head.bias"] = torch.full((1,), 10.0)  # sigmoid ~ 1: never triggers early exit
    if kind == "eagle3" and "d2t" not in sd:  # a full-vocabulary draft
        sd["d2t"] = torch.zeros(expected["d2t"].shape, dtype=torch.long)
        sd["t2d"] = torch.ones(expected["t2d"].shape, dtype=torch.bool)
    sd.pop("embed_tokens.weight", None)  # EAGLE-3 may carry a copy of the target's; we use the target's
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise M.CheckpointError(f"draft {path} holds tensor {unexpected[0]} that this {kind} network does not "
                                f"use ({len(unexpected)} unexpected): refusing rather than running without it")
    for key, t in expected.items():
        if key not in sd:
            raise M.CheckpointError(f"draft checkpoint {path} lacks tensor {key}")
        if sd[key].shape != t.shape:
            raise M.CheckpointError(f"draft tensor {key} in {path} has shape {tuple(sd[key].shape)}, "
                                    f"expected {tuple(t.shape)}")
    sd = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in sd.items()}
    net.load_state_dict(sd, assign=True)
    return kind, net.eval()


def write_draft_files(net, folder: Path, target_args: M.ModelArgs, extra_config: dict | None = None,
                      dtype=torch.bfloat16):
    """config.json and model.safetensors of a draft, in the released layout (HF names, unfused),
    into an existing folder."""
    from safetensors.torch import save_file
    a = net.args
    config = {"hidden_size": a.dim, "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_head,
              "num_key_value_heads": a.n_kv_head, "head_dim": a.head_dim, "num_hidden_layers": a.n_layer,
              "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "max_position_embeddings": a.max_position_embeddings,
              "vocab_size": a.vocab_size, "tie_word_embeddings": False, "torch_dtype": str(dtype).replace("torch.", "")}
    if isinstance(net, Eagle3):
        config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                      draft_vocab_size=net.lm_head.out_features, target_hidden_size=target_args.dim,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in net.target_layers]})
    else:
        config.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=net.block_size,
                      num_target_layers=target_args.n_layer, target_hidden_size=target_args.dim,
                      dflash_config={"target_layer_ids": net.target_layer_ids, "mask_token_id": net.mask_token_id})
    config.update(extra_config or {})
    sd = M.unfuse_to_hf({k: v.detach().cpu() for k, v in net.state_dict().items()}, a)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def save_draft(net, path, target_args: M.ModelArgs, extra_config: dict | None = None, dtype=torch.bfloat16):
    """Write a draft directory atomically: a temporary directory, renamed into place once whole."""
    import shutil
    import tempfile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the draft from other users
    try:
        write_draft_files(net, tmp, target_args, extra_config, dtype)
        replace_directory(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def replace_directory(new: Path, path: Path):
    """Move the complete directory `new` to `path`. An older `path` is first renamed aside, so a
    kill in between leaves it under <path>.old, never half-deleted."""
    import shutil
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        new.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(path)
