"""
A target ready to run on this machine: its weight layout, threads and compilation.

A run has one model. `--dtype auto` picks one weight layout per CPU, torch version and model,
and every forward of the run uses it: plain one-token steps, verification blocks, trees
and the prefill. So greedy speculation emits plain decoding's tokens bit for bit, and a run that
drafts can always fall back to the plain step at the plain step's speed.

The choice is made by measurement on probes (the target's first four layers with its real
embedding and head, and the same with no layers, built in each candidate layout; never a copy of
the whole model): a forward is estimated as head + n_layer * (one layer). auto takes the fastest
one-token step, the speed a speculative run falls back to where drafting does not pay
(draft.AdaptiveDraft). Where that layout's blocks do not give the bits of one-token steps here, the
choice says so (inexact) and decode.py's default decodes plainly. The same probes time blocks of
1..16 tokens: the table AdaptiveDraft weighs a block's cost against its expected tokens with.

Decisions are kept (engine/timing_cache.py) whole and only when no other process kept a core busy while
they were timed and their repeats agreed, keyed by the step code's digest too: new step code is
timed anew, a new comment not. A kept choice stands until a trusted timing replaces it; where none
was ever kept, a fixed order decides (FIXED_ORDER), so what a run prints never depends on how busy
the machine was when it started. A kept timing that no forward could give is timed again.

Whatever the layout, a CPU run keeps its KV cache in fp32 (model.KVCache): torch's CPU attention
for one query is several times slower in bf16 than in fp32, and at a long context attention is
most of a step.
"""
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine import linear_forms as LF
import model as M
from engine.machine import machine_is_quiet, machine_problem
from engine.rows_apart import attend_rows_apart, rows_attend_apart
from engine import timing_cache as TC
from engine.timing_cache import (BLOCKS, LONG_CONTEXT, agree, cache_key, impossible_blocks, impossible_choice, keep,
                                 kept_entry, note_once, read_cache, write_cache)
from tokenizer import load_tokenizer
from engine.weights import check_checkpoint, load_model, read_config, resolve_model

# -----------------------------------------------------------------------------
# The layouts

# "-packed": oneDNN's blocked layout (linear_forms.PackedLinear). Coarse layouts (bf16, int8, int4) attend
# verification blocks row by row, so greedy speculation stays exact (model.py). int8 and int4 change the
# model (README: their cost in quality) and are opt-in, except int4 for --dtype auto where the weights
# are 4-bit codes in groups of 32 at their source (the embedded GGUF): there only the scales round.
LAYOUTS = ("float32-packed", "float32", "bfloat16-packed", "bfloat16", "float16", "int8", "int4")
# (tests point it elsewhere, so that their tiny models leave no entries in a user's cache)
PROBE_LAYERS = 4


def layout_dtype(layout: str) -> torch.dtype:
    """The dtype a model is loaded in before `layout` is applied (int8 and int4 quantize from fp32)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(layout.removesuffix("-packed"), torch.float32)


def apply_layout(model: M.Transformer, layout: str, device: str) -> M.Transformer:
    """Put a model just loaded in layout_dtype(layout) into `layout` (in place)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if layout == "int8":
        LF.quantize_int8(model)
    elif layout == "int4":
        LF.quantize_int4(model)  # from the fp32 weights, then the rest in bf16
    elif layout.endswith("-packed"):
        LF.pack_for_cpu(model)
    if layout in ("int8", "int4") or layout.startswith("bfloat16") and device == "cpu":
        attend_rows_apart(model)  # coarse activations: blocks must give the bits of one-token steps
    return model


def layout_of(model: M.Transformer) -> str:
    """The layout a model runs in (one of LAYOUTS), read off the form of its decoder Linears."""
    linear = model.layers[0].mlp.down_proj
    if isinstance(linear, (LF.Int4Linear, LF.Int8Linear)):
        return "int4" if isinstance(linear, LF.Int4Linear) else "int8"
    dtype = str(linear.weight.dtype).removeprefix("torch.")
    return f"{dtype}-packed" if isinstance(linear, LF.PackedLinear) else dtype


def build_target(path: Path, layout: str, device: str, max_seq_len: int, n_layer: int | None = None,
                 vocab: int | None = None):
    """The model at `path` in `layout` (for a probe: its first n_layer layers only, its first
    `vocab` tokens only), caches allocated, ready for inference."""
    return_freed_weights()
    target = apply_layout(load_model(path, layout_dtype(layout), device, n_layer, vocab), layout, device)
    target.setup_caches(1, min(max_seq_len, target.args.max_position_embeddings))  # in the final dtype
    return target


def int4_fits(config: dict) -> bool:
    """Whether the int4 kernel can take the model's matmuls: inputs in whole groups of 32 and
    outputs in multiples of 16 (torch's packing), for the layers' widths."""
    dim, hidden = config.get("hidden_size", 0), config.get("intermediate_size", 0)
    heads, kv = config.get("num_attention_heads", 1), config.get("num_key_value_heads") or config.get(
        "num_attention_heads", 1)
    head_dim = config.get("head_dim") or dim // max(heads, 1)
    return all(isinstance(v, int) and v > 0 for v in (dim, hidden)) and dim % LF.INT4_GROUP == 0 and \
        hidden % LF.INT4_GROUP == 0 and (heads * head_dim) % LF.INT4_GROUP == 0 and (heads + 2 * kv) * head_dim % 16 == 0


def layout_candidates(path: Path) -> list:
    """The layouts --dtype auto times on this CPU: fp32 and, where oneDNN has bf16 kernels here,
    bf16, each packed and not; int4 where the weights are 4-bit at their source."""
    candidates = ["float32-packed", "float32"]
    if LF.packable(torch.bfloat16):
        candidates += ["bfloat16-packed", "bfloat16"]
        config = read_config(path)
        if config.get("source_quantization", {}).get("group_size") == LF.INT4_GROUP and int4_fits(config):
            candidates.append("int4")
    return candidates


def layout_problem(path: Path, layout: str) -> str | None:
    """Why the model at `path` cannot run in `layout`, or None."""
    config = read_config(path) if layout == "int4" else {}
    if config and not int4_fits(config):
        return (f"--dtype int4 needs layer widths in multiples of {LF.INT4_GROUP} (the model at {path} has "
                f"hidden_size {config.get('hidden_size')}, intermediate_size {config.get('intermediate_size')}): "
                f"use another --dtype")
    return None


# -----------------------------------------------------------------------------
# Timing

def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs), or 64 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
    return max(sizes, default=64 << 20)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a model holds, its CPU forms' packed weights included (a tied weight
    once)."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(v for v in vars(module).values() if torch.is_tensor(v))]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def step_seconds(target: M.Transformer, block: int, seconds: float = 0.3, cold: bool = False,
                 context: int = 64) -> float:
    """Median wall time of a forward of `block` new tokens after a `context`-token one (rewritten in
    place each time, as a rejected speculative block is), over about `seconds` of steps. cold:
    read a buffer four times the CPU's largest cache before each forward, so a small model's
    weights come from memory as a whole model's do (a probe's few layers would otherwise stay in
    cache between steps, and the layouts that read the most bytes would look cheap). A model twice
    the cache's size or more cannot stay in it: it is timed without the buffer, which would only
    add to the process's peak memory."""
    context = min(context, target.max_seq_len - block)
    tokens = torch.randint(0, target.args.vocab_size, (1, context + block))
    positions = torch.arange(context + block)
    cache_bytes = last_level_cache_bytes()
    flush = torch.ones(min(4 * cache_bytes, 1 << 30) // 4) if cold and held_bytes(target) < 2 * cache_bytes else None
    with torch.no_grad():
        target(tokens[:, :context], positions[:context])
        for _ in range(2):  # first calls allocate and pick kernels
            target(tokens[:, context:], positions[context:])
        times, spent = [], time.perf_counter()
        while len(times) < 5 or (time.perf_counter() - spent < seconds and len(times) < 50):
            if flush is not None:
                flush.sum()
            start = time.perf_counter()
            target(tokens[:, context:], positions[context:])
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def attention_ms_per_key(probe: M.Transformer, n_layer: int) -> float:
    """What one more cached key adds to one query's attention over all of a whole model's layers,
    from a probe's one-token steps after a short and a long context."""
    short = step_seconds(probe, 1, cold=True)
    long = step_seconds(probe, 1, cold=True, context=LONG_CONTEXT)
    return max(long - short, 0.0) * 1e3 / (LONG_CONTEXT - 64) * n_layer / len(probe.layers)


PROBE_VOCAB = 256  # the layer probe's vocabulary: its embedding and head cost next to nothing


def estimated_ms(path: Path, layout: str, context: int, n_layer: int, blocks) -> tuple:
    """({block: milliseconds of a whole model's forward of `block` tokens}, the layer probe, {block:
    milliseconds of the layer probe's own forward}): the
    head alone (embedding, norm, head, no layers), timed on a model of just those, plus n_layer
    times what one layer adds, timed on a probe of PROBE_LAYERS layers whose vocabulary is cut to
    PROBE_VOCAB rows (its tiny head timed apart and taken off). One model alive at a time, so the
    vocabulary matrices (two copies where a packed head is tied to the embedding) are never held
    beside the layers."""
    head = build_target(path, layout, "cpu", context, n_layer=0)
    head_ms = {b: 1e3 * step_seconds(head, b, cold=True) for b in blocks}
    del head  # (freed as its last reference goes: a model holds no reference cycle)
    release_memory()
    probe = build_target(path, layout, "cpu", context, n_layer=PROBE_LAYERS, vocab=PROBE_VOCAB)
    small_head = probe.without_layers()
    ms, probe_ms = {}, {}
    for b in blocks:
        probe_ms[b] = 1e3 * step_seconds(probe, b, cold=True)
        # (timed cold as the probe is: a flush evicts the interpreter's state too, which a warm
        # timing would leave in the layers' share, multiplied by n_layer / PROBE_LAYERS)
        layers_ms = probe_ms[b] - 1e3 * step_seconds(small_head, b, cold=True)
        ms[b] = round(head_ms[b] + n_layer * max(layers_ms, 0.0) / len(probe.layers), 3)
    return ms, probe, probe_ms


# A layout that rounds activations coarsely (bf16, int4) keeps greedy speculation exact only if a
# verification block gets the bits of one-token steps. Its attention is made so (row by row), but
# its matmuls are the CPU's: on some CPUs oneDNN's bf16 kernels sum a long row in another order for
# one row than for eight, and greedy speculation then parts from plain decoding. fp32's matmuls
# differ there by 2^-24 relative, which has not changed a token in any test or report run.
EXACT_LAYOUTS = ("bfloat16-packed", "bfloat16", "int8", "int4")


def blocks_match_steps(target: M.Transformer, block: int, trials: int = 3, step=None) -> bool:
    """Whether forwards of `block` tokens give bit for bit the logits of `block` one-token steps,
    on random tokens after a 64-token context, here (this CPU, its thread count). step: the forward
    the run decodes with (a compiled target), if not the target's own; the context is prefilled
    by the target either way, as generate() does."""
    step = target if step is None else step
    context = min(64, target.max_seq_len - block)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # (as generate runs: a compiled step guards on it)
        for _ in range(trials):
            tokens = torch.randint(0, target.args.vocab_size, (1, context + block), generator=generator)
            positions = torch.arange(context + block)
            target(tokens[:, :context], positions[:context])
            whole, _ = step(tokens[:, context:], positions[context:])
            steps = [step(tokens[:, i:i + 1], positions[i:i + 1])[0] for i in range(context, context + block)]
            if not torch.equal(whole, torch.cat(steps, 1)):
                return False
    return True


def inexact_blocks(probe: M.Transformer, layout: str) -> list:
    """The block sizes (of BLOCKS) whose rows do not give the bits of one-token steps, where the
    probe's layout promises them (EXACT_LAYOUTS); [] for the others."""
    if layout not in EXACT_LAYOUTS:
        return []
    return [b for b in BLOCKS[1:] if not blocks_match_steps(probe, b, trials=1)]


def forget_timings(path: Path) -> int:
    """Drop every kept decision for the model at `path` (decode.py --retime): this process reads
    none of them again, and the next load times again. Returns how many the cache held."""
    model = str(Path(path).resolve())
    TC.FORGOTTEN.add(model)
    for memo in [memo for memo in CHOSEN if f" | {model} | " in memo[1]]:
        del CHOSEN[memo]
    cache = read_cache()
    dropped = [key for key in cache if f" | {model} | " in key]
    for key in dropped:
        del cache[key]
    if dropped:
        write_cache(cache, "they stay there, and this run times the layouts again without them")
    return len(dropped)


# Where no trusted timing was ever kept (a busy machine, repeats that disagree), the layout is the
# first of this order that the CPU can run exactly: the same for every such run, so what a run
# prints never depends on how busy the machine was when it started. int4 first where the weights
# are 4-bit at their source (only the scales round); fp32 packed, always exact, last.
FIXED_ORDER = ("int4", "bfloat16-packed", "float32-packed")

CHOSEN = {}  # (cache, key) -> this process's decisions: one model per process, whatever later timings say


def choose_layout(path: Path) -> dict:
    """{layout, ms, inexact, threads, blocks_ms, attention_ms_per_key}: the layout of this
    machine's runs of the model at `path` (the fastest estimated one-token step, ms), the
    candidates whose blocks part from one-token steps here (inexact: where the chosen one is among
    them, drafting would change the output and the default decodes plainly), the thread count
    they were timed at, and the chosen layout's block table at this run's thread count
    (block_table). Measured once on probes, one alive at a time (see the module docstring), on a
    quiet machine, then read from the kept decisions (engine/timing_cache.py); where no such timing was ever kept, FIXED_ORDER
    decides (with ms {} and `fixed`: why)."""
    memo = (str(TC.LAYOUT_CACHE), cache_key(path, "layout", threads=False))
    if memo not in CHOSEN:
        CHOSEN[memo] = decide_layout(path, memo[1])
    choice = CHOSEN[memo]
    return {**choice, **block_table(path, choice["layout"])}


def decide_layout(path: Path, key: str) -> dict:
    """choose_layout's decision: a kept one, a trusted timing now, a kept stale one, or FIXED_ORDER."""
    candidates = layout_candidates(path)
    kept = kept_entry(key)
    problem = impossible_choice(kept, candidates) if kept is not None else None
    if problem:
        note_once(f"the kept layout choice for {path} cannot be a timing ({problem}): it is timed again")
        kept = None
    if kept and "stale" not in kept:
        return kept
    if not machine_is_quiet():
        why = "another process keeps a core busy"
    else:
        timed, why = time_layouts(path, candidates)
        if timed:
            cache = read_cache()
            cache[key] = timed
            write_cache(cache, "the layout choice is used for this run only")
            return timed
    if kept:  # a choice stands until a trusted timing replaces it
        note_once(f"{why}: the weight layouts are not timed again now, and the kept choice ({kept['layout']}) stands")
        return kept
    return fixed_choice(path, candidates, why)


def time_layouts(path: Path, candidates: list) -> tuple:
    """(a choice, None) from timing every candidate on probes, or (None, why the timing cannot be
    trusted): another process took a core meanwhile, the fastest candidate's step timed again
    parts from its first timing, or a timing that is not possible."""
    n_layer = int(read_config(path).get("num_hidden_layers") or 1)
    ms, inexact = {}, []
    context = LONG_CONTEXT + max(BLOCKS)  # (a probe's cache is small whatever the run's context)
    for layout in tqdm(candidates, desc="timing weight layouts (once per CPU)", file=sys.stderr):
        one, probe, _ = estimated_ms(path, layout, context, n_layer, (1,))
        ms[layout] = one[1]
        if inexact_blocks(probe, layout):
            inexact.append(layout)
        del probe
        release_memory()
    best = min(ms, key=ms.get)
    again = estimated_ms(path, best, context, n_layer, (1,))[0][1]
    release_memory()
    choice = {"layout": best, "ms": ms, "inexact": inexact, "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d")}
    if not machine_is_quiet():
        return None, "another process took a core while the weight layouts were timed"
    if not agree(ms[best], again):
        return None, f"the {best} step timed twice disagreed ({ms[best]:.1f} and {again:.1f} ms)"
    problem = impossible_choice(choice, candidates)
    return (None, f"the layout timings are not possible ({problem})") if problem else (choice, None)


def fixed_choice(path: Path, candidates: list, why: str) -> dict:
    """The first layout of FIXED_ORDER among the candidates whose blocks give the bits of
    one-token steps here (checked on a probe: bits, not times, so a busy machine does not change
    the verdict)."""
    for layout in [layout for layout in FIXED_ORDER if layout in candidates]:
        if layout not in EXACT_LAYOUTS:
            break
        probe = build_target(path, layout, "cpu", 64 + max(BLOCKS), n_layer=PROBE_LAYERS, vocab=PROBE_VOCAB)
        exact = not inexact_blocks(probe, layout)
        del probe
        release_memory()
        if exact:
            break
    note_once(f"{why} and no trusted layout timing is kept for this model: its weights run in {layout}, the first "
              f"exact layout of a fixed order ({', '.join(FIXED_ORDER)}), as in every such run; run decode.py "
              f"--retime with nothing else busy to time them")
    return {"layout": layout, "ms": {}, "inexact": [], "threads": torch.get_num_threads(), "fixed": why}


def measure_blocks(path: Path, layout: str, n_layer: int) -> tuple:
    """(a layout's block table, whether its timings agreed): from probes, the estimated forward of
    each block size and what a cached key adds to one query's attention; the one-token step is
    timed again last, and a repeat that parts from the first (REPEAT_AGREEMENT) says the machine
    was disturbed in between."""
    ms, probe, probe_ms = estimated_ms(path, layout, LONG_CONTEXT + max(BLOCKS), n_layer, BLOCKS)
    table = {"blocks_ms": {str(b): ms[b] for b in BLOCKS}, "attention_ms_per_key": attention_ms_per_key(probe, n_layer)}
    agreed = agree(probe_ms[1], 1e3 * step_seconds(probe, 1, cold=True))  # the first timing, repeated last
    del probe
    release_memory()
    return table, agreed


def glibc():
    """The C library's allocator controls, or None where it is not glibc (its allocator decides)."""
    import ctypes
    try:
        lib = ctypes.CDLL("libc.so.6")
        return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


def return_freed_weights():
    """Make glibc give every block of a megabyte or more back to the system when it is freed.
    Loading reads each weight, then a layout replaces it with its packed or quantized form; by
    default glibc keeps the freed weights' memory for reuse, and a model would peak at twice its
    size."""
    if glibc():
        glibc().mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB


def release_memory(collect: bool = False):
    """Hand the memory of dropped probes back to the system before the next model is built. A
    model holds no reference cycle, so it is freed as its last reference goes; collect: run the
    garbage collector first, for a caller whose objects may hold one (a quarter second or more in a
    process of many objects, such as one that imported transformers)."""
    import gc
    if collect:
        gc.collect()
    if glibc():
        glibc().malloc_trim(0)


def block_table(path: Path, layout: str) -> dict:
    """{blocks_ms, attention_ms_per_key} of `layout` at this run's thread count (measure_blocks):
    kept where a quiet machine timed it; timed otherwise, and kept where the timing can be trusted.
    A stale table stands on a busy machine. These steer --adaptive's block lengths only: they
    never change what a run prints."""
    key = cache_key(path, f"blocks {layout}")
    memo = (str(TC.LAYOUT_CACHE), key)
    if memo in CHOSEN:
        return CHOSEN[memo]
    kept = kept_entry(key)
    problem = impossible_blocks(kept) if kept is not None else None
    if problem:
        note_once(f"the kept {layout} block costs for {path} cannot be a timing ({problem}): they are timed again")
        kept = None
    quiet = machine_is_quiet()
    if kept and ("stale" not in kept or not quiet):
        table = kept
    else:
        for _ in range(2 if quiet else 1):  # (a quiet machine's passing disturbance: measured once more)
            table, agreed = measure_blocks(path, layout, int(read_config(path).get("num_hidden_layers") or 1))
            problem = impossible_blocks(table)
            not_kept = ("another process kept a core busy" if not (quiet and machine_is_quiet()) else
                        "the same step timed twice disagreed" if not agreed else
                        f"a timing that is not possible ({problem})" if problem else None)
            if not not_kept:
                break
        keep(key, {**table, "date": time.strftime("%Y-%m-%d")}, not_kept)
    CHOSEN[memo] = {k: table[k] for k in ("blocks_ms", "attention_ms_per_key")}
    return CHOSEN[memo]


def block_costs(blocks_ms: dict, max_block: int) -> list:
    """costs[n]: a forward verifying n drafted tokens (a block of n + 1) in one-token steps, for
    n = 0 .. max_block - 1; sizes between the timed ones interpolated, past them extrapolated."""
    sizes = sorted(int(b) for b in blocks_ms)
    ms = [float(blocks_ms[str(b)]) for b in sizes]

    def at(b):
        if b in sizes:
            return ms[sizes.index(b)]
        hi = next((i for i, s in enumerate(sizes) if s > b), len(sizes) - 1)
        lo = hi - 1
        return ms[lo] + (ms[hi] - ms[lo]) * (b - sizes[lo]) / (sizes[hi] - sizes[lo])
    # a block costs at least a one-token step and at most one a token (it reads the weights once),
    # and a longer block never costs less: timing noise cannot say otherwise
    costs = [min(max(at(b) / ms[0], 1.0), b) for b in range(1, max_block + 1)]
    return [max(costs[:n + 1]) for n in range(len(costs))]


def load_target(name_or_path: str, device: str, layout: str, max_seq_len: int):
    """Resolve, load and prepare a model for inference in `layout` (one of LAYOUTS), or, with
    'auto' on a CPU, in the layout chosen for this machine (choose_layout). Returns (target,
    tokenizer, choice): choice is auto's decision (choose_layout), {} when the layout was asked for
    by name; layout_of(target) names the layout either way."""
    path = resolve_model(name_or_path)
    check_checkpoint(path)  # (a checkpoint that cannot load is refused before any layout is timed)
    problem = layout_problem(path, layout)
    if problem:
        raise ValueError(problem)
    choice = {}
    if layout == "auto":
        choice = choose_layout(path)
        layout = choice["layout"]
    target = build_target(path, layout, device, max_seq_len)
    return target, load_tokenizer(path), choice


def block_cost_model(table: dict, rows_apart: bool):
    """cost(n, context): a forward verifying n drafted tokens after `context` cached ones, in
    one-token steps at that context. A block's rows each attend over the whole context where they
    attend one at a time (engine/rows_apart.py), so at long context a block costs more steps."""
    blocks_ms, per_key = table["blocks_ms"], float(table["attention_ms_per_key"])
    costs = block_costs(blocks_ms, max(BLOCKS))  # (past the largest timed block: extrapolated)
    one = float(blocks_ms["1"])

    def cost(n: int, context: int) -> float:
        base = costs[n] if n < len(costs) else block_costs(blocks_ms, n + 1)[n]
        attention = per_key * max(context - 64, 0)
        return (base * one + (n + 1 if rows_apart else 1) * attention) / (one + attention)
    return cost


def run_block_costs(target: M.Transformer, choice: dict) -> tuple:
    """(cost(n, context) (block_cost_model) of a loaded CPU target in its layout, seconds of its
    one-token step): from auto's decision `choice`, or for a layout asked for by name ({}), its
    own block table; (None, None) on a GPU, where they are not timed."""
    if target.embed_tokens.weight.device.type != "cpu":
        return None, None
    table = choice or block_table(target.source, layout_of(target))
    return block_cost_model(table, rows_attend_apart(target)), float(table["blocks_ms"]["1"]) / 1e3


def drafting_is_exact(target: M.Transformer, choice: dict, block: int, step=None) -> bool:
    """Whether verification blocks give the bits of one-token steps in the run's layout: as auto's
    probe saw it at this thread count, or, for a coarse layout asked for by name or at another
    thread count (the bits of a block can depend on it), checked now on blocks of `block` tokens
    with the run's forward `step` (default the target's own; fp32's blocks differ from its steps
    by 2^-24 relative at most, which EXACT_LAYOUTS says). The probe checked blocks up to
    max(BLOCKS) tokens; a longer one is checked now (past ROWS_APART_MAX its rows attend together)."""
    if choice and step is None and choice.get("threads") == torch.get_num_threads() and block <= max(BLOCKS):
        return choice["layout"] not in choice["inexact"]  # (auto's probe ran eager forwards, not compiled ones)
    return layout_of(target) not in EXACT_LAYOUTS or target.embed_tokens.weight.device.type != "cpu" \
        or blocks_match_steps(target, block, step=step)


def layout_reason(target: M.Transformer, choice: dict) -> str:
    """One line on why a run's weights are in their layout (choice: auto's decision, or {})."""
    if not choice:
        return f"{layout_of(target)} weights, as asked"
    if not choice["ms"]:
        return f"{layout_of(target)} weights: auto's fixed order, no trusted timing kept here ({choice['fixed']})"
    others = ", ".join(f"{layout} {ms:.1f}" for layout, ms in choice["ms"].items() if layout != choice["layout"])
    return (f"{layout_of(target)} weights: auto's fastest one-token step here, {choice['ms'][choice['layout']]:.1f} "
            f"ms (est.; {others})")


def experiment_layout(device: str) -> str:
    """The layout that training and the lossy experiment run their target in, whatever is fastest:
    fp32 on a CPU, so that corpora and results do not change with the CPU; bf16 on CUDA."""
    return "float32-packed" if device == "cpu" else "bfloat16"


def target_layout(dtype: str | None, device: str, compiled: bool, pack: bool = True) -> str:
    """--dtype as load_target takes it. Default (auto): on a CPU the layout measured fastest here
    (for eager steps; a compiled run takes it too, unpacked); bfloat16 on CUDA. float32 and
    bfloat16 on a CPU are packed unless pack is False or the run is compiled (torch.compile packs
    the weights itself)."""
    dtype = dtype or "auto"
    problem = machine_problem(device, "auto", dtype, compiled)
    if problem:
        raise ValueError(problem)
    if device != "cpu":
        return "bfloat16" if dtype == "auto" else dtype
    if dtype == "auto":
        return "auto"
    packs = pack and not compiled and dtype in ("float32", "bfloat16") and LF.packable(getattr(torch, dtype))
    return f"{dtype}-packed" if packs else dtype
