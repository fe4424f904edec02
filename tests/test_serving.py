"""Drafts that serve: the mapping of vLLM's and SGLang's loaders (serving_layouts.py) accepts the
released EAGLE-3 layout and our exports, and refuses the layout that kept the verification head
among the served tensors. (A freshly trained and exported draft of each kind is checked end to
end in test_train_vat.py.)"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import serving_layouts as SL
from conftest import dflash_net, eagle3_net
from engine.checkpoints import load_draft, save_draft
from test_draft import released_eagle3


def test_the_released_eagle3_layout_is_what_the_engines_load(target, tmp_path):
    released_eagle3(tmp_path / "released", target, "safetensors")
    for engine in SL.ENGINES:
        assert SL.served_problems(tmp_path / "released", engine) == []
        assert SL.engine_aux_layers(engine, tmp_path / "released", target.args.n_layer) == \
            load_draft(tmp_path / "released", target)[1].target_layers


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_exports_serve_and_the_head_among_the_served_tensors_does_not(target, tmp_path, kind):
    net = eagle3_net(target) if kind == "eagle3" else dflash_net(target, block=4)
    ours = save_draft(net, tmp_path / "ours", target.args, {"objective": "vat"})
    for engine in SL.ENGINES:
        assert SL.served_problems(ours, engine) == []
        assert SL.engine_aux_layers(engine, ours, target.args.n_layer) == net.target_layers
    # the older layout: the head inside model.safetensors, which vLLM refuses to load
    older = tmp_path / "older"
    shutil.copytree(ours, older)
    save_file({**load_file(older / "model.safetensors"), **load_file(older / "vat" / "head.safetensors")},
              str(older / "model.safetensors"))
    shutil.rmtree(older / "vat")
    for engine in SL.ENGINES:
        assert [p.split(":")[0] for p in SL.served_problems(older, engine)] == ["verify_head.bias",
                                                                                "verify_head.weight"]
    # and a shape the engine's parameter does not take is named
    tensors = load_file(ours / "model.safetensors")
    tensors["fc.weight"] = torch.zeros(tensors["fc.weight"].shape[0], tensors["fc.weight"].shape[1] + 1)
    save_file(tensors, str(ours / "model.safetensors"))
    assert any(p.startswith("fc.weight: shape") for p in SL.served_problems(ours, "vllm"))


def test_the_committed_drafts_are_in_the_served_layout():
    from engine.files import ROOT
    folders = sorted((ROOT / "drafts").iterdir())
    assert folders
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        n_layer = config.get("num_target_layers") or 30  # (the default target's layers)
        for engine in SL.ENGINES:
            assert SL.served_problems(folder, engine) == [], (folder.name, engine)
        assert (folder / "vat" / "head.safetensors").is_file() and (folder / "vat" / "config.json").is_file()
        assert SL.engine_aux_layers("vllm", folder, n_layer) == SL.engine_aux_layers("sglang", folder, n_layer)
