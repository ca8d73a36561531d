"""One-launch stable sort of slots by expert id, for small S (decode-sized batches).

The torch path (:func:`fp8_moe_ops.routing.sort_slots`) costs about eight launches
(key, sort, arange, searchsorted, casts), which dominate a T = 1 layer inside a CUDA
graph.  Here each slot's sorted position is its stable rank,
``#{j: key_j < key_i} + #{j < i: key_j == key_i}`` (sentinels keyed E, so last), and
``offsets[e] = #{j: key_j <= e}``: O(S^2 / BLOCK) work per program, which is nothing
for S up to a few thousand and too much beyond (the caller switches to torch.sort).
Same results as the torch path, bitwise: a stable sort is unique.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 128
MAX_SLOTS = 2048  # above this the torch path (radix sort) is cheaper
# The loop over slot blocks has a constant trip count (masked by S) so one compiled
# kernel serves every S: a runtime trip count would also not run in the interpreter.
NUM_BLOCKS = MAX_SLOTS // BLOCK


@triton.jit
def _key(ids_ptr, j, S, E):
    ids = tl.load(ids_ptr + j, mask=j < S, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit
def _sort_kernel(ids_ptr, perm_ptr, offsets_ptr, S, E, BLOCK: tl.constexpr, EP: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    key_i = _key(ids_ptr, i, S, E)
    eo = tl.arange(0, EP)
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    counts = tl.zeros((EP,), dtype=tl.int32)
    for jb in range(NUM_BLOCKS):
        if jb * BLOCK < S:
            j = jb * BLOCK + tl.arange(0, BLOCK)
            key_j = _key(ids_ptr, j, S, E)
            jvalid = j < S
            before = (key_j[None, :] < key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((before & jvalid[None, :]).to(tl.int32), axis=1)
            if pid == 0:
                counts += tl.sum(((key_j[None, :] <= eo[:, None]) & jvalid[None, :]).to(tl.int32), axis=1)
    tl.store(perm_ptr + rank, i.to(perm_ptr.dtype.element_ty), mask=i < S)
    if pid == 0:
        tl.store(offsets_ptr + eo, counts, mask=eo < E)


def sort_launch_shape(S: int, E: int) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK, EP, NUM_BLOCKS) for S slots (S <= MAX_SLOTS)."""
    return (triton.cdiv(S, BLOCK),), BLOCK, max(2, triton.next_power_of_2(E)), NUM_BLOCKS
