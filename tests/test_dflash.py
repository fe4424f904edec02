"""dflash.py: the block mask, the training forward equals inference, greedy speculation equals plain
decoding, the released layout round-trips, settings where released configs keep them, the committed draft."""
import json

import pytest
import torch
import torch.nn.functional as F

from engine import checkpoints as CK
from engine import files as FL
import model as M
from engine.checkpoints import load_draft, save_draft
from speculative import generate
from dflash import DFlashDraft, dflash_blocks, dflash_mask
from verify import Verifier
from conftest import dflash_net
from test_draft import edit_checkpoint, features


def test_dflash_mask_context_before_anchor_and_own_block():
    anchors, T, B = torch.tensor([3, 7]), 10, 4
    m = dflash_mask(anchors, T, B)
    assert m.shape == (8, T + 8)
    for j, a in enumerate(anchors.tolist()):
        for r in range(j * B, (j + 1) * B):
            assert m[r, :T].tolist() == [p < a for p in range(T)]
            assert m[r, T:].tolist() == [j * B <= c < (j + 1) * B for c in range(8)]


def test_dflash_training_forward_equals_inference(target):
    net = dflash_net(target)
    layers = net.target_layers
    torch.manual_seed(2)
    seq = torch.randint(0, 96, (20,)).tolist()
    a = 9  # the anchor: context is positions 0..8
    drafter = DFlashDraft(net, target.embed_tokens, target.lm_head, 128, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    drafter.start(seq[:a + 1], features(target, torch.tensor([seq[:a]]), layers)[0])
    _, q = drafter.propose(net.block_size - 1)
    full = torch.tensor([seq])
    with torch.no_grad():
        logits, _ = dflash_blocks(net, target.embed_tokens, target.lm_head, full, features(target, full, layers),
                                     torch.tensor([[a, 2]]))  # a second block must not disturb the first
    assert torch.allclose(F.softmax(logits[0, 0], -1), q, atol=1e-5)
    greedy = DFlashDraft(net, target.embed_tokens, target.lm_head, 128)  # T = 0: the argmax, q None
    greedy.start(seq[:a + 1], features(target, torch.tensor([seq[:a]]), layers)[0])
    tokens, q = greedy.propose(net.block_size - 1)
    assert q is None and tokens.tolist() == logits[0, 0].argmax(-1).tolist()


def test_dflash_greedy_speculative_equals_plain(target):
    net = dflash_net(target)
    prompt = [7, 7, 2, 9, 4]
    plain = generate(target, prompt, max_new_tokens=25)
    drafter = DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    spec = generate(target, prompt, drafter, Verifier("greedy"), k=5, max_new_tokens=25)
    assert spec["tokens"] == plain["tokens"]


def test_dflash_release_layout_round_trips(target, tmp_path):
    net = dflash_net(target)
    path = tmp_path / "dflash"
    save_draft(net, path, target.args, dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    assert config["block_size"] == 6
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in net.target_layers]  # layer outputs
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
                "layers.0.mlp.down_proj.weight"} <= set(f.keys())
    kind, loaded = load_draft(path, target)
    assert kind == "dflash"
    prompt = [4, 4, 8, 15, 16, 23, 42]
    layers = net.target_layers
    feats = features(target, torch.tensor([prompt[:-1]]), layers)[0]
    outs = []
    for n in (net, loaded):
        d = DFlashDraft(n, target.embed_tokens, target.lm_head, 128, temperature=1.0,
                        generator=torch.Generator().manual_seed(0))  # (T > 0: q is the whole distribution)
        d.start(prompt, feats)
        outs.append(d.propose(5))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)


def test_dflash_settings_at_the_top_level_and_a_missing_mask_id(target, tmp_path):
    net = dflash_net(target)
    path = tmp_path / "dflash"
    save_draft(net, path, target.args, dtype=torch.float32)

    def to_top(c):
        dc = c.pop("dflash_config")
        c.update(target_layer_ids=[0, 1], mask_token_id=dc["mask_token_id"] - 1)
    edit_checkpoint(path, to_top)
    _, loaded = load_draft(path, target)
    assert loaded.target_layers == (1, 2) != net.target_layers  # outputs of layers 0 and 1
    assert loaded.mask_token_id == net.mask_token_id - 1
    edit_checkpoint(path, lambda c: c.pop("mask_token_id"))
    with pytest.raises(M.CheckpointError, match="names no mask_token_id"):
        load_draft(path, target)
    edit_checkpoint(path, lambda c: c.update(mask_token_id=3, causal=True))
    with pytest.raises(M.CheckpointError, match="sets causal=true"):
        load_draft(path, target)
    edit_checkpoint(path, lambda c: c.update(causal=False, num_target_layers=12))
    with pytest.raises(M.CheckpointError, match="trained on a target of 12 layers"):
        load_draft(path, target)
    edit_checkpoint(path, lambda c: c.update(num_target_layers=None))
    for ids, message in (([0, "1"], 'target_layer_ids is \\[0, "1"\\], not a list of layer numbers'),
                         ([-2], "target_layer_ids is \\[-2\\], not a list"), (7, "target_layer_ids is 7, not a list"),
                         ([0, 40], "reads target layers target_layer_ids \\[0, 40\\]; this target has layers 0 to")):
        edit_checkpoint(path, lambda c: c.update(target_layer_ids=ids))
        with pytest.raises(M.CheckpointError, match=message):
            load_draft(path, target)
    edit_checkpoint(path, lambda c: c.update(target_layer_ids=[0, 1], dflash_config="x"))
    with pytest.raises(M.CheckpointError, match='dflash_config is "x", not an object'):
        load_draft(path, target)


def test_dflash_block_cap_is_not_counted_as_early_exit(target):
    net = dflash_net(target, block=4)  # at most 3 tokens a block
    drafter = DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    out = generate(target, [7, 7, 2, 9, 4], drafter, Verifier("greedy"), k=6, max_new_tokens=20)
    # k = 6 asks for more than a block holds: the 3 it cannot draft are not positions an early exit saved
    assert out["declined_tokens"] == 0
    assert 0 < out["drafted_tokens"] <= 3 * out["target_forwards"]


@pytest.mark.slow  # (decode.py's DFlash command line, in tests/test_decode.py, holds it by default)
def test_committed_dflash_draft_decodes_the_default_target_exactly(default_int4):
    """The committed GSM8K DFlash draft, its fixed block without early exit, emits plain greedy
    decoding's tokens on the int4 default target (bf16 and int4 verify row by row: exact by
    construction); decode.py's default for it, early exit and all, is held in tests/test_decode.py."""
    target, tokenizer = default_int4
    ids = tokenizer.encode_chat([{"role": "user", "content": "A baker makes 24 rolls and sells 3 bags of 5 "
                                  "rolls. How many rolls are left?"}])
    plain = generate(target, ids, max_new_tokens=64, stop_ids=tokenizer.stop_ids)
    draft = CK.build_draft(str(FL.ROOT / "drafts" / "smollm2-135m-dflash-gsm8k"), target, tokenizer, early_exit=None)
    assert isinstance(draft, DFlashDraft)
    spec = generate(target, ids, draft, Verifier("greedy"), k=7, max_new_tokens=64, stop_ids=tokenizer.stop_ids)
    assert spec["tokens"] == plain["tokens"]
    assert spec["target_forwards"] < plain["target_forwards"]  # it drafts tokens the target keeps

