"""
The target's forward compiled whole, as gpt-fast compiles its decode step: one graph for the
one-token step and one for a verification block of block_len tokens, so that no acceptance count
or adaptive draft length changes a shape and nothing recompiles after the first step and block.
A block shorter than the graph's is padded with copies of its last token at the positions after
it: their keys land in cache slots past the block, which no real row reads and the next step
overwrites. Every row attends apart (engine/rows_apart.py), through the kernel a
one-token step uses on the keys that step would see, so a block gives the bits of the steps it
stands for wherever its matmuls do too (checked, not assumed: engine.layouts.blocks_match_steps).
On a CPU a graph attends only the visible keys, their count a number of the graph (one graph for
every context); on CUDA it attends the whole static cache through a mask, fixed shapes that
mode "reduce-overhead" captures as CUDA graphs. Prompts (longer than a block) and trees run the
eager forward; the cache must hold block_len slots from a block's first position (generate
sizes it so).
"""
import sys
import time

import torch

import model as M
from engine.machine import unpack
from engine.rows_apart import attend_rows_apart

# inductor on a CPU: weights frozen as constants (it packs them itself), the kernels called from
# C++ rather than Python, and bf16 rounded wherever eager code rounds it. No guards on the modules'
# tensors (checking hundreds of them is a large part of a small step): a CompiledTarget drops
# every earlier graph, and nothing changes its target's modules while it runs
CPU_OPTIONS = {"freezing": True, "cpp_wrapper": True, "emulate_precision_casts": True,
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


CACHE_BUCKET = 512
# a compiled run's default chain: its blocks are padded to their full length, so every block costs
# what the longest does, and a matmul's cost per row steps up past a few rows (docs/compiled)
COMPILED_K = 3


def cache_slots(reach: int, context: int) -> int:
    """The KV cache a compiled run allocates for `reach` positions: rounded up to a multiple of
    CACHE_BUCKET (at most the model's context), so that runs of other prompt and answer lengths
    meet the same graphs, compiled once and then read from inductor's cache on disk."""
    return min(context, -(-reach // CACHE_BUCKET) * CACHE_BUCKET)


class CompiledTarget:
    """Called as the target is, (tokens, input_pos, hidden_layers, last_logits_only, key_valid,
    tree_parents) -> (logits, hidden); one-token steps and blocks of up to block_len tokens run
    the compiled graphs, anything else the target's eager forward. The graphs return the hidden
    states of the layers the run's draft reads (hidden_layers) whatever a call asks for, so that
    asking for fewer (an exactness check, a plain step) meets the same graph."""

    def __init__(self, target, block_len: int, hidden_layers=(), mode: str = "default"):
        cpu = target.embed_tokens.weight.device.type == "cpu"
        torch._dynamo.reset()  # (graphs of another target would guard on shapes only: one target a process)
        attend_rows_apart(target, whole_cache=not cpu)
        self.target, self.block_len, self.cpu = target, block_len, cpu
        self.hidden_layers = tuple(hidden_layers)
        self.compile_seconds = {}  # {graph: seconds its first call took}, as compile_target fills it
        self.max_seq_len = target.max_seq_len
        self.embed_tokens = target.embed_tokens  # (generate reads the device from it)
        # the output head stays out of the graphs, as it is: on a CPU the engine's packed head is
        # faster than what inductor makes of it, and a block's padded rows need no logits
        if cpu:
            unpack(target.layers)  # (inductor cannot read oneDNN's blocked weights; freezing packs them)
            self.slots = torch.arange(target.max_seq_len)  # (a slice of it carries a graph's key count)
            self.step_graph, self.block_graph = (torch.compile(f, fullgraph=True, options=CPU_OPTIONS)
                                                 for f in (self.visible_step, self.visible_block))
        else:
            self.step_graph = self.block_graph = torch.compile(self.whole_cache_decoder, dynamic=False,
                                                               fullgraph=True, mode=mode)
        self.copy_outputs = not cpu and mode == "reduce-overhead"  # a CUDA graph reuses its outputs

    def visible_step(self, tokens, input_pos, visible):
        return self.visible_decoder(tokens, input_pos, visible.shape[0])

    def visible_block(self, tokens, input_pos, visible):  # (its own function: its own graph, never the step's)
        return self.visible_decoder(tokens, input_pos, visible.shape[0])

    def visible_decoder(self, tokens, input_pos, kv_len):
        """target.decoder for a chain block or a step on a CPU, attending the kv_len visible keys
        only, each row its own: kv_len is the length of a slice marked dynamic (one graph for
        every context), where an int argument would make every int of the graph dynamic."""
        mask = M.attention_mask(input_pos, kv_len)  # (T, kv_len)
        return self.target.trunk(tokens, input_pos, input_pos, mask, self.hidden_layers)

    def whole_cache_decoder(self, tokens, input_pos):
        """target.decoder attending every cache slot through its mask: shapes that never change,
        which CUDA graphs capture."""
        mask = M.attention_mask(input_pos, self.max_seq_len)  # (T, max_seq_len)
        return self.target.trunk(tokens, input_pos, input_pos, mask, self.hidden_layers)

    def __call__(self, tokens, input_pos, hidden_layers=(), last_logits_only=False, key_valid=None,
                 tree_parents=None):
        T = tokens.shape[1]
        if T > self.block_len or key_valid is not None or tree_parents is not None or \
                not set(hidden_layers) <= set(self.hidden_layers) or \
                self.cpu and T > 1 and int(input_pos[0]) + self.block_len > self.max_seq_len:
            return self.target(tokens, input_pos, hidden_layers, last_logits_only, key_valid, tree_parents)
        if 1 < T < self.block_len:
            # padded rows, at the positions after the block (CUDA: generate sizes the cache to hold them)
            pad = self.block_len - T
            pad_pos = input_pos[-1] + torch.arange(1, pad + 1, device=input_pos.device)  # (pad,)
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], 1)  # (B, block_len)
            input_pos = torch.cat([input_pos, pad_pos])
        # (copied: the graphs are specialized to their inputs' strides as well as their shapes, and
        # a slice of one row is "contiguous" with its parent's strides)
        tokens, input_pos = tokens.clone(memory_format=torch.contiguous_format), input_pos.contiguous()
        graph = self.step_graph if T == 1 else self.block_graph
        if self.cpu:
            visible = self.slots[:int(input_pos[-1]) + 1]
            torch._dynamo.maybe_mark_dynamic(visible, 0)  # (guards may bound it: a context past them, another graph)
            x, hidden = graph(tokens, input_pos, visible)  # x: (B, 1 or block_len, dim)
        else:
            x, hidden = graph(tokens, input_pos)
        if self.copy_outputs:
            x, hidden = x.clone(), [h.clone() for h in hidden]
        x = x[:, T - 1:T] if last_logits_only else x[:, :T]
        return self.target.lm_head(x), [hidden[self.hidden_layers.index(i)][:, :T] for i in hidden_layers]

    def warm_up(self):
        """(what, compile) for each graph: compile() runs it once and returns the seconds it took.
        They write cache slots from 2 on (a key count of 0 or 1 would be compiled as a constant),
        which the next prompt's prefill and steps rewrite."""
        device = self.embed_tokens.weight.device
        shapes = [("one-token step", 1)] + ([(f"verification block of {self.block_len}", self.block_len)]
                                           if self.block_len > 1 else [])
        for what, T in shapes:
            def compile(T=T):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self(torch.zeros(1, T, dtype=torch.long, device=device), torch.arange(2, 2 + T, device=device))
                return time.perf_counter() - t0
            yield what, compile

    def block_costs(self, repeats: int = 7) -> tuple:
        """(cost(n, context), seconds of a one-token step) as an adaptive draft takes them: every
        block is one graph of block_len rows, so a block of any length costs the same, timed here
        against the step (medians; a busy machine changes how much is drafted, never the output)."""
        def median_seconds(T):
            times = []
            with torch.inference_mode():
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self(torch.zeros(1, T, dtype=torch.long), torch.arange(2, 2 + T))
                    times.append(time.perf_counter() - t0)
            return sorted(times)[repeats // 2]
        step = median_seconds(1)
        block = median_seconds(self.block_len) / step
        return (lambda n, context: 1.0 if n == 0 else block), step


def compile_target(target, block_len: int, hidden_layers=(), device: str = "cpu") -> CompiledTarget:
    """The target compiled, its graphs compiled here (rather than inside the first prompt's timing),
    each with a line on stderr that says what is compiling and how long it took."""
    compiled = CompiledTarget(target, block_len, hidden_layers, "default" if device == "cpu" else "reduce-overhead")
    for what, graph in compiled.warm_up():
        print(f"note: --compile on: compiling the {what}", end="", file=sys.stderr, flush=True)
        compiled.compile_seconds[what] = graph()
        print(f" ({compiled.compile_seconds[what]:.0f} s; inductor keeps it on disk for later runs)", file=sys.stderr)
    return compiled
