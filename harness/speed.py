"""
Timed runs: drafts and verifiers (and peers) decoding the same prompts, interleaved prompt by
prompt so that drift of the machine falls on every run alike, and what their records say: speedup
over plain decoding at the same temperature, tau, acceptance by position, whether an exact run
emitted plain decoding's tokens; and the records as results files keep them. bench.py and
experiments/report.py time with these.

A run's draft is named as bench.py's --drafts take it: a draft as decode.py's --draft takes it,
with suffixes @ee or @ee0.2 (early exit), @conf (the exit reads the draft's confidence, not its
head), @treeN (trees of N tokens) and @adapt (decode.py's --adaptive).
"""
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine.checkpoints import build_draft
from engine.training_runs import checkpoint_step
from engine.machine import peak_memory_mb, reset_peak_memory, wall_clock
from harness.peers import hf_peer, llama_cpp_peer
from speculative import adaptive, generate
from harness.stats import paired_ratio, quartiles
from verify import VERIFIERS, Verifier
from engine.weights import DEFAULT_TARGET, resolve_model

SUFFIX = re.compile(r"@(ee|conf|tree|adapt)([^@]*)")


def parse_spec(spec: str) -> tuple:
    """A --drafts entry -> (draft as decode.py's --draft takes it, early exit, tree budget, adaptive,
    exit signal). Suffixes come in any order, each at most once: @ee (the draft's recorded
    threshold, 'auto') or @ee0.2; @conf (the early exit reads the draft's confidence, not its head:
    decode.py --early-exit-signal confidence); @treeN (trees of N tokens, decode.py --tree N);
    @adapt (decode.py --adaptive). A suffix that is unknown, repeated, out of range or does not
    apply is a one-line error."""
    base, _, _ = spec.partition("@")
    rest = spec[len(base):]
    found = SUFFIX.findall(rest)
    if "".join(f"@{name}{value}" for name, value in found) != rest:
        raise ValueError(f"{spec}: suffixes are @ee, @ee<threshold>, @conf, @tree<N> and @adapt")
    names = [name for name, _ in found]
    if len(set(names)) < len(names):
        raise ValueError(f"{spec}: each suffix at most once")
    values = dict(found)
    early_exit = tree = None
    if "ee" in values:
        if values["ee"]:
            try:
                early_exit = float(values["ee"])
            except ValueError:
                early_exit = float("nan")
            if not 0 <= early_exit <= 1:
                raise ValueError(f"{spec}: @ee takes a threshold in [0, 1], got {values['ee']!r}")
        else:
            early_exit = "auto"
        if base == "lookup":
            raise ValueError(f"{spec}: early exit needs a draft with a verification head (EAGLE-3, DFlash), "
                             f"not prompt lookup")
    if "tree" in values:
        if not values["tree"].isdigit() or int(values["tree"]) < 1:
            raise ValueError(f"{spec}: @tree takes a number of draft tokens >= 1, as in lookup@tree16")
        tree = int(values["tree"])
    for flag in ("adapt", "conf"):
        if values.get(flag):
            raise ValueError(f"{spec}: @{flag} takes no value")
    if "conf" in values and early_exit is None:
        raise ValueError(f"{spec}: @conf says what early exit reads; it needs @ee or @ee<threshold> too")
    return base, early_exit, tree or 0, "adapt" in values, "confidence" if "conf" in values else "head"


def draft_label(spec: str) -> str:
    base, early_exit, tree, adapt, signal = parse_spec(spec)
    hybrid = base.startswith("lookup+")
    path = Path(base.removeprefix("lookup+").split(":", 1)[-1])
    name = base if base == "lookup" else (path.parent.name if path.name == "checkpoint" else path.name)
    if checkpoint_step(path) is not None:  # a kept checkpoint of a run (train_vat --keep-every)
        name = f"{path.parent.name}@{checkpoint_step(path)}"
    name = ("lookup+" if hybrid else "") + name
    if early_exit is not None:
        name += " +early-exit" + (" by confidence" if signal == "confidence" else "") + \
            ("" if early_exit == "auto" else f" {early_exit:g}")
    name += f" tree{tree}" if tree else ""
    return name + (" +adaptive" if adapt else "")


def make_draft(spec, target, tokenizer, temperature, generator):
    """A --drafts entry (parse_spec) as a draft, before adapt_draft; the run's tree budget is
    parse_spec's too."""
    base, early_exit, tree, adapt, signal = parse_spec(spec)
    return build_draft(base, target, tokenizer, temperature=temperature, generator=generator,
                       early_exit=early_exit, exit_signal=signal)


def adapt_draft(spec, draft, block_costs: tuple, temperature, device: str):
    """The draft of a --drafts entry with @adapt, its length chosen by block_costs (what the run's
    target forwards cost: engine.layouts.run_block_costs, or a compiled target's block_costs)."""
    _, _, tree, adapt, _ = parse_spec(spec)
    return adaptive(draft, block_costs, tree, temperature, wall_clock(device)) if adapt else draft


@dataclass
class Run:
    """One configuration of the speed table: ours (a draft and a verifier, or plain decoding when
    draft is None) or a peer (a function of the prompt ids). Its speedup divides by the run named
    'baseline T=...' at its temperature, prompt by prompt (summarize)."""
    name: str
    temperature: float
    target: object = None  # the model this run decodes with (runs of one table may differ in weights)
    draft: object = None
    verifier: Verifier | None = None  # None: the exact rule for the temperature (speculative.exact_verifier)
    peer: object = None
    tree: int = 0  # draft trees of this many nodes (0: chains)


def emit(run: Run, ids: list, k: int, max_new_tokens: int, stop_ids, generator, step_fn=None, clock=None) -> dict:
    """One run on one prompt: what it emitted and its statistics, with its rate over the whole
    call (prompt included), the one rate ours and transformers' generate share. Plain decoding
    (no draft) and a run without a verifier take the exact rule for their temperature."""
    if run.peer is not None:
        r = run.peer(ids, max_new_tokens, run.temperature, stop_ids)
    else:
        clock = clock or wall_clock(run.target.embed_tokens.weight.device.type)  # (a timed run, always)
        # a tree's shape changes every step: trees run eager, never through one static compiled graph
        r = generate(run.target, ids, run.draft, run.verifier, k=k if run.draft else 0,
                     max_new_tokens=max_new_tokens, temperature=run.temperature, stop_ids=stop_ids,
                     generator=generator, step_fn=None if run.tree else step_fn, tree=run.tree, clock=clock)
    return {**r, "wall_tokens_per_s": r["new_tokens"] / max(r["seconds"], 1e-9)}


def interleave(runs: list, prompts: list, k: int, max_new_tokens: int, stop_ids, generator, device: str,
               warmup: int = 1, step_fn=None, desc: str = "speed runs (prompts)") -> dict:
    """Every run on each prompt before the next prompt (A B C A B C ...), after `warmup` prompts
    run untimed, so that drift of the machine falls on all runs alike. prompts: [(category, ids)].
    Returns {run name: [one result per prompt]}."""
    def timed(run: Run, ids):
        reset_peak_memory(device)
        r = emit(run, ids, k, max_new_tokens, stop_ids, generator, step_fn, wall_clock(device))
        return {**r, "peak_memory_mb": peak_memory_mb(device)}

    for _, ids in prompts[:warmup]:
        for run in runs:
            timed(run, ids)
    records = {run.name: [] for run in runs}
    for i, (category, ids) in enumerate(tqdm(prompts, desc=desc, file=sys.stderr)):
        for run in runs:
            records[run.name].append({**timed(run, ids), "prompt": i, "category": category})
    return records


def peer_runs(target_name: str, temperature: float, k: int, transformers: bool = True) -> list:
    """transformers' generate and assisted lookup on the same weights (unless transformers is
    False); llama.cpp on the same GGUF file when the target is the embedded default and
    llama-cpp-python is installed."""
    target_dir = resolve_model(target_name)
    runs = [Run(f"{label} T={temperature:g}", temperature, peer=hf_peer(target_dir, kind, k))
            for kind, label in (("generate", "transformers generate"), ("assisted", "transformers assisted lookup"))
            if transformers]
    if target_name != DEFAULT_TARGET:
        return runs
    try:
        runs += [Run(f"{label} T={temperature:g}", temperature, peer=llama_cpp_peer(kind, k))
                 for kind, label in (("plain", "llama.cpp"), ("lookup", "llama.cpp prompt lookup"))]
    except ImportError:
        print("note: llama.cpp is left out: pip install llama-cpp-python (README: how to build it)", file=sys.stderr)
    return runs


def summarize(records: dict, temperatures: dict, calibrations: dict | None = None) -> dict:
    """Per run: median tokens/s and speedup over the plain baseline at its temperature (the run
    named 'baseline T=...') with IQRs, tau overall and per category, acceptance by draft
    position, draft time, memory; the verification head's calibration where given."""
    summary = {}
    for name, rs in records.items():
        base = records[f"baseline T={temperatures[name]:g}"]
        # rates over the whole call, prompt included: the one both ours and a peer's generate give
        lo, med, hi = quartiles([r["wall_tokens_per_s"] / b["wall_tokens_per_s"] for r, b in zip(rs, base)])
        tps = quartiles([r["wall_tokens_per_s"] for r in rs])
        decoding = [r["tokens_per_s"] for r in rs if r["tokens_per_s"] is not None]
        ratios = {}
        for r, b in zip(rs, base):
            ratios.setdefault(r["category"], []).append(r["wall_tokens_per_s"] / b["wall_tokens_per_s"])
        ours = [r for r in rs if r["target_forwards"]]  # the peers count no forwards
        per_category = {}
        for r in ours:
            c = per_category.setdefault(r["category"], [0, 0])
            c[0], c[1] = c[0] + r["new_tokens"], c[1] + r["target_forwards"]
        k = max((len(r["accepted_per_position"]) for r in rs), default=0)
        summary[name] = {
            "temperature": temperatures[name],
            "tokens_per_s_median": tps[1], "tokens_per_s_iqr": [tps[0], tps[2]],
            # ours only: new tokens over the time after the prompt's prefill
            "decode_tokens_per_s_median": statistics.median(decoding) if decoding else None,
            "speedup_median": med, "speedup_iqr": [lo, hi],
            "tau": (sum(r["new_tokens"] for r in ours) / sum(r["target_forwards"] for r in ours)) if ours
            else None,
            "tau_per_category": {c: n / f for c, (n, f) in per_category.items()},
            "speedup_median_per_category": {c: statistics.median(v) for c, v in ratios.items()},
            "acceptance_per_position": [statistics.mean(r["accepted_per_position"][i] for r in rs
                                                        if len(r["accepted_per_position"]) > i)
                                        for i in range(k)],
            "draft_time_fraction": sum(r["draft_seconds"] for r in rs) / sum(r["seconds"] for r in rs),
            "drafted_tokens": sum(r["drafted_tokens"] for r in rs),
            "declined_tokens": sum(r["declined_tokens"] for r in rs),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in rs),
            "new_tokens": sum(r["new_tokens"] for r in rs),
            "target_forwards": sum(r["target_forwards"] or 0 for r in rs),
            # at T = 0 an exact run of ours emits the baseline's tokens on every prompt
            "prompts_with_the_baseline_tokens": sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base)),
        }
        if name in (calibrations or {}):
            summary[name]["head_calibration"] = calibrations[name]
    return summary


def records_for_file(records: dict, temperatures: dict) -> dict:
    """The per-prompt records as a results file keeps them: per run, a column per field ({field:
    [its value on each prompt]}), and where a run's tokens are its baseline's on a prompt (an exact
    run at T = 0) tokens_as_baseline says so and tokens holds null there, not a repeat."""
    out = {}
    for name, rs in records.items():
        base = records.get(f"baseline T={temperatures[name]:g}")
        same = [] if base is None or base is rs else \
            [r.get("tokens") is not None and r.get("tokens") == b.get("tokens") for r, b in zip(rs, base)]
        if any(same):
            rs = [{**r, "tokens": None, "tokens_as_baseline": s} if s else {**r, "tokens_as_baseline": False}
                  for r, s in zip(rs, same)]
        fields = list(dict.fromkeys(k for r in rs for k in r))
        out[name] = {k: [r.get(k) for r in rs] for k in fields}
    return out


def records_from_file(runs: dict) -> dict:
    """A results file's runs back as records_for_file's input: {run: [one dict per prompt]}, the
    baseline's tokens filled in where a run's were its baseline's."""
    records = {name: [dict(zip(columns, row)) for row in zip(*columns.values())] for name, columns in runs.items()}
    for name, rs in records.items():
        base = records.get("baseline T=" + name.rsplit("T=", 1)[-1], [])
        for r, b in zip(rs, base):
            if r.get("tokens_as_baseline"):
                r["tokens"] = b["tokens"]
    return records


def paired_runs(paired: list, records: dict) -> dict:
    """Each pair [A, B] of drafts: A's runs against B's, verifier by verifier and temperature by
    temperature (a run is named '<draft label> <verifier> T=<t>')."""
    pairs = {}
    for a, b in ([draft_label(d) for d in pair] for pair in paired):
        for name in records:  # A's run with a verifier and temperature, and B's with the same ones
            rest = name[len(a) + 1:].split(" ")
            exactly_a = name.startswith(a + " ") and len(rest) == 2 and rest[0] in VERIFIERS and rest[1].startswith("T=")
            twin = f"{b} {' '.join(rest)}"
            if exactly_a and twin in records:
                pairs[f"{name} vs {b}"] = paired_ratio(records[name], records[twin])
    return pairs
