"""Grouped block-scaled fp8 GEMM over expert-sorted rows, with a device-side tile map.

``out[orow(i)] = sum_k a[arow(i), k] * w[e(i), n, k]`` for the sorted rows i of each
expert, with per-K-step scales: one activation scale per row and ``bk`` group
(dynamic) or per expert (static), one weight scale per (``bn``, ``bk``) block (or per
matrix).  ``BLOCK_K`` divides ``bk``, so each K step multiplies one fp8 ``tl.dot``
(fresh float32 accumulator, so the fp8 MMA's partial sums are promoted to float32
every step) by ``a_scale[:, None] * w_scale[None, :]``.  When ``BN`` divides ``bn``
(or the weight has one scale per matrix) the tile's columns share one weight scale
per K step (``W_SCALE_PER_TILE``): the rescale is then one multiply-add per
accumulator element, ``acc += dot * (a_scale * w_scale)[:, None]``, instead of an
outer product plus a multiply-add, which matters where the tensor cores wait on it.
With dynamic scales and tiles of 64 rows or more, each K step's scales (a gather of
its rows' scales, which Triton's pipeliner does not prefetch) are loaded a step ahead.

No host sync and a grid independent of the routing: every program reads the (E,)
``offsets`` and finds its own (expert, row tile) with a cumsum of tiles per expert.
The grid has ``cdiv(S, BM) + min(E, S) + 1`` row tiles, an upper bound on the tiles
of E groups plus one tail group; tiles past the tail exit at once.  The tail tiles
(rows at or past ``offsets[-1]``, i.e. sentinel slots) write zeros, so every output
row is written.

``TILE_MAP`` (the experts forward's GEMMs up to 2048 slots, :mod:`.experts`): the sort
launch has written that map for tiles of ``BM`` rows (:func:`.sort.write_tile_map`), and
a program loads its tile's (expert, first row, the expert's end) and its rows' slots at
addresses it knows at its start.  Without it a decode program's first weight copy waits
for the offsets' load, the scan (CTA barriers at E = 128 and 256) and the load of
``perm`` that its A rows' addresses need; with it, for one load.  The gathered A rows are
then ``slot // TOPK`` and the scattered output rows the slots (no load of ``perm`` after
the K loop either): the same rows, so the same results bitwise.

``W_TABLE``: the weights are E separate (N, K) tensors (an ``nn.ModuleList`` of
experts) and ``w_ptr`` / ``ws_ptr`` point to (E,) int64 tables of their addresses
(:mod:`.moe_list`); expert e's tile reads its base address from the table, and the
arithmetic is otherwise the same, so the results equal the stacked weights' bitwise.
With ``W_SPLIT`` the table holds 2E (N, K) matrices, every expert's gate then every
expert's up, and ``out`` has 2N columns: a column tile reads the gate (first half of
the tiles) or the up matrix (second half) and writes its half of ``out``, so separate
gate and up weights take one launch, computed exactly as the fused (2N, K) matrix is.

``COMBINE`` (the down GEMM at decode, :mod:`.experts`): the kernel also does the
weighted combine of :mod:`.combine`, one launch fewer.  ``out`` is the (S, N) slot-order
y, as without it; each row tile, once its rows of a column tile are stored, adds one to
that column tile's counter (``counter_ptr``, zeroed by the sort kernel earlier in the
forward), and the program that brings it to the number of row tiles combines the
column tile for all T (<= ``TB``) tokens into ``final_ptr`` (T, N).  With ``ADDRS``
the ids', weights' and output's addresses come from ``addr_ptr`` (written by the sort's
launch: :func:`.combine.fed_pointers`) instead of the arguments.  The atomic is
acquire/release at GPU scope after a CTA barrier, so the last program sees every row
tile's stores; which program is last does not change a result.  Launched without FMA
contraction (as the combine kernel), so the combine rounds each product as the reference
does; the K loop's rescale is an explicit ``tl.fma``, so it rounds as in an unfused
launch (where the compiler contracts it to the same FMA).
With ``SPLIT`` > 1 (decode, where too few (expert, column tile) programs would stream
the weights: :func:`.config.gemm_config`) each program sums one of SPLIT ranges of K
into float32 partials (S, SPLIT, N), every row tile and range counts, and the combine
adds a slot's partials in range order and rounds that to y's dtype first.

``GATED`` (the gate_up GEMM at decode): the kernel also runs the gated activation and
its quantisation for the down GEMM (:func:`.activation.gated_act_quant`), one launch
fewer, with the same pattern: one counter per quantisation group of I, at
``counter_ptr + CNT_OFF``.  Each row tile, once its tile of ``out`` (h) is stored,
counts itself on every group whose gate or up columns the tile holds, and the program
that completes a group's count (every row tile of every column tile holding the
group) quantises that group for all sorted rows, ROWS (<= S rounded up to a power of
two) in blocks of RB, into ``act_q_ptr`` / ``act_s_ptr``.  Also launched without FMA
contraction, as the activation kernel is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..functional import cdiv
from .activation import gated_act_quant
from .combine import combine_tokens, fed_pointers
from .quant import round_to


@triton.jit
def load_weight_scale(ws_ptr, idx, mask, SCALE_E8M0: tl.constexpr):
    """Weight scales as float32; UE8M0 bytes (2^(u-127); 0 -> 2^-127, 255 -> NaN)
    are expanded in-kernel so the scale grid is never converted on the host.
    ``mask`` may be a scalar ``True`` (one in-bounds scale)."""
    if SCALE_E8M0:
        u = tl.load(ws_ptr + idx, mask=mask, other=127).to(tl.int32)
        bits = tl.where(u == 0, 0x400000, tl.where(u == 255, 0x7FC00000, u << 23))
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ws_ptr + idx, mask=mask, other=0.0)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, stride_am,                        # a (rows, K) e4m3, unit stride in K
    a_scale_ptr, stride_asm, stride_ask,     # dynamic: (rows, ceil(K/bk)) f32, either order; static: (E,) f32
    w_ptr,                                   # w (E, N, K) e4m3 contiguous; W_TABLE: (E,) int64 addresses of (N, K)
    ws_ptr, stride_wse, stride_wsn, stride_wsk,  # weight scale grid (0 strides broadcast); W_TABLE: (E,) addresses
    out_ptr, stride_om,                      # out (rows, N)
    perm_ptr,                                # (S,) sorted position -> slot (GATHER_A / SCATTER_OUT)
    offsets_ptr,                             # (E,) int32 inclusive cumsum of rows per expert
    map_ptr,                                 # TILE_MAP: the sort's map of the num_pid_m row tiles (module doc)
    ids_ptr, tw_ptr, final_ptr, counter_ptr, T,  # COMBINE: (T, k) ids and weights, (T, N) output; counters
    addr_ptr,                                # COMBINE with ADDRS: the addresses of ids, tw and final (int64)
    part_ptr,                                # SPLIT > 1: (S, SPLIT, N) float32 partial sums
    act_q_ptr, act_s_ptr, limit,             # GATED: (S, I) e4m3 out; dynamic (S, G) scales out, static (E,) in
    S, N, E, num_pid_m,
    K: tl.constexpr,  # constexpr: static trip count (and the interpreter cannot loop to a runtime int)
    TOPK: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, STATIC: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_OFFSETS: tl.constexpr, TILE_MAP: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr,
    W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr,  # W_ALIGN: bytes every table address is a multiple of
    W_SPLIT: tl.constexpr,  # W_TABLE of 2E (N, K) gates then ups -> out (rows, 2N)
    COMBINE: tl.constexpr, TB: tl.constexpr, KP: tl.constexpr, ADDRS: tl.constexpr,  # the fused combine (module doc)
    SPLIT: tl.constexpr, KS: tl.constexpr,  # split K (COMBINE only): SPLIT ranges of KS (a multiple of BK)
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_STATIC: tl.constexpr,  # fused activation
    NG: tl.constexpr, CNT_OFF: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_G: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    if ADDRS:
        ids_ptr, tw_ptr, final_ptr = fed_pointers(addr_ptr, ids_ptr, tw_ptr, final_ptr)
    tiles_n = tl.cdiv(N, BN)
    num_pid_n = 2 * tiles_n if W_SPLIT else tiles_n
    if SPLIT > 1:
        pid_s = pid // (num_pid_m * num_pid_n)  # the K range
        pid = pid % (num_pid_m * num_pid_n)
    else:
        pid_s = 0
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    if TILE_MAP:
        # every load at an address known at the start: the header, the tile's entry and
        # its rows' slots (those of a tile past the real ones are never written, nor used)
        total = tl.load(map_ptr)
        last = tl.load(map_ptr + 1)
        entry = map_ptr + 4 + 4 * pid_m
        e = tl.load(entry)
        row0 = tl.load(entry + 1)
        row_end = tl.load(entry + 2)
        slots = tl.load(map_ptr + 4 + 4 * num_pid_m + pid_m * BM + tl.arange(0, BM))
        if GATED:  # the activation's experts of its rows
            eo = tl.arange(0, EP)
            emask = eo < E
            ends = tl.minimum(tl.load(offsets_ptr + eo, mask=emask, other=0), S)
    elif HAS_OFFSETS:
        eo = tl.arange(0, EP)
        emask = eo < E
        # clamped into [0, S]: the caller's offsets (grouped_mm on CUDA checks no values)
        ends = tl.minimum(tl.maximum(tl.load(offsets_ptr + eo, mask=emask, other=0), 0), S)
        starts = tl.minimum(tl.maximum(tl.load(offsets_ptr + eo - 1, mask=emask & (eo > 0), other=0), 0), S)
        tiles = tl.cdiv(tl.maximum(ends - starts, 0), BM)
        cum = tl.cumsum(tiles, 0)
        total = tl.sum(tiles, 0)
        last = tl.max(ends, 0)
    else:
        total = tl.cdiv(S, BM)
        last = S

    if W_SPLIT:
        half = (pid_n >= tiles_n).to(tl.int32)  # 0: gate, 1: up
        n0 = (pid_n - half * tiles_n) * BN
    else:
        half = 0
        n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)  # rows of the weight matrix
    nmask = offs_n < N
    out_n = offs_n + half * N  # columns of out
    if pid_m >= total:
        # tail: rows past offsets[-1] belong to no expert; write them as zeros
        row0 = last + (pid_m - total) * BM
        if (row0 < S) & (pid_s == 0):
            rows = row0 + tl.arange(0, BM)
            rmask = rows < S
            if SCATTER_OUT:
                orow = tl.load(perm_ptr + rows, mask=rmask, other=0)
            else:
                orow = rows
            zero = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + orow.to(tl.int64)[:, None] * stride_om + out_n[None, :], zero,
                     mask=rmask[:, None] & nmask[None, :])
        if COMBINE:
            if (total == 0) & (pid_m == 0) & (pid_s == 0):  # no rows at all: the combine of nothing
                combine_tokens(0, T, out_n, nmask, out_ptr, part_ptr, ids_ptr, tw_ptr, final_ptr, N, E, TOPK, KP, TB,
                               SPLIT)
        return

    if not TILE_MAP:  # (the map's tile entry was loaded at the start)
        if HAS_OFFSETS:
            e = tl.sum((cum <= pid_m).to(tl.int32), 0)
            sel = eo == e
            row0 = tl.sum(tl.where(sel, starts + (pid_m - (cum - tiles)) * BM, 0), 0)
            row_end = tl.sum(tl.where(sel, ends, 0), 0)
        else:
            e = 0
            row0 = pid_m * BM
            row_end = S
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    if GATHER_A:
        if TILE_MAP:
            arow = slots // TOPK
        else:
            arow = tl.load(perm_ptr + rows, mask=rmask, other=0) // TOPK
    else:
        arow = rows
    arow = arow.to(tl.int64)
    e64 = e.to(tl.int64)
    if W_SPLIT:
        e64 += half * E  # the up matrices follow the gates in the table

    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :]
    if W_TABLE:
        # per-expert tensors where they are: their addresses, one table entry per expert
        # the alignment hint keeps the weight loads as wide as with one stacked tensor
        w_base = tl.multiple_of(tl.load(w_ptr + e64).to(tl.pointer_type(tl.float8e4nv)), W_ALIGN)
        if SCALE_E8M0:
            ws_base = tl.load(ws_ptr + e64).to(tl.pointer_type(tl.uint8))
        else:
            ws_base = tl.load(ws_ptr + e64).to(tl.pointer_type(tl.float32))
    else:
        w_base = w_ptr + e64 * N * K
        ws_base = ws_ptr + e64 * stride_wse
    w_ptrs = w_base + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    if W_SCALE_PER_TILE:
        ws_row = ws_base + (n0 // BN_SCALE) * stride_wsn
    else:
        ws_row = ws_base + (offs_n // BN_SCALE) * stride_wsn
    a_s = 0.0  # dynamic: each K step's per-row scales (_step_scales)
    if STATIC:
        if W_SCALE_PER_TILE:
            # the expert's scale once per row, as the dynamic scheme's per-row scales: the
            # same products, and the same rescale code (the scalar form of it ran the
            # static down GEMM of qwen3_30b_a3b T=8192 4.5 % slower on the H200)
            a_s = tl.load(a_scale_ptr + e + 0 * rows, mask=rmask, other=0.0)
        else:
            a_s = tl.load(a_scale_ptr + e)
    # The dynamic scheme's per-row scales of each K step are a gather.  With tiles of 64
    # rows and more (wgmma) both scales are loaded a step ahead, so that their latency
    # hides behind the step before: on the H200 the dynamic gate_up GEMMs of qwen3_30b_a3b
    # and deepseek_v3 at 512-4096 tokens ran 9-25 % faster.  Measured and not kept: the
    # activation scales alone ahead (no faster), the static scheme's scales ahead (slower),
    # and the 16-row decode tiles' (capped at 72 registers, they spilled; slower).
    PREFETCH_SCALES: tl.constexpr = (BM >= 64) and (not STATIC)
    if SPLIT > 1:
        k_lo = pid_s * KS
        a_ptrs += k_lo
        w_ptrs += k_lo
    else:
        k_lo = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # K groups are clamped in bounds (a scale past the grid could be NaN, and 0 * NaN is
    # NaN): the last range of a split-K launch may run whole steps past K (their dot is 0),
    # and the scales loaded a step ahead after the last step are never used
    if PREFETCH_SCALES:
        a_sv, w_s = _step_scales(a_scale_ptr, stride_asm, stride_ask, ws_row, stride_wsk, arow, rmask, nmask, a_s,
                                 tl.minimum(k_lo, K - 1) // BK_SCALE, STATIC, W_SCALE_PER_TILE, SCALE_E8M0)
    for kk in range(0, KS, BK):
        k0 = k_lo + kk
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if PREFETCH_SCALES:
            a_sv_next, w_s_next = _step_scales(a_scale_ptr, stride_asm, stride_ask, ws_row, stride_wsk, arow, rmask,
                                               nmask, a_s, tl.minimum(k0 + BK, K - 1) // BK_SCALE, STATIC,
                                               W_SCALE_PER_TILE, SCALE_E8M0)
        else:
            a_sv, w_s = _step_scales(a_scale_ptr, stride_asm, stride_ask, ws_row, stride_wsk, arow, rmask, nmask,
                                     a_s, tl.minimum(k0, K - 1) // BK_SCALE, STATIC, W_SCALE_PER_TILE, SCALE_E8M0)
        if W_SCALE_PER_TILE:
            scale = (a_sv * w_s)[:, None]
        elif STATIC:
            scale = a_sv * w_s[None, :]
        else:
            scale = a_sv[:, None] * w_s[None, :]
        # one FMA per element whatever the launch's fp_fusion: fused and unfused launches round alike
        acc = tl.fma(tl.dot(a, tl.trans(w)), tl.broadcast_to(scale, (BM, BN)), acc)
        if PREFETCH_SCALES:
            a_sv, w_s = a_sv_next, w_s_next
        a_ptrs += BK
        w_ptrs += BK

    if SCATTER_OUT:
        if TILE_MAP:
            orow = slots
        else:
            orow = tl.load(perm_ptr + rows, mask=rmask, other=0)
    else:
        orow = rows
    if SPLIT > 1:  # this K range's float32 sum; the combine adds the ranges in order
        prow = orow.to(tl.int64) * SPLIT + pid_s
        tl.store(part_ptr + prow[:, None] * N + out_n[None, :], acc, mask=rmask[:, None] & nmask[None, :])
    else:
        tl.store(out_ptr + orow.to(tl.int64)[:, None] * stride_om + out_n[None, :],
                 round_to(acc, out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
    if COMBINE:
        # every row tile counts itself once its rows of this column tile are stored; the
        # last one (release/acquire through the counter) combines the tile's columns
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == total * SPLIT - 1:
            tl.debug_barrier()
            combine_tokens(0, T, out_n, nmask, out_ptr, part_ptr, ids_ptr, tw_ptr, final_ptr, N, E, TOPK, KP, TB,
                           SPLIT)

    if GATED:
        # every row tile counts itself on each quantisation group of I that its columns
        # touch (gate or up); the last one for a group runs the group's activation
        tl.debug_barrier()
        I = N if W_SPLIT else N // 2
        c_lo = n0 + half * N  # the tile's columns of out: [c_lo, c_hi)
        c_hi = tl.minimum(c_lo + BN, N + half * N)
        for part in tl.static_range(2):  # the tile's gate columns, then its up columns
            lo = tl.maximum(c_lo, part * I) - part * I
            hi = tl.minimum(c_hi, part * I + I) - part * I
            for j in tl.static_range(NG):
                g = lo // BK_SCALE + j
                if (lo < hi) & (g * BK_SCALE < hi):
                    done = tl.atomic_add(counter_ptr + CNT_OFF + g, 1, sem="acq_rel", scope="gpu")
                    if done == total * _tiles_of_group(g, I, W_SPLIT, BK_SCALE, BN) - 1:
                        tl.debug_barrier()
                        for r0 in range(0, ROWS, RB):  # a loop, not unrolled: registers
                            act_rows = r0 + tl.arange(0, RB)
                            # each row's expert: the number of inclusive offsets <= row
                            expert = tl.sum(((ends[None, :] <= act_rows[:, None]) & emask[None, :]).to(tl.int32), 1)
                            gated_act_quant(out_ptr, stride_om, act_q_ptr, act_s_ptr, act_s_ptr, act_rows,
                                            act_rows < last, expert, g, I, limit, ACT, HAS_LIMIT, ACT_STATIC,
                                            BK_SCALE, BLOCK_G, BY_RECIPROCAL=False)


@triton.jit
def _step_scales(a_scale_ptr, stride_asm, stride_ask, ws_row, stride_wsk, arow, rmask, nmask, a_s, kg,
                 STATIC: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """K group ``kg``'s activation scales (dynamic: one per row; static: the expert's
    ``a_s``, unchanged) and weight scales (one per tile, or one per column)."""
    if W_SCALE_PER_TILE:
        w_s = load_weight_scale(ws_row, kg * stride_wsk, True, SCALE_E8M0)  # scalar
    else:
        w_s = load_weight_scale(ws_row, kg * stride_wsk, nmask, SCALE_E8M0)
    if STATIC:
        a_sv = a_s
    else:
        a_sv = tl.load(a_scale_ptr + arow * stride_asm + kg * stride_ask, mask=rmask, other=0.0)
    return a_sv, w_s


@triton.jit
def _tiles_of_group(g, I, W_SPLIT: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr):
    """Column tiles of the gate_up GEMM that hold columns of quantisation group ``g``:
    its gate columns ``[g * GROUP, end)`` and its up columns (at ``I`` onwards in the
    stacked (2I, K) matrix; the up half's tiles start afresh with ``W_SPLIT``)."""
    start = g * GROUP
    end = tl.minimum(start + GROUP, I)
    up = 0 if W_SPLIT else I
    return ((end - 1) // BN - start // BN + 1) + ((up + end - 1) // BN - (up + start) // BN + 1)


class WeightTable(NamedTuple):
    """E per-expert (N, K) e4m3 matrices read where they are (``W_TABLE``), or with
    ``split`` 2E: each expert's gate and up, written to the two column halves of the
    output (``W_SPLIT``)."""

    w: torch.Tensor  # (E,) or split (2E,) int64 device addresses of the matrices
    scale: torch.Tensor  # likewise, the addresses of their scale grids
    shape: tuple  # (E, N, K)
    scale_rows: int  # rows of each grid (1: one scale per matrix or one block of rows)
    scale_strides: tuple  # (row, column) strides of each grid, 0 for a size-1 dim
    scale_e8m0: bool  # UE8M0 grids (read as bytes), else float32
    align: int  # every weight address is a multiple of this many bytes (16, or 1)
    split: bool  # gate and up matrices -> (rows, 2N)


def max_row_tiles(S: int, E: int, BM: int, has_offsets: bool) -> int:
    """Upper bound on row tiles: each non-empty group adds at most one partial tile
    (and the tail group one more), whatever the routing."""
    if not has_offsets:
        return cdiv(S, BM)
    return cdiv(S, BM) + min(E, S) + 1
