"""model.py against transformers: logits, hidden-state indices, KV cache, loading errors."""
import json
import os
import shutil

import pytest
import torch

import weights as WT
import layouts as LY
import model as M
from tokenizer import load_tokenizer



def hf_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ours(path, max_seq_len=128, pack=False):
    m = WT.load_model(path)
    m.setup_caches(4, max_seq_len)
    return M.pack_for_cpu(m) if pack else m


@pytest.mark.parametrize("kind,shard", [("llama3", False), ("qwen3_tied", False), ("qwen3_untied", True),
                                        ("qwen2_bias", False), ("llama3", True)])
@pytest.mark.parametrize("pack", [False, True])
def test_logits_match_transformers(tiny_dir, kind, shard, pack):
    path = tiny_dir(kind, shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    torch.manual_seed(1)
    tokens = torch.randint(0, 97, (4, 80))  # past original_max_position_embeddings=32: llama3 scaling matters
    with torch.no_grad():
        expected = hf_model(path)(tokens).logits
        got, hidden = ours(path, pack=pack)(tokens, torch.arange(80))
        assert hidden == []  # none asked for
    assert (got - expected).abs().max().item() < 1e-4


def test_hidden_state_index_convention(tiny_dir):
    path = tiny_dir("qwen3_untied")
    tokens = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        hf_states = hf_model(path)(tokens, output_hidden_states=True).hidden_states
        m = ours(path)
        n = m.args.n_layer
        _, hidden = m(tokens, torch.arange(20), hidden_layers=tuple(range(n + 1)))
    for i in range(n):  # hidden[i] enters layer i, as transformers' hidden_states[i]
        assert torch.allclose(hidden[i], hf_states[i], atol=1e-5), i
    # the last entry: ours is before the final norm, transformers' after it
    assert torch.allclose(m.norm(hidden[n]), hf_states[n], atol=1e-5)


@pytest.mark.parametrize("pack", [False, True])
def test_kv_cache_incremental_equals_full_and_rewinds(tiny_dir, pack):
    m = ours(tiny_dir("qwen2_bias"), pack=pack)
    tokens = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        full, _ = m(tokens, torch.arange(40))
        m(tokens[:, :10], torch.arange(10))  # prefill, then one token at a time
        steps = [m(tokens[:, i:i + 1], torch.tensor([i]))[0] for i in range(10, 40)]
        assert (torch.cat(steps, 1) - full[:, 10:]).abs().max() < 1e-4
        # draft 8 wrong tokens at 20..27, rewind to 20 and decode the right ones: as a fresh run
        m(torch.randint(0, 97, (1, 8)), torch.arange(20, 28))
        again, _ = m(tokens[:, 20:30], torch.arange(20, 30))
        assert (again - full[:, 20:30]).abs().max() < 1e-4


def test_int8_linear_is_close_to_fp32_and_exact_per_row():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    q = M.Int8Linear(linear)
    x = torch.randn(5, 3, 64)
    ref = linear(x)
    assert ((q(x) - ref).norm() / ref.norm()).item() < 0.02  # int8 weights and activations: about 1%
    # each row depends on itself alone: the same token alone or in a block gives the same bits
    assert all(torch.equal(q(x[:, i:i + 1]), q(x)[:, i:i + 1]) for i in range(3))
    assert torch.allclose(M.dense_weight(q), linear.weight, atol=linear.weight.abs().max().item() / 127)


def test_int4_linear_keeps_4bit_codes_and_is_exact_per_row():
    """Weights already on a Q4_1 grid (min-max codes 0..15 in groups of 32 inputs) come back to
    the same codes: only the bf16 rounding of each group's scale and offset remains."""
    torch.manual_seed(0)
    step = torch.rand(48, 2, 1) * 0.01 + 0.001  # (out, groups, 1)
    low = -torch.rand(48, 2, 1) * 0.05
    codes = torch.randint(0, 16, (48, 2, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps a block's min to code 0 and its max to 15
    linear = torch.nn.Linear(64, 48, bias=True)
    linear.weight.data = (codes * step + low).view(48, 64)
    q = M.Int4Linear(linear)
    error = (M.dense_weight(q) - linear.weight).abs().view(48, 2, 32) / step
    assert error.max() < 0.5  # within half a step of the right code: a wrong code is a whole step off
    x = torch.randn(5, 3, 64)
    ref = linear(x)
    assert ((q(x) - ref).norm() / ref.norm()).item() < 0.02  # bf16 activations
    assert all(torch.equal(q(x[:, i:i + 1]), q(x)[:, i:i + 1]) for i in range(3))


@pytest.mark.parametrize("layout", ["int8", "bfloat16-packed", "bfloat16", "int4"])
def test_coarse_layouts_give_blocks_the_bits_of_one_token_steps(tiny_dir, layout):
    """A verification block on a target whose activations round coarsely gives bit for bit what
    one-token steps give: its matmuls are exact per row, and its blocks attend row by row (after
    200 tokens of context, where attending the block at once parts from one-token steps in int4)."""
    m = LY.build_target(tiny_dir("qwen3_untied"), layout, "cpu", 256)
    assert m.layers[0].self_attn.row_by_row
    torch.manual_seed(0)
    tokens = torch.randint(0, 97, (1, 210))
    with torch.no_grad():
        m(tokens[:, :200], torch.arange(200))
        block, _ = m(tokens[:, 200:208], torch.arange(200, 208))
        steps = [m(tokens[:, i:i + 1], torch.tensor([i]))[0] for i in range(200, 208)]
    assert torch.equal(block, torch.cat(steps, 1))


def test_default_target_matches_transformers(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": "List three prime numbers and explain why they are prime."}])
    hf = hf_model(smollm2_dir)
    m = ours(smollm2_dir, max_seq_len=256, pack=True)
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (m(x, torch.arange(len(ids)))[0] - hf(x).logits).abs().max().item()
        hf_out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    assert diff < 1e-3  # 30 layers of fp32 with different (packed) matmul kernels
    from decode import generate
    assert generate(m, ids, max_new_tokens=32)["tokens"] == hf_out


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


def test_rms_norm_computes_in_fp32_like_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    ref, ours_norm = LlamaRMSNorm(64, eps=1e-5), M.RMSNorm(64, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.randn(64))
        ours_norm.weight.copy_(ref.weight)
    x = (torch.randn(3, 7, 64) * 40).to(torch.bfloat16)
    ref, ours_norm = ref.to(torch.bfloat16), ours_norm.to(torch.bfloat16)
    assert torch.equal(ours_norm(x), ref(x))  # bit for bit in bf16
    x32 = torch.randn(2, 64)
    assert torch.allclose(ours_norm.float()(x32), ref.float()(x32), atol=1e-6)


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
