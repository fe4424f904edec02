"""The drafts' shared interface and its wrappers: checkpoint errors, packed drafts, a draft that sat out
steps, the hybrid with lookup, every committed draft loading for the default target. (The networks:
tests/test_eagle3.py, tests/test_dflash.py.)"""
import json
import pytest
import torch
from engine import weights as WT
from engine import linear_forms as LF
import model as M
from engine.checkpoints import load_draft
from speculative import generate
from draft import HybridDraft, LookupDraft
from dflash import DFlashDraft
from eagle3 import Eagle3Draft
from verify import Verifier
from conftest import dflash_net, eagle3_net  # noqa: E402


def features(target, tokens, layers):
    with torch.no_grad():
        _, hidden = target(tokens, torch.arange(tokens.shape[1]), hidden_layers=layers)
    return torch.cat(hidden, -1)


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


def test_lookup_proposes_what_followed_the_longest_and_most_recent_match():
    """Prompt lookup proposes what followed the most recent earlier occurrence of the longest tail
    n-gram it finds: here the trigram (1, 2, 3) at position 5 (the unigram 3 last occurred at 10,
    the trigram first at 0); a tree takes the other matches as branches after it."""
    draft = LookupDraft()
    draft.start([1, 2, 3, 4, 7, 1, 2, 3, 5, 8, 3, 6, 1, 2, 3])
    guesses, q = draft.propose(3)
    assert guesses.tolist() == [5, 8, 3] and q is None
    tokens, parents, _ = draft.propose_tree(6, depth=2)
    assert tokens.tolist()[:2] == [5, 8] and parents[:2] == [-1, 0]


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

