"""
The target model: one hand-written decoder-only Transformer for LLaMA-3.x, Qwen2 and Qwen3
checkpoints, and a static KV cache that speculative decoding rewinds by moving a position. It
runs as it is (fp32 or bf16, on a CPU or CUDA); the CPU engine (engine/) swaps its Linears for
faster CPU forms (engine/linear_forms.py), chooses among them (engine/layouts.py) and loads
weights from names, directories and the embedded GGUF (engine/weights.py). Tokenizers are
tokenizer.py's.

Hidden-state index convention (used by the drafts in eagle3.py and dflash.py), one place for all:
    hidden[i] is the residual stream *entering* decoder layer i, for 0 <= i < n_layer,
    so hidden[0] is the token embedding; hidden[n_layer] is the last layer's output before the
    final norm. This equals transformers' `output_hidden_states[i]` for i < n_layer (its last
    entry has the final norm applied, ours does not). "The output of layer j" is hidden[j + 1].
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class CheckpointError(Exception):
    """A checkpoint or tokenizer that cannot be used; the message is one line for the user."""


# -----------------------------------------------------------------------------
# Configuration: read straight from a Hugging Face config.json

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelArgs:
    model_type: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and LLaMA's optional attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED:
            archs = ",".join(cfg.get("architectures") or []) or "?"
            raise CheckpointError(f"unsupported architecture {model_type!r} ({archs}); "
                                  f"supported: {', '.join(SUPPORTED.values())}")
        # transformers >= 5 nests rope settings in `rope_parameters`; older configs keep them flat
        rope = dict(config_mapping(cfg, "rope_parameters"))
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else \
            config_mapping(cfg, "rope_scaling")
        rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if scaling and rope_type not in ("llama3", "default"):
            raise CheckpointError(f"unsupported rope scaling {scaling!r}")
        n_head = config_int(cfg, "num_attention_heads")
        dim = config_int(cfg, "hidden_size")
        is_llama3_scaling = rope_type == "llama3"
        return cls(
            model_type=model_type,
            vocab_size=config_int(cfg, "vocab_size"),
            dim=dim,
            n_layer=config_int(cfg, "num_hidden_layers"),
            n_head=n_head,
            n_kv_head=config_int(cfg, "num_key_value_heads", n_head),
            head_dim=config_int(cfg, "head_dim", dim // n_head),
            intermediate_size=config_int(cfg, "intermediate_size"),
            # (an eps past 1 drowns the norm)
            norm_eps=config_number(cfg, "rms_norm_eps", 1e-6, below=1.0),
            rope_theta=config_number({"rope_theta": theta}, "rope_theta"),
            rope_scaling=scaling if is_llama3_scaling else None,
            max_position_embeddings=config_int(cfg, "max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def config_int(cfg: dict, key: str, default=None) -> int:
    """A positive integer field of config.json; a missing or mistyped one is a one-line error."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise CheckpointError(f"config.json lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config.json field {key!r} must be a positive integer, "
                              f"not {value!r}")
    return value


def config_number(cfg: dict, key: str, default=None, below: float = math.inf) -> float:
    """A finite positive number field of config.json, under `below`; else a one-line error."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < below or \
            not math.isfinite(value):
        bound = "" if below == math.inf else f" below {below:g}"
        raise CheckpointError(f"config.json field {key!r} must be a finite positive number{bound}, "
                              f"not {value!r}")
    return float(value)


def config_mapping(cfg: dict, key: str) -> dict:
    """An optional object field of config.json ({} when absent or null); another type is an
    error."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json field {key!r} must be an object, not {value!r}")
    return value


# -----------------------------------------------------------------------------
# The network

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalize in fp32 and cast back before the weight, as HF, EAGLE and DFlash do, so bf16
        # runs round where theirs round (torch's rms_norm's arithmetic, bit for bit)
        x32 = x if x.dtype == torch.float32 else x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s:  # LLaMA-3.1: stretch low frequencies by `factor`, keep high ones, blend in between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / lo, inv_freq / factor,
                               torch.where(wavelen < old_ctx / hi, inv_freq, blended))
    return inv_freq.float()


def rope_table(args: ModelArgs, max_seq_len: int, device=None, dtype=torch.float32):
    """cos and sign-folded sin tables, (max_seq_len, head_dim) each, computed in fp32."""
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(args))
    cos, sin = freqs.cos(), freqs.sin()  # (max_seq_len, head_dim // 2)
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


def apply_rope(x, cos, sin_signed):
    # HF's x * cos + rotate_half(x) * sin, with rotate_half's sign folded into the table: fewer ops
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class KVCache(nn.Module):
    """Keys and values stored at their absolute positions. Rewinding a speculative block is free:
    the next forward starts at an earlier position, the causal mask hides the stale entries past
    it, and they are overwritten as decoding moves on. On a CPU they are kept in fp32 whatever the
    weights (bf16 keys convert to fp32 exactly), the dtype torch's CPU attention runs best in
    (engine/layouts.py)."""

    def __init__(self, batch, n_kv_head, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch, n_kv_head, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        keys, values = self.k, self.v
        if k.shape[0] < keys.shape[0]:  # a smaller batch than the cache was sized for
            keys, values = keys[:k.shape[0]], values[:k.shape[0]]
        keys.index_copy_(2, input_pos, k)
        values.index_copy_(2, input_pos, v)
        return keys, values


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        # q, k and v in one matmul (checkpoints' q_proj, k_proj and v_proj are fused on loading)
        qkv_dim = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.qkv_proj = nn.Linear(in_dim or args.dim, qkv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.kv_cache: KVCache | None = None

    def project(self, x, cos, sin):
        """(B, T, in_dim) -> q (B, heads, T, head_dim), k and v (B, kv_heads, T, head_dim), with
        RoPE."""
        B, T, _ = x.shape
        H, KV = self.n_head, self.n_kv_head
        # RoPE and attention run in the RoPE table's dtype (the KV cache's: see KVCache)
        qkv = self.qkv_proj(x).to(cos.dtype).view(B, T, H + 2 * KV, self.head_dim).transpose(1, 2)
        q_and_k, v = qkv.split([H + KV, KV], dim=1)  # (B, H + KV, T, head_dim), (B, KV, ...)
        if self.q_norm is not None:
            q_and_k = torch.cat([self.q_norm(q_and_k[:, :H]), self.k_norm(q_and_k[:, H:])], 1)
        # q and k rotate together: one RoPE instead of two
        q, k = apply_rope(q_and_k, cos, sin).split([H, KV], dim=1)
        return q, k, v

    def mix(self, q, k, v, mask):
        """(B, heads, T, head_dim) queries over the keys and values given -> the same shape."""
        gqa = self.n_kv_head != self.n_head
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def attend(self, q, k, v, mask, dtype=None):
        """Attention of q over the keys k, v given and the output projection,
        (B, heads, T, head_dim) -> (B, T, dim) in `dtype` (default q's)."""
        return self.o_proj(self.mix(q, k, v, mask).transpose(1, 2).flatten(2).to(dtype or q.dtype))

    def forward(self, x, cos, sin, mask, input_pos):
        """x (B, T, in_dim) at cache slots input_pos (T,) -> (B, T, dim). mask (T, kv_len) or
        (B, 1, T, kv_len) bool: which of the first kv_len cache slots each row sees."""
        q, k, v = self.project(x, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, kv_heads, max_seq_len, head_dim)
        kv_len = mask.shape[-1]  # (no row sees a later slot: reading them would waste bandwidth)
        return self.attend(q, k[:, :, :kv_len], v[:, :, :kv_len], mask, x.dtype)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. source: the directory its weights came from (drafts record which target they
    serve)."""

    def __init__(self, args: ModelArgs, source=None):
        super().__init__()
        self.args, self.source = args, source
        # drawn uniform, not nn.Embedding's normal: checkpoints build a model on the meta device
        # before its weights arrive, and normal_ there sets up lazily (a second of every start);
        # the values are always replaced by loaded weights or only timed
        drawn = torch.empty(args.vocab_size, args.dim).uniform_(-1, 1)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, _weight=drawn)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.max_seq_len = 0

    def without_layers(self) -> "Transformer":
        """A model with no decoder layers that shares this one's embedding, final norm and head (no
        copy): what the head alone costs, which the CPU engine's probes time apart from a layer."""
        with torch.device("meta"):
            head = Transformer(dataclasses.replace(self.args, n_layer=0), self.source)
        head.embed_tokens, head.norm, head.lm_head = self.embed_tokens, self.norm, self.lm_head
        head.setup_caches(1, self.max_seq_len)
        return head

    def tie_weights(self):
        """With tie_word_embeddings, the output head reads the embedding table (again after a
        load_state_dict(assign=True) replaced either)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_caches(self, max_batch_size: int, max_seq_len: int):
        """Allocate the KV caches and the RoPE table for sequences of up to max_seq_len tokens."""
        weight = self.embed_tokens.weight  # (never packed or quantized: its dtype is the model's)
        self.max_seq_len = max_seq_len
        # (fp32 on a CPU: see KVCache)
        cache_dtype = torch.float32 if weight.device.type == "cpu" else weight.dtype
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(max_batch_size, self.args.n_kv_head, max_seq_len,
                                               self.args.head_dim, cache_dtype, weight.device)
        cos, sin = rope_table(self.args, max_seq_len, weight.device, cache_dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, input_pos, hidden_layers=(), last_logits_only=False, key_valid=None,
                tree_parents=None):
        """tokens (B, T) at absolute positions input_pos (T,), contiguous and increasing.
        Returns (logits, hidden): logits (B, T, vocab), or (B, 1, vocab) with last_logits_only, and
        the hidden states named by hidden_layers (indices in the module docstring's convention), a
        list of (B, T, dim), empty when none are asked for. key_valid (B, max_seq_len) bool hides
        cache slots per sequence (left padding in a batch).
        tree_parents (T-1 ints) makes the block a draft tree (see tree_attention): input_pos are
        then the cache slots it is written to, and keep_path moves the accepted path into place."""
        x, hidden = self.decoder(tokens, input_pos, tuple(hidden_layers), key_valid, tree_parents)
        if last_logits_only:
            x = x[:, -1:]
        return self.lm_head(x), hidden

    def decoder(self, tokens, input_pos, hidden_layers=(), key_valid=None, tree_parents=None):
        """forward without the output head: (B, T) tokens -> (B, T, dim) final-normed states, and
        the hidden states named by hidden_layers."""
        assert self.max_seq_len, "call setup_caches() first"
        kv_len = int(input_pos[-1]) + 1  # the cache slots any row can see
        if tree_parents is None:
            rope_pos, mask = input_pos, attention_mask(input_pos, kv_len, key_valid)
        else:
            rope_pos, mask = tree_attention(tree_parents, input_pos, kv_len)
        return self.trunk(tokens, rope_pos, input_pos, mask, hidden_layers)

    def trunk(self, tokens, rope_pos, input_pos, mask, hidden_layers=()):
        """The embedding, the decoder layers and the final norm, (B, T) tokens at cache slots
        input_pos and RoPE positions rope_pos -> (B, T, dim), and the hidden states named by
        hidden_layers. Compiled graphs call it with masks of their own (engine/compiled.py)."""
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]  # (T, head_dim)
        x = self.embed_tokens(tokens)  # (B, T, dim)
        hidden = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = x
            x = layer(x, cos, sin, mask, input_pos)
        hidden[self.args.n_layer] = x
        return self.norm(x), [hidden[i] for i in hidden_layers]

    def keep_path(self, path_slots: list, first_slot: int):
        """After a tree's verification: move the keys and values of the accepted nodes (at
        path_slots, root to leaf) to first_slot, first_slot + 1, ..., where a chain would have
        written them; what lies past them is stale and masked, as after a chain's rewind."""
        last_slot = first_slot + len(path_slots) - 1
        if not path_slots or path_slots[0] == first_slot and path_slots[-1] == last_slot:
            return  # already in place (a path down the first children)
        device = self.embed_tokens.weight.device
        src = torch.tensor(path_slots, device=device)
        dst = torch.arange(first_slot, first_slot + len(path_slots), device=device)
        for layer in self.layers:
            cache = layer.self_attn.kv_cache
            for buffer in (cache.k, cache.v):
                buffer.index_copy_(2, dst, buffer.index_select(2, src))


def tree_attention(parents: list, slots: torch.Tensor, kv_len: int):
    """A verification block shaped as a tree: row 0 the root (the last committed token), row i + 1
    draft node i with parent row parents[i] + 1 (parents[i] = -1: the root), rows in topological
    order and written to consecutive cache slots from slots[0]. Returns the RoPE positions (T,),
    slots[0] + depth, where a node sits in its own chain; and the mask (T, kv_len): the cache
    before the block, then the row's ancestors and itself."""
    T, first = len(parents) + 1, int(slots[0])
    depth, ancestors = [0], [[0]]
    for parent in parents:
        depth.append(depth[parent + 1] + 1)
        ancestors.append(ancestors[parent + 1] + [len(ancestors)])
    mask = torch.zeros(T, kv_len, dtype=torch.bool, device=slots.device)
    mask[:, :first] = True
    for row, rows_seen in enumerate(ancestors):
        mask[row, [first + r for r in rows_seen]] = True
    return first + torch.tensor(depth, device=slots.device), mask


def attention_mask(input_pos, kv_len: int, key_valid=None):
    """Which of the first kv_len cache slots each query sees: (T, kv_len) bool, or (B, 1, T, kv_len)
    with key_valid. Causal over absolute positions, which is also what hides the stale entries
    past a speculative rewind."""
    slots = torch.arange(kv_len, device=input_pos.device)
    causal = slots <= input_pos[:, None]  # (T, kv_len)
    if key_valid is not None:
        # a padding query sees itself, so no row is empty (an empty row would spread NaNs)
        return causal & (key_valid[:, None, None, :kv_len] | (slots == input_pos[:, None]))
    return causal
