"""
The end-to-end benchmark: what each draft and verifier buys in acceptance length (tau) and
wall-clock speed over plain autoregressive decoding, measured side by side in one run.

Runs are interleaved prompt by prompt (A B C A B C ...) after a warm-up, so that machine drift
cancels in the ratios; every speedup is the median over prompts of (tokens/s of the run) /
(tokens/s of the baseline on the same prompt), with its interquartile range.

    python bench.py --quick                                   # a smoke test: 2 prompts, few tokens
    python bench.py --limit 5 --drafts lookup --verifiers greedy --temperatures 0
    python bench.py --prompt-file my.jsonl --peers            # add transformers' generate

Writes a markdown table to stdout, every raw number and the configuration to --out (JSON), and
ends stdout with one JSON line of headline figures.
"""
import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import model as M
from decode import build_draft, default_device, generate, load_target, prompt_text
from verify import VERIFIERS, Verifier

ROOT = Path(__file__).resolve().parent
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"


def load_prompts(path: Path, categories, limit: int | None) -> list:
    """[(category, text)] from a Spec-Bench-like jsonl; `limit` prompts per category."""
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (pass --prompt-file)")
    out, per_category = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        category = record.get("category", "all")
        if categories and category not in categories:
            continue
        if limit is not None and per_category.get(category, 0) >= limit:
            continue
        per_category[category] = per_category.get(category, 0) + 1
        out.append((category, prompt_text(record)))
    if not out:
        raise ValueError(f"no prompts selected from {path}")
    return out


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def hf_peer(target_dir, kind: str, k: int):
    """transformers' generate (kind='generate') or its prompt-lookup assisted generation, on the same weights."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def run(ids, max_new_tokens, temperature, stop_ids):
        x = torch.tensor([ids])
        extra = dict(prompt_lookup_num_tokens=k) if kind == "assisted" else {}
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        t0 = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(stop_ids), pad_token_id=sorted(stop_ids)[0], **sampling, **extra)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return {"tokens": new, "new_tokens": len(new), "seconds": seconds, "tokens_per_s": len(new) / seconds,
                "tau": None, "target_forwards": None, "draft_seconds": 0.0, "accepted_per_position": []}
    return run


def get_args(argv=None):
    ap = argparse.ArgumentParser(description="Speculative decoding benchmark, runs interleaved side by side.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--target", default=M.DEFAULT_TARGET)
    ap.add_argument("--drafts", default="lookup",
                    help="comma-separated drafts: lookup, a model name/path (independent draft)")
    ap.add_argument("--verifiers", default="greedy,lossless",
                    help=f"comma-separated, from {','.join(VERIFIERS)}; greedy runs only at T=0")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    ap.add_argument("--prompt-file", default=str(SPEC_BENCH), help="Spec-Bench-style jsonl (or any supported jsonl)")
    ap.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each configuration first")
    ap.add_argument("--peers", action="store_true", help="also run transformers' generate and assisted lookup")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 16 tokens, T=0 and 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--out", default=None, help="JSON results path (default: results/bench-<time>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.max_new_tokens, args.warmup = 1, 16, 0
        args.categories = args.categories or "writing,translation"
    if args.num_draft_tokens < 1 or args.max_new_tokens < 1 or args.limit < 1:
        ap.error("-k, --max-new-tokens and --limit must be >= 1")
    return args


def main(argv=None):
    args = get_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    temperatures = [float(t) for t in args.temperatures.split(",")]
    verifier_names = args.verifiers.split(",")
    for name in verifier_names:
        Verifier(name)  # unknown names fail before anything loads
    prompts = load_prompts(Path(args.prompt_file), args.categories and args.categories.split(","), args.limit)
    target, tokenizer = load_target(args.target, args.device, dtype, 4096)
    stop_ids = tokenizer.stop_ids
    generator = torch.Generator(device=args.device).manual_seed(args.seed)

    # every configuration: a name and a function (prompt ids, temperature) -> result dict
    configs = {}
    for temperature in temperatures:
        configs[f"baseline T={temperature:g}"] = (temperature, None, None)
        for draft_spec in args.drafts.split(","):
            ns = argparse.Namespace(temperature=temperature, top_p=1.0, pack=True)
            draft = build_draft(draft_spec, target, tokenizer, ns, args.device, dtype, generator)
            for name in verifier_names:
                if name == "greedy" and temperature > 0:
                    continue
                configs[f"{draft_spec}+{name} T={temperature:g}"] = (temperature, draft, Verifier(name))
    peers = {}
    if args.peers:
        target_dir = M.resolve_model(args.target)
        peers = {"transformers generate": hf_peer(target_dir, "generate", args.num_draft_tokens),
                 "transformers assisted lookup": hf_peer(target_dir, "assisted", args.num_draft_tokens)}

    def run(name, ids):
        if name in peers:
            return peers[name](ids, args.max_new_tokens, temperature_of[name], stop_ids)
        temperature, draft, verifier = configs[name]
        return generate(target, ids, draft, verifier or Verifier("greedy"),
                        args.num_draft_tokens if draft else 0, args.max_new_tokens, temperature, 1.0,
                        stop_ids, generator)

    temperature_of = {name: c[0] for name, c in configs.items()}
    for name in peers:
        for temperature in temperatures:
            temperature_of[f"{name} T={temperature:g}"] = temperature
    peers = {f"{name} T={t:g}": fn for name, fn in peers.items() for t in temperatures}
    names = list(configs) + list(peers)

    encoded = [(category, tokenizer.encode_chat([{"role": "user", "content": text}])) for category, text in prompts]
    for _, ids in encoded[:1] * args.warmup:
        for name in names:
            run(name, ids)
    records = {name: [] for name in names}
    for i, (category, ids) in enumerate(tqdm(encoded, desc="prompts", file=sys.stderr)):
        for name in names:  # interleaved: every configuration on this prompt before the next prompt
            r = run(name, ids)
            r.update(prompt=i, category=category)
            records[name].append(r)

    # aggregate
    summary = {}
    for name in names:
        rs = records[name]
        base = records[f"baseline T={temperature_of[name]:g}"]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base)]
        lo, med, hi = quartiles(ratios)
        tps = quartiles([r["tokens_per_s"] for r in rs])
        forwards = [r["target_forwards"] for r in rs if r["target_forwards"]]
        per_category = {}
        for r in rs:
            if r["target_forwards"]:
                c = per_category.setdefault(r["category"], [0, 0])
                c[0] += r["new_tokens"]
                c[1] += r["target_forwards"]
        k = max((len(r["accepted_per_position"]) for r in rs), default=0)
        summary[name] = {
            "tokens_per_s_median": tps[1], "tokens_per_s_iqr": [tps[0], tps[2]],
            "speedup_median": med, "speedup_iqr": [lo, hi],
            "tau": sum(r["new_tokens"] for r in rs) / sum(forwards) if forwards else None,
            "tau_per_category": {c: n / f for c, (n, f) in per_category.items()},
            "acceptance_per_position": [statistics.mean(r["accepted_per_position"][i] for r in rs
                                                        if len(r["accepted_per_position"]) > i) for i in range(k)],
            "draft_time_fraction": sum(r["draft_seconds"] for r in rs) / sum(r["seconds"] for r in rs),
            "new_tokens": sum(r["new_tokens"] for r in rs),
        }

    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens max, k={args.num_draft_tokens}, "
          f"{args.target} on {args.device} ({torch.get_num_threads()} threads)\n")
    print("| run | tau | tokens/s (median) | speedup (median, IQR) | draft time |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        tau = f"{s['tau']:.2f}" if s["tau"] else "-"
        print(f"| {name} | {tau} | {s['tokens_per_s_median']:.1f} | {s['speedup_median']:.2f}x "
              f"({s['speedup_iqr'][0]:.2f}-{s['speedup_iqr'][1]:.2f}) | {100 * s['draft_time_fraction']:.0f}% |")

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {
        "config": {**vars(args), "git_commit": commit, "torch": torch.__version__, "device": args.device,
                   "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
        "summary": summary,
        "runs": {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for name, rs in records.items()},
    }
    out = Path(args.out or ROOT / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)  # never a half-written results file
    speedups = {n: s["speedup_median"] for n, s in summary.items() if not n.startswith("baseline")}
    best = max(speedups, key=speedups.get) if speedups else None
    print(json.dumps({"results": str(out), "best": best, "best_speedup": speedups.get(best),
                      "baseline_tokens_per_s": {n: s["tokens_per_s_median"] for n, s in summary.items()
                                                if n.startswith("baseline")},
                      "tau": {n: s["tau"] for n, s in summary.items() if s["tau"]}}))


if __name__ == "__main__":
    try:
        main()
    except (M.CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
