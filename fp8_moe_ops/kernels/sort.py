"""Stable sort of slots by expert id on the GPU: one launch for small S (decode-sized
batches), three beyond.

The torch path (:func:`fp8_moe_ops.routing.sort_slots`: a key, a 64-bit radix sort,
searchsorted, casts and, at prefill, an inverse permutation) costs 15-32 launches and
60-120 µs on an H200 (``bench/sort_slots.py``): at T = 1 that dominated a layer inside
a CUDA graph, and past 2048 slots it was 14-22 % of a qwen3_30b_a3b layer at 512-2048
tokens (docs/benchmarks.md).

Here each program owns ``BLOCK`` slots (sentinels keyed E, so last):

* a histogram of all S keys (``offsets`` = its inclusive cumsum over [0, E)) and of
  the keys in the blocks before this one;
* its own slots sorted by ``key * BLOCK + lane`` (stable within the block);
* the slot at position p of that order goes to
  ``#{keys < k} + #{earlier blocks' keys == k} + (p - #{own keys < k})``.

Up to ``MAX_SLOTS`` slots every program computes the histograms itself, O(S / BLOCK)
of them per program (no O(S^2) or O(E * S) compare matrix: the previous rank-counting
version spent 10-37 us at T = 1-64 there), in one launch with the activations'
quantisation; there the blocks also write the grouped GEMMs' map of their row tiles
(:func:`write_tile_map`), so that a GEMM program finds its tile without a scan.
Beyond, three launches of O(S) work in all: each block's histogram (``LARGE_BLOCK``
slots per program), their exclusive prefix sums over the blocks, one program per
``SCAN_BINS`` bins (in place, the totals in one more row), then each block sorts itself
and stores ``perm`` and, for the prefill GEMM that reads its A rows in place, the
inverse (each slot's sorted position).  Same results as the torch path,
bitwise: a stable sort is unique.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2
from .quant import quant_block

BLOCK = 128
MAX_SLOTS = 2048  # up to this many slots, one launch (each program histograms all S slots)
# slots per program of the three-launch sort, and bins per program of its prefix sums: on
# the H200 256 / 8 sorted 4096-131072 slots in 11-17 µs where 1024 / 32 took 19-21
# (bench/sort_slots.py with both patched; docs/benchmarks.md)
LARGE_BLOCK = 256
SCAN_BINS = 8
CNT_STEP = tl.constexpr(1024)  # counters zeroed per store
# The loop over slot blocks has a constant trip count (masked by S) so one compiled
# kernel serves every S: a runtime trip count would also not run in the interpreter.
NUM_BLOCKS = MAX_SLOTS // BLOCK


@triton.jit
def _key(ids_ptr, j, S, E):
    ids = tl.load(ids_ptr + j, mask=j < S, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit
def scatter_block(pid, ids_ptr, perm_ptr, offsets_ptr, rows_ptr, total, before, S, E, BLOCK: tl.constexpr,
                  NB: tl.constexpr, SLOT_ROWS: tl.constexpr, map_ptr, n_tiles, MAP_BM: tl.constexpr):
    """Block ``pid``'s slots to their sorted positions, given the histograms (``NB``
    bins) of all S keys (``total``) and of the blocks before this one (``before``):
    ``perm[dest] = slot`` and, with ``SLOT_ROWS``, ``rows[slot] = dest``; program 0
    also writes ``offsets``.  With ``MAP_BM`` > 0, also the GEMMs' tile map of
    ``n_tiles`` row tiles of MAP_BM rows (:func:`write_tile_map`)."""
    lane = tl.arange(0, BLOCK)
    i = pid * BLOCK + lane
    key = _key(ids_ptr, i, S, E)  # padded lanes get key E, and sort after every valid lane
    own = tl.histogram(key, NB, mask=i < S)
    packed = tl.sort(key * BLOCK + lane)
    k_p = packed // BLOCK
    slot = pid * BLOCK + packed % BLOCK
    less_all = tl.cumsum(total, 0) - total
    less_own = tl.cumsum(own, 0) - own
    dest = (tl.gather(less_all, k_p, 0) + tl.gather(before, k_p, 0)
            + (lane - tl.gather(less_own, k_p, 0)))
    tl.store(perm_ptr + dest, slot.to(perm_ptr.dtype.element_ty), mask=slot < S)
    if SLOT_ROWS:
        tl.store(rows_ptr + slot, dest.to(rows_ptr.dtype.element_ty), mask=slot < S)
    if pid == 0:
        eo = tl.arange(0, NB)
        tl.store(offsets_ptr + eo, tl.cumsum(total, 0), mask=eo < E)
    if MAP_BM > 0:
        write_tile_map(pid, map_ptr, n_tiles, total, less_all, k_p, dest, slot, S, E, NB, MAP_BM)


@triton.jit
def write_tile_map(pid, map_ptr, n_tiles, total, starts, key, dest, slot, S, E, NB: tl.constexpr,
                   MAP_BM: tl.constexpr):
    """The grouped GEMMs' map of their row tiles (``MAP_BM`` rows; int32, laid out as
    :func:`tile_map_size` says), from the lanes of one sort block: each slot (``key``
    its expert, ``dest`` its sorted row) writes its entry of its tile's slots, the slot
    of a tile's first row writes the tile's (expert, first row, the expert's end), and
    program 0 the header (the tiles with rows, the rows with an expert).  A GEMM program
    then loads its tile and its rows' slots at addresses it knows at its start, where
    it would otherwise scan the offsets for its tile and then load ``perm``."""
    bins = tl.arange(0, NB)
    tiles = tl.where(bins < E, tl.cdiv(total, MAP_BM), 0)  # the sentinels' bin E has none
    first_tile = tl.cumsum(tiles, 0) - tiles
    valid = (slot < S) & (key < E)
    r = dest - tl.gather(starts, key, 0)  # the slot's row within its expert's rows
    tile = tl.gather(first_tile, key, 0) + r // MAP_BM
    tl.store(map_ptr + 4 + 4 * n_tiles + tile * MAP_BM + r % MAP_BM, slot, mask=valid)
    head = map_ptr + 4 + 4 * tile
    first = valid & (r % MAP_BM == 0)
    tl.store(head, key, mask=first)
    tl.store(head + 1, dest, mask=first)
    tl.store(head + 2, tl.gather(starts + total, key, 0), mask=first)
    if pid == 0:
        tl.store(map_ptr, tl.sum(tiles, 0))
        tl.store(map_ptr + 1, tl.sum(tl.where(bins < E, total, 0), 0))


@triton.jit
def sort_block(pid, ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, map_ptr, n_tiles, BLOCK: tl.constexpr,
               NB: tl.constexpr, NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr, MAP_BM: tl.constexpr):
    """Block ``pid`` of the sort (program 0 also writes ``offsets``, and zeroes the
    ``n_cnt`` <= ``CNT_BLOCK`` int32 counters of the forward's fused activation and
    combine, if any: ``CNT_BLOCK`` a multiple of ``CNT_STEP``, 0 for none); with
    ``MAP_BM`` > 0 the blocks also write the GEMMs' tile map (:func:`write_tile_map`)."""
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
    scatter_block(pid, ids_ptr, perm_ptr, offsets_ptr, perm_ptr, total, before, S, E, BLOCK, NB, False, map_ptr,
                  n_tiles, MAP_BM)
    if pid == 0:
        for c0 in range(0, CNT_BLOCK, CNT_STEP):
            c = c0 + tl.arange(0, CNT_STEP)
            tl.store(cnt_ptr + c, tl.zeros((CNT_STEP,), dtype=tl.int32), mask=c < n_cnt)


@triton.jit
def _sort_kernel(ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, BLOCK: tl.constexpr, NB: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr):
    sort_block(tl.program_id(0), ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, offsets_ptr, 0, BLOCK, NB,
               NUM_BLOCKS, CNT_BLOCK, 0)


@triton.jit
def _sort_quant_kernel(ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, map_ptr, n_tiles, sort_programs,
                       x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, R, K, groups,
                       tw_ptr, out_ptr, addr_ptr,
                       BLOCK: tl.constexpr, NB: tl.constexpr, NUM_BLOCKS: tl.constexpr, CNT_BLOCK: tl.constexpr,
                       MAP_BM: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, STATIC: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, ADDRS: tl.constexpr):
    """The sort (programs ``[0, sort_programs)``) and the quantisation of the
    activations (the rest, ``groups`` K groups per row block) in one launch: they are
    independent, and at decode each is a few microseconds of launch latency.  Dynamic:
    x's R = T rows; static: each of the R = T rows into its TOPK slots (slot order),
    each with the scale ``s_ptr[e]`` of its expert e (the sort is not needed for
    that).  With ``ADDRS`` program 0 also writes the addresses of the ids, the routing
    weights and the layer's output (``tw_ptr``, ``out_ptr``) to ``addr_ptr[0:3]``
    (int64), from where the forward's later launches read them (:mod:`.plans`: a plan
    replayed as a CUDA graph)."""
    pid = tl.program_id(0)
    if ADDRS:
        if pid == 0:
            tl.store(addr_ptr, ids_ptr.to(tl.int64))
            tl.store(addr_ptr + 1, tw_ptr.to(tl.int64))
            tl.store(addr_ptr + 2, out_ptr.to(tl.int64))
    if pid < sort_programs:
        sort_block(pid, ids_ptr, perm_ptr, offsets_ptr, cnt_ptr, n_cnt, S, E, map_ptr, n_tiles, BLOCK, NB, NUM_BLOCKS,
                   CNT_BLOCK, MAP_BM)
    else:
        j = pid - sort_programs
        quant_block(j // groups, j % groups, x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, ids_ptr,
                    ids_ptr, s_ptr, ids_ptr, R, K, E, TOPK=TOPK, KP=KP, GROUP=GROUP, BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G,
                    SEARCH_STEPS=1, STATIC=STATIC, GATHER=False, SLOTS=STATIC, DEST=False, BY_RECIPROCAL=False,
                    GPP=1)


@triton.jit
def _sort_hist_kernel(ids_ptr, hist_ptr, S, E, BLOCK: tl.constexpr, NB: tl.constexpr):
    """The three-launch sort's first: block b's histogram of keys -> ``hist[b, :NB]``."""
    b = tl.program_id(0)
    j = b * BLOCK + tl.arange(0, BLOCK)
    h = tl.histogram(_key(ids_ptr, j, S, E), NB, mask=j < S)
    tl.store(hist_ptr + b * NB + tl.arange(0, NB), h)


@triton.jit
def _sort_scan_kernel(hist_ptr, n_blocks, NB: tl.constexpr, CB: tl.constexpr, RB: tl.constexpr):
    """The second: ``hist`` (n_blocks + 1, NB), its first n_blocks rows the blocks'
    histograms, becomes each bin's exclusive prefix sum over the blocks (the keys of the
    blocks before each), and its last row the totals.  Program c takes bins
    [c * CB, (c + 1) * CB), RB blocks a step (a ``while`` loop: the interpreter cannot
    run a ``for`` to a run-time bound)."""
    bins = tl.program_id(0) * CB + tl.arange(0, CB)
    carry = tl.zeros((CB,), dtype=tl.int32)
    j0 = 0
    while j0 < n_blocks:
        jb = j0 + tl.arange(0, RB)
        mask = (jb < n_blocks)[:, None]
        ptrs = hist_ptr + jb[:, None] * NB + bins[None, :]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(h, 0) - h + carry[None, :], mask=mask)
        carry += tl.sum(h, 0)
        j0 += RB
    tl.store(hist_ptr + n_blocks * NB + bins, carry)


@triton.jit
def _sort_scatter_kernel(ids_ptr, hist_ptr, perm_ptr, offsets_ptr, rows_ptr, S, E, n_blocks, BLOCK: tl.constexpr,
                         NB: tl.constexpr, SLOT_ROWS: tl.constexpr):
    """The third: block b's slots to their sorted positions, from its row of the prefix
    sums and the totals."""
    b = tl.program_id(0)
    bins = tl.arange(0, NB)
    before = tl.load(hist_ptr + b * NB + bins)
    total = tl.load(hist_ptr + n_blocks * NB + bins)
    scatter_block(b, ids_ptr, perm_ptr, offsets_ptr, rows_ptr, total, before, S, E, BLOCK, NB, SLOT_ROWS,
                  offsets_ptr, 0, 0)


def tile_map_size(n_tiles: int, bm: int) -> int:
    """int32 entries of the tile map of ``n_tiles`` row tiles of ``bm`` rows
    (:func:`write_tile_map`): a header [the tiles with rows, the rows with an expert, 0,
    0], then per tile [expert, first row, the expert's end, unused], then per tile its
    ``bm`` rows' slots.  Entries of tiles (and rows) past the real ones are never
    written, and never used."""
    return 4 + n_tiles * (4 + bm)


def sort_launch_shape(S: int, E: int) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK, NB, NUM_BLOCKS) for S slots (S <= MAX_SLOTS).  Up to ``BLOCK``
    slots (decode) one program of the fewest lanes that hold them (at least 16) sorts
    them all: its in-block sort network is shorter (16 lanes at T = 1 of a top-8 model,
    where 128 would sort 120 padding lanes too)."""
    bins = next_power_of_2(E + 1)
    if S <= BLOCK:
        return (1,), max(16, next_power_of_2(S)), bins, 1
    return (cdiv(S, BLOCK),), BLOCK, bins, NUM_BLOCKS


def large_sort_launch_shape(S: int, E: int) -> tuple[int, int, int, int, int]:
    """(blocks, BLOCK, NB, CB, RB) of the three-launch sort of S slots: ``blocks``
    programs of BLOCK slots in the first and the third launch, NB bins, the (blocks + 1,
    NB) int32 histograms between them, and the scan's NB / CB programs of CB bins taking
    RB blocks a step (RB x CB = 2048 int32)."""
    bins = next_power_of_2(E + 1)
    if bins * LARGE_BLOCK > 2**31:  # the in-block sort's key * BLOCK + lane is an int32
        raise ValueError(f"number of experts: expected at most {2**31 // LARGE_BLOCK - 1}, got {E}")
    cb = min(bins, SCAN_BINS)
    return cdiv(S, LARGE_BLOCK), LARGE_BLOCK, bins, cb, 2048 // cb
