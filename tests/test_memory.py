"""Memory: decode.py holds a large target within 1.3x its weights + 0.5 GB at its peak, on a fresh
cache (the layouts timed first), for a tied large-vocabulary Qwen3 and a LLaMA. The weights are
what the run's layout holds: its parameters in the layout's bytes, and where a head tied to the
embedding is packed for oneDNN, that head's own copy (a bf16 matmul reorders an unpacked weight
into the same copy on every call, so the copy is the fast head's price, not a leak). Slow: each
writes a random checkpoint of over a billion parameters (bf16, two shards) and decodes from it in
a process of its own, whose peak resident set (VmHWM) is the figure."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.weights import DEFAULT_TARGET, resolve_model

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

SHAPES = {  # the public configs' shapes, random weights
    "qwen3-1.1b-tied": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                            hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, max_position_embeddings=40960, torch_dtype="bfloat16"),
    # LLaMA-3.2-1B's layers, untied, with the vocabulary of the tokenizer it is given (SmolLM2's)
    "llama-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                     hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=131072, torch_dtype="bfloat16",
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
BYTES_PER_PARAMETER = {"float32": 4, "float32-packed": 4, "bfloat16": 2, "bfloat16-packed": 2}  # (a bf16 source)


def held_weight_bytes(config: dict, params: int, layout: str) -> int:
    """The bytes a model of `params` parameters holds in `layout`, a packed tied head's copy included."""
    size = BYTES_PER_PARAMETER[layout]
    tied_copy = config["vocab_size"] * config["hidden_size"] if config["tie_word_embeddings"] and \
        layout.endswith("-packed") else 0
    return (params + tied_copy) * size


def hf_shapes(config: dict) -> dict:
    """{Hugging Face tensor name: shape} of a decoder of this config."""
    d, f, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if config["model_type"] == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def write_random_checkpoint(path: Path, config: dict) -> int:
    """A checkpoint of random bf16 weights in two shards with its index, as save_pretrained lays
    one out, and Qwen's tokenizer file; returns its parameter count."""
    from safetensors.torch import save_file
    from test_tokenizer import qwen_tiktoken_path
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if config["model_type"] == "qwen3":  # (a random model reads any vocabulary no larger than its own)
        (path / "qwen.tiktoken").symlink_to(qwen_tiktoken_path())
    else:
        (path / "tokenizer.json").symlink_to(resolve_model(DEFAULT_TARGET) / "tokenizer.json")
    shapes = hf_shapes(config)
    names = list(shapes)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), 1):
        file = f"model-0000{shard}-of-00002.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=generator) * (0.02 if len(shapes[n]) > 1 else 1.0) +
                       (0.0 if len(shapes[n]) > 1 else 1.0)).to(torch.bfloat16) for n in part}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(torch.Size(s).numel() for s in shapes.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_large_target_decodes_within_its_memory_bound(tmp_path, name):
    params = write_random_checkpoint(tmp_path / name, SHAPES[name])
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "SPECDEC_LAYOUT_CACHE": str(tmp_path / "cache" / "layouts.json")}
    # the peak resident set of the decoding process itself, read as it exits
    wrapper = ("import atexit, runpy, sys; atexit.register(lambda: print('VmHWM', [l for l in "
               "open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1], file=sys.stderr)); "
               "sys.argv = ['decode.py'] + sys.argv[1:]; runpy.run_path('decode.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", wrapper, "--target", str(tmp_path / name), "--verifier", "none",
                        "--max-new-tokens", "8", "--json"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = int(r.stderr.split("VmHWM")[-1].split()[0]) * 1024
    layout = json.loads(r.stdout.strip().splitlines()[-1])["layout"]
    weights = held_weight_bytes(SHAPES[name], params, layout)
    print(f"{name}: {params / 1e9:.2f} B parameters, {layout}: {weights / GB:.2f} GB held "
          f"({params * BYTES_PER_PARAMETER[layout] / GB:.2f} GB of parameters), peak {peak / GB:.2f} GB, "
          f"bound {(1.3 * weights + 0.5 * GB) / GB:.2f} GB")
    assert peak <= 1.3 * weights + 0.5 * GB
