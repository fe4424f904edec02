"""
Drafts on disk: released EAGLE-3 and DFlash checkpoints load into eagle3.py's and dflash.py's
networks exactly or not at all, drafts are saved in the layouts vLLM and SGLang serve (a training
run's checkpoints are directories of those: training_runs.py), and build_draft turns a --draft
spec into a draft ready to run beside its target. Every directory is written whole or not at all
(files.py); no non-finite tensor is written or read.

A draft directory:

    config.json, model.safetensors   the draft as the serving engines read it: exactly the tensors
                                     their EAGLE-3 / DFlash loaders map to parameters, and the config
                                     fields they read (tests/serving_layouts.py holds the mapping)
    vat/head.safetensors             the verification head (verify_head.weight, verify_head.bias)
    vat/config.json                  what VAT adds: objective, parts, step, target, and the
                                     early-exit threshold chosen for the draft

The serving loaders read the *.safetensors of the directory itself, never of a subfolder, and
refuse (vLLM) or drop (SGLang) a tensor they have no parameter for: the head lives apart. A draft
from an older export (its head inside model.safetensors, its record in config.json) still loads.
"""
import json
import sys
from pathlib import Path

import torch

from engine import linear_forms as LF
import model as M
from dflash import DFlash, DFlashDraft, dflash_target_layers
from draft import HybridDraft, LookupDraft, ModelDraft
from eagle3 import Eagle3, Eagle3Draft, eagle3_target_layers
from engine.files import ROOT, directory_written_atomically, first_non_finite
from model import CheckpointError
from tokenizer import load_tokenizer
from engine.weights import (DEFAULT_TARGET, fuse_hf, load_model, read_config, read_safetensors,
                            read_safetensors_file, resolve_model, unfuse_to_hf)

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
    for name in ("eagle_config", "dflash_config"):
        if not isinstance(config.get(name) or {}, dict):
            raise CheckpointError(f"draft {path}: {name} is {json.dumps(config[name])}, not an object")
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


EAGLE3_FUSED = 3  # EAGLE-3 fuses a low, a middle and a high layer of the target


def check_layer_ids(ids, name: str, count: int | None, path: Path, lowest: int = -1):
    """A config's list of target layer ids (None where absent): whole numbers >= lowest (layer
    outputs start at -1, the embeddings' output; layer inputs at 0), as many as the network fuses
    where it fixes that; else a one-line error quoting the config's own value."""
    if ids is None:
        return None
    whole = isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= lowest for i in ids)
    if not whole or not ids or (count is not None and len(ids) != count):
        many = f"{count} " if count is not None else ""
        raise CheckpointError(f"draft {path}: {name} is {json.dumps(ids)}, not a list of {many}layer numbers >= {lowest}")
    return ids


def eagle3_layers_from_config(config: dict, n_target_layer: int, path: Path) -> tuple:
    """The fused target states, named in two conventions: eagle_config's
    eagle_aux_hidden_state_layer_ids name layer outputs (SpecForge, SGLang: hidden[j + 1]); the
    same key at the top level names the states entering layers (vLLM: hidden[j]). Either, both
    when they agree, or EAGLE-3's default (the same in both engines)."""
    eagle_config = config.get("eagle_config") or {}
    nested = check_layer_ids(eagle_config.get("eagle_aux_hidden_state_layer_ids"),
                             "eagle_config.eagle_aux_hidden_state_layer_ids", EAGLE3_FUSED, path)
    top = check_layer_ids(config.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids",
                          EAGLE3_FUSED, path, lowest=0)  # (layer inputs: hidden[j])
    if nested and top and from_layer_outputs(nested) != tuple(top):
        raise CheckpointError(f"draft {path}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) "
                              f"and the top-level {top} (layer inputs) name different target states")
    if nested:
        return from_layer_outputs(nested)
    return tuple(top) if top else eagle3_target_layers(n_target_layer)


def dflash_settings(config: dict, n_draft_layer: int, path: Path):
    """(target layers, mask token id, number of target layers) from dflash_config or, as some
    released configs have them, the top level."""
    dc = config.get("dflash_config") or {}
    mask_id = dc.get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        raise CheckpointError(f"DFlash draft {path} names no mask_token_id (in dflash_config or at the top "
                                f"level): its blocks cannot be filled")
    n_target = config.get("num_target_layers")
    ids = check_layer_ids(dc.get("target_layer_ids"), "dflash_config.target_layer_ids", None, path) or \
        check_layer_ids(config.get("target_layer_ids"), "target_layer_ids", None, path)
    if ids:
        return from_layer_outputs(ids), mask_id, n_target
    if not n_target:
        raise CheckpointError(f"DFlash draft {path} names neither target_layer_ids nor num_target_layers")
    return dflash_target_layers(n_target, n_draft_layer), mask_id, n_target  # DFlash's own default


def dflash_block(config: dict, mask_id: int, vocab_size: int, path: Path) -> int:
    """A DFlash config's block size, checked with its mask token against the target's vocabulary."""
    block_size = config.get("block_size", 16)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise CheckpointError(f"DFlash draft {path}: block_size must be a whole number >= 2 (a block holds "
                              f"the last token and at least one to fill), got {block_size!r}")
    if not 0 <= mask_id < vocab_size:
        raise CheckpointError(f"DFlash draft {path}: mask_token_id {mask_id} lies outside the vocabulary of "
                              f"{vocab_size}")
    return block_size


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
        raise CheckpointError(f"draft {path} reads target layers {layer_ids_as_written(read_config(path))}; "
                              f"this target has layers 0 to {t.n_layer - 1}")


def layer_ids_as_written(config: dict) -> str:
    """The key and value that name a draft's target layers, as its config holds them."""
    for section, key in (("eagle_config", "eagle_aux_hidden_state_layer_ids"), ("", "eagle_aux_hidden_state_layer_ids"),
                         ("dflash_config", "target_layer_ids"), ("", "target_layer_ids")):
        value = (config.get(section) or {}).get(key) if section else config.get(key)
        if value:
            return f"{section + '.' if section else ''}{key} {json.dumps(value)}"
    return "by default (its config names none)"


def warn_if_trained_for_another_target(path: Path, config: dict, target: M.Transformer):
    """A draft records the target it was trained for (train_vat's checkpoints do); one trained for
    another target of the same shape loads, but its guesses will rarely be kept: say so."""
    recorded = draft_record(path).get("target") or config.get("target")
    source = target.source
    if not recorded or source is None:
        return
    try:
        same = resolve_model(recorded).resolve() == source
    except CheckpointError:  # a name not on this machine: it cannot be the target in use
        same = False
    if not same:
        print(f"warning: draft {path} was trained for target {recorded}, not {source}; its guesses may "
              f"rarely be kept", file=sys.stderr)


def eagle3_draft_vocab(config: dict, vocab_size: int, path: Path) -> int:
    """An EAGLE-3 config's draft vocabulary, checked against the target's before anything is
    allocated for it (its d2t map and head are draft-vocabulary sized)."""
    draft_vocab = config.get("draft_vocab_size") or vocab_size
    if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or not 1 <= draft_vocab <= vocab_size:
        raise CheckpointError(f"draft {path}: draft_vocab_size must be a whole number from 1 to the target's "
                              f"vocabulary of {vocab_size}, got {draft_vocab!r}")
    return draft_vocab


def check_vocab_map(d2t: torch.Tensor, vocab_size: int, path: Path):
    """d2t maps draft token i to target token i + d2t[i]: every one must lie in the target's vocabulary."""
    target_ids = d2t.long() + torch.arange(len(d2t))
    if len(target_ids) and not (target_ids.min() >= 0 and target_ids.max() < vocab_size):
        bad = int(((target_ids < 0) | (target_ids >= vocab_size)).nonzero()[0])
        raise CheckpointError(f"draft {path}: d2t maps draft token {bad} to target token {int(target_ids[bad])}, "
                              f"outside the target's vocabulary of {vocab_size}")


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
            layers = eagle3_layers_from_config(config, target.args.n_layer, path)
            check_matches_target(path, target, target_dim, layers, None)
            net = Eagle3(args, target_dim, eagle3_draft_vocab(config, args.vocab_size, path), layers)
        else:
            layers, mask_id, n_target = dflash_settings(config, args.n_layer, path)
            check_matches_target(path, target, config.get("target_hidden_size", target.args.dim),
                                 layers, n_target)
            net = DFlash(args, target.args.dim, layers, dflash_block(config, mask_id, target.args.vocab_size, path),
                         mask_id)
    expected = net.state_dict()
    sd.update(verification_head(path, sd, args.dim))
    if kind == "eagle3" and "d2t" not in sd:  # a full-vocabulary draft
        sd["d2t"] = torch.zeros(expected["d2t"].shape, dtype=torch.long)
        sd["t2d"] = torch.ones(expected["t2d"].shape, dtype=torch.bool)
    sd.pop("embed_tokens.weight", None)  # EAGLE-3 may carry a copy of the target's; we use the target's
    check_draft_tensors(sd, expected, kind, target.args.vocab_size, path)
    # copies in memory of their own: tensors read from the file can sit at any offset of its buffer,
    # and the CPU kernels' last bits depend on alignment, so a resumed training would part from the
    # uninterrupted one
    sd = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
          for k, v in sd.items()}
    net.load_state_dict(sd, assign=True)
    return kind, net.eval()


def check_draft_tensors(sd: dict, expected: dict, kind: str, vocab_size: int, path: Path):
    """Every tensor the network uses, in its shape and kind of dtype, none other, all finite, and
    an EAGLE-3 vocabulary map into the target's vocabulary; else a one-line CheckpointError."""
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
        if sd[key].is_floating_point() != t.is_floating_point() or (t.dtype == torch.bool) != (sd[key].dtype == torch.bool):
            raise CheckpointError(f"draft tensor {key} in {path} is {str(sd[key].dtype).removeprefix('torch.')}, "
                                  f"expected {str(t.dtype).removeprefix('torch.')}")
    if kind == "eagle3":
        check_vocab_map(sd["d2t"], vocab_size, path)
    bad = first_non_finite(sd)
    if bad:
        raise CheckpointError(f"draft {path} holds non-finite values in {bad}: refusing to decode with it")


def write_draft_files(net, folder: Path, target_args: M.ModelArgs, record: dict | None = None,
                      dtype=torch.bfloat16):
    """A draft directory's files (see the top of this file) into an existing folder: the draft in
    the served layout (HF names, unfused), its head and `record` (what VAT adds) under vat/."""
    from safetensors.torch import save_file
    a = net.args
    config = {"hidden_size": a.dim, "intermediate_size": a.intermediate_size, "num_attention_heads": a.n_head,
              "num_key_value_heads": a.n_kv_head, "head_dim": a.head_dim, "num_hidden_layers": a.n_layer,
              "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
              "max_position_embeddings": a.max_position_embeddings,
              "vocab_size": a.vocab_size, "tie_word_embeddings": False,
              "torch_dtype": str(dtype).replace("torch.", "")}
    if isinstance(net, Eagle3):
        # the fused layers in both engines' conventions (eagle3_layers_from_config): SGLang reads
        # eagle_config's (layer outputs), vLLM the top level's first (layer inputs)
        config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                      draft_vocab_size=net.lm_head.out_features, target_hidden_size=target_args.dim,
                      eagle_aux_hidden_state_layer_ids=list(net.target_layers),
                      eagle_config={"eagle_aux_hidden_state_layer_ids": to_layer_outputs(net.target_layers),
                                    "use_aux_hidden_state": True})
    else:
        config.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=net.block_size,
                      num_target_layers=target_args.n_layer, target_hidden_size=target_args.dim,
                      dflash_config={"target_layer_ids": to_layer_outputs(net.target_layers),
                                     "mask_token_id": net.mask_token_id})
    bad = first_non_finite(net.state_dict())
    if bad:
        raise ValueError(f"the draft's {bad} holds non-finite values: refusing to save it")
    sd = unfuse_to_hf({k: v.detach().cpu() for k, v in net.state_dict().items()}, a)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    head = {k: sd.pop(k) for k in HEAD_TENSORS}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / VAT_DIR).mkdir()
    save_file(head, str(folder / VAT_DIR / "head.safetensors"))
    (folder / VAT_DIR / "config.json").write_text(json.dumps(record or {}, indent=2))


def save_draft(net, path, target_args: M.ModelArgs, record: dict | None = None, dtype=torch.bfloat16):
    """Write a draft directory atomically: a temporary directory, renamed into place once whole."""
    path = Path(path)
    with directory_written_atomically(path) as tmp:
        write_draft_files(net, tmp, target_args, record, dtype)
    return path


# -----------------------------------------------------------------------------
# What VAT adds, beside the served draft: the verification head and the record

VAT_DIR = "vat"
HEAD_TENSORS = ("verify_head.weight", "verify_head.bias")
REEXPORT = "python train_vat.py --export DIR NEW_DIR writes it again whole"


def draft_record(path: Path) -> dict:
    """What a draft directory records beside its weights (objective, vat_parts, step, target,
    early_exit_threshold): vat/config.json, or an older export's config.json keys; {} for a released draft."""
    path = Path(path)
    if (path / VAT_DIR / "config.json").is_file():
        record, where = read_config(path / VAT_DIR), f"{path / VAT_DIR / 'config.json'}"
    else:
        config = read_config(path)
        record, where = config.get("vat") or {}, f"{path / 'config.json'}"
        if isinstance(record, dict) and "early_exit_threshold" in config:
            record = {**record, "early_exit_threshold": config["early_exit_threshold"]}
    problem = record_problem(record)
    if problem:
        raise CheckpointError(f"draft {path}: {where}: {problem}")
    return dict(record)


VAT_PARTS = ("head", "weighting", "ce")  # what VAT adds to a draft's loss (objectives.py)


def record_problem(record) -> str | None:
    """What is wrong with a draft's record (what train_vat.py writes beside it), or None."""
    if not isinstance(record, dict):
        return f"holds {type(record).__name__}, not an object, which train_vat.py never writes"
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    rules = {"target": lambda v: isinstance(v, str) and v != "", "objective": lambda v: v in ("vat", "baseline"),
             "vat_parts": lambda v: isinstance(v, list) and all(p in VAT_PARTS for p in v),
             "step": whole, "steps": lambda v: whole(v) and v >= 1, "corpus_response_tokens": whole,
             "response_tokens_trained": whole,
             "train_minutes": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < 1e9,
             "early_exit_threshold": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1}
    for key, ok in rules.items():
        if key in record and not ok(record[key]):
            if key == "early_exit_threshold":  # (as decode.py's --early-exit is checked)
                return f"early_exit_threshold must be a number in [0, 1], got {record[key]!r}"
            return f"records {key} {json.dumps(record[key])}, which train_vat.py never writes"
    return None


def verification_head(path: Path, sd: dict, dim: int) -> dict:
    """The head's tensors: vat/head.safetensors, an older export's (inside model.safetensors, taken
    out of sd), or, for a released draft that has none, a neutral head that never exits early."""
    head_file, record_file = path / VAT_DIR / "head.safetensors", path / VAT_DIR / "config.json"
    inside = {k: sd.pop(k) for k in HEAD_TENSORS if k in sd}
    if head_file.is_file():
        if inside:
            raise CheckpointError(f"draft {path} holds two verification heads (model.safetensors and {head_file}): "
                                  f"{REEXPORT}")
        with open(head_file, "rb") as f:
            head = read_safetensors_file(f, head_file, None, None)
        missing = [k for k in HEAD_TENSORS if k not in head]
        if missing or len(head) != len(HEAD_TENSORS):
            raise CheckpointError(f"draft {path}: {head_file} must hold exactly {', '.join(HEAD_TENSORS)}")
        return head
    if head_file.exists():
        raise CheckpointError(f"draft {path}: {head_file} is not a file: the verification head must be one")
    if record_file.is_file():
        raise CheckpointError(f"draft {path}: {head_file} is missing beside {record_file} (copy the whole draft "
                              f"directory, or {REEXPORT})")
    if inside:
        return inside
    return {"verify_head.weight": torch.zeros(1, dim),
            "verify_head.bias": torch.full((1,), 10.0)}  # sigmoid ~ 1: never triggers early exit


# A bare --early-exit takes the threshold a draft records (vat/config.json's `early_exit_threshold`,
# chosen on training questions for the committed drafts), else this one. The VAT paper's 0.5
# (EAGLE-3) and 0.6 (DFlash) suit drafts whose head is confident; ours, trained on a CPU, are not,
# and at 0.5 they draft almost nothing.
EARLY_EXIT_DEFAULT = 0.1
# The threshold a bare --early-exit takes when the exit reads the draft's confidence instead
# (--early-exit-signal confidence): recorded thresholds are the head's, a probability of another
# kind; chosen on GSM8K training questions (docs/exit-signal)
CONFIDENCE_EXIT_DEFAULT = 0.45


def recorded_threshold(path: Path) -> float:
    """The early-exit threshold a draft's config.json records, checked as the command line's is."""
    value = draft_record(path).get("early_exit_threshold", EARLY_EXIT_DEFAULT)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheckpointError(f"draft {path}: early_exit_threshold must be a number in [0, 1], "
                              f"got {value!r}")
    return float(value)


DEFAULT_DRAFTS = {DEFAULT_TARGET: ROOT / "drafts" / "smollm2-135m-eagle3-chat"}  # (docs/chat-draft/)


def draft_spec_problem(spec: str) -> str | None:
    """What is wrong with a --draft value that can be told before any weights load (a missing
    directory, one without config.json), or None."""
    where = spec.removeprefix("lookup+")
    if where == "lookup":
        return None if spec == "lookup" else f"--draft {spec}: lookup+ takes a model draft after it"
    kind, _, where = where.partition(":") if where.split(":")[0] in ("eagle3", "dflash") else ("", "", where)
    if not where:
        return f"--draft {spec!r} names no draft"
    try:
        path = resolve_model(where)
    except CheckpointError as e:
        return f"--draft {spec}: {e}"
    if not (path / "config.json").is_file():
        return f"--draft {spec}: {path} holds no config.json (a draft or model directory has one)"
    return None


def draft_dir_problem(where: str, kind: str) -> str | None:
    """What is wrong with `where` as a trained draft of `kind` (eagle3, dflash), before any load."""
    try:
        found = draft_kind(read_config(resolve_model(where)))
    except CheckpointError as e:
        return f"{where}: {e}"
    names = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}
    return None if found == kind else f"{where} holds {names[found]} draft, not {names[kind]} one"


def build_draft(spec: str, target, tokenizer, temperature: float = 0.0, top_p: float = 1.0, generator=None,
                early_exit=None, pack: bool | None = None, exit_signal: str = "head"):
    """--draft lookup | eagle3:PATH | dflash:PATH | a trained draft's directory (its config says
    which) | NAME_OR_PATH of an independent model sharing the target's tokenizer | lookup+ANY OF
    THOSE (HybridDraft: lookup where it matches, the draft elsewhere). early_exit: a threshold,
    'auto' (the threshold the draft's config records), or None; exit_signal: what it reads
    (draft.EXIT_SIGNALS). A draft takes the target's dtype and oneDNN's layout unless the target's
    layout is an unpacked one (pack=None) or pack says otherwise; an EAGLE-3 draft on a CPU takes
    int8 weights (bf16 activations where the CPU multiplies bf16), in compiled runs too
    (engine.compiled.compile_draft compiles the draft built here)."""
    if pack is None:
        pack = getattr(target, "layout", "float32-packed") not in ("float32", "bfloat16")
    if spec == "lookup":
        return LookupDraft()
    if spec.startswith("lookup+"):
        model_draft = build_draft(spec.removeprefix("lookup+"), target, tokenizer, temperature, top_p,
                                  generator, early_exit, pack, exit_signal)
        return HybridDraft(model_draft)
    kind, _, where = spec.partition(":") if spec.split(":")[0] in ("eagle3", "dflash") else ("", "", spec)
    path = resolve_model(where)
    if not kind and (path / "config.json").is_file():
        config = read_config(path)
        kind = draft_kind(config) if config.get("model_type") not in M.SUPPORTED or \
            "draft_vocab_size" in config or "dflash_config" in config else ""
    sampling = dict(temperature=temperature, top_p=top_p, generator=generator)
    if kind:
        # On a CPU an EAGLE-3 draft (which owns its lm_head) takes int8 weights for its layer and
        # head (a drafted token waits on its weights' bytes: docs/draft-cost), unpacked, with bf16
        # activations where the CPU multiplies bf16: integer matmuls build no kernel per row count,
        # where bf16's oneDNN ones would build one for each number of pairs an adaptive draft
        # catches up on. The draft only proposes, so its rounding moves how many tokens are kept,
        # never which are printed.
        cpu_eagle3 = kind == "eagle3" and target.embed_tokens.weight.device.type == "cpu"
        dtype = (torch.bfloat16 if LF.packable(torch.bfloat16) else torch.float32) if cpu_eagle3 else None
        found, net = load_draft(path, target, dtype=dtype)
        if found != kind:
            raise ValueError(f"{path} holds a {found} draft, not {kind}")
        if cpu_eagle3:  # (fc runs once a proposal, on the pairs committed; the verification head is one row)
            LF.quantize_int8(net, keep=("fc", "verify_head"))
        elif pack:  # inference only: oneDNN's layout reads a draft's small matmuls faster
            LF.pack_for_cpu(net)
        if early_exit == "auto":
            early_exit = recorded_threshold(path) if exit_signal == "head" else CONFIDENCE_EXIT_DEFAULT
        if kind == "eagle3":
            return Eagle3Draft(net, target.embed_tokens, target.max_seq_len, early_exit=early_exit,
                               exit_signal=exit_signal, **sampling)
        return DFlashDraft(net, target.embed_tokens, target.lm_head, target.max_seq_len,
                           early_exit=early_exit, exit_signal=exit_signal, **sampling)
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
        LF.pack_for_cpu(draft_model)
    return ModelDraft(draft_model, **sampling)
