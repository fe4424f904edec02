"""
Whether torch.compile makes an EAGLE-3 draft's training step faster on this machine, and whether
it trains the same numbers (train_vat.py --compile on against --compile off). One step is what train_vat.py runs on a CPU by default: a batch of
captured features (batch 4 x 320 tokens, its corpus's default), the training-time test of 7 steps
(eagle3.eagle3_chains), the loss (objectives.DraftLoss), backward and an AdamW step. Compiled, the
training-time test is one graph (dynamic shapes: a corpus's batches differ in length and in how
many chains carry loss); the loss's statistics read values to the host and stay eager.

    python experiments/train_compile.py --out docs/train-compile/train-compile.json

Run it with nothing else busy. Eager and compiled steps alternate, each on a copy of one draft
fed the same batches, so drift of the machine falls on both; the losses of the two copies are
recorded step by step.
"""
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the core modules, one folder up

import torch

from engine import linear_forms as LF
from engine.checkpoints import draft_dir_problem, load_draft
from engine.layouts import experiment_layout, load_target
from engine.machine import ArgumentParser, pick_threads, run_script
from engine.weights import DEFAULT_TARGET, resolve_model
from harness.results import machine_stamp, unwritable, write_results
from objectives import DraftLoss, LossSettings


def get_args(argv=None):
    ap = ArgumentParser(description="Whether compiling a draft's training step pays here.")
    ap.add_argument("--draft", default="drafts/smollm2-135m-eagle3-chat", help="an EAGLE-3 draft's directory")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each (after two warm-up steps)")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args(argv)
    if args.steps < 3 or args.batch_size < 1 or not 16 <= args.seq_len <= 4096:
        ap.error("--steps must be >= 3, --batch-size >= 1 and --seq-len from 16 to 4096")
    problem = draft_dir_problem(args.draft, "eagle3")  # (the training-time test compiled is EAGLE-3's)
    if problem:
        ap.error(f"--draft {problem}")
    problem = unwritable(args.out)
    if problem:
        ap.error(problem)
    return args


def captured_batch(target, layers: tuple, B: int, T: int, generator) -> tuple:
    """A batch as a captured corpus gives one: tokens (B, T), the response mask (B, T), the
    features of `layers` (B, T, 3 * dim), the final-normed states (B, T, dim), their logsumexp and
    top token (B, T). Lengths and response starts vary from batch to batch, as a corpus's do."""
    dim, vocab = target.args.dim, target.args.vocab_size
    T = int(torch.randint(T // 2, T + 1, (), generator=generator))
    tokens = torch.randint(vocab, (B, T), generator=generator)
    starts = torch.randint(T // 8, T // 2, (B, 1), generator=generator)
    response = (torch.arange(T) >= starts).to(torch.uint8)
    features = torch.randn(B, T, len(layers) * dim, generator=generator)
    final = torch.randn(B, T, dim, generator=generator)
    with torch.no_grad():
        logits = final @ LF.dense_weight(target.lm_head).float().t()  # (B, T, V)
    return tokens, response, features, final, logits.logsumexp(-1), logits.argmax(-1)


def main(argv=None):
    args = get_args(argv)
    torch.set_num_threads(pick_threads("auto"))
    target, _, _ = load_target(str(resolve_model(DEFAULT_TARGET)), "cpu", experiment_layout("cpu"), args.seq_len)
    _, net = load_draft(resolve_model(args.draft), target, dtype=torch.float32)
    layers = net.target_layers
    head_weight = LF.dense_weight(target.lm_head)
    generator = torch.Generator().manual_seed(0)
    batches = [captured_batch(target, layers, args.batch_size, args.seq_len, generator)
               for _ in range(args.steps + 2)]
    runs = {}
    for name in ("eager", "compiled"):  # (compiled as train_vat.py --compile on compiles it)
        trained = copy.deepcopy(net).train()
        runs[name] = {"loss": DraftLoss(trained, target, LossSettings(), 7, 4, head_weight=head_weight,
                                        captured_layers=layers, compiled=name == "compiled"),
                      "opt": torch.optim.AdamW(trained.parameters(), lr=1e-4, betas=(0.9, 0.95)),
                      "seconds": [], "losses": []}

    def train_step(run, batch) -> tuple:
        t0 = time.perf_counter()
        loss, stats = run["loss"](*batch)
        run["opt"].zero_grad(set_to_none=True)
        loss.backward()
        run["opt"].step()
        return time.perf_counter() - t0, stats["loss"]

    first_seconds = {}
    for i, batch in enumerate(batches):
        for name, run in runs.items():  # alternated: drift falls on both
            seconds, loss = train_step(run, batch)
            if i < 2:
                first_seconds.setdefault(name, []).append(seconds)
                continue
            run["seconds"].append(seconds)
            run["losses"].append(loss)
        print(f"step {i + 1}/{len(batches)}: " + ", ".join(
            f"{name} {run['losses'][-1] if run['losses'] else float('nan'):.4f}" for name, run in runs.items()),
            file=sys.stderr)
    eager_s, compiled_s = (statistics.median(runs[n]["seconds"]) for n in ("eager", "compiled"))
    differences = [abs(a - b) / abs(a) for a, b in zip(runs["eager"]["losses"], runs["compiled"]["losses"])]
    result = {"machine": machine_stamp("cpu"),
              "config": {"target": DEFAULT_TARGET, "layout": experiment_layout("cpu"), "draft": args.draft,
                         "batch_size": args.batch_size, "max_seq_len": args.seq_len, "ttt_steps": 7,
                         "timed_steps": args.steps},
              "step_seconds": {"eager": eager_s, "compiled": compiled_s},
              "first_two_steps_seconds": first_seconds,
              "compiled_over_eager_speed": eager_s / compiled_s,
              # what dynamo compiled: graphs, and the breaks that split them
              "dynamo": {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                         "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values())},
              "losses": {name: run["losses"] for name, run in runs.items()},
              "largest_relative_loss_difference": max(differences)}
    out = write_results(args.out, result)
    print(f"training step: eager {eager_s:.3f} s, compiled {compiled_s:.3f} s ({eager_s / compiled_s:.2f}x); "
          f"first two compiled steps {sum(first_seconds['compiled']):.0f} s; losses differ by at most "
          f"{max(differences):.1e} (relative)")
    print(f"results: {out}")


if __name__ == "__main__":
    run_script(main, "interrupted: nothing written (the results are written once every timing is done)")
