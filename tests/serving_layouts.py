"""
What vLLM and SGLang read from an EAGLE-3 or DFlash draft directory, written down from their
public loaders (no GPU here, so neither is installed): how each renames a checkpoint's tensors,
which parameters it then holds and in what shapes, and which config fields name the target
layers the draft fuses. `served_problems` holds a draft directory to one engine's loader: every
tensor maps to a parameter of the right shape, none is left over, none is missing.

Sources (file @ commit, in the public repositories):
- vLLM EAGLE-3: vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (Eagle3LlamaForCausalLM.load_weights: drops t2d, renames d2t to draft_id_to_target_id, prefixes
  every other name but lm_head with "model."; LlamaModel.load_weights: "midlayer." -> "layers.0.",
  q/k/v into qkv_proj and gate/up into gate_up_proj, then params_dict[name], so an unknown name
  stops the load). The aux layers: vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @
  0cfdd2e15d6991f354c6e22fd7f7e7577afe0424 (top-level eagle_aux_hidden_state_layer_ids as they are,
  else dflash_config.target_layer_ids + 1); vllm/model_executor/models/llama.py captures
  hidden_states + residual *entering* layer idx, by default (2, L // 2, L - 3).
- vLLM DFlash: vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9
  (DFlashQwen3ForCausalLM.load_weights: the same renames; lm_head and embed_tokens optional, the
  target's otherwise; fc reads target_hidden_size x the number of aux layers).
- SGLang EAGLE-3: python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
  (d2t -> hot_token_id, t2d dropped, the same fusions, a name looked up as it is or under "model.";
  a name with no parameter is silently dropped). The aux layers: eagle_config's
  eagle_aux_hidden_state_layer_ids, each + 1 (set_eagle3_layers_to_capture), default (2, L // 2, L - 3).
- SGLang DFlash: python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734
  (DFlashDraftModel: layers.*, fc (hidden x the number of target layers), hidden_norm, norm; no
  embedding or head of its own; dflash_config.target_layer_ids name layer outputs).
"""
import json
from pathlib import Path

from engine.weights import read_safetensors

ENGINES = ("vllm", "sglang")
FUSED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
         ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def layer_parameters(prefix: str, c: dict, attn_in: int, qk_norm: bool) -> dict:
    """A decoder layer's parameters after fusion: name -> shape, with each fused one's shards."""
    D, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    params = {f"{prefix}self_attn.qkv_proj.weight": ((H + 2 * KV) * hd, attn_in),
              f"{prefix}self_attn.o_proj.weight": (D, H * hd),
              f"{prefix}mlp.gate_up_proj.weight": (2 * I, D),
              f"{prefix}mlp.down_proj.weight": (D, I),
              f"{prefix}input_layernorm.weight": (D,),
              f"{prefix}post_attention_layernorm.weight": (D,)}
    if qk_norm:
        params.update({f"{prefix}self_attn.q_norm.weight": (hd,), f"{prefix}self_attn.k_norm.weight": (hd,)})
    return params


def shard_shape(param_shape: tuple, shard, c: dict) -> tuple:
    """The shape of one shard of a fused parameter (what the checkpoint's unfused tensor must have)."""
    hd, H, KV = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    rows = {"q": H * hd, "k": KV * hd, "v": KV * hd, 0: c["intermediate_size"], 1: c["intermediate_size"]}[shard]
    return (rows,) + tuple(param_shape[1:])


def engine_parameters(engine: str, kind: str, c: dict) -> tuple:
    """(required parameters, optional parameters): name -> shape, as `engine` builds them for the
    draft config c."""
    D = c["hidden_size"]
    target_dim = c.get("target_hidden_size", D)
    if kind == "eagle3":
        Vd = c.get("draft_vocab_size") or c["vocab_size"]
        layer = "model.layers.0." if engine == "vllm" else "model.midlayer."
        required = {**layer_parameters(layer, c, 2 * D, qk_norm=False), f"{layer}hidden_norm.weight": (D,),
                    "model.fc.weight": (D, 3 * target_dim), "model.norm.weight": (D,), "lm_head.weight": (Vd, D)}
        mapping = "draft_id_to_target_id" if engine == "vllm" else "hot_token_id"
        optional = {"model.embed_tokens.weight": (c["vocab_size"], D), mapping: (Vd,)}
        return required, optional
    ids = (c.get("dflash_config") or {}).get("target_layer_ids") or []
    prefix = "model." if engine == "vllm" else ""
    required = {"fc.weight": (D, len(ids) * (target_dim if engine == "vllm" else D)), "hidden_norm.weight": (D,),
                "norm.weight": (D,)}
    for i in range(c["num_hidden_layers"]):
        required.update(layer_parameters(f"layers.{i}.", c, D, qk_norm=True))
    required = {prefix + k: v for k, v in required.items()}
    optional = {"model.embed_tokens.weight": (c["vocab_size"], D), "lm_head.weight": (c["vocab_size"], D)} \
        if engine == "vllm" else {}
    return required, optional


def engine_name(engine: str, kind: str, name: str, params: dict):
    """(parameter name, shard or None) for a checkpoint tensor, or None where the loader drops it
    on purpose (t2d); a name with no parameter comes back as it is."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return ("draft_id_to_target_id" if engine == "vllm" else "hot_token_id"), None
    if engine == "vllm" and "lm_head" not in name:
        name = "model." + name
    if engine == "vllm":
        name = name.replace("midlayer.", "layers.0.")
    shard = None
    for unfused, (fused, shard_id) in FUSED.items():
        if unfused + "." in name:
            name, shard = name.replace(unfused, fused), shard_id
            break
    if engine == "sglang" and name not in params:  # looked up as it is, or under "model." (stripped for DFlash)
        for other in ("model." + name, name.removeprefix("model.")):
            if other in params:
                return other, shard
    return name, shard


def served_problems(folder: Path, engine: str) -> list:
    """What keeps `engine` from loading the draft in `folder` unchanged: tensors with no parameter
    (vLLM stops; SGLang drops them and runs without), shapes that differ, parameters left unfilled."""
    c = json.loads((folder / "config.json").read_text())
    kind = "dflash" if "dflash_config" in c else "eagle3"
    required, optional = engine_parameters(engine, kind, c)
    params = {**required, **optional}
    problems, filled = [], {}
    for name, tensor in read_safetensors(folder, meta=True).items():
        mapped = engine_name(engine, kind, name, params)
        if mapped is None:
            continue
        param, shard = mapped
        if param not in params:
            problems.append(f"{name}: no parameter {param} in {engine}'s {kind} draft")
            continue
        want = params[param] if shard is None else shard_shape(params[param], shard, c)
        if tuple(tensor.shape) != tuple(want):
            problems.append(f"{name}: shape {tuple(tensor.shape)}, {engine}'s {param} takes {want}")
        filled.setdefault(param, set()).add(shard)
    for param in required:
        shards = {"q", "k", "v"} if param.endswith("qkv_proj.weight") else {0, 1} \
            if param.endswith("gate_up_proj.weight") else {None}
        if filled.get(param, set()) != shards:
            problems.append(f"{engine}'s {param} is not filled (shards {sorted(map(str, shards - filled.get(param, set())))})")
    return problems


def engine_aux_layers(engine: str, folder: Path, n_target_layer: int) -> tuple:
    """The target hidden states (model.py's index: hidden[i] enters layer i) that `engine` feeds
    the draft in `folder`, from the config fields it reads."""
    c = json.loads((folder / "config.json").read_text())
    default = (2, n_target_layer // 2, n_target_layer - 3)
    dflash_ids = (c.get("dflash_config") or {}).get("target_layer_ids")
    if engine == "vllm":
        top = c.get("eagle_aux_hidden_state_layer_ids")
        if top:
            return tuple(top)
        return tuple(i + 1 for i in dflash_ids) if dflash_ids else default
    if dflash_ids:
        return tuple(i + 1 for i in dflash_ids)
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(i + 1 for i in ids) if ids else default
