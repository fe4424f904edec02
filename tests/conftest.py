"""Shared fixtures: tiny random checkpoints written by transformers itself, and the default target."""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch


def session_layout_cache() -> Path:
    """A layouts file for this session, holding at first the decisions the user's cache keeps for
    the default target (its converted weights live in the user's cache too): the tests then decode
    it in the layout decode.py runs it in on this machine, read as a second run reads it, rather
    than timing every layout again each session. Where none is kept (a new machine), the first test
    that loads it times them. The user's file is only read."""
    from engine.weights import cache_dir  # (reads no layout cache)
    session = Path(tempfile.mkdtemp(prefix="layouts-")) / "layouts.json"
    user = Path(os.environ.get("SPECDEC_LAYOUT_CACHE") or cache_dir() / "layouts.json")
    try:
        kept = json.loads(user.read_text())
    except (OSError, ValueError):
        return session
    default = f" | {cache_dir().resolve()}{os.sep}"
    if isinstance(kept, dict):
        session.write_text(json.dumps({k: v for k, v in kept.items() if default in k}))
    return session


# --dtype auto remembers its choice per model path: the tests' tiny models (and the scripts they
# start) keep theirs in a file of this session, not in the user's cache
os.environ["SPECDEC_LAYOUT_CACHE"] = str(session_layout_cache())
os.environ["SPECDEC_GRAPH_CACHE"] = str(Path(tempfile.mkdtemp(prefix="graphs-")))  # (compiled graphs, likewise)
# (inductor's own cache keeps its usual place: the tests' tiny kernels compile once per machine, not per session)
from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: E402
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())

from engine import weights as WT
from engine import layouts as LY  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))  # lossy, report, ...

from engine import linear_forms as LF  # noqa: E402
import model as M  # noqa: E402
from eagle3 import Eagle3, eagle3_target_layers
from dflash import DFlash, dflash_target_layers


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow (long end-to-end runs)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end run, selected with --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

# sandbox.py runs model-written code under bubblewrap, a system package (.ci/run installs it)
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed: apt-get install bubblewrap")

# the architectures the parity tests cover, each with the feature that sets it apart
TINY = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
}


def write_tiny_checkpoint(path: Path, kind: str, seed: int = 0, shard: bool = False, vocab: int = 97, layers: int = 3):
    import transformers
    config_cls, model_cls, extra = TINY[kind]
    config = getattr(transformers, config_cls)(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, **extra)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases/norm weights, so that a loader ignoring them fails the test
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    return hf


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A function kind -> directory of a tiny checkpoint (cached per session)."""
    made = {}

    def get(kind="llama3", shard=False):
        key = (kind, shard)
        if key not in made:
            d = tmp_path_factory.mktemp(f"{kind}{'_sharded' if shard else ''}")
            write_tiny_checkpoint(d, kind, shard=shard)
            made[key] = d
        return made[key]
    return get


@pytest.fixture(scope="session")
def smollm2_dir():
    return WT.resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_int4(smollm2_dir):
    """(target, tokenizer): the default target in int4, loaded once for the tests that decode with it
    (each generate() call writes its sequence's cache from position 0, so they can share it)."""
    return LY.load_target(str(smollm2_dir), "cpu", "int4", 512)[:2]


@pytest.fixture
def decode_failure(monkeypatch, capsys):
    """decode.py's main in this process, on input it must refuse (a fresh process per case would
    import torch each time): returns (exit status, what the script prints last on stderr). The
    script's wrapper turns a CheckpointError or ValueError into one line 'error: <message>' (tested
    end to end in tests/test_decode.py); argparse prints its usage, then one line."""
    import decode
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's thread count stays

    def run(argv):
        try:
            decode.main(argv)
        except SystemExit as e:
            return e.code, capsys.readouterr().err.strip().splitlines()[-1]
        except (M.CheckpointError, ValueError) as e:
            return 1, f"error: {e}"
        raise AssertionError(f"decode.py {' '.join(argv)} did not fail")
    return run


@pytest.fixture(scope="module")
def target(tiny_dir):
    """A tiny Qwen3 target the draft tests (test_draft, test_eagle3, test_dflash) draft for."""
    m = WT.load_model(tiny_dir("qwen3_untied"))
    m.setup_caches(1, 128)
    return m


# random EAGLE-3 and DFlash drafts over a target (non-trivial norms and biases: a path that ignores one fails)

def eagle3_net(target, draft_vocab=60, seed=0):
    torch.manual_seed(seed)
    t = target.args
    args = M.ModelArgs(model_type="llama", vocab_size=t.vocab_size, dim=t.dim, n_layer=1, n_head=t.n_head,
                       n_kv_head=t.n_kv_head, head_dim=t.head_dim, intermediate_size=t.intermediate_size)
    net = Eagle3(args, t.dim, draft_vocab, eagle3_target_layers(t.n_layer))
    ids = torch.randperm(t.vocab_size)[:draft_vocab].sort().values
    net.d2t.copy_(ids - torch.arange(draft_vocab))
    net.t2d.zero_()
    net.t2d[ids] = True
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))  # non-trivial norms and biases
    return net.eval()


def dflash_net(target, block=6, seed=0):
    torch.manual_seed(seed)
    t = target.args
    args = M.ModelArgs(model_type="qwen3", vocab_size=t.vocab_size, dim=t.dim, n_layer=2, n_head=t.n_head,
                       n_kv_head=t.n_kv_head, head_dim=t.head_dim, intermediate_size=t.intermediate_size, qk_norm=True)
    net = DFlash(args, t.dim, dflash_target_layers(t.n_layer, 2), block, mask_token_id=t.vocab_size - 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target over 16 tokens (few enough to enumerate every continuation), an independent draft
    model with its own weights, and the int8 target (tests/test_emits.py, tests/test_tree.py)."""
    target_dir, draft_dir = tmp_path_factory.mktemp("target16"), tmp_path_factory.mktemp("draft16")
    write_tiny_checkpoint(target_dir, "llama3", seed=1, vocab=16)
    write_tiny_checkpoint(draft_dir, "llama3", seed=2, vocab=16, layers=1)

    def load(path, int8=False):
        m = WT.load_model(path)
        m.setup_caches(1, 64)
        return LF.quantize_int8(m) if int8 else m
    return {"target": load(target_dir), "int8": load(target_dir, int8=True), "draft_dir": draft_dir,
            "load": load}


def tiny_chat_target(path):
    """A tiny Qwen3 checkpoint with a real (small) byte-level BPE chat tokenizer beside it."""
    from conftest import write_tiny_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    write_tiny_checkpoint(path, "qwen3_untied", vocab=320, layers=4)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["user assistant system question answer numbers 12345"] * 50, trainer)
    tok.save(str(path / "tokenizer.json"))
