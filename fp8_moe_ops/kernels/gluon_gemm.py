"""The Gluon source of the Hopper prefill GEMM; :mod:`.ws_gemm` says what it computes,
when it runs, and builds its launch.  Gluon's API is experimental (it has moved between
Triton releases): this module is written against Triton 3.6 and 3.7, and :mod:`.ws_gemm`
imports it only where it can."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the CTA-wide barrier: gl.thread_barrier in Triton 3.6, gl.barrier in 3.7
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

__all__ = ["OUT_TYPES", "TensorDescriptor", "_ws_gemm_kernel", "load_tile", "ring", "out_layout", "shared_layout"]


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _add_max(a0, a1, b0, b1):
    return a0 + b0, gl.maximum(a1, b1)


@gluon.jit
def _clamped(offset, S):
    """An offset as int32 in [0, S]."""
    return gl.minimum(gl.maximum(offset.to(gl.int32), 0), S)


@gluon.jit
def _expert_tiles(offsets_ptr, S, E, BM: gl.constexpr, EP: gl.constexpr):
    """What the tile map needs of ``offsets`` beyond two of its entries, the same for
    every tile of a launch: the inclusive cumsum of the experts' row tiles (in ``EP``
    lanes), the number of row tiles, and the end of the experts' rows."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    eo = gl.arange(0, EP, layout=lay)
    emask = eo < E
    # int32 whatever the offsets' dtype (TMA coordinates are 32-bit), clamped into [0, S]
    # (grouped_mm on CUDA checks no values)
    ends = _clamped(gl.load(offsets_ptr + eo, mask=emask, other=0), S)
    starts = _clamped(gl.load(offsets_ptr + eo - 1, mask=emask & (eo > 0), other=0), S)
    tiles = (gl.maximum(ends - starts, 0) + BM - 1) // BM
    return gl.associative_scan(tiles, 0, _add), gl.sum(tiles, 0), gl.max(ends, 0)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(row tile, column tile) of ``tile`` in the grouped order: ``GROUP_M`` row tiles
    take each column tile in turn."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@gluon.jit
def _expert_coords(tile, cum, total, num_pid_n, GROUP_M: gl.constexpr):
    """(row tile, column tile) of ``tile`` in the order by expert: expert after expert,
    its row tiles (from :func:`_expert_tiles`' ``cum``) in groups of ``GROUP_M`` from its
    first, each group's row tiles taking each column tile in turn; so the tiles that read
    one weight tile are consecutive, and a group never holds two experts' rows (nor cuts
    an expert of up to ``GROUP_M`` row tiles).  The tail's row tiles (past the experts'
    rows) row-major after them.  A group's tiles are those of its row tiles' range times
    the column tiles, so the row tile ``tile // num_pid_n`` is in ``tile``'s group."""
    q = tile // num_pid_n
    passed = cum <= q
    before = gl.max(gl.where(passed, cum, 0), 0)  # the first row tile of q's expert
    end = gl.min(gl.where(passed, 2147483647, cum), 0)  # its last + 1 (past the tail: none)
    first = before + ((q - before) // GROUP_M) * GROUP_M  # q's group's first row tile
    local = tile - first * num_pid_n
    tail = q >= total
    size = gl.where(tail, 1, gl.minimum(end, first + GROUP_M) - first)
    return gl.where(tail, q, first + local % size), gl.where(tail, tile % num_pid_n, local // size)


@gluon.jit
def _tile_rows(pid_m, cum, total, last, offsets_ptr, S, E, BM: gl.constexpr):
    """(expert, row0, row1, whether it is a tail tile) of row tile ``pid_m``, from
    :func:`_expert_tiles`: the grouped kernel's tile map.  A tail tile (past the
    experts' rows) runs no K step over [row0, S) and so stores zeros."""
    # the expert: the number of experts whose row tiles all come before pid_m (the first
    # with a tile past it, so one with rows); and the cumsum before it, in one reduction
    passed = cum <= pid_m
    e, before = gl.reduce((passed.to(gl.int32), gl.where(passed, cum, 0)), 0, _add_max)
    e = gl.minimum(e, E - 1)
    row0 = _clamped(gl.load(offsets_ptr + e - 1, mask=e > 0, other=0), S) + (pid_m - before) * BM
    row1 = _clamped(gl.load(offsets_ptr + e), S)
    tail = pid_m >= total
    row0 = gl.where(tail, _tail_row0(pid_m, total, last, BM), row0)
    row1 = gl.where(tail, S, row1)
    return e, row0, row1, tail


@gluon.jit
def _tail_row0(pid_m, total, last, BM: gl.constexpr):
    """The first row of tail tile ``pid_m``: tail tiles split [last, S) in ``BM`` rows."""
    return last + (pid_m - total) * BM


@gluon.jit
def _put_tile(info, s, e, row0, row1, pid_n):
    """Writes a tile's expert, rows and column tile into ``info``'s slot ``s`` (fields
    0-3), every lane the same values; then a barrier, so that the thread which next
    arrives at the slot's ``ready`` has made the writes its own."""
    field = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [gl.num_warps()], [0]))
    info.index(s).store(gl.where(field == 0, e, gl.where(field == 1, row0, gl.where(field == 2, row1, pid_n))))
    _cta_barrier()


@gluon.jit
def _get_tile(info, s):
    """(expert, row0, row1, column tile) that :func:`_put_tile` wrote into ``info``'s slot ``s``."""
    lay: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    field = gl.arange(0, 4, layout=lay)
    v = info.index(s).load(lay)
    return (gl.sum(gl.where(field == 0, v, 0), 0), gl.sum(gl.where(field == 1, v, 0), 0),
            gl.sum(gl.where(field == 2, v, 0), 0), gl.sum(gl.where(field == 3, v, 0), 0))


@gluon.jit
def _weight_scale(ptr, SCALE_E8M0: gl.constexpr):
    """One weight scale as float32; UE8M0 bytes expanded as :func:`.grouped_gemm.load_weight_scale`."""
    if SCALE_E8M0:
        u = gl.load(ptr).to(gl.int32)
        bits = gl.where(u == 0, 0x400000, gl.where(u == 255, 0x7FC00000, u << 23))
        return bits.to(gl.float32, bitcast=True)
    else:
        return gl.load(ptr)


@gluon.jit
def _row_scale(i, BK: gl.constexpr, BK_SCALE: gl.constexpr, as_row, rmask, ROW_MAJOR: gl.constexpr):
    """K step ``i``'s activation scales of the rows, read from global memory where they
    are laid out row-major (``as_row``: each row's first; issued before the step's MMAs,
    whose run hides the load); else unused."""
    if ROW_MAJOR:
        return gl.load(as_row + (i * BK) // BK_SCALE, mask=rmask, other=0.0)
    else:
        return 0.0


@gluon.jit
def _act_scale(row_scale, as_smem, it, rmask, a_s, HALF: gl.constexpr, STAGES: gl.constexpr, STATIC: gl.constexpr,
               KMAJOR: gl.constexpr):
    """The rows' activation scales of ring position ``it`` (read once its ``ready``
    barrier has passed): K-group major, those the producer copied beside the step's A
    tile (0 for rows past the tile's expert); row-major, ``row_scale``
    (:func:`_row_scale`); static, the expert's, read through ``a_s`` (each row's pointer to
    it; 0 for rows past the tile's expert)."""
    if STATIC:
        return gl.load(a_s, mask=rmask, other=0.0)
    elif KMAJOR:
        HM: gl.constexpr = rmask.type.shape[0]
        v = as_smem.index(it % STAGES).slice(HALF * HM, HM).load(rmask.type.layout)
        return gl.where(rmask, v, 0.0)
    else:
        return row_scale


@gluon.jit
def _step_weight_scale(i, BK: gl.constexpr, BK_SCALE: gl.constexpr, ws_tile, stride_wsk, SCALE_E8M0: gl.constexpr):
    """K step ``i``'s weight scale of the tile (of its first block of columns)."""
    return _weight_scale(ws_tile + ((i * BK) // BK_SCALE) * stride_wsk, SCALE_E8M0)


@gluon.jit
def _start_mma(a_smem, w_smem, ready, it, zero, HALF: gl.constexpr, STAGES: gl.constexpr, COL: gl.constexpr = 0,
               WN: gl.constexpr = 1):
    """Waits for ring position ``it``'s tiles to arrive and starts the MMAs of this
    warpgroup's half of the rows on them, with block ``COL`` of the weight tile's ``WN``
    blocks of columns (asynchronous: the caller waits for them, then releases the slot)."""
    HM: gl.constexpr = a_smem.type.shape[1] // 2
    BN: gl.constexpr = w_smem.type.shape[1] // WN
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    w = w_smem.index(s)
    if WN > 1:  # a wide weight tile: one block of its rows (the output's columns)
        w = w.slice(COL * BN, BN, dim=0)
    return warpgroup_mma(a_smem.index(s).slice(HALF * HM, HM, dim=0), w.permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def ring(a_desc, w_desc, STAGES: gl.constexpr):
    """The shared-memory ring of ``STAGES`` K steps: A and weight tiles, and per slot a
    ``ready`` mbarrier (the producer's TMA bytes arrived) and an ``empty`` one (both
    consumer warpgroups are done with it).  (Activation scales laid out K-group major
    have a ring beside it: :func:`_ws_gemm_kernel`.)"""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)
    return a_smem, w_smem, ready, empty


@gluon.jit
def load_tile(a_desc, w_desc, a_smem, w_smem, ready, empty, row0, wrow, KT, it, STAGES: gl.constexpr,
              as_ptr=None, as_smem=None, stride_ask=0, S=0, BK_SCALE: gl.constexpr = 128,
              COPY_SCALES: gl.constexpr = False):
    """TMA loads of one tile's ``KT`` K steps (A rows from ``row0``, weight rows from
    ``wrow``) into the ring from its position ``it`` (K steps issued before); returns
    the position after them.  With ``COPY_SCALES``, ``as_ptr`` (the dynamic scheme's activation scales
    of the S rows, K-group major: K group g's from ``g * stride_ask``) also each step's
    scales of the tile's rows into ``as_smem``, on the same barrier: by ``cp.async``
    (a tile's rows start anywhere, and TMA's innermost coordinate must be 16-byte
    aligned), whose completion the barrier awaits beside the TMA bytes."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BM: gl.constexpr = a_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    if COPY_SCALES:
        # lane l copies rows l, l + 32, ...: a copy instruction's 32 lanes read 128 adjacent bytes (a tile's
        # rows start at any row, so each copy is 4 bytes; the producer is one warp)
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        srows = row0 + gl.arange(0, BM, layout=lay)
    for i in range(KT):
        s = it % STAGES
        # the slot's previous K step (it - STAGES) must be released by both consumers
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
        if COPY_SCALES:
            # each lane's copies, then its arrival once they land (the barrier's count raised by
            # one before the expect's arrival below, so the phase waits for them)
            async_copy.async_copy_global_to_shared(as_smem.index(s), as_ptr + ((i * BK) // BK_SCALE) * stride_ask
                                                   + srows, mask=srows < S)
            async_copy.mbarrier_arrive(ready.index(s))
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, i * BK], ready.index(s), a_smem.index(s))
        tma.async_copy_global_to_shared(w_desc, [wrow, i * BK], ready.index(s), w_smem.index(s))
        it += 1
    return it


@gluon.jit
def _producer(a_desc, w_desc, a_smem, w_smem, ready, empty, info, as_ptr, as_smem, stride_as, offsets_ptr, S, N, E,
              KT, num_pid_m, EP: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, BK_SCALE: gl.constexpr,
              COPY_SCALES: gl.constexpr, BY_EXPERT: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    cum, total, last = _expert_tiles(offsets_ptr, S, E, BM, EP)
    it = 0  # K steps issued by this program, over all its tiles: the ring's position
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        if BY_EXPERT:
            pid_m, pid_n = _expert_coords(tile, cum, total, num_pid_n, GROUP_M)
        else:
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        e, row0, row1, tail = _tile_rows(pid_m, cum, total, last, offsets_ptr, S, E, BM)
        kt = gl.where(tail, 0, KT)
        # the tile's expert and rows, for the consumers, beside its first K step (a tail tile has none: the
        # consumers know it from the tile's index); written once the slot is free, before its loads
        # announce it
        if kt > 0:
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
            _put_tile(info, s, e, row0, row1, pid_n)
        it = load_tile(a_desc, w_desc, a_smem, w_smem, ready, empty, row0, e * N + pid_n * BN, kt, it, STAGES,
                       as_ptr, as_smem, stride_as, S, BK_SCALE, COPY_SCALES)


@gluon.jit
def _consumer(a_smem, w_smem, ready, empty, info, c_smem, as_ptr, stride_as, as_smem, ws_ptr, stride_wse, stride_wsn,
              stride_wsk, out_ptr, stride_om, out_desc, perm_ptr, offsets_ptr, S, N, E, KT, num_pid_m,
              HALF: gl.constexpr, STAGES: gl.constexpr, BN_SCALE: gl.constexpr, BK_SCALE: gl.constexpr,
              STATIC: gl.constexpr, KMAJOR: gl.constexpr, SCATTER_OUT: gl.constexpr, SCALE_E8M0: gl.constexpr,
              EP: gl.constexpr, GROUP_M: gl.constexpr, LAG: gl.constexpr, EPILOGUE: gl.constexpr, WN: gl.constexpr,
              BY_EXPERT: gl.constexpr):
    BM: gl.constexpr = a_smem.type.shape[1]
    HM: gl.constexpr = BM // 2
    BK: gl.constexpr = a_smem.type.shape[2]
    BN: gl.constexpr = w_smem.type.shape[1] // WN  # the columns of one MMA (a tile has WN blocks of them)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    zero = gl.zeros((HM, BN), gl.float32, mma)
    num_pid_n = gl.cdiv(N, BN * WN)
    num_tiles = num_pid_m * num_pid_n
    it = 0  # K steps consumed by this program, over all its tiles (as the producer counts them)
    # the scan in at least 128 lanes (one per thread): with fewer, ptxas spilled some of the
    # wide tiles' per-tile values at E <= 16 (sm_90a, compiled offline)
    EPC: gl.constexpr = EP if EP > 128 else 128
    total, last = _expert_tiles(offsets_ptr, S, E, BM, EPC)[1:]
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        # the expert, rows and column tile from the producer, beside the tile's first K step:
        # between two tiles the consumers read only shared memory; a tail tile, which has no K
        # step, from its index (in the order by expert the tail's tiles come last, row-major)
        if BY_EXPERT:
            pid_m = tile // num_pid_n
            tail_n = tile % num_pid_n
        else:
            pid_m, tail_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        tail = pid_m >= total
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1, pred=~tail)
        e, row0, row1, pid_n = _get_tile(info, s)
        pid_n = gl.where(tail, tail_n, pid_n)
        e = gl.where(tail, 0, e)
        row0 = gl.where(tail, _tail_row0(pid_m, total, last, BM), row0)
        row1 = gl.where(tail, S, row1)
        n0 = pid_n * BN * WN
        ws_tile = ws_ptr + e.to(gl.int64) * stride_wse + (n0 // BN_SCALE) * stride_wsn
        ws_next = ((n0 + BN) // BN_SCALE - n0 // BN_SCALE) * stride_wsn  # the second block's, from ws_tile (WN == 2)
        rows = row0 + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
        rmask = rows < row1
        if STATIC:
            # the expert's scale once per row, as the grouped kernel's static tiles read it, at each K step
            # (an L1 hit) as the dynamic scheme's rows read theirs: held across the K loop, the scattered
            # 128 x 256 form left ptxas short of registers (local memory inside the loop, sm_90a)
            a_s = as_ptr + e + 0 * rows
        else:
            a_s = 0.0  # unused: the rows' own scales are read per K step
        ROW_MAJOR: gl.constexpr = not STATIC and not KMAJOR
        as_row = as_ptr + rows.to(gl.int64) * stride_as  # (row-major: each row's first scale)
        if SCATTER_OUT:  # the output rows, read before the K loop: the store does not wait for them
            orow = gl.load(perm_ptr + rows, mask=rmask, other=0)
        else:
            orow = rows
        acc = gl.zeros((HM, BN), gl.float32, mma)
        acc1 = gl.zeros((HM, BN), gl.float32, mma)  # the second block of columns (WN == 2; else unused)
        kt = gl.where(tail, 0, KT)
        if WN == 2:
            # each K step's A half feeds two MMAs, one per block of columns: half the A bytes
            # per FLOP.  One MMA in flight at a time (two accumulators and two products
            # would not fit in the registers); the other warpgroup's MMAs overlap the FMAs
            for i in range(kt):
                w_s0 = _step_weight_scale(i, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                w_s1 = _step_weight_scale(i, BK, BK_SCALE, ws_tile + ws_next, stride_wsk, SCALE_E8M0)
                r_s = _row_scale(i, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                t = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES, 0, WN)
                a_sc = _act_scale(r_s, as_smem, it, rmask, a_s, HALF, STAGES, STATIC, KMAJOR)
                scale0 = a_sc * w_s0
                scale1 = a_sc * w_s1
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
                acc = acc + t * scale0[:, None]
                t = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES, 1, WN)
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
                mbarrier.arrive(empty.index(it % STAGES), count=1)
                acc1 = acc1 + t * scale1[:, None]
                it += 1
        else:
            if LAG:
                # two K steps per trip: the second step's MMAs run while the first is rescaled
                # (none in flight across the loop's back edge: ptxas would serialise every wgmma)
                for i in range(0, kt - 1, 2):
                    w_s0 = _step_weight_scale(i, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                    w_s1 = _step_weight_scale(i + 1, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                    r_s0 = _row_scale(i, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                    r_s1 = _row_scale(i + 1, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                    t0 = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES)
                    t1 = _start_mma(a_smem, w_smem, ready, it + 1, zero, HALF, STAGES)
                    scale0 = _act_scale(r_s0, as_smem, it, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s0
                    scale1 = _act_scale(r_s1, as_smem, it + 1, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s1
                    t0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0, ))
                    mbarrier.arrive(empty.index(it % STAGES), count=1)
                    acc = acc + t0 * scale0[:, None]
                    t1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1, ))
                    mbarrier.arrive(empty.index((it + 1) % STAGES), count=1)
                    acc = acc + t1 * scale1[:, None]
                    it += 2
                first = kt - kt % 2
            else:
                first = 0
            for i in range(first, kt):
                w_s = _step_weight_scale(i, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                r_s = _row_scale(i, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                t = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES)
                scale = _act_scale(r_s, as_smem, it, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
                mbarrier.arrive(empty.index(it % STAGES), count=1)
                acc = acc + t * scale[:, None]  # contracted to one FMA, as the grouped kernel's tl.fma
                it += 1
        _store_tile(acc.to(out_ptr.dtype.element_ty), c_smem, out_ptr, stride_om, out_desc, orow, rmask, row0, row1,
                    n0, S, N, HALF, HALF * WN, True, SCATTER_OUT, EPILOGUE)
        if WN == 2:  # its staging buffer is the warpgroup's second: the wait above freed both
            _store_tile(acc1.to(out_ptr.dtype.element_ty), c_smem, out_ptr, stride_om, out_desc, orow, rmask, row0,
                        row1, n0 + BN, S, N, HALF, HALF * WN + 1, False, SCATTER_OUT, EPILOGUE)
    if EPILOGUE == 2:
        tma.store_wait(0)  # the last tile's store has left shared memory before the program ends


@gluon.jit
def _store_rows(vals, out_ptr, stride_om, orow, rmask, n0, N, EPILOGUE: gl.constexpr):
    """Stores ``vals`` (rows in the MMA layout) into rows ``orow`` of ``out`` where
    ``rmask``: from the MMA layout (``EPILOGUE`` 0: each store 4 bytes of a row), or
    through shared memory into 16 bytes per thread of whole rows (1 and 2)."""
    BN: gl.constexpr = vals.type.shape[1]
    if EPILOGUE == 0:
        lay: gl.constexpr = vals.type.layout
        v = vals
        r = orow
        m = rmask
    else:
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        v = gl.convert_layout(vals, lay)
        r = gl.convert_layout(orow, gl.SliceLayout(1, lay))
        m = gl.convert_layout(rmask, gl.SliceLayout(1, lay))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, lay))
    gl.store(out_ptr + r.to(gl.int64)[:, None] * stride_om + cols[None, :], v, mask=m[:, None] & (cols < N)[None, :])


@gluon.jit
def _store_tile(vals, c_smem, out_ptr, stride_om, out_desc, orow, rmask, row0, row1, n0, S, N, HALF: gl.constexpr,
                BUF: gl.constexpr, WAIT: gl.constexpr, SCATTER_OUT: gl.constexpr, EPILOGUE: gl.constexpr):
    """Stores this warpgroup's half of a tile's columns from ``n0`` (``vals``: its rows
    in the MMA layout, ``orow`` their output rows, ``rmask`` the tile's own).  With
    ``EPILOGUE`` 2, where every row of the half is the tile's (output rows in place; the
    half not past its expert's end, or ending at S, where TMA clips), it is staged in
    shared memory (``c_smem``'s buffer ``BUF``; with ``WAIT``, once this warpgroup's
    earlier stores have read theirs) and stored by TMA, asynchronously: the next tile's
    MMAs start at once.  Otherwise :func:`_store_rows`."""
    HM: gl.constexpr = vals.type.shape[0]
    if EPILOGUE == 2 and not SCATTER_OUT:
        first = row0 + HALF * HM
        if (first + HM <= row1) | (row1 == S):
            if WAIT:
                tma.store_wait(0)  # the previous tile's store has read the staging buffer
            c_smem.index(BUF).store(vals)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [first, n0], c_smem.index(BUF))
        else:
            _store_rows(vals, out_ptr, stride_om, orow, rmask, n0, N, EPILOGUE)
    else:
        _store_rows(vals, out_ptr, stride_om, orow, rmask, n0, N, EPILOGUE)


@gluon.jit
def _ws_gemm_kernel(
    a_desc,                              # TMA: a (rows, K) e4m3, expert-sorted, tiles (128, 128)
    as_ptr, stride_as,                   # dynamic: (rows, ceil(K/bk)) f32, row-major (strides (stride_as, 1)) or
                                         # K-group major (KMAJOR: strides (1, stride_as)); static: (E,) f32, 0
    w_desc,                              # TMA: the (E * N, K) view of w (E, N, K), tiles (128 * WN, 128)
    ws_ptr, stride_wse, stride_wsn, stride_wsk,  # weight scale grid (0 strides broadcast)
    out_ptr, stride_om,                  # out (rows, N)
    out_desc,                            # TMA: out, tiles (64, 128) (EPILOGUE 2; else None)
    perm_ptr,                            # (S,) sorted position -> slot (SCATTER_OUT)
    offsets_ptr,                         # (E,) int32 inclusive cumsum of rows per expert
    S, N, E, KT, num_pid_m,
    BN_SCALE: gl.constexpr, BK_SCALE: gl.constexpr, STATIC: gl.constexpr, KMAJOR: gl.constexpr,
    SCATTER_OUT: gl.constexpr, SCALE_E8M0: gl.constexpr, EP: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LAG: gl.constexpr,
    EPILOGUE: gl.constexpr, WN: gl.constexpr, BY_EXPERT: gl.constexpr,
):
    a_smem, w_smem, ready, empty = ring(a_desc, w_desc, STAGES)
    # per ring slot, the expert, first row and end row of the tile whose first K step it holds
    info = gl.allocate_shared_memory(gl.int32, [STAGES, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if EPILOGUE == 2:  # a staging buffer per consumer warpgroup and block of columns for its TMA stores
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [2 * WN] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_smem = info  # unused
    COPY_SCALES: gl.constexpr = KMAJOR and not STATIC
    if COPY_SCALES:  # per ring slot, the K step's activation scales of the tile's rows
        as_smem = gl.allocate_shared_memory(gl.float32, [STAGES, a_desc.block_type.shape[0]],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        as_smem = info  # unused
    gl.warp_specialize([
        (_consumer, (a_smem, w_smem, ready, empty, info, c_smem, as_ptr, stride_as, as_smem, ws_ptr, stride_wse,
                     stride_wsn, stride_wsk, out_ptr, stride_om, out_desc, perm_ptr, offsets_ptr, S, N, E, KT,
                     num_pid_m, 0, STAGES, BN_SCALE, BK_SCALE, STATIC, COPY_SCALES, SCATTER_OUT, SCALE_E8M0, EP,
                     GROUP_M, LAG, EPILOGUE, WN, BY_EXPERT)),
        (_consumer, (a_smem, w_smem, ready, empty, info, c_smem, as_ptr, stride_as, as_smem, ws_ptr, stride_wse,
                     stride_wsn, stride_wsk, out_ptr, stride_om, out_desc, perm_ptr, offsets_ptr, S, N, E, KT,
                     num_pid_m, 1, STAGES, BN_SCALE, BK_SCALE, STATIC, COPY_SCALES, SCATTER_OUT, SCALE_E8M0, EP,
                     GROUP_M, LAG, EPILOGUE, WN, BY_EXPERT)),
        (_producer, (a_desc, w_desc, a_smem, w_smem, ready, empty, info, as_ptr, as_smem, stride_as, offsets_ptr,
                     S, N, E, KT, num_pid_m, EP, GROUP_M, STAGES, BK_SCALE, COPY_SCALES, BY_EXPERT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(empty.index(j))


# the output dtypes the TMA store stages (ws_gemm stores others whole rows at a time)
OUT_TYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def shared_layout(block_shape: list[int]):
    """The NVMMA shared layout of an e4m3 tile of ``block_shape`` (what a descriptor carries)."""
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.float8e4nv)


def out_layout(block_shape: list[int], dtype: torch.dtype):
    """The NVMMA shared layout of an output tile of ``block_shape`` and ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for(block_shape, OUT_TYPES[dtype])
