"""Bad input in draft folders and weights: non-finite tensors, drafts for another target, configs
out of range, links and permissions. Each ends in a one-line error (or a warning that says what
runs), and nothing non-finite is saved or loaded."""
import json

import pytest
import torch

from engine import checkpoints as CK
from engine import weights as WT
from engine import files as FL
from engine import linear_forms as LF
import model as M
from engine.checkpoints import load_draft, save_draft
from conftest import eagle3_net


def test_non_finite_drafts_are_neither_saved_nor_loaded(tmp_path, tiny_dir):
    target = WT.load_model(tiny_dir("qwen3_untied"))
    net = eagle3_net(target)
    good = save_draft(net, tmp_path / "good", target.args)
    from safetensors.torch import load_file, save_file
    tensors = load_file(good / "model.safetensors")
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name][0] = float("inf")
    save_file(tensors, str(good / "model.safetensors"))
    with pytest.raises(M.CheckpointError, match="non-finite"):
        load_draft(good, target)
    with torch.no_grad():
        net.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight holds non-finite"):
        save_draft(net, tmp_path / "bad", target.args)
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["good"]


def test_a_draft_trained_for_another_target_loads_with_a_warning(tmp_path, tiny_dir, capsys):
    target = WT.load_model(tiny_dir("qwen3_untied"))
    net = eagle3_net(target)
    save_draft(net, tmp_path / "other", target.args, {"target": str(tiny_dir("llama3"))})
    save_draft(net, tmp_path / "own", target.args, {"target": str(tiny_dir("qwen3_untied"))})
    capsys.readouterr()
    load_draft(tmp_path / "own", target)
    assert capsys.readouterr().err == ""
    load_draft(tmp_path / "other", target)
    err = capsys.readouterr().err
    assert "warning" in err and str(tiny_dir("llama3")) in err and str(tiny_dir("qwen3_untied")) in err


def test_a_draft_folder_with_a_bad_head_is_one_line_and_an_older_export_still_loads(tmp_path, tiny_dir):
    """The head lives in vat/head.safetensors, beside the served weights: missing (with the record
    that says there is one), cut short, or shaped for another target, the folder is refused in
    one line; a draft of the older layout (its head inside model.safetensors, its record in
    config.json) loads with the same head and threshold."""
    from safetensors.torch import load_file, save_file
    target = WT.load_model(tiny_dir("qwen3_untied"))
    net = eagle3_net(target)
    with torch.no_grad():
        net.verify_head.bias.fill_(-1.5)
    good = save_draft(net, tmp_path / "good", target.args, {"objective": "vat", "early_exit_threshold": 0.3},
                      dtype=torch.float32)
    import shutil
    for name, spoil, message in [
            ("missing", lambda d: (d / "vat" / "head.safetensors").unlink(), "head.safetensors is missing beside"),
            ("cut", lambda d: (d / "vat" / "head.safetensors").write_bytes(
                (d / "vat" / "head.safetensors").read_bytes()[:-3]), "corrupt safetensors file"),
            ("other", lambda d: save_file({"verify_head.weight": torch.zeros(1, target.args.dim + 8),
                                           "verify_head.bias": torch.zeros(1)}, str(d / "vat" / "head.safetensors")),
             "verify_head.weight .* has shape"),
            ("nan", lambda d: save_file({"verify_head.weight": torch.full((1, target.args.dim), float("nan")),
                                         "verify_head.bias": torch.zeros(1)}, str(d / "vat" / "head.safetensors")),
             "non-finite")]:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        spoil(folder)
        with pytest.raises(M.CheckpointError, match=message) as e:
            load_draft(folder, target)
        assert "\n" not in str(e.value)
    # the older layout: one folder, head inside model.safetensors, record in config.json
    older = tmp_path / "older"
    shutil.copytree(good, older)
    tensors = {**load_file(older / "model.safetensors"), **load_file(older / "vat" / "head.safetensors")}
    save_file(tensors, str(older / "model.safetensors"))
    config = json.loads((older / "config.json").read_text())
    config.update(vat={"objective": "vat"}, early_exit_threshold=0.3)
    (older / "config.json").write_text(json.dumps(config))
    shutil.rmtree(older / "vat")
    _, loaded = load_draft(older, target)
    assert torch.equal(loaded.verify_head.bias, net.verify_head.bias)
    assert CK.recorded_threshold(older) == CK.recorded_threshold(good) == 0.3


@pytest.fixture
def tiny_drafts(tmp_path, tiny_dir):
    """(target, an EAGLE-3 draft folder, a DFlash draft folder) on a tiny target."""
    from conftest import dflash_net
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(1, 128)
    eagle = save_draft(eagle3_net(target), tmp_path / "eagle", target.args)
    dflash = save_draft(dflash_net(target, block=4), tmp_path / "dflash", target.args)
    return target, eagle, dflash


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_draft_configs_out_of_range_are_refused(tiny_drafts):
    target, eagle, dflash = tiny_drafts
    (eagle / "config.json").write_text("[]")
    with pytest.raises(M.CheckpointError, match="holds a list, not a JSON object"):
        load_draft(eagle, target)
    mask = json.loads((dflash / "config.json").read_text())["dflash_config"]["mask_token_id"]
    edit_config(dflash, dflash_config={**json.loads((dflash / "config.json").read_text())["dflash_config"],
                                       "mask_token_id": 999999})
    with pytest.raises(M.CheckpointError, match="mask_token_id 999999 lies outside the vocabulary"):
        load_draft(dflash, target)
    edit_config(dflash, dflash_config={**json.loads((dflash / "config.json").read_text())["dflash_config"],
                                       "mask_token_id": mask})
    for size in (1, 0, "4"):
        edit_config(dflash, block_size=size)
        with pytest.raises(M.CheckpointError, match="block_size must be a whole number >= 2"):
            load_draft(dflash, target)


@pytest.mark.parametrize("threshold", [5, "abc", -0.1])
def test_a_recorded_early_exit_threshold_is_checked_like_the_command_lines(tiny_drafts, threshold):
    target, eagle, _ = tiny_drafts
    edit_config(eagle / "vat", early_exit_threshold=threshold)  # (what VAT adds lives in vat/config.json)
    with pytest.raises(M.CheckpointError, match=r"early_exit_threshold must be a number in \[0, 1\]"):
        CK.build_draft(str(eagle), target, None, early_exit="auto")
    (eagle / "vat" / "config.json").write_text("[]")
    with pytest.raises(M.CheckpointError, match="holds a list, not a JSON object"):
        load_draft(eagle, target)


def test_int4_knows_which_models_it_can_take(tmp_path):
    from engine import layouts as LY
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "intermediate_size": 100, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2}))
    assert "--dtype int4 needs layer widths in multiples of 32" in LY.layout_problem(tmp_path, "int4")
    assert LY.layout_problem(tmp_path, "float32") is None
    linear = torch.nn.Linear(64, 200)  # 200 outputs: not a multiple of 16, stays bf16 (packed)
    model = torch.nn.Sequential(linear, torch.nn.Linear(64, 64))
    LF.quantize_int4(model)
    assert not isinstance(model[0], LF.Int4Linear) and isinstance(model[1], LF.Int4Linear)


def test_writing_a_folder_through_a_dangling_link_is_refused(tmp_path, tiny_drafts):
    target, eagle, _ = tiny_drafts
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    kind, net = load_draft(eagle, target)
    with pytest.raises(M.CheckpointError, match="is a link to .*nowhere, which is no directory"):
        save_draft(net, link, target.args)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_written_folders_are_readable_by_others(tmp_path):
    with FL.directory_written_atomically(tmp_path / "out") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        (tmp / "model.safetensors").chmod(0o600)  # as some writers create their files
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_an_unreadable_weights_file_is_named_as_such(tmp_path, tiny_dir, monkeypatch):
    import builtins
    import shutil
    shutil.copytree(tiny_dir("llama3"), tmp_path / "m")
    real_open = builtins.open

    def denied(path, *a, **k):
        if str(path).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(M.CheckpointError, match="cannot read .*model.safetensors: permission denied"):
        WT.load_model(tmp_path / "m")



BASE_CONFIG = dict(model_type="llama", vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=96)


@pytest.mark.parametrize("change,message", [
    (dict(rope_scaling="linear"), "'rope_scaling' must be an object, not 'linear'"),
    (dict(rope_parameters=[1, 2]), "'rope_parameters' must be an object, not [1, 2]"),
    (dict(rope_theta=float("inf")), "'rope_theta' must be a finite positive number, not inf"),
    (dict(rope_theta=float("nan")), "'rope_theta' must be a finite positive number"),
    (dict(rms_norm_eps=1e30), "'rms_norm_eps' must be a finite positive number below 1"),
    (dict(rms_norm_eps=-1e-6), "'rms_norm_eps' must be a finite positive number"),
])
def test_config_fields_of_the_wrong_kind_or_range_are_refused(change, message):
    """A target's or an EAGLE-3 draft's config.json (both read by ModelArgs.from_hf_config) with a
    rope field of the wrong type, or a number that is not finite or out of range, is one line."""
    with pytest.raises(M.CheckpointError, match="config.json field") as e:
        M.ModelArgs.from_hf_config({**BASE_CONFIG, **change})
    assert message in str(e.value) and "\n" not in str(e.value)
    assert M.ModelArgs.from_hf_config({**BASE_CONFIG, "rope_scaling": None}).rope_scaling is None
