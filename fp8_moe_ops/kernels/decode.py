"""The gate_up half of a decode step in one launch: the sort of the slots, the
activations' quantisation, the gate and up GEMMs, the gated activation and its
quantisation for the down GEMM.

At decode a layer streams its experts' weights once and each kernel is microseconds:
the sort-and-quantise launch before the gate_up GEMM costs about as much as its own
work in launch latency.  Here every program sorts the S (<= ``DECODE_SLOTS`` of
:mod:`.experts`, at most 64) slots itself, in registers: a slot's sorted position is
the number of slots whose (expert, slot) key is smaller, with sentinels (ids outside
[0, E)) last, which is the stable order of :mod:`.sort` and
:func:`fp8_moe_ops.routing.sort_slots`.  Program 0 also writes ``perm`` and
``offsets`` for the down GEMM and zeroes the counters of its fused combine (the down
GEMM runs after this launch, in stream order).

Program ``(u, c)`` takes the u-th expert with slots (ascending id) and column group c
(``GROUP`` = bk columns of I): it gathers its slots' token rows, quantises each K
step of them in registers exactly as :mod:`.quant` does (the step is one quantisation
group, so ``BK`` = bk), and accumulates both the gate and the up columns of the group,
so it holds every input of the group's activation: no counter, no other program to
wait for.  The accumulation is the grouped GEMM's (:mod:`.grouped_gemm`): a fresh fp8
``tl.dot`` per K step, rescaled by an explicit FMA; its rounding to the activation
dtype, the activation and the quantisation are :mod:`.activation`'s.  So the rows of
the quantised intermediate (``q`` (S, I) in sorted order, and its scales) are those of
the unfused forward.  Launched without FMA contraction, as the activation kernel.

The weights are the stacked (E, 2I, H) tensor or an address table (``W_TABLE``, the
ModuleList op; with ``W_SPLIT`` separate gate and up matrices), as in the grouped GEMM.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2
from .activation import ACT_IDS, gated_act
from .config import block_k
from .grouped_gemm import load_weight_scale
from .launch import KernelCall
from .moe import weight_args
from .quant import quantize_and_store, quantize_dynamic, quantize_static, round_to
from .sort import CNT_STEP

__all__ = ["MAX_SLOTS", "usable", "decode_gate_up_call"]

MAX_SLOTS = 64  # the in-register sort holds (S, S) compares per program
NUM_STAGES = 3  # weight loads in flight: two programs of 36 KB per stage fit an SM's shared memory


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, stride_xm,                       # hidden (T, H), unit stride in H
    ids_ptr,                                # (S,) each slot's expert (the contiguous (T, k) ids)
    up_scale_ptr,                           # static: (E,) act scales of the gate_up GEMM
    w_ptr, ws_ptr, stride_wse, stride_wsn, stride_wsk,  # (E, 2I, H) e4m3 and its scale grid; W_TABLE: addresses
    perm_ptr, offsets_ptr, cnt_ptr, n_cnt,  # out, program 0: (S,) and (E,) int32 for the down GEMM; counters zeroed
    q_ptr, s_ptr, down_scale_ptr,           # out: (S, I) e4m3, sorted rows; dynamic (S, G) scales; static (E,) in
    limit, S, E, I, groups,
    H: tl.constexpr, TOPK: tl.constexpr, SP: tl.constexpr, EB: tl.constexpr, EP: tl.constexpr,
    CNT_BLOCK: tl.constexpr, BN_SCALE: tl.constexpr,
    STATIC_UP: tl.constexpr, STATIC_DOWN: tl.constexpr, SCALE_E8M0: tl.constexpr, W_SCALE_PER_TILE: tl.constexpr,
    W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr, W_SPLIT: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    u = pid // groups
    c = pid % groups

    # every slot's sort key (sentinels E, padding lanes E + 1) and sorted position
    j = tl.arange(0, SP)
    jm = j < S
    ids = tl.load(ids_ptr + j, mask=jm, other=-1)
    key = tl.where(jm, tl.where((ids >= 0) & (ids < E), ids, E), E + 1).to(tl.int32)
    ki, kj = key[None, :], key[:, None]
    same_before = (ki == kj) & (j[None, :] < j[:, None])
    pos = tl.sum(((ki < kj) | same_before).to(tl.int32), 1)
    if pid == 0:
        tl.store(perm_ptr + pos, j.to(perm_ptr.dtype.element_ty), mask=jm)
        for e0 in range(0, EP, EB):
            eo = e0 + tl.arange(0, EB)
            tl.store(offsets_ptr + eo, tl.sum((ki <= eo[:, None]).to(tl.int32), 1), mask=eo < E)
        for c0 in range(0, CNT_BLOCK, CNT_STEP):
            cn = c0 + tl.arange(0, CNT_STEP)
            tl.store(cnt_ptr + cn, tl.zeros((CNT_STEP,), dtype=tl.int32), mask=cn < n_cnt)

    # this program's expert: the u-th distinct one among the slots, in ascending id
    first = (key < E) & (tl.sum(same_before.to(tl.int32), 1) == 0)
    rank = tl.sum((first[None, :] & (ki < kj)).to(tl.int32), 1)
    mine = first & (rank == u)
    if tl.sum(mine.to(tl.int32), 0) == 0:
        return
    e = tl.sum(tl.where(mine, key, 0), 0)
    start = tl.sum((key < e).to(tl.int32), 0)  # its first sorted row
    count = tl.sum((key == e).to(tl.int32), 0)

    e64 = e.to(tl.int64)
    cols = c * BK + tl.arange(0, BK)  # the group's columns of I: gate rows of the weight, and up rows
    nmask = cols < I
    if W_TABLE:
        # the alignment hint keeps the weight loads as wide as with one stacked tensor
        gate_w = tl.multiple_of(tl.load(w_ptr + e64).to(tl.pointer_type(tl.float8e4nv)), W_ALIGN)
        if SCALE_E8M0:
            gate_s = tl.load(ws_ptr + e64).to(tl.pointer_type(tl.uint8))
        else:
            gate_s = tl.load(ws_ptr + e64).to(tl.pointer_type(tl.float32))
        if W_SPLIT:  # every expert's gate, then every expert's up: (I, H) matrices each
            up_w = tl.multiple_of(tl.load(w_ptr + E + e64).to(tl.pointer_type(tl.float8e4nv)), W_ALIGN)
            if SCALE_E8M0:
                up_s = tl.load(ws_ptr + E + e64).to(tl.pointer_type(tl.uint8))
            else:
                up_s = tl.load(ws_ptr + E + e64).to(tl.pointer_type(tl.float32))
            up0 = 0
        else:
            up_w, up_s, up0 = gate_w, gate_s, I
    else:
        gate_w = w_ptr + e64 * 2 * I * H
        gate_s = ws_ptr + e64 * stride_wse
        up_w, up_s, up0 = gate_w, gate_s, I
    offs_k = tl.arange(0, BK)
    gate_ptrs0 = gate_w + cols.to(tl.int64)[:, None] * H + offs_k[None, :]
    up_ptrs0 = up_w + (up0 + cols).to(tl.int64)[:, None] * H + offs_k[None, :]
    if W_SCALE_PER_TILE:
        gate_srow = gate_s + (c * BK // BN_SCALE) * stride_wsn
        up_srow = up_s + ((up0 + c * BK) // BN_SCALE) * stride_wsn
    else:
        gate_srow = gate_s + (cols // BN_SCALE) * stride_wsn
        up_srow = up_s + ((up0 + cols) // BN_SCALE) * stride_wsn
    if STATIC_UP:
        up_scale = tl.load(up_scale_ptr + e)

    for r0 in range(0, SP, BM):  # the expert's rows, BM at a time (more than BM only with repeated ids)
        if r0 < count:
            r = r0 + tl.arange(0, BM)
            rmask = r < count
            rows = start + r  # sorted positions
            slot = tl.sum(tl.where((pos[None, :] == rows[:, None]) & jm[None, :], j[None, :], 0), 1)
            x_ptrs = x_ptr + (slot // TOPK).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
            gate_ptrs, up_ptrs = gate_ptrs0, up_ptrs0
            acc_g = tl.zeros((BM, BK), dtype=tl.float32)
            acc_u = tl.zeros((BM, BK), dtype=tl.float32)
            for k0 in range(0, H, BK):
                kmask = (k0 + offs_k) < H
                x = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                if STATIC_UP:
                    a = quantize_static(x, up_scale)
                    a_s = tl.where(rmask, up_scale, 0.0)
                else:
                    a, a_s = quantize_dynamic(x)
                wg = tl.load(gate_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
                wu = tl.load(up_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
                kg = k0 // BK  # BK is the quantisation group of K, of the weights' grid too
                if W_SCALE_PER_TILE:
                    scale_g = (a_s * load_weight_scale(gate_srow, kg * stride_wsk, True, SCALE_E8M0))[:, None]
                    scale_u = (a_s * load_weight_scale(up_srow, kg * stride_wsk, True, SCALE_E8M0))[:, None]
                else:
                    scale_g = a_s[:, None] * load_weight_scale(gate_srow, kg * stride_wsk, nmask, SCALE_E8M0)[None, :]
                    scale_u = a_s[:, None] * load_weight_scale(up_srow, kg * stride_wsk, nmask, SCALE_E8M0)[None, :]
                acc_g = tl.fma(tl.dot(a, tl.trans(wg)), tl.broadcast_to(scale_g, (BM, BK)), acc_g)
                acc_u = tl.fma(tl.dot(a, tl.trans(wu)), tl.broadcast_to(scale_u, (BM, BK)), acc_u)
                x_ptrs += BK
                gate_ptrs += BK
                up_ptrs += BK
            mask = rmask[:, None] & nmask[None, :]
            dt = x_ptr.dtype.element_ty  # h's dtype in the unfused forward: rounded to it first
            act = gated_act(round_to(acc_g, dt).to(tl.float32), round_to(acc_u, dt).to(tl.float32), mask, limit, dt,
                            ACT, HAS_LIMIT)
            quantize_and_store(act, rows, rmask, mask, cols, c, e + 0 * r, q_ptr, s_ptr, down_scale_ptr, I,
                               GROUP=BK, STATIC=STATIC_DOWN)


def usable(block: tuple[int, int]) -> bool:
    """Whether the kernel takes this block size: a K step of one whole quantisation
    group (bk a power of two from 16 to 128)."""
    return block_k(block[1]) == block[1]


def decode_gate_up_call(ids, hidden, up_scale, w, w_scale, perm, offsets, counters, q, q_scale, down_scale,
                        I: int, block: tuple[int, int], activation: str, swiglu_limit) -> KernelCall:
    """The launch over the (T, k) ``ids`` (contiguous) and ``hidden`` (T, H): ``w`` /
    ``w_scale`` as :func:`.moe._gemm_call` takes them (the stacked (E, 2I, H) weight and
    its grid, or a :class:`WeightTable` and None); ``up_scale`` / ``down_scale`` the
    static act scales (E,) or None; ``q`` / ``q_scale`` the (S, I) quantised
    intermediate and its dynamic scales (or the static ``down_scale``); ``counters``
    those of the down GEMM's fused combine, or None."""

    T, H = hidden.shape
    k = ids.shape[1]
    S = T * k
    E = w.shape[0]
    bn, bk = block
    w, ws, ws_strides, one_scale_row, e8m0, table, split, align = weight_args(w, w_scale)
    groups = cdiv(I, bk)
    sp = max(16, next_power_of_2(S))
    ep = next_power_of_2(E)
    grid = (min(E, S) * groups,)
    # one scale per (row block, K group) for the tile's gate columns and for its up columns
    per_tile = one_scale_row or (bn % bk == 0 and (split or I % bk == 0))
    dummy = q
    n_cnt = 0 if counters is None else counters.numel()  # the down GEMM's combine counters, if fused
    return KernelCall(_decode_gate_up_kernel, grid, (
        hidden, hidden.stride(0), ids, up_scale if up_scale is not None else dummy,
        w, ws, *ws_strides,
        perm, offsets, dummy if counters is None else counters, n_cnt,
        q, q_scale, down_scale if down_scale is not None else dummy,
        float(swiglu_limit) if swiglu_limit is not None else 0.0, S, E, I, groups,
    ), dict(H=H, TOPK=k, SP=sp, EB=min(ep, max(16, 4096 // sp)), EP=ep,
            CNT_BLOCK=cdiv(n_cnt, CNT_STEP.value) * CNT_STEP.value, BN_SCALE=bn,
            STATIC_UP=up_scale is not None, STATIC_DOWN=down_scale is not None, SCALE_E8M0=e8m0,
            W_SCALE_PER_TILE=per_tile, W_TABLE=table, W_ALIGN=align, W_SPLIT=split,
            ACT=ACT_IDS[activation], HAS_LIMIT=swiglu_limit is not None, BM=16, BK=bk),
        dict(num_warps=4, num_stages=NUM_STAGES, enable_fp_fusion=False))

