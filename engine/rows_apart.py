"""
Verification blocks that give the bits of one-token steps: model.Attention swapped, layer by
layer, for a form whose short blocks attend one row at a time, the way the engine swaps Linears
for its CPU forms. Each row attends as a one-token step at its position would: the same kernel on
the same keys, the cache up to its own slot. Where activations round coarsely (bf16, int8, int4
weights) the float noise of another attention kernel would turn into other tokens, and greedy
speculation would part from plain decoding. The cost: each row reads the whole context.

A tree's row sees the cache before the block, then its ancestors and itself (model.tree_attention),
which a one-token step down that row's path would see in consecutive slots. So before a row
attends, the keys and values of its path are copied where that step would have them, and the
block is put back as it was written afterwards (for Transformer.keep_path).
"""
import torch

import model as M

ROWS_APART_MAX = 32  # longer inputs (prompt prefills) attend in one call: both decoding modes share them


class RowsApartAttention(M.Attention):
    """model.Attention whose blocks of 2 to ROWS_APART_MAX rows attend a row at a time.
    whole_cache: the forward attends every cache slot under its mask (compiled CUDA graphs), so a
    row sees every slot, as the one-token step does; otherwise a row sees the slots up to its own."""
    whole_cache = False

    def forward(self, x, cos, sin, mask, input_pos):
        T = x.shape[1]
        if not 1 < T <= ROWS_APART_MAX or mask.dim() != 2:
            return super().forward(x, cos, sin, mask, input_pos)
        q, k, v = self.project(x, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, kv_heads, max_seq_len, head_dim)
        kv_len = mask.shape[-1]
        if self.whole_cache:
            rows = [self.mix(q[:, :, t:t + 1], k[:, :, :kv_len], v[:, :, :kv_len], mask[t:t + 1]) for t in range(T)]
        elif (moves := block_moves(mask)) is None:
            every = mask.new_ones(1, kv_len)  # (1, kv_len): row t sees the slots up to its own, as its step
            # row t's key count (a list: a range over a graph's key count would fix that count)
            seen = [kv_len - T + 1 + t for t in range(T)]
            rows = [self.mix(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], every[:, :n]) for t, n in enumerate(seen)]
        else:
            rows = self.tree_rows(q, k, v, mask, moves)
        return self.o_proj(torch.cat(rows, 2).transpose(1, 2).flatten(2).to(x.dtype))  # rows: (B, heads, 1, head_dim)

    def tree_rows(self, q, k, v, mask, moves: list):
        """Each row of a tree over the cache and its own path, moved into a chain's slots first."""
        T, kv_len = mask.shape
        first = kv_len - T
        block_k, block_v = k[:, :, first:kv_len].clone(), v[:, :, first:kv_len].clone()  # (B, kv_heads, T, head_dim)
        every = mask.new_ones(1, kv_len)
        rows = []
        for t, (start, path) in enumerate(moves):
            if start is not None:
                k[:, :, first + start:first + len(path)] = block_k[:, :, path[start:]]
                v[:, :, first + start:first + len(path)] = block_v[:, :, path[start:]]
            if t < T:
                n = first + len(path)
                rows.append(self.mix(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], every[:, :n]))
        return rows


# The last block's mask and its moves: every layer of a forward attends through the same mask, so
# its moves are worked out (a host read of the mask) once a forward, not once a layer.
LAST_BLOCK = {"mask": None, "moves": None}


def block_moves(mask):
    """None where a block's rows see the block causally (a chain), else a tree's moves
    (tree_moves), read off the mask (T, kv_len); a compiled graph verifies chains only
    (engine/compiled.py), so there it is a chain."""
    if torch.compiler.is_compiling():
        return None
    if mask is not LAST_BLOCK["mask"]:
        T = mask.shape[0]
        block = mask[:, mask.shape[1] - T:]  # (T, T): which block rows each row sees
        chain = torch.equal(block, torch.ones_like(block).tril())
        LAST_BLOCK.update(mask=mask, moves=None if chain else tree_moves(block.tolist()))
    return LAST_BLOCK["moves"]


def tree_moves(block_seen: list) -> list:
    """block_seen (T lists of T bools): which block rows each row sees, its path. Returns, for each
    row and then once more to put the block back, (start, path): the path's rows from `start` on
    must be copied to the slots from the block's first + start before the row attends (start None:
    already in place)."""
    T = len(block_seen)
    paths = [[j for j, seen in enumerate(row) if seen] for row in block_seen] + [list(range(T))]
    placed, moves = list(range(T)), []  # placed: the block row each slot from the block's first holds
    for path in paths:
        start = next((j for j, row in enumerate(path) if placed[j] != row), None)
        moves.append((start, path))
        if start is not None:
            placed[start:len(path)] = path[start:]
    return moves


def attend_rows_apart(model, whole_cache: bool = False):
    """Swap every layer's attention for RowsApartAttention (in place; its weights and cache stay)."""
    for layer in model.layers:
        layer.self_attn.__class__ = RowsApartAttention
        layer.self_attn.whole_cache = whole_cache


def rows_attend_apart(model) -> bool:
    return any(isinstance(layer.self_attn, RowsApartAttention) for layer in model.layers)
