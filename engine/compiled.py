"""
The target's forward compiled whole, as gpt-fast compiles its decode step: one graph for the
one-token step and one for a verification block of block_len tokens, so that no acceptance count
or adaptive draft length changes a shape and nothing recompiles after the first step and block.
A block shorter than the graph's is padded with copies of its last token at the positions after
it: their keys land in cache slots past the block, which no real row reads and the next step
overwrites. Every row attends apart (engine/rows_apart.py), through the kernel a
one-token step uses on the keys that step would see, so a block gives the bits of the steps it
stands for wherever its matmuls do too (checked, not assumed: engine.layouts.blocks_match_steps).
On a CPU a graph attends only the visible keys, their count a dynamic size (one graph for every
context), and is compiled ahead of its first call and kept on disk (engine/graph_cache.py), so a
second run loads it instead of tracing the model again. On CUDA it attends the whole static cache
through a mask, fixed shapes that mode "reduce-overhead" captures as CUDA graphs, compiled at its
first call. Prompts (longer than a block) and trees run the eager forward; the cache must hold
block_len slots from a block's first position (generate sizes it so).
"""
import importlib
import sys
import threading
import time

import torch

import eagle3
import model as M
from engine import linear_forms, rows_apart
from engine.graph_cache import GRAPH_CACHE, compiled_graph, graph_key, kept_verdict
from engine.machine import unpack
from engine.rows_apart import attend_rows_apart

# inductor on a CPU: the kernels called from C++ rather than Python, and bf16 rounded wherever
# eager code rounds it. (Not "freezing": a frozen graph holds the weights as constants and cannot
# be kept on disk apart from them.)
CPU_OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True}


CACHE_BUCKET = 512
# a compiled run's default chain: its blocks are padded to their full length, so every block costs
# what the longest does, and a matmul's cost per row steps up past a few rows (docs/compiled)
COMPILED_K = 3


GRAPH_CODE = (M, linear_forms, rows_apart, sys.modules[__name__])  # the code a graph is traced from


def cache_slots(reach: int, context: int) -> int:
    """The KV cache a compiled run allocates for `reach` positions: rounded up to a multiple of
    CACHE_BUCKET (at most the model's context), so that runs of other prompt and answer lengths
    meet the same graphs, compiled once and then read from inductor's cache on disk."""
    return min(context, -(-reach // CACHE_BUCKET) * CACHE_BUCKET)


def visible_decoder(target, tokens, input_pos, visible, hidden_layers):
    """target.decoder for a chain block or a step on a CPU, attending the visible keys only, each
    row its own: their count is the length of `visible`, a slice marked dynamic (one graph for
    every context), where an int argument would make every int of the graph dynamic."""
    mask = M.attention_mask(input_pos, visible.shape[0])  # (T, visible keys)
    return target.trunk(tokens, input_pos, input_pos, mask, hidden_layers)


def whole_cache_decoder(target, tokens, input_pos, hidden_layers):
    """target.decoder attending every cache slot through its mask: shapes that never change,
    which CUDA graphs capture."""
    mask = M.attention_mask(input_pos, target.max_seq_len)  # (T, max_seq_len)
    return target.trunk(tokens, input_pos, input_pos, mask, hidden_layers)


def draft_chain_row(draft, token, state, visible):
    """One row of an EAGLE-3 draft's chain, as eagle3.Eagle3Draft.chain_guess takes it: token (1,)
    fed with the state (1, dim) it pairs with, at the last of the visible slots, seeing them all
    -> the next state (1, dim) and its heads' logits (Vd,), (). The visible slots' count is
    dynamic, as the target's graphs' is."""
    position = visible[-1:]  # (1,)
    seen = torch.ones(1, visible.shape[0], dtype=torch.bool, device=visible.device)  # (1, kv_len)
    state = draft.rows(token, state, position, position, seen)
    return (state, *draft.net.heads(state[-1]))


class CompiledTarget:
    """Called as the target is, (tokens, input_pos, hidden_layers, last_logits_only, key_valid,
    tree_parents) -> (logits, hidden); one-token steps and blocks of up to block_len tokens run
    the compiled graphs, anything else the target's eager forward. The graphs return the hidden
    states of the layers the run's draft reads (hidden_layers) whatever a call asks for, so that
    asking for fewer (an exactness check, a plain step) meets the same graph."""

    def __init__(self, target, block_len: int, hidden_layers=(), mode: str = "default", whole_cache=None):
        """whole_cache: the graphs attend the whole static cache through a mask, as on CUDA (the
        default there; a CPU test runs that code too), rather than the visible keys (a CPU's)."""
        cpu = target.embed_tokens.weight.device.type == "cpu"
        whole_cache = not cpu if whole_cache is None else whole_cache
        torch._dynamo.reset()  # (graphs of another target would guard on shapes only: one target a process)
        attend_rows_apart(target, whole_cache=whole_cache)
        self.target, self.block_len, self.visible = target, block_len, not whole_cache
        self.hidden_layers = tuple(hidden_layers)
        self.compile_seconds = {}  # {graph: seconds it took to compile or load}, as compile_target fills it
        self.graph_keys = []  # the kept graphs' keys (a CPU's)
        self.max_seq_len = target.max_seq_len
        self.embed_tokens = target.embed_tokens  # (generate reads the device from it)
        # the output head stays out of the graphs, as it is: on a CPU the engine's packed head is
        # faster than what inductor makes of it, and a block's padded rows need no logits
        if self.visible:
            unpack(target.layers)  # (inductor reads plain weights, not oneDNN's blocked ones)
            self.slots = torch.arange(target.max_seq_len)  # (a slice of it carries a graph's key count)
            self.step_graph = self.block_graph = None  # (graphs() prepares them)
        else:
            self.step_graph = self.block_graph = torch.compile(whole_cache_decoder, dynamic=False, fullgraph=True,
                                                               mode=mode)
        self.copy_outputs = mode == "reduce-overhead"  # a CUDA graph reuses its outputs

    def __call__(self, tokens, input_pos, hidden_layers=(), last_logits_only=False, key_valid=None,
                 tree_parents=None):
        B, T = tokens.shape
        last = int(input_pos[-1]) if self.visible else None  # (one host read: the visible keys end there)
        if B != 1 or T > self.block_len or key_valid is not None or tree_parents is not None or \
                not set(hidden_layers) <= set(self.hidden_layers) or self.visible and \
                (last < 1 or T > 1 and int(input_pos[0]) + self.block_len > self.max_seq_len):
            return self.target(tokens, input_pos, hidden_layers, last_logits_only, key_valid, tree_parents)
        if 1 < T < self.block_len:
            # padded rows, at the positions after the block (CUDA: generate sizes the cache to hold them)
            pad = self.block_len - T
            pad_pos = input_pos[-1] + torch.arange(1, pad + 1, device=input_pos.device)  # (pad,)
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], 1)  # (1, block_len)
            input_pos = torch.cat([input_pos, pad_pos])
        # (copied: a graph is specialized to its inputs' strides as well as their shapes, and a
        # slice of one row is "contiguous" with its parent's strides)
        tokens, input_pos = tokens.clone(memory_format=torch.contiguous_format), input_pos.contiguous()
        graph = self.step_graph if T == 1 else self.block_graph
        if self.visible:  # (a kept graph checks no guards: one row, a visible key count of 2 or more)
            visible = self.slots[:last + 1 + (tokens.shape[1] - T)]  # (padded rows included)
            # x: (1, T or block_len, dim)
            x, hidden = graph(self.target, tokens, input_pos, visible, self.hidden_layers)
        else:
            x, hidden = graph(self.target, tokens, input_pos, self.hidden_layers)
        if self.copy_outputs:
            x, hidden = x.clone(), [h.clone() for h in hidden]
        x = x[:, T - 1:T] if last_logits_only else x[:, :T]
        return self.target.lm_head(x), [hidden[self.hidden_layers.index(i)][:, :T] for i in hidden_layers]

    def graphs(self):
        """(what, prepare) for each graph: prepare() loads it from the graph cache or compiles it
        (on CUDA: runs it once, which compiles it) and returns (seconds, loaded). Examples write
        cache slots from 2 on (a key count of 0 or 1 would be compiled as a constant), which the
        next prompt's prefill and steps rewrite."""
        shapes = [("one-token step", 1)] + ([(f"verification block of {self.block_len}", self.block_len)]
                                           if self.block_len > 1 else [])
        for what, T in shapes:
            def prepare(what=what, T=T):
                t0 = time.perf_counter()
                device = self.embed_tokens.weight.device
                tokens = torch.zeros(1, T, dtype=torch.long, device=device)
                input_pos = torch.arange(2, 2 + T, device=device)
                if not self.visible:
                    with torch.inference_mode():
                        self(tokens, input_pos)
                    return time.perf_counter() - t0, False
                visible = self.slots[:2 + T]
                torch._dynamo.mark_dynamic(visible, 0)
                key = graph_key(self.target, f"{what}, hidden layers {self.hidden_layers}", GRAPH_CODE)
                self.graph_keys.append(key)
                graph, loaded = compiled_graph(visible_decoder, (self.target, tokens, input_pos, visible,
                                                                 self.hidden_layers), key, CPU_OPTIONS)
                if T == 1:
                    self.step_graph = graph
                else:
                    self.block_graph = graph
                return time.perf_counter() - t0, loaded
            yield what, prepare

    def kept_check(self, what: str, check) -> bool:
        """check() (what: its name) of this run's graphs at this thread count, kept beside them: a
        kept graph runs the same kernels in every run on this CPU, whatever the weights' values, so
        what a check found holds for the next run too (on CUDA, checked in every run)."""
        if not self.graph_keys:
            return check()
        return kept_verdict(graph_key(self.target, f"{what}, {torch.get_num_threads()} threads, "
                                      f"{' '.join(self.graph_keys)}", GRAPH_CODE), check)

    def block_costs(self, repeats: int = 9) -> tuple:
        """(cost(n, context), seconds of a one-token step) as an adaptive draft takes them. Every
        block is one graph of block_len rows, so a block of any length costs the same; on a CPU
        each of its rows reads the whole context where the step reads it once, so a block costs
        more steps at a longer context: block and step are timed, alternated (medians), at a short
        and at a long context, each taken as linear in the context between and beyond. (A busy
        machine changes how much is drafted, never the output.)"""
        def medians(context: int) -> list:
            times = {1: [], self.block_len: []}
            with torch.inference_mode():
                for _ in range(repeats):
                    for T, seconds in times.items():
                        t0 = time.perf_counter()
                        self(torch.zeros(1, T, dtype=torch.long), torch.arange(context, context + T))
                        seconds.append(time.perf_counter() - t0)
            return [sorted(seconds)[repeats // 2] for seconds in times.values()]
        near = 2  # (a graph's key count is 2 or more)
        far = max(near, min(512, self.max_seq_len - self.block_len)) if self.visible else near
        (step_near, block_near), (step_far, block_far) = medians(near), medians(far)

        def at(context, near_value, far_value):
            return near_value + (far_value - near_value) * (context - near) / max(far - near, 1)

        def cost(n, context):
            if n == 0:
                return 1.0
            step = max(at(context, step_near, step_far), step_near)
            return max(1.0, at(context, block_near, block_far) / step)
        return cost, step_near


def start_compiler() -> threading.Thread:
    """Import the compiler and let inductor probe the CPU's vector instructions (child processes)
    on a thread of its own, begun before the weights load: their seconds then pass while the
    weights load, and a kept graph loads in the time its own files take. compile_target waits for it."""
    def prepare():
        for module in ("torch._dynamo.aot_compile", "torch._inductor.codecache", "torch._inductor.graph",
                       "torch._inductor.select_algorithm"):  # (what loading a kept graph imports)
            importlib.import_module(module)
        importlib.import_module("torch._inductor.cpu_vec_isa").pick_vec_isa()
    thread = threading.Thread(target=prepare, daemon=True)
    thread.start()
    return thread


def compile_target(target, block_len: int, hidden_layers=(), device: str = "cpu",
                   compiler: threading.Thread | None = None) -> CompiledTarget:
    """The target compiled, its graphs loaded or compiled here (rather than inside the first
    prompt's timing), each with a line on stderr that says what it is doing and how long it took.
    compiler: start_compiler's thread, where the run began one."""
    if compiler is not None:
        compiler.join()
    compiled = CompiledTarget(target, block_len, hidden_layers, "default" if device == "cpu" else "reduce-overhead")
    for what, prepare in compiled.graphs():
        compiled.compile_seconds[what] = announced(what, prepare, kept=compiled.visible)
    return compiled


def announced(what: str, prepare, kept: bool = True) -> float:
    """prepare() (-> (seconds, loaded)) with a line on stderr saying what it is doing, whether the
    graph was loaded or compiled (kept: and kept on disk) and how long it took; -> the seconds."""
    print(f"note: --compile on: the {what}", end="", file=sys.stderr, flush=True)
    seconds, loaded = prepare()
    where = f"loaded from {GRAPH_CACHE}" if loaded else \
        f"compiled; kept in {GRAPH_CACHE} for later runs" if kept else "compiled"
    print(f" ({where}, {seconds:.0f} s)", file=sys.stderr)
    return seconds


def compile_draft(draft) -> float | None:
    """A CPU run's EAGLE-3 draft (alone or behind lookup) with the one-row step of its chains
    compiled, loaded from the graph cache or compiled and kept there, announced as the target's
    graphs are; returns its seconds, or None where the run has no such draft (DFlash drafts a block
    in one forward and an independent model steps as the target's eager forward does: both run
    eagerly). On CUDA drafts run eagerly. The graph runs the draft as build_draft made it (on a
    CPU, int8 weights: a drafted token waits on its weights' bytes, docs/draft-cost)."""
    inner = getattr(draft, "model_draft", draft)
    if not isinstance(inner, eagle3.Eagle3Draft) or inner.slots.device.type != "cpu":
        return None

    def prepare():
        t0 = time.perf_counter()
        token = torch.zeros(1, dtype=torch.long)
        state = torch.zeros(1, inner.net.args.dim, dtype=inner.net.fc.weight.dtype)
        visible = inner.slots[:3]  # (an example writes cache slot 2, which the prompt's catch-up rewrites)
        torch._dynamo.mark_dynamic(visible, 0)
        reads = torch.nn.ModuleDict({"net": inner.net, "embed": inner.embed, "cache": inner.cache})
        key = graph_key(reads, f"EAGLE-3 chain row, rope {tuple(inner.cos.shape)} {inner.cos.dtype}",
                        GRAPH_CODE + (eagle3,))
        inner.row_graph, loaded = compiled_graph(draft_chain_row, (inner, token, state, visible), key,
                                                 CPU_OPTIONS)
        return time.perf_counter() - t0, loaded
    return announced("draft's one-token step", prepare)
