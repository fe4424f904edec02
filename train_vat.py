"""
Verification-Aware Training (VAT) of EAGLE-3 and DFlash drafts, and their plain objectives.

    python train_vat.py                                        # EAGLE-3 + VAT for the default target, CPU
    python train_vat.py --target qwen3-4b --draft dflash       # on a GPU machine that has the weights
    python train_vat.py --objective baseline                   # the plain EAGLE-3 / DFlash loss, same budget

1. Data (corpus.py). Prompts from jsonl files (Spec-Bench/MT-bench `turns`, ShareGPT `conversations`, Alpaca
   `instruction`, GSM8K `question`) or written by the target itself from the bare chat-template
   prefix (Magpie). The target regenerates every response (greedy by default), so the draft learns
   the target's own distribution; responses are cached on disk and reused by later runs.
2. Target features: on a CPU, captured while the target generates and kept on disk with its
   log-probability normalizer (corpus.py), so training never runs the target; on a GPU,
   computed on the fly batch by batch (storing them costs hundreds of GB for an 8B target).
3. EAGLE-3 unrolls K = 7 draft steps (training-time test) for the base positions whose chain
   reaches a response token: step s attends to the real prefix and to its own earlier steps; loss
   weights 0.8^(k-1); soft cross-entropy against the target on the draft vocabulary. DFlash fills blocks of 16 at random anchors; hard cross-entropy with weights
   exp(-(k-1)/7).
4. VAT simulates verification at every step: m_k = 1 if the target keeps the drafted token at
   position k; k* is the first k with m_k = 0 (K+1 if none). The verification head learns
   v_k = 1[k < k*] (BCE), and the loss weights restart their decay at k*:
   w_hat_k = 1 for k < k*, w_(k-k*+1) after. L = sum_k w_hat_k (soft CE + hard CE) + beta L_VH.
5. Shipping: --export runs/NAME/checkpoint drafts/NAME writes the trained draft in bf16 with the
   early-exit threshold chosen for it (checkpoints keep fp32 for the optimizer).
"""
import argparse
import json
import math
import random
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

import model as M
from checkpoints import (checkpoint_dirs, draft_kind, latest_checkpoint, load_draft, read_log,
                         save_checkpoint, save_draft)
from corpus import (DEFAULT_DATA, Corpus, Recipe, batches, build_corpus, build_dataset, corpus_batches,
                    corpus_layers, data_sources, draft_vocabulary, fitting, length_groups)
from decode import generate
from dflash import DFlash, DFlashDraft, dflash_blocks, dflash_target_layers
from eagle3 import Eagle3, Eagle3Draft, eagle3_chains, eagle3_target_layers
from files import ROOT, repo_path
from layouts import default_device, experiment_layout, load_target, machine_problem, start_processes
from verify import Verifier
from weights import DEFAULT_TARGET, HF_REPOS, cache_dir, load_model, read_config, resolve_model

# -----------------------------------------------------------------------------
# VAT: simulated verification, first rejection, head labels, adaptive weights

def eagle3_decay(j):
    return 0.8 ** (j - 1)


def dflash_decay(j):
    return torch.exp(-(j - 1) / 7.0)


def vat_targets(accepted: torch.Tensor, decay):
    """accepted (N, K) bool: m_k for each chain. Returns k* (N,) in 1..K+1, head labels v (N, K)
    and the adaptive weights w_hat (N, K): 1 before k*, the decay restarted at k* after it."""
    N, K = accepted.shape
    k = torch.arange(1, K + 1, device=accepted.device).expand(N, K)
    kstar = accepted.long().cumprod(-1).sum(-1) + 1  # (N,)
    labels = k < kstar[:, None]
    w = torch.where(labels, torch.ones_like(k, dtype=torch.float), decay((k - kstar[:, None] + 1).float()))
    return kstar, labels, w


def plain_weights(N, K, decay, device=None):
    return decay(torch.arange(1, K + 1, device=device).float()).expand(N, K)


def step_losses(draft_logits, target_logits, valid, soft: bool, hard: bool):
    """Per-position soft CE (against the target's distribution) and/or hard CE (against its
    argmax), (...,) each; positions that are not valid contribute 0."""
    logp = F.log_softmax(draft_logits.float(), -1)
    loss = torch.zeros(draft_logits.shape[:-1], device=draft_logits.device)
    if soft:
        loss = loss - (F.softmax(target_logits.float(), -1) * logp).sum(-1)
    if hard:
        loss = loss - logp.gather(-1, target_logits.argmax(-1, keepdim=True))[..., 0]
    return loss * valid


def simulate_acceptance(draft_logits, target_logp, label: str):
    """m_k: does the target keep the draft's token? greedy: the argmaxes agree; sample: a token
    drawn from q is kept with probability min(1, p/q). target_logp are the target's log-probs on
    the draft's vocabulary (not renormalized there, so p(x) is the target's true probability)."""
    if label == "greedy":
        return draft_logits.argmax(-1) == target_logp.argmax(-1)
    q, p = F.softmax(draft_logits.float(), -1), target_logp.float().exp()
    x = torch.multinomial(q.reshape(-1, q.shape[-1]), 1).view(q.shape[:-1] + (1,))
    ratio = (p.gather(-1, x) / q.gather(-1, x).clamp_min(1e-12))[..., 0]
    return torch.rand_like(ratio) < ratio.clamp(max=1)


class LossSettings(NamedTuple):
    """What the draft's loss trains, read off the command line once: VAT's parts (none: the draft's
    own objective), the verification its labels and k* simulate, and the head's weight in the sum."""
    parts: frozenset = frozenset()
    label: str = "greedy"
    beta: float = 1.0

    @classmethod
    def from_args(cls, args):
        return cls(frozenset(args.vat_parts) if args.objective == "vat" else frozenset(), args.vat_label, args.beta)


def objective(draft_logits, head_logits, target_logp, valid, settings: LossSettings, decay, native: str,
              target_in_vocab=None):
    """The loss of one batch of K-step chains. draft_logits and target_logp (N, K, V') on the same
    vocabulary, head_logits (N, K), valid (N, K). native: 'soft' (EAGLE-3) or 'hard' (DFlash).
    target_in_vocab (N, K): whether the target's argmax is in the draft vocabulary at all."""
    N, K = valid.shape
    valid = valid.bool()
    with torch.no_grad():
        accepted = simulate_acceptance(draft_logits, target_logp, settings.label)
        if target_in_vocab is not None and settings.label == "greedy":
            # greedy verification keeps only the target's argmax, which a draft cannot propose when
            # its vocabulary lacks it; sampled verification can still keep another drafted token
            accepted &= target_in_vocab
        kstar, labels, w_hat = vat_targets(accepted | ~valid, decay)  # past the sequence: no rejection
    valid_f = valid.float()
    ce_valid = valid_f if target_in_vocab is None else valid_f * target_in_vocab
    # VAT changes three things; --vat-parts picks them for the paper's ablation rows
    parts = settings.parts
    both_ce = "ce" in parts  # soft + hard CE for either draft, instead of the draft's native one
    ce = step_losses(draft_logits, target_logp, ce_valid, soft=both_ce or native == "soft",
                     hard=both_ce or native == "hard")
    weights = w_hat if "weighting" in parts else plain_weights(N, K, decay, valid.device)
    loss = (weights * ce).sum() / N
    head_loss = torch.zeros(())
    if "head" in parts:
        head = F.binary_cross_entropy_with_logits(head_logits.float(), labels.float(), reduction="none")
        head_loss = (head * valid_f).sum() / valid_f.sum().clamp_min(1)
        loss = loss + settings.beta * head_loss
    chains = valid[:, 0].bool()  # chains that start inside the response
    n_valid = valid_f.sum().clamp_min(1).item()
    stats = {"loss": loss.item(), "head_loss": head_loss.item(),
             "sim_tau": (kstar[chains].float().mean().item() if chains.any() else 1.0),  # k*-1 kept + bonus
             # the chains whose loss weights VAT's weighting changes: k* = 1 restarts the decay where
             # it starts anyway
             "weighting_changes": ((kstar[chains] > 1).float().mean().item() if chains.any() else 0.0),
             "head_acc": (((head_logits > 0) == labels).float() * valid_f).sum().item() / n_valid,
             # the share of positions labelled "kept": a constant head scores max(this, 1 - this)
             "kept_share": (labels.float() * valid_f).sum().item() / n_valid}
    return loss, stats


def target_pass(target, batch, layers):
    """The frozen target on a batch: its logits (B, T, V) and the features the draft reads
    (B, T, len(layers) * dim). From a corpus the batch carries the features (of the corpus's
    layers) and the final-normed states, from which the logits are one matmul away."""
    tokens, _, *captured = batch
    with torch.no_grad():
        if captured:
            features, final = captured[0], captured[1].to(target.norm.weight.dtype)
            return target.lm_head(final), captured_features(features, layers, target)
        logits, hidden = target(tokens, torch.arange(tokens.shape[1], device=tokens.device),
                                hidden_layers=layers)
        return logits, torch.cat(hidden, -1)


def captured_features(features, layers, target):
    """The draft's layers out of a corpus's features (B, T, L*dim), in the draft's order."""
    have = corpus_layers(target.args.n_layer)
    dim = target.args.dim
    features = features.to(target.norm.weight.dtype)
    return torch.cat([features[..., have.index(i) * dim:(have.index(i) + 1) * dim] for i in layers], -1)


def eagle3_target_side(net: Eagle3, target, batch):
    """(features (B, T, 3*dim_t), the target's log-probs on the draft vocabulary (B, T, Vd), its
    top token (B, T)): from a corpus without the target, else from a target forward."""
    tokens, _, *captured = batch
    with torch.no_grad():
        if not captured:
            logits, features = target_pass(target, batch, net.target_layers)
            logp = F.log_softmax(logits.float(), -1)[..., net.draft_to_target()]
            return features, logp, logits.argmax(-1)
        features, final, lse, top = captured
        rows = M.dense_weight(target.lm_head)[net.draft_to_target()].float()  # (Vd, dim)
        logp = F.linear(final.float(), rows) - lse[..., None]  # (B, T, Vd), normalized over all V
        return captured_features(features, net.target_layers, target), logp, top.long()


def eagle3_loss(net: Eagle3, target, batch, settings: LossSettings, K: int):
    """EAGLE-3's training-time test on one batch, as K-step chains from the base positions whose
    chain predicts at least one response token; the loss is a mean over those chains."""
    tokens, response = batch[0], batch[1].bool()
    T = tokens.shape[1]
    features, target_logp, target_top = eagle3_target_side(net, target, batch)
    # the chain from base t predicts, at step s, the token at t+2+s; the target's distribution
    # for it sits at t+1+s
    step = torch.arange(K, device=tokens.device)
    predicted = torch.arange(T, device=tokens.device)[:, None] + 2 + step  # (T, K)
    valid = (predicted < T) & response[:, predicted.clamp(max=T - 1)]  # (B, T, K)
    b, t = valid.any(-1).nonzero(as_tuple=True)  # (N,) each: the chains that carry loss
    logits, heads = eagle3_chains(net, target.embed_tokens, tokens, features, b, t, K)  # (N, K, Vd), (N, K)
    source = (t[:, None] + 1 + step).clamp(max=T - 1)  # (N, K)
    return objective(logits, heads, target_logp[b[:, None], source], valid[b, t], settings, eagle3_decay,
                     native="soft", target_in_vocab=net.t2d[target_top[b[:, None], source]])


def dflash_loss(net: DFlash, target, batch, settings: LossSettings, blocks_per_seq: int):
    """DFlash's block objective on one batch: blocks_per_seq blocks at random anchors inside each
    response."""
    tokens, response = batch[0], batch[1].bool()
    B, T = tokens.shape
    bs = net.block_size
    target_logits, features = target_pass(target, batch, net.target_layers)
    anchors = sample_anchors(response, blocks_per_seq)  # (B, nb)
    # the target's lm_head as a plain matmul: a packed CPU weight has no autograd, and the draft's
    # gradient must flow through it
    lm_weight = M.dense_weight(target.lm_head)
    logits, heads = dflash_blocks(net, target.embed_tokens, lambda x: F.linear(x, lm_weight), tokens,
                                  features, anchors)
    pos = anchors[..., None] + torch.arange(1, bs, device=tokens.device)  # (B, nb, bs-1) predicted positions
    pos_inside = pos.clamp(max=T - 1)
    # the target's distribution for the token at pos comes from position pos - 1
    rows = (pos_inside - 1).view(B, -1, 1).expand(-1, -1, target_logits.shape[-1])
    target_logits = target_logits.gather(1, rows).view(*pos.shape, -1)  # (B, nb, bs-1, V)
    target_logp = F.log_softmax(target_logits.float(), -1)
    valid = (pos < T) & response.gather(1, pos_inside.view(B, -1)).view(pos.shape)

    def blocks(x):  # (B, nb, bs-1, ...) -> (B*nb, bs-1, ...): one chain per block
        return x.flatten(0, 1)
    return objective(blocks(logits), blocks(heads), blocks(target_logp), blocks(valid), settings, dflash_decay,
                     native="hard")


def sample_anchors(response, n: int):
    """n random anchors per sequence, each the position just before a response token."""
    B, T = response.shape
    out = torch.zeros(B, n, dtype=torch.long, device=response.device)
    for b in range(B):
        starts = (response[b, 1:].nonzero()[:, 0])  # anchor a predicts a+1.. : a+1 must be response
        if len(starts) == 0:
            continue
        out[b] = starts[torch.randint(len(starts), (n,))]
    return out


# -----------------------------------------------------------------------------
# Evaluation: real tau through decode.py's loop

@torch.no_grad()
def evaluate_tau(net, target, tokenizer, prompts, k: int, max_prompt_tokens: int) -> float:
    """Real tau of the draft on held-out prompts, greedy, k drafted tokens a step, through decode.py's
    own loop. It leaves the target's caches sized for one sequence: the caller restores its own."""
    net.eval()
    target.setup_caches(1, max_prompt_tokens + EVAL_NEW_TOKENS + k + 1)
    if isinstance(net, Eagle3):
        draft = Eagle3Draft(net, target.embed_tokens, target.max_seq_len)
    else:
        draft = DFlashDraft(net, target.embed_tokens, target.lm_head, target.max_seq_len)
    new = forwards = 0
    for text in prompts:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])[-max_prompt_tokens:]
        r = generate(target, ids, draft, Verifier("greedy"), k=k, max_new_tokens=EVAL_NEW_TOKENS,
                     stop_ids=tokenizer.stop_ids)
        new, forwards = new + r["new_tokens"], forwards + r["target_forwards"]
    net.train()
    return new / max(forwards, 1)


# -----------------------------------------------------------------------------
# The run

# defaults that depend on the machine: the GPU recipe, and a CPU one that ends in well under an hour
GPU_DEFAULTS = dict(features="on-the-fly", steps=2000, batch_size=8, seq_len=384, draft_vocab=8192,
                    eval_every=250, save_every=100)
CPU_DEFAULTS = dict(features="captured", steps=150, batch_size=4, seq_len=320, draft_vocab=4096,
                    eval_every=50, save_every=25)
QUICK = dict(steps=2, batch_size=2, seq_len=128, draft_vocab=1024, eval_every=2, save_every=1, num_prompts=12,
             self_prompts=0, response_tokens=24, gen_batch=12, eval_prompts=2)
VAT_PARTS = ("head", "weighting", "ce")


def get_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train an EAGLE-3 or DFlash draft with Verification-Aware Training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Machine-dependent defaults (None above): on CUDA "
               + ", ".join(f"{k}={v}" for k, v in GPU_DEFAULTS.items())
               + "; on CPU " + ", ".join(f"{k}={v}" for k, v in CPU_DEFAULTS.items())
               + " (the committed general draft's recipe). --quick is a 2-step smoke run on 12 prompts.")
    for add in (add_objective_args, add_data_args, add_architecture_args, add_schedule_args, add_output_args,
                add_other_modes):
        add(ap)
    return complete_args(ap, ap.parse_args(argv))


def add_objective_args(ap):
    """What is trained, for which target, with which loss."""
    g = ap.add_argument_group("target, draft and objective")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"name ({', '.join(HF_REPOS)}) or directory")
    g.add_argument("--draft", default="eagle3", choices=("eagle3", "dflash"))
    g.add_argument("--objective", default="vat", choices=("vat", "baseline"),
                   help="vat: the parts in --vat-parts; baseline: the plain EAGLE-3/DFlash loss")
    g.add_argument("--vat-parts", default=None,
                   help="with --objective vat, which of VAT's parts to apply (the ablation rows), comma-separated: "
                        "head, weighting, ce; default: all three")
    g.add_argument("--vat-label", default="greedy", choices=("greedy", "sample"),
                   help="simulated verification: argmax match, or min(1, p/q) acceptance of a sampled token")
    g.add_argument("--beta", type=float, default=1.0, help="weight of the verification-head loss")


def add_data_args(ap):
    """The prompts and the target's regenerated responses to them."""
    g = ap.add_argument_group("training data")
    g.add_argument("--data", default=",".join(DEFAULT_DATA + ["self"]),
                   help="comma-separated prompt jsonl files; 'self' adds prompts the target writes (Magpie)")
    g.add_argument("--num-prompts", type=int, default=600, help="prompts taken from the files (0: all)")
    g.add_argument("--self-prompts", type=int, default=300, help="self-written prompts, with 'self' in --data")
    g.add_argument("--max-prompt-tokens", type=int, default=256)
    g.add_argument("--response-tokens", type=int, default=160, help="tokens per regenerated response")
    g.add_argument("--gen-batch", type=int, default=48, help="prompts per batched target generation")
    g.add_argument("--corpus-batches", type=int, default=None,
                   help="captured features: generate and train on only the first N generation batches "
                        "(after the held-out prompts; prompts are ordered by length, so the shortest)")


def add_architecture_args(ap):
    """The draft network's shape (EAGLE-3 or DFlash)."""
    g = ap.add_argument_group("draft architecture")
    g.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3 reduced draft vocabulary")
    g.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 unrolled training-time-test steps K")
    g.add_argument("--block-size", type=int, default=16, help="DFlash block size")
    g.add_argument("--blocks-per-seq", type=int, default=4, help="DFlash random anchors per sequence")
    g.add_argument("--draft-layers", type=int, default=None, help="DFlash layers (default 5, 2 for small targets)")


def add_schedule_args(ap):
    """Steps, batches, learning rate, real-tau evaluations and checkpoints."""
    g = ap.add_argument_group("schedule and evaluation")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--time-budget", type=float, default=None, help="stop training after this many minutes")
    g.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop after this step and save it, the schedule still running to --steps: a point "
                        "midway through a schedule (an ablation row), which --resume can continue")
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--seq-len", type=int, default=None)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=50, help="linear warm-up steps (0: none)")
    g.add_argument("--eval-every", type=int, default=None, help="steps between real-tau evaluations (0: never)")
    g.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for real tau")
    g.add_argument("--eval-k", type=int, default=7)
    g.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    g.add_argument("--keep-every", type=int, default=0,
                   help="also keep the checkpoints at multiples of this step (0: only the newest two), "
                        "to measure a learning curve on test prompts afterwards")


def add_output_args(ap):
    """Where the run, its cache and its features live, and on what it runs."""
    g = ap.add_argument_group("output and machine")
    g.add_argument("--out", default=None, help="output directory (default runs/<target>-<draft>-<objective>)")
    g.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --out")
    g.add_argument("--cache-dir", default=str(cache_dir() / "train"), help="where regenerated responses are cached")
    g.add_argument("--features", default=None, choices=("captured", "on-the-fly"),
                   help="captured: keep the target's features from response generation on disk (training never "
                        "runs the target); on-the-fly: a target forward every step (large targets)")
    g.add_argument("--prepare-only", action="store_true", help="build (and cache) the data, then stop")
    g.add_argument("--quick", action="store_true", help="smoke run: 12 prompts, 2 steps")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=default_device())


def add_other_modes(ap):
    """Learning curves of finished runs, and exporting a checkpoint as a draft."""
    g = ap.add_argument_group("other modes (train nothing)")
    g.add_argument("--learning-curves", default=None, metavar="FILE",
                   help="train nothing: write the learning curves of the finished runs in --runs to FILE (JSON)")
    g.add_argument("--runs", nargs="+", default=[], metavar="DIR", help="--out directories, for --learning-curves")
    g.add_argument("--export", nargs=2, default=None, metavar=("CHECKPOINT", "DIR"),
                   help="train nothing: write a run's checkpoint (e.g. runs/NAME/checkpoint) as a draft to ship "
                        "in DIR: bf16, the released layout, without the optimizer state")
    g.add_argument("--early-exit-threshold", type=float, default=None,
                   help="with --export, the threshold a bare decode.py --early-exit takes from the draft")


def complete_args(ap, args):
    """The other modes' checks, then --quick's and the machine's defaults, the settings' checks
    and --out's."""
    if args.learning_curves or args.runs:
        if not (args.learning_curves and args.runs):
            ap.error("--learning-curves FILE and --runs DIR [DIR ...] go together")
        return args
    if args.export:
        check_export(ap, args.export[0], args.export[1], args.early_exit_threshold)
        return args
    if args.early_exit_threshold is not None:
        ap.error("--early-exit-threshold goes with --export")
    for name, value in QUICK.items() if args.quick else ():  # what the user left at its default
        if getattr(args, name) == ap.get_default(name):
            setattr(args, name, value)
    for name, value in (CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_settings(ap, args)
    name = f"{args.target.replace('/', '_')}-{args.draft}-{args.objective}" + ("-quick" if args.quick else "")
    args.out = Path(args.out or ROOT / "runs" / name)
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file, not a directory")
    if args.quick and not args.resume and args.out == ROOT / "runs" / name and args.out.is_dir():
        shutil.rmtree(args.out)  # the smoke run's own folder: nothing in it is worth keeping
    if not args.resume and (checkpoint_dirs(args.out) or (args.out / "checkpoint").exists()):
        ap.error(f"{args.out} already holds checkpoints: pass --resume to continue them, or another --out")
    return args


def check_export(ap, checkpoint: str, out_dir: str, threshold):
    """--export's arguments, checked before the target is loaded: nothing is ever written over."""
    if not Path(checkpoint).is_dir():
        ap.error(f"--export: no checkpoint directory {checkpoint}")
    if Path(out_dir).exists():
        ap.error(f"--export: {out_dir} exists: choose a new directory (nothing is overwritten)")
    if threshold is not None and not 0 < threshold < 1:
        ap.error(f"--early-exit-threshold is a probability in (0, 1), got {threshold}")


def check_settings(ap, args):
    """Every setting checked before any data is generated or weights are loaded."""
    for name in ("steps", "batch_size", "seq_len", "ttt_steps", "block_size", "draft_vocab", "gen_batch",
                 "save_every", "response_tokens", "max_prompt_tokens", "eval_k", "blocks_per_seq"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.corpus_batches is not None and args.corpus_batches < 1:
        ap.error(f"--corpus-batches must be >= 1, got {args.corpus_batches}")
    for name in ("warmup", "eval_every", "eval_prompts", "num_prompts", "self_prompts", "keep_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (args.block_size >= 2 and math.isfinite(args.lr) and args.lr > 0 and math.isfinite(args.beta)
            and args.beta >= 0):
        ap.error("need --block-size >= 2, --lr > 0 and --beta >= 0")
    if args.time_budget is not None and not args.time_budget > 0:
        ap.error("--time-budget must be > 0 minutes")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        ap.error(f"--stop-at must be a step from 1 to --steps ({args.steps}), got {args.stop_at}")
    problem = machine_problem(args.device, "auto", None)
    if problem:
        ap.error(problem)
    if args.objective == "baseline" and args.vat_parts is not None:
        ap.error("--vat-parts applies to --objective vat")
    # what the loss trains (recorded in every checkpoint): no VAT part for the baseline objective
    args.vat_parts = [] if args.objective == "baseline" else \
        [p for p in (args.vat_parts or ",".join(VAT_PARTS)).split(",") if p]
    if args.objective == "vat" and (not args.vat_parts or any(p not in VAT_PARTS for p in args.vat_parts)):
        ap.error(f"--vat-parts takes a comma-separated subset of {','.join(VAT_PARTS)}")
    files, n_self = data_sources(args.data, args.self_prompts)
    from_files = (args.num_prompts or 10 ** 9) if files else 0  # 0 takes every prompt: count unknown yet
    n_prompts = from_files + n_self
    if args.eval_prompts >= n_prompts:
        ap.error(f"--eval-prompts {args.eval_prompts} would hold out all {n_prompts} prompts")
    for path in files:
        if not repo_path(path).is_file():
            ap.error(f"prompt file not found: {path}")


def announce_defaults(args):
    """Say up front what a CPU run will cost: the defaults must not start a 10-hour job unasked."""
    if args.device == "cpu" and not args.quick:
        print(f"CPU run: {args.steps} steps of batch {args.batch_size} x {args.seq_len} tokens (draft "
              f"vocabulary {args.draft_vocab}), after the target generates the training data the first time "
              f"(cached for later runs). The progress bars show the ETA; --time-budget caps it.", file=sys.stderr)


GRAD_CLIP = 0.5  # EAGLE's training configs clip the gradient norm at 0.5
EVAL_NEW_TOKENS = 64  # answer length of the periodic real-tau check


def build_draft_net(args, target, data):
    t = target.args
    if args.draft == "eagle3":
        dargs = M.ModelArgs(model_type="llama", vocab_size=t.vocab_size, dim=t.dim, n_layer=1,
                            n_head=t.n_head,
                            n_kv_head=t.n_kv_head, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                            norm_eps=t.norm_eps, rope_theta=t.rope_theta,
                            max_position_embeddings=t.max_position_embeddings)
        size = min(args.draft_vocab, t.vocab_size)
        net = Eagle3(dargs, t.dim, size, eagle3_target_layers(t.n_layer))
        d2t, t2d = draft_vocabulary(data, t.vocab_size, size)
        net.d2t.copy_(d2t)
        net.t2d.copy_(t2d)
        with torch.no_grad():  # start the draft's head from the target's rows for its vocabulary
            net.lm_head.weight.copy_(M.dense_weight(target.lm_head)[net.draft_to_target()].float())
            net.norm.weight.copy_(target.norm.weight.float())
        return net
    # DFlash's released drafts use 5 layers for 4B-8B targets; on a small target (dim < 2048) 5
    # layers would cost nearly what the target does, so 2
    n_layer = args.draft_layers or (5 if t.dim >= 2048 else 2)
    dargs = M.ModelArgs(model_type="qwen3", vocab_size=t.vocab_size, dim=t.dim, n_layer=n_layer,
                        n_head=t.n_head,
                        n_kv_head=t.n_kv_head, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                        norm_eps=t.norm_eps, rope_theta=t.rope_theta,
                        max_position_embeddings=t.max_position_embeddings,
                        qk_norm=True)
    # the mask token: a special token the chat never uses (DFlash adds its own <|MASK|> where the
    # embedding table has spare rows; SmolLM2's has none)
    mask_id = t.vocab_size - 1
    net = DFlash(dargs, t.dim, dflash_target_layers(t.n_layer, n_layer), args.block_size, mask_id)
    with torch.no_grad():
        net.norm.weight.copy_(target.norm.weight.float())
    return net


def draft_to_train(args, target, data, device):
    """(draft, optimizer, step, log): the newest checkpoint's with --resume, else new."""
    resumed = latest_checkpoint(args.out, target) if args.resume else None
    if resumed:
        net, state, log = resumed
        print(f"resuming from step {state['step']}", file=sys.stderr)
    else:
        if args.resume:
            print(f"no complete checkpoint in {args.out}: starting fresh", file=sys.stderr)
        net, state, log = build_draft_net(args, target, data), None, []
    net = net.to(device).train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    if state is None:
        return net, opt, 0, log
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return net, opt, state["step"], log


def learning_rate(args, step: int) -> float:
    """Linear warm-up, then cosine decay to zero at args.steps."""
    warm = min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0
    return args.lr * warm * 0.5 * (1 + math.cos(math.pi * step / args.steps))


def main(argv=None):
    args = get_args(argv)
    if args.learning_curves:
        write_learning_curves(Path(args.learning_curves), args.runs, argv)
        return
    if args.export:
        export_draft(Path(args.export[0]), Path(args.export[1]), args.target, args.early_exit_threshold)
        return
    announce_defaults(args)
    device, rank, world = start_processes(args.device)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed + rank)

    # data: prompts, the target's own responses, a few held out for the real-tau check
    target, tokenizer = load_target(args.target, device, experiment_layout(device),
                                    args.max_prompt_tokens + args.response_tokens)
    target.setup_caches(args.gen_batch, args.max_prompt_tokens + args.response_tokens)
    recipe = Recipe.from_args(args)
    corpus = Corpus(*build_corpus(target, tokenizer, recipe)) if args.features == "captured" else None
    data = [corpus.sequence(i) for i in range(len(corpus))] if corpus else build_dataset(target, tokenizer, recipe)
    if args.prepare_only:
        print(json.dumps({"sequences": len(data), "tokens": sum(len(ids) for ids, *_ in data),
                          "response_tokens": sum(len(ids) - start for ids, start, _ in data)}))
        return
    if args.eval_prompts >= len(data):
        raise ValueError(f"--eval-prompts {args.eval_prompts} leaves nothing to train on: the data holds "
                         f"{len(data)} sequences")
    held_out, data = data[:args.eval_prompts], data[args.eval_prompts:]

    # model: the draft (new or resumed) and its loss; the target stays frozen beside it
    net, opt, step, log = draft_to_train(args, target, data, device)
    if args.stop_at is not None and step >= args.stop_at:
        raise ValueError(f"--stop-at {args.stop_at} lies behind the checkpoint's step {step}: nothing to train "
                         f"(a later --stop-at, or none, continues it)")
    target.setup_caches(args.batch_size, args.seq_len)  # training forwards: one batch of sequences
    model = DraftLoss(net, target, LossSettings.from_args(args), args.ttt_steps, args.blocks_per_seq)
    if world > 1:  # gradients of the draft are averaged across processes; the target is never all-reduced
        model = torch.nn.parallel.DistributedDataParallel(model)
    # the batches in the seed's order, past the `step` ones a resumed run trained: the same batches as
    # an uninterrupted run, also when it stopped mid-epoch
    stream = batch_stream(args, corpus, data, rng, step)
    train(args, model, net, target, opt, step, log, stream, tokenizer, [text for _, _, text in held_out],
          rank == 0)
    if world > 1:
        torch.distributed.destroy_process_group()


def batch_stream(args, corpus, data: list, rng: random.Random, start: int):
    """Training batches from batch `start` on: from the corpus, whole sequences of similar length, as
    many as fit batch_size * seq_len padded tokens; else fixed-size batches of the regenerated data."""
    if corpus is None:
        keep = fitting([(start, len(ids)) for ids, start, _ in data], args.seq_len)
        return batches([data[i] for i in keep], args.batch_size, args.seq_len, rng, start)
    rows = range(args.eval_prompts, len(corpus))
    train_rows = [rows[i] for i in fitting([(int(corpus.starts[r]), int(corpus.lengths[r])) for r in rows],
                                           args.seq_len)]
    epoch = len(length_groups(corpus, train_rows, args.batch_size * args.seq_len, args.seq_len))
    print(f"corpus: {len(train_rows)} training sequences, {corpus.response_tokens()} response tokens; "
          f"one epoch is {epoch} steps of up to {args.batch_size * args.seq_len} tokens", file=sys.stderr)
    return corpus_batches(corpus, train_rows, args.batch_size * args.seq_len, args.seq_len, rng, start)


def train(args, model, net, target, opt, step: int, log: list, stream, tokenizer, eval_texts: list,
          master: bool):
    """The loop from `step` to args.steps (or --stop-at, or the time budget), with the periodic real-tau check
    and checkpoints. `model` is the draft's loss (DDP-wrapped with several processes) around
    `net`. A non-finite loss stops the loop before the draft is touched or saved."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if target.embed_tokens.weight.is_cuda else nullcontext()
    t0, trained_tokens = time.time(), 0
    bar = tqdm(total=args.steps, initial=step, desc=f"{args.draft} {args.objective}", file=sys.stderr,
               disable=not master)
    end = args.stop_at or args.steps  # the learning rate still follows the schedule to args.steps
    out_of_time = False
    while step < end:
        lr = learning_rate(args, step)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            batch = next(stream)
            loss, stats = model(*[x.to(target.embed_tokens.weight.device) for x in batch])
        if not torch.isfinite(loss):  # a damaged corpus or a diverging run: stop before it spoils the draft
            raise ValueError(f"the loss is {loss.item()} at step {step + 1}; nothing after the last checkpoint "
                             f"was saved (a lower --lr, or a corpus generated again, may help)")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), GRAD_CLIP)
        opt.step()
        step += 1
        stats.update(step=step, lr=lr, seconds=time.time() - t0, response_tokens=int(batch[1].sum()))
        trained_tokens += stats["response_tokens"]
        log.append(stats)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", head_acc=f"{stats['head_acc']:.2f}",
                        sim_tau=f"{stats['sim_tau']:.2f}")
        out_of_time = args.time_budget and (time.time() - t0) / 60 > args.time_budget
        last = step == end or out_of_time
        if master and args.eval_every and (step % args.eval_every == 0 or last):
            stats["real_tau"] = evaluate_tau(net, target, tokenizer, eval_texts, args.eval_k,
                                             args.max_prompt_tokens)
            target.setup_caches(args.batch_size, args.seq_len)  # back to training batches
            tqdm.write(f"step {step}: real tau {stats['real_tau']:.2f} on {len(eval_texts)} held-out prompts",
                       file=sys.stderr)
        if master and (step % args.save_every == 0 or last):
            save_checkpoint(args.out, net, target.args, step, opt, log,
                            {"objective": args.objective, "vat_parts": args.vat_parts, "target": args.target},
                            args.keep_every)
        if out_of_time:
            tqdm.write(f"time budget of {args.time_budget} min reached at step {step}", file=sys.stderr)
            break
    if step < args.steps and not out_of_time and master:
        tqdm.write(f"stopped at step {step} of {args.steps} (--stop-at); --resume continues the schedule",
                   file=sys.stderr)
    bar.close()
    if master:  # response tokens trained on per second, evaluations included
        print(json.dumps({"out": str(args.out / "checkpoint"), "steps": step, "minutes": (time.time() - t0) / 60,
                          "response_tokens_per_s": trained_tokens / (time.time() - t0),
                          "final": log[-1] if log else None}))


# -----------------------------------------------------------------------------
# The record of finished runs: each one's learning curve, with what it trained

CURVE_FIELDS = ("step", "loss", "sim_tau", "head_acc", "weighting_changes", "real_tau")


def learning_curves(run_dirs: list) -> dict:
    """Each run's log, cut to what a learning curve needs, with the draft kind and objective its last
    checkpoint records. Real tau is in the steps that evaluated it (--eval-every)."""
    runs = {}
    for folder in map(Path, run_dirs):
        log = read_log(folder / "log.jsonl")
        if not log or not (folder / "checkpoint").is_dir():
            raise ValueError(f"{folder} holds no training log and checkpoint: not a train_vat.py --out directory")
        if folder.name in runs:  # the record is keyed by run name: a second one would overwrite the first
            raise ValueError(f"two runs named {folder.name} in --runs: give each run its own name")
        config = read_config(folder / "checkpoint")
        trained = config.get("vat", {})
        if trained.get("objective") == "baseline":  # checkpoints once recorded every part for it
            trained = {**trained, "vat_parts": []}
        runs[folder.name] = {"draft": draft_kind(config), **trained,
                             "curve": [{k: s[k] for k in CURVE_FIELDS if k in s} for s in log]}
    return runs


def write_learning_curves(out: Path, run_dirs: list, argv=None):
    from results import machine_stamp, write_results  # the one home of results files and their stamp
    command = "python train_vat.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    runs = learning_curves(run_dirs)
    write_results(out, {"command": command, "machine": machine_stamp("cpu"), "runs": runs})
    for name, run in runs.items():
        evaluated = [s for s in run["curve"] if "real_tau" in s]
        print(f"{name}: {run['draft']} {run['objective']}, {run['curve'][-1]['step']} steps, real tau "
              + " ".join(f"{s['real_tau']:.2f}@{s['step']}" for s in evaluated))


def export_draft(checkpoint: Path, out: Path, target_name: str, early_exit_threshold: float | None):
    """A training checkpoint as a draft to ship: the network in bf16 (half the bytes; training keeps
    fp32 for its optimizer), what it was trained with, and the early-exit threshold chosen for it."""
    target = load_model(resolve_model(target_name), dtype=torch.bfloat16)  # checks the draft matches it
    kind, net = load_draft(checkpoint, target)
    extra = {"vat": read_config(checkpoint).get("vat", {})}
    if early_exit_threshold is not None:
        extra["early_exit_threshold"] = early_exit_threshold
    save_draft(net, out, target.args, extra)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"{kind} draft from {checkpoint} written to {out} (bf16, {size:.1f} MB)")


class DraftLoss(torch.nn.Module):
    """The draft and its training loss as one module, so DDP sees the forward it must sync.
    The target is held outside the module's parameters: frozen, and never all-reduced."""

    def __init__(self, net, target, settings: LossSettings, ttt_steps: int, blocks_per_seq: int):
        super().__init__()
        self.net, self.frozen, self.settings = net, [target], settings
        self.ttt_steps, self.blocks_per_seq = ttt_steps, blocks_per_seq

    def forward(self, *batch):
        if isinstance(self.net, Eagle3):
            return eagle3_loss(self.net, self.frozen[0], batch, self.settings, self.ttt_steps)
        return dflash_loss(self.net, self.frozen[0], batch, self.settings, self.blocks_per_seq)



if __name__ == "__main__":
    try:
        main()
    except (M.CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
