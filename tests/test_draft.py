"""EAGLE-3 and DFlash drafts: masks, training forward = inference, VAT pieces, checkpoints, decoding."""
import json

import pytest
import torch
import torch.nn.functional as F

from engine import checkpoints as CK
from engine import weights as WT
from engine import files as FL
from engine import linear_forms as LF
import model as M
from engine.checkpoints import load_draft, save_draft
from speculative import generate
from draft import HybridDraft, LookupDraft
from dflash import DFlashDraft, dflash_blocks, dflash_mask, dflash_target_layers
from eagle3 import Eagle3Draft, eagle3_chains, eagle3_target_layers
from verify import Verifier

from conftest import dflash_net, eagle3_net  # noqa: E402


@pytest.fixture(scope="module")
def target(tiny_dir):
    m = WT.load_model(tiny_dir("qwen3_untied"))
    m.setup_caches(1, 128)
    return m


def features(target, tokens, layers):
    with torch.no_grad():
        _, hidden = target(tokens, torch.arange(tokens.shape[1]), hidden_layers=layers)
    return torch.cat(hidden, -1)


def test_dflash_mask_context_before_anchor_and_own_block():
    anchors, T, B = torch.tensor([3, 7]), 10, 4
    m = dflash_mask(anchors, T, B)
    assert m.shape == (8, T + 8)
    for j, a in enumerate(anchors.tolist()):
        for r in range(j * B, (j + 1) * B):
            assert m[r, :T].tolist() == [p < a for p in range(T)]
            assert m[r, T:].tolist() == [j * B <= c < (j + 1) * B for c in range(8)]


def test_eagle3_index_convention():
    assert eagle3_target_layers(32) == (2, 16, 29)
    # DFlash's rule picks the outputs of layers 1, 9, 17, 25, 33: hidden states 2, 10, ..., 34
    assert dflash_target_layers(36, 5) == (2, 10, 18, 26, 34)


def test_eagle3_training_forward_equals_inference_chain(target):
    net = eagle3_net(target)
    layers = eagle3_target_layers(target.args.n_layer)
    torch.manual_seed(1)
    seq = torch.randint(0, 97, (14,)).tolist()
    t, K = 6, 5  # draft from base position t: the prompt is seq[:t+2]
    g = torch.Generator().manual_seed(0)
    drafter = Eagle3Draft(net, target.embed_tokens, 128, temperature=1.0, generator=g)
    prompt = seq[:t + 2]
    drafter.start(prompt, features(target, torch.tensor([prompt[:-1]]), layers)[0])
    tokens, q = drafter.propose(K)
    full = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits, _ = eagle3_chains(net, target.embed_tokens, full, features(target, full, layers),
                                     torch.tensor([0]), torch.tensor([t]), K)  # the one chain at base t
    train_q = net.to_target_probs(F.softmax(logits[0], -1))  # (K, V)
    assert torch.allclose(train_q, q, atol=1e-5)


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


def test_dflash_greedy_speculative_equals_plain(target):
    net = dflash_net(target)
    prompt = [7, 7, 2, 9, 4]
    plain = generate(target, prompt, max_new_tokens=25)
    drafter = DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    spec = generate(target, prompt, drafter, Verifier("greedy"), k=5, max_new_tokens=25)
    assert spec["tokens"] == plain["tokens"]


def released_eagle3(path, target, fmt):
    """A checkpoint with exactly the names, shapes and config of the published EAGLE-3 drafts."""
    net = eagle3_net(target)
    sd = WT.unfuse_to_hf({k: v for k, v in net.state_dict().items() if not k.startswith("verify_head")}, net.args)
    sd["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "midlayer.mlp.gate_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(sd)
    path.mkdir()
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    t = target.args
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": t.dim,
        "intermediate_size": t.intermediate_size, "num_attention_heads": t.n_head, "num_key_value_heads": t.n_kv_head,
        "head_dim": t.head_dim, "num_hidden_layers": 1, "rms_norm_eps": net.args.norm_eps, "vocab_size": t.vocab_size,
        "draft_vocab_size": 60, "tie_word_embeddings": False, "rope_theta": 10000.0}))
    return net


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle3_release_layout_round_trips(target, tmp_path, fmt):
    original = released_eagle3(tmp_path / "released", target, fmt)
    kind, loaded = load_draft(tmp_path / "released", target)
    assert kind == "eagle3"
    save_draft(loaded, tmp_path / "ours", target.args, dtype=torch.float32)
    _, again = load_draft(tmp_path / "ours", target)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert "midlayer.self_attn.k_proj.weight" in f.keys() and "verify_head.weight" in f.keys()
    layers = eagle3_target_layers(target.args.n_layer)
    prompt = [5, 6, 7, 8, 9, 10]
    feats = features(target, torch.tensor([prompt[:-1]]), layers)[0]
    outs = []
    for net in (original, loaded, again):
        d = Eagle3Draft(net, target.embed_tokens, 128, temperature=1.0,
                          generator=torch.Generator().manual_seed(0))
        d.start(prompt, feats)
        outs.append(d.propose(4))
    for tokens, q in outs[1:]:
        assert torch.equal(tokens, outs[0][0]) and torch.allclose(q, outs[0][1], atol=1e-6)


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
        d = DFlashDraft(n, target.embed_tokens, target.lm_head, 128)
        d.start(prompt, feats)
        outs.append(d.propose(5))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)


def test_draft_checkpoint_errors(target, tmp_path):
    released_eagle3(tmp_path / "bad", target, "safetensors")
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    cfg["draft_vocab_size"] = 61
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(M.CheckpointError, match=r"draft tensor \S+ in .* has shape \(60"):
        load_draft(tmp_path / "bad", target)


def edit_checkpoint(path, config_edit=None, tensors_edit=None):
    from safetensors.torch import load_file, save_file
    if config_edit:
        cfg = json.loads((path / "config.json").read_text())
        config_edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if tensors_edit:
        sd = load_file(str(path / "model.safetensors"))
        tensors_edit(sd)
        save_file(sd, str(path / "model.safetensors"))


@pytest.mark.parametrize("change,message", [
    (dict(tensors=lambda sd: sd.update({"fc_norm.weight": torch.ones(32)})), "holds tensor fc_norm.weight"),
    (dict(tensors=lambda sd: sd.update({"fc.bias": torch.zeros(32)})), "holds tensor fc.bias"),
    (dict(tensors=lambda sd: sd.update({"layers.1.mlp.down_proj.weight": torch.zeros(4, 4)})), "holds tensor layers.1"),
    (dict(config=lambda c: c.update(fc_norm=True)), "sets fc_norm=true"),
    (dict(config=lambda c: c.update(norm_output=False)), "sets norm_output=false"),
    (dict(config=lambda c: c.update(num_hidden_layers=2)), "2 decoder layers"),
    (dict(config=lambda c: c.update(hidden_act="gelu")), "hidden_act='gelu'"),
    (dict(config=lambda c: c.update(target_hidden_size=128)), "hidden size 128"),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})),
     "reads the outputs of target layers [0, 1, 9]"),
    (dict(tensors=lambda sd: sd.update({"fc.weight": sd["fc.weight"].to(torch.int32)})), "fc.weight in .* is int32, "
                                                                                       "expected float"),
    (dict(tensors=lambda sd: sd.update({"d2t": torch.full_like(sd["d2t"], 100000000)})),
     "d2t maps draft token 0 to target token 100000000, outside the target's vocabulary"),
    (dict(config=lambda c: c.update(draft_vocab_size=1000000000), tensors=lambda sd: [sd.pop("d2t"), sd.pop("t2d")]),
     "draft_vocab_size must be a whole number from 1 to the target's vocabulary"),
])
def test_eagle3_checkpoint_that_would_run_wrong_is_refused(target, tmp_path, change, message):
    path = tmp_path / "released"
    released_eagle3(path, target, "safetensors")
    edit_checkpoint(path, change.get("config"), change.get("tensors"))
    with pytest.raises(M.CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_draft(path, target)


@pytest.mark.parametrize("where", ["eagle_config", "top"])
def test_eagle3_reads_the_layer_ids_its_config_names(target, tmp_path, where):
    path = tmp_path / "released"
    net = released_eagle3(path, target, "safetensors")
    ids = [0, 1, 2]  # outputs of layers 0..2, i.e. hidden[1..3]; the default would be (2, 1, 0)
    edit_checkpoint(path, lambda c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if
                                             where == "eagle_config" else {"eagle_aux_hidden_state_layer_ids": ids}))
    _, loaded = load_draft(path, target)
    assert loaded.target_layers == (1, 2, 3) != net.target_layers
    drafter = Eagle3Draft(loaded, target.embed_tokens, 128)
    assert drafter.target_layers == (1, 2, 3)
    prompt = [5, 6, 7, 8, 9]
    plain = generate(target, prompt, max_new_tokens=12)
    assert generate(target, prompt, drafter, Verifier("greedy"), k=3, max_new_tokens=12)["tokens"] == plain["tokens"]
    save_draft(loaded, tmp_path / "again", target.args, dtype=torch.float32)  # and it is written back
    assert load_draft(tmp_path / "again", target)[1].target_layers == (1, 2, 3)


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


def test_eagle3_drafts_from_a_one_token_prompt(target):
    net = eagle3_net(target)
    plain = generate(target, [11], max_new_tokens=10)
    drafter = Eagle3Draft(net, target.embed_tokens, 128)
    out = generate(target, [11], drafter, Verifier("greedy"), k=3, max_new_tokens=10)
    assert out["tokens"] == plain["tokens"] and out["drafted_tokens"] > 0


def test_dflash_block_cap_is_not_counted_as_early_exit(target):
    net = dflash_net(target, block=4)  # at most 3 tokens a block
    drafter = DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    out = generate(target, [7, 7, 2, 9, 4], drafter, Verifier("greedy"), k=6, max_new_tokens=20)
    # k = 6 asks for more than a block holds: the 3 it cannot draft are not positions an early exit saved
    assert out["declined_tokens"] == 0
    assert 0 < out["drafted_tokens"] <= 3 * out["target_forwards"]


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_packed_drafts_propose_what_plain_ones_do(target, kind):
    """decode.py packs a draft's Linears for CPU inference: the same guesses, the same q."""
    import copy
    net = eagle3_net(target) if kind == "eagle3" else dflash_net(target)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    feats = features(target, torch.tensor([prompt[:-1]]), net.target_layers)[0]
    packed = LF.pack_for_cpu(copy.deepcopy(net))
    assert any(isinstance(m, LF.PackedLinear) for m in packed.modules())
    outs = []
    for n in (net, packed):
        g = torch.Generator().manual_seed(0)
        d = (Eagle3Draft(n, target.embed_tokens, 128, temperature=1.0, generator=g) if kind == "eagle3" else
             DFlashDraft(n, target.embed_tokens, target.lm_head, 128, temperature=1.0, generator=g))
        d.start(prompt, feats)
        outs.append(d.propose(4))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_draft_that_sat_out_steps_proposes_as_if_it_had_drafted_them(target, kind):
    """Commits pile up while another draft proposes (HybridDraft); the next proposal is the one
    a draft started on the whole sequence makes."""
    net = eagle3_net(target) if kind == "eagle3" else dflash_net(target, block=5)
    layers = net.target_layers

    def drafter():
        if kind == "eagle3":
            return Eagle3Draft(net, target.embed_tokens, 128)
        return DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    torch.manual_seed(3)
    seq = torch.randint(0, 97, (20,)).tolist()
    states = features(target, torch.tensor([seq]), layers)[0]  # (20, n * dim)
    sat_out = drafter()
    sat_out.start(seq[:8], states[:7])
    sat_out.propose(3)  # drafted once, then others proposed for two steps
    sat_out.commit(seq[8:10], 1, states[7:9])
    sat_out.commit(seq[10:13], 2, states[9:12])
    fresh = drafter()
    fresh.start(seq[:13], states[:12])
    assert sat_out.propose(4)[0].tolist() == fresh.propose(4)[0].tolist()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_hybrid_draft_uses_both_and_decodes_exactly(target, kind):
    net = eagle3_net(target) if kind == "eagle3" else dflash_net(target, block=5)
    model_draft = Eagle3Draft(net, target.embed_tokens, 128) if kind == "eagle3" else \
        DFlashDraft(net, target.embed_tokens, target.lm_head, 128)
    prompt = [5, 17, 3, 9, 5, 17, 3, 9, 5, 17, 3, 42, 8, 11]
    plain = generate(target, prompt, max_new_tokens=40)
    hybrid = HybridDraft(model_draft)
    spec = generate(target, prompt, hybrid, Verifier("greedy"), k=4, max_new_tokens=40)
    assert spec["tokens"] == plain["tokens"]
    assert 0 < hybrid.looked_up < hybrid.steps and spec["draft_forwards"] > 0
    assert isinstance(hybrid.lookup, LookupDraft) and hybrid.lookup.min_ngram == 2


def test_every_committed_draft_loads_for_the_default_target_and_stays_small(smollm2_dir):
    """drafts/: each committed draft loads exactly for the target it was trained on (a stray or
    missing tensor is an error in load_draft) and stays under the 25 MB a repository can carry."""
    from pathlib import Path
    from engine.checkpoints import load_draft
    committed = sorted(p for p in (Path(__file__).resolve().parent.parent / "drafts").iterdir() if p.is_dir())
    assert len(committed) >= 4
    target = WT.load_model(smollm2_dir)
    kinds = set()
    for folder in committed:
        assert sum(f.stat().st_size for f in folder.iterdir()) < 25e6, folder
        kind, net = load_draft(folder, target)
        kinds.add(kind)
        # EAGLE-3 fuses three target layers; DFlash the layers its config names
        fused = 3 if kind == "eagle3" else len(net.target_layers)
        assert net.fc.weight.shape[1] == fused * target.args.dim, folder
    assert kinds == {"eagle3", "dflash"}


def test_committed_dflash_draft_decodes_the_default_target_exactly(default_int4):
    """The committed GSM8K DFlash draft, with and without early exit, emits plain greedy decoding's
    tokens on the int4 default target (bf16 and int4 verify row by row: exact by construction)."""
    target, tokenizer = default_int4
    ids = tokenizer.encode_chat([{"role": "user", "content": "A baker makes 24 rolls and sells 3 bags of 5 "
                                  "rolls. How many rolls are left?"}])
    plain = generate(target, ids, max_new_tokens=64, stop_ids=tokenizer.stop_ids)
    for early_exit in (None, "auto"):
        draft = CK.build_draft(str(FL.ROOT / "drafts" / "smollm2-135m-dflash-gsm8k"), target, tokenizer,
                               early_exit=early_exit)
        assert isinstance(draft, DFlashDraft)
        spec = generate(target, ids, draft, Verifier("greedy"), k=7, max_new_tokens=64,
                        stop_ids=tokenizer.stop_ids)
        assert spec["tokens"] == plain["tokens"]
        assert spec["target_forwards"] < plain["target_forwards"]  # it drafts tokens the target keeps
