"""
Compiled graphs kept on disk, so that a second run loads what the first one compiled. torch.compile
traces the model again in every process (dynamo, then AOTAutograd; inductor's own cache on disk
keeps only the generated code), which costs seconds a graph at every start. A graph compiled whole
ahead of its first call (torch.compile(...).aot_compile) is saved instead, and loaded as a callable
that traces nothing.

A loaded graph checks no guards: it runs whatever it is given. So the key of a kept graph names
everything a graph was specialized to: the CPU, torch, the code the graph was traced from (as
Python compiles it), what the graph is (the step, a block of n rows, the hidden layers it returns)
and the name, shape, dtype and module type of every tensor and module of the model it reads. A
model of another layout, size, cache length or draft meets another key, and the caller keeps the
inputs to the shapes the graph was compiled for. A file is written whole (a rename); one that
cannot be read is compiled and written again, and a cache that cannot be written is named once and
the run goes on with the graph it compiled.
"""
import hashlib
import os
from pathlib import Path

import torch

from engine.files import file_written_atomically, write_atomically
from engine.timing_cache import code_digest, cpu_description, note_once
from engine.weights import cache_dir

GRAPH_CACHE = Path(os.environ.get("SPECDEC_GRAPH_CACHE") or cache_dir() / "graphs")
# A kept graph holds its kernels' source; the binaries built from it live in inductor's cache, by
# default under /tmp, which a reboot empties (a kept graph then loads in the time a compile takes).
# Kept beside the graphs, they last as long as the graphs do (where the user has not chosen a place).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(GRAPH_CACHE / "inductor"))


def graph_key(model: torch.nn.Module, what: str, code_modules: tuple) -> str:
    """The name a graph of `model` (what: which graph, and anything else it was specialized to)
    is kept under: a digest of what it holds for (see the module's docstring)."""
    cpu = cpu_description()
    modules = [f"{name}:{type(m).__qualname__}" for name, m in model.named_modules()]
    tensors = [f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}"
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    described = "\n".join([cpu["cpu"], ",".join(cpu["cpu_features"]), f"torch {torch.__version__}",
                           code_digest(*code_modules), what, *modules, *tensors])
    return hashlib.sha1(described.encode()).hexdigest()[:20]


def load_graph(key: str):
    """The graph kept under `key`, or None where there is none or it cannot be read (named)."""
    path = GRAPH_CACHE / f"{key}.graph"
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            graph = torch.compiler.load_compiled_function(f)
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file fails in pickle, zipfile or torch itself)
        note_once(f"the kept compiled graph {path} could not be read ({type(e).__name__}): compiling it again")
        return None
    graph.disable_guard_check()
    return graph


def keep_graph(graph, key: str):
    """Write `graph` under `key`, whole or not at all; a cache that cannot be written is named once."""
    try:
        GRAPH_CACHE.mkdir(parents=True, exist_ok=True)
        with file_written_atomically(GRAPH_CACHE / f"{key}.graph") as tmp:
            graph.save_compiled_function(str(tmp))
    except (OSError, RuntimeError) as e:
        note_once(f"{GRAPH_CACHE} could not be written ({getattr(e, 'strerror', None) or e}): the next run "
                  "compiles its graphs again")


def compiled_graph(fn, example_args: tuple, key: str, options: dict):
    """fn compiled whole for example_args (fn's first argument: the object whose modules it
    reads), loaded from the cache where a graph of `key` was kept, otherwise compiled here and
    kept. Returns (graph, loaded): the graph is called as fn is, and checks no guards."""
    graph = load_graph(key)
    if graph is not None:
        return graph, True
    options = {**options, "guard_filter_fn": lambda guards: [False] * len(guards)}  # (none kept: none checked)
    with torch.inference_mode():
        graph = torch.compile(fn, fullgraph=True, options=options).aot_compile((example_args, {}))
    keep_graph(graph, key)
    graph.disable_guard_check()
    return graph, False


def kept_verdict(key: str, check) -> bool:
    """check()'s verdict on graphs kept under `key` (see CompiledTarget.kept_check), kept beside
    them: read where a run found it before, else checked here and kept."""
    path = GRAPH_CACHE / f"{key}.verdict"
    try:
        kept = path.read_text().strip()
        if kept in ("true", "false"):
            return kept == "true"
    except OSError:
        pass  # (none kept, or unreadable: checked again)
    verdict = bool(check())
    try:
        GRAPH_CACHE.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "true" if verdict else "false")
    except OSError:
        pass  # (the cache's writability is named once, where the graphs are kept)
    return verdict
