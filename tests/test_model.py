"""model.py against transformers: logits, hidden-state indices, KV cache, loading errors."""

import pytest
import torch

from engine import weights as WT
from engine import layouts as LY
from engine import linear_forms as LF
from engine.rows_apart import rows_attend_apart
import model as M
from tokenizer import load_tokenizer



def hf_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ours(path, max_seq_len=128, pack=False):
    m = WT.load_model(path)
    m.setup_caches(4, max_seq_len)
    return LF.pack_for_cpu(m) if pack else m


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
    q = LF.Int8Linear(linear)
    x = torch.randn(5, 3, 64)
    ref = linear(x)
    assert ((q(x) - ref).norm() / ref.norm()).item() < 0.02  # int8 weights and activations: about 1%
    # each row depends on itself alone: the same token alone or in a block gives the same bits
    assert all(torch.equal(q(x[:, i:i + 1]), q(x)[:, i:i + 1]) for i in range(3))
    assert torch.allclose(LF.dense_weight(q), linear.weight, atol=linear.weight.abs().max().item() / 127)


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
    q = LF.Int4Linear(linear)
    error = (LF.dense_weight(q) - linear.weight).abs().view(48, 2, 32) / step
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
    assert rows_attend_apart(m) and LY.layout_of(m) == layout
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
    from speculative import generate
    assert generate(m, ids, max_new_tokens=32)["tokens"] == hf_out


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
