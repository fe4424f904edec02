"""eagle3.py: the network's training forward is its inference chain, the released layout round-trips
(safetensors and .bin), configs that would run wrong are refused, the layer ids its config names are read."""
import pytest
import torch
import torch.nn.functional as F

import model as M
from engine.checkpoints import load_draft, save_draft
from speculative import generate
from dflash import dflash_target_layers
from eagle3 import Eagle3Draft, eagle3_chains, eagle3_target_layers
from verify import Verifier
from conftest import eagle3_net
from test_draft import edit_checkpoint, features, released_eagle3


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
    # at T = 0 the chain is the training forward's argmax chain, each on its target id, and
    # deterministic (q None: one-hot at the guess)
    greedy = Eagle3Draft(net, target.embed_tokens, 128)
    greedy.start(prompt, features(target, torch.tensor([prompt[:-1]]), layers)[0])
    tokens, q = greedy.propose(K)
    full = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits, _ = eagle3_chains(net, target.embed_tokens, full, features(target, full, layers),
                                  torch.tensor([0]), torch.tensor([t]), K)
    assert q is None and tokens.tolist() == net.draft_to_target()[logits[0].argmax(-1)].tolist()


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle3_release_layout_round_trips(target, tmp_path, fmt):
    original = released_eagle3(tmp_path / "released", target, fmt)
    kind, loaded = load_draft(tmp_path / "released", target)
    assert kind == "eagle3"
    save_draft(loaded, tmp_path / "ours", target.args, dtype=torch.float32)
    _, again = load_draft(tmp_path / "ours", target)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:  # the head apart, under vat/
        assert "midlayer.self_attn.k_proj.weight" in f.keys() and "verify_head.weight" not in f.keys()
    with safe_open(str(tmp_path / "ours" / "vat" / "head.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["verify_head.bias", "verify_head.weight"]
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
     "reads target layers eagle_config.eagle_aux_hidden_state_layer_ids [0, 1, 9]; this target has layers 0 to"),
    (dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 99])),  # (as written, not converted)
     "reads target layers eagle_aux_hidden_state_layer_ids [1, 2, 99]"),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": ["0", "1", "2"]})),
     'eagle_config.eagle_aux_hidden_state_layer_ids is ["0", "1", "2"], not a list of 3 layer numbers >= -1'),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": 5})), "is 5, not a list of 3"),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": {"a": 1}})),
     'is {"a": 1}, not a list'),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]})), "is [0, 1], not a list of 3"),
    (dict(config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [-2, 1, 2]})),
     "is [-2, 1, 2], not a list of 3 layer numbers >= -1"),  # (-1: the embeddings' output)
    (dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[-1, 1, 2])),
     "eagle_aux_hidden_state_layer_ids is [-1, 1, 2], not a list of 3 layer numbers >= 0"),
    (dict(config=lambda c: c.update(eagle_config="x")), 'eagle_config is "x", not an object'),
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


@pytest.mark.parametrize("where", ["eagle_config", "top", "both"])
def test_eagle3_reads_the_layer_ids_its_config_names(target, tmp_path, where):
    """eagle_config's ids name layer outputs (SpecForge, SGLang add 1), the top level's the states
    entering layers (vLLM reads them as they are): hidden[1..3] either way."""
    path = tmp_path / "released"
    net = released_eagle3(path, target, "safetensors")  # the default would be hidden (2, 1, 0)
    nested, top = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, \
        {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    edit_checkpoint(path, lambda c: c.update({"eagle_config": nested, "top": top, "both": {**nested, **top}}[where]))
    _, loaded = load_draft(path, target)
    assert loaded.target_layers == (1, 2, 3) != net.target_layers
    drafter = Eagle3Draft(loaded, target.embed_tokens, 128)
    assert drafter.target_layers == (1, 2, 3)
    prompt = [5, 6, 7, 8, 9]
    plain = generate(target, prompt, max_new_tokens=12)
    assert generate(target, prompt, drafter, Verifier("greedy"), k=3, max_new_tokens=12)["tokens"] == plain["tokens"]
    save_draft(loaded, tmp_path / "again", target.args, dtype=torch.float32)  # and it is written back
    assert load_draft(tmp_path / "again", target)[1].target_layers == (1, 2, 3)


def test_eagle3_layer_ids_that_disagree_are_refused(target, tmp_path):
    path = tmp_path / "released"
    released_eagle3(path, target, "safetensors")
    edit_checkpoint(path, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2],  # hidden[0..2]
                                             eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))  # [1..3]
    with pytest.raises(M.CheckpointError, match="name different target states"):
        load_draft(path, target)


def test_eagle3_drafts_from_a_one_token_prompt(target):
    net = eagle3_net(target)
    plain = generate(target, [11], max_new_tokens=10)
    drafter = Eagle3Draft(net, target.embed_tokens, 128)
    out = generate(target, [11], drafter, Verifier("greedy"), k=3, max_new_tokens=10)
    assert out["tokens"] == plain["tokens"] and out["drafted_tokens"] > 0

