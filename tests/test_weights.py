"""weights.py: names resolve to local directories, the GGUF conversion is atomic and cleans up
after killed ones, llama.cpp's q/k permutation is undone, broken checkpoints fail in one line."""
import json
import os
import shutil

import pytest
import torch

from engine import weights as WT
import model as M



def test_gguf_conversion_is_atomic(tmp_path, monkeypatch):
    import safetensors.torch

    def die(*a, **k):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C halfway
    monkeypatch.setattr(safetensors.torch, "save_file", die)
    # what is written does not matter to what an interruption leaves: skip dequantizing the weights
    monkeypatch.setattr(WT, "gguf_tensors_in_hf_names", lambda reader, meta: {"model.norm.weight": torch.ones(4)})
    with pytest.raises(KeyboardInterrupt):
        WT.convert_embedded_smollm2(tmp_path / "smol")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # (a whole conversion; the default suite's first decode converts, and atomicity is tested above)
def test_gguf_conversion_cleans_up_after_killed_ones(tmp_path):
    out = tmp_path / "smol"
    dead = tmp_path / ".tmp-999999999-abc"  # no such process: a conversion killed halfway
    live = tmp_path / f".tmp-{os.getppid()}-def"  # a conversion still running elsewhere
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    out.mkdir()  # a cache folder without weights, which used to block every later run
    (out / "config.json").write_text("{}")
    assert WT.convert_embedded_smollm2(out) == out and (out / "model.safetensors").is_file()
    assert not dead.exists() and live.exists()
    assert WT.load_model(out).args.n_layer == 30


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, rows, cols = 3, 12, 5
    w = torch.randn(rows, cols).numpy()
    # llama.cpp's convert_hf_to_gguf permute()
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert (WT.unpermute_qk(permuted, n_head) == w).all()


def test_resolve_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(M.CheckpointError, match="huggingface-cli download Qwen/Qwen3-4B"):
        WT.resolve_model("qwen3-4b")
    snap = tmp_path / "models--Qwen--Qwen3-4B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--Qwen--Qwen3-4B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-4B" / "refs" / "main").write_text("abc123")
    assert WT.resolve_model("qwen3-4b") == snap
    with pytest.raises(M.CheckpointError, match="neither a directory nor a known model"):
        WT.resolve_model("qwen9-1t")


# -----------------------------------------------------------------------------
# Bad input through the command line: one line, non-zero exit

def broken_copy(tiny_dir, tmp_path, how):
    """A tiny checkpoint broken in one way, with a tokenizer (decode.py reads it first)."""
    src = tiny_dir("llama3", shard=True)
    dst = tmp_path / how
    shutil.copytree(src, dst)
    shutil.copy(WT.resolve_model(WT.DEFAULT_TARGET) / "tokenizer.json", dst)
    if how == "missing_shard":
        next(dst.glob("model-00002-*.safetensors")).unlink()
    elif how == "wrong_shape":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "unsupported":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how in ("fewer_layers", "missing_field", "mistyped_field"):
        cfg = json.loads((dst / "config.json").read_text())
        if how == "fewer_layers":  # the weights hold 3 layers
            cfg["num_hidden_layers"] = 2
        elif how == "missing_field":
            del cfg["intermediate_size"]
        else:
            cfg["hidden_size"] = "64"
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "corrupt":
        shard = next(dst.glob("model-00001-*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:1000])
    return dst


@pytest.mark.parametrize("how,message", [("missing_shard", "missing shard model-00002"),
                                         ("wrong_shape", "has shape"),
                                         ("unsupported", "unsupported architecture 'gpt2'"),
                                         ("corrupt", "corrupt safetensors file"),
                                         ("fewer_layers", "holds tensor layers.2."),
                                         ("missing_field", "config.json lacks 'intermediate_size'"),
                                         ("mistyped_field", "'hidden_size' must be a positive integer, not '64'")])
def test_bad_checkpoints_fail_in_one_line(tiny_dir, tmp_path, how, message, decode_failure):
    status, line = decode_failure(["--target", str(broken_copy(tiny_dir, tmp_path, how))])
    assert status != 0 and line.startswith("error:") and message in line and "\n" not in line, line


def test_missing_directory_and_long_prompt(tmp_path, smollm2_dir, decode_failure):
    status, line = decode_failure(["--target", str(tmp_path / "nope")])
    assert status != 0 and line.startswith("error:") and "neither a directory" in line
    status, line = decode_failure(["--prompt", "word " * 300, "--max-seq-len", "256"])
    assert status != 0 and "\n" not in line and "the context holds 256" in line
    status, line = decode_failure(["--verifier", "overshoot", "--ceiling", "0.5"])
    assert status != 0 and "c >= 1" in line
    status, line = decode_failure(["--verifier", "magic"])
    assert status != 0 and "invalid choice" in line
