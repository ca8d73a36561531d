"""One-launch stable sort of slots by expert id, for small S (decode-sized batches).

The torch path (:func:`fp8_moe_ops.routing.sort_slots`) costs about eight launches
(key, sort, arange, searchsorted, casts), which dominate a T = 1 layer inside a CUDA
graph.  Here each program owns ``BLOCK`` slots (sentinels keyed E, so last):

* a histogram of all S keys (``offsets`` = its inclusive cumsum over [0, E)) and of
  the keys in the blocks before this one;
* its own slots sorted by ``key * BLOCK + lane`` (stable within the block);
* the slot at position p of that order goes to
  ``#{keys < k} + #{earlier blocks' keys == k} + (p - #{own keys < k})``.

O(S / BLOCK) histograms per program, no O(S^2) or O(E * S) compare matrix (the
previous rank-counting version spent 10-37 us at T = 1-64 there).  Same results as
the torch path, bitwise: a stable sort is unique.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2
from .quant import quant_block

BLOCK = 128
MAX_SLOTS = 2048  # above this the torch path (radix sort) is cheaper
CNT_STEP = tl.constexpr(1024)  # counters zeroed per store
# The loop over slot blocks has a constant trip count (masked by S) so one compiled
# kernel serves every S: a runtime trip count would also not run in the interpreter.
NUM_BLOCKS = MAX_SLOTS // BLOCK


@triton.jit
def _key(ids_ptr, j, S, E):
    ids = tl.load(ids_ptr + j, mask=j < S, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit
def sort_block(pid, ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, BLOCK: tl.constexpr, NB: tl.constexpr,
               NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr):
    """Block ``pid`` of the sort (program 0 also writes ``offsets``, and zeroes the
    ``n_cnt`` <= ``CNT_BLOCK`` int32 counters of the forward's fused activation and
    combine, if any: ``CNT_BLOCK`` a multiple of ``CNT_STEP``, 0 for none)."""
    # NB: histogram bins, a power of two > E (keys are 0..E, E = sentinel)
    lane = tl.arange(0, BLOCK)
    total = tl.zeros((NB,), dtype=tl.int32)    # keys of all S slots
    before = tl.zeros((NB,), dtype=tl.int32)   # keys of the blocks before this one
    for jb in range(NUM_BLOCKS):
        if jb * BLOCK < S:
            j = jb * BLOCK + lane
            h = tl.histogram(_key(ids_ptr, j, S, E), NB, mask=j < S)
            total += h
            before += tl.where(jb < pid, h, 0)
    i = pid * BLOCK + lane
    valid = i < S
    key = _key(ids_ptr, i, S, E)  # padded lanes get key E, and sort after every valid lane
    own = tl.histogram(key, NB, mask=valid)
    packed = tl.sort(key * BLOCK + lane)
    k_p = packed // BLOCK
    slot = pid * BLOCK + packed % BLOCK
    less_all = tl.cumsum(total, 0) - total
    less_own = tl.cumsum(own, 0) - own
    dest = (tl.gather(less_all, k_p, 0) + tl.gather(before, k_p, 0)
            + (lane - tl.gather(less_own, k_p, 0)))
    tl.store(perm_ptr + dest, slot.to(perm_ptr.dtype.element_ty), mask=slot < S)
    if pid == 0:
        eo = tl.arange(0, NB)
        tl.store(offsets_ptr + eo, tl.cumsum(total, 0), mask=eo < E)
        for c0 in range(0, CNT_BLOCK, CNT_STEP):
            c = c0 + tl.arange(0, CNT_STEP)
            tl.store(cnt_ptr + c, tl.zeros((CNT_STEP,), dtype=tl.int32), mask=c < n_cnt)


@triton.jit
def _sort_kernel(ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, BLOCK: tl.constexpr, NB: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr):
    sort_block(tl.program_id(0), ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, BLOCK, NB, NUM_BLOCKS,
               CNT_BLOCK)


@triton.jit
def _sort_quant_kernel(ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, sort_programs,
                       x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, R, K, groups,
                       BLOCK: tl.constexpr, NB: tl.constexpr, NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr,
                       TOPK: tl.constexpr, KP: tl.constexpr, STATIC: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """The sort (programs ``[0, sort_programs)``) and the quantisation of the
    activations (the rest, ``groups`` K groups per row block) in one launch: they are
    independent, and at decode each is a few microseconds of launch latency.  Dynamic:
    x's R = T rows; static: each of the R = T rows into its TOPK slots (slot order),
    each with the scale ``s_ptr[e]`` of its expert e (the sort is not needed for
    that)."""
    pid = tl.program_id(0)
    if pid < sort_programs:
        sort_block(pid, ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, BLOCK, NB, NUM_BLOCKS, CNT_BLOCK)
    else:
        j = pid - sort_programs
        quant_block(j // groups, j % groups, x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, ids_ptr,
                    ids_ptr, s_ptr, ids_ptr, R, K, E, TOPK=TOPK, KP=KP, GROUP=GROUP, BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G,
                    SEARCH_STEPS=1, STATIC=STATIC, GATHER=False, SLOTS=STATIC, DEST=False)


def sort_launch_shape(S: int, E: int) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK, NB, NUM_BLOCKS) for S slots (S <= MAX_SLOTS)."""
    return (cdiv(S, BLOCK),), BLOCK, next_power_of_2(E + 1), NUM_BLOCKS
