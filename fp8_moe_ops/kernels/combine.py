"""Deterministic weighted combine of the per-slot expert outputs.

out[t] = sum over token t's slots, in ascending expert id (ties by slot), of
``y[t*k + j].float() * w[t, j].float()``, sentinel slots adding 0.0, in float32,
rounded once: :func:`fp8_moe_ops.reference.combine` term by term.  Launched with
``enable_fp_fusion=False`` so ``acc + y * w`` is not contracted into an FMA (the
reference rounds the product first).  :func:`combine_tokens` is also the combine that
the down GEMM runs in its own launch at decode (``COMBINE`` in :mod:`.grouped_gemm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2
from .launch import KernelCall, launch
from .quant import round_to


@triton.jit
def slot_ranks(t, tm, ids_ptr, E, TOPK: tl.constexpr, KP: tl.constexpr):
    """(j, valid, rank), each (tokens, KP): tokens ``t`` (where ``tm``) and their slots
    ``j`` (``KP`` lanes, ``TOPK`` of them real), whether a slot's expert id is in [0, E),
    and its stable rank by (id, slot), sentinels last: the reference's argsort(stable=True)."""
    j = tl.arange(0, KP)
    jm = j < TOPK
    ids = tl.load(ids_ptr + t[:, None] * TOPK + j[None, :], mask=tm[:, None] & jm[None, :], other=E)
    valid = (ids >= 0) & (ids < E) & jm[None, :]
    key = tl.where(valid, ids, E)
    kj, ki = key[:, None, :], key[:, :, None]
    before = (kj < ki) | ((kj == ki) & (j[None, None, :] < j[None, :, None]))
    return j, valid, tl.sum(before.to(tl.int32), axis=2)


@triton.jit
def fed_pointers(addr_ptr, ids_ptr, w_ptr, out_ptr):
    """The ids', routing weights' and output's addresses that the sort's launch wrote to
    ``addr_ptr[0:3]`` (``ADDRS`` in :mod:`.sort`), as pointers of the arguments' types
    (those arguments' own addresses are not read).  The output is the forward's own
    allocation: 16-byte aligned."""
    ids = tl.load(addr_ptr).to(ids_ptr.dtype)
    w = tl.load(addr_ptr + 1).to(w_ptr.dtype)
    out = tl.multiple_of(tl.load(addr_ptr + 2).to(out_ptr.dtype), 16)
    return ids, w, out


@triton.jit
def combine_tokens(t0, T, cols, cmask, y_ptr, part_ptr, ids_ptr, w_ptr, out_ptr, H, E, TOPK: tl.constexpr,
                   KP: tl.constexpr, TB: tl.constexpr, SPLIT: tl.constexpr):
    """out[t, cols] for the tokens t0 .. t0+TB-1 below T: each token's slots' rows of y
    (T*k, H), weighted and summed in ascending expert id (ties by slot).  With SPLIT > 1
    a slot's y is its SPLIT float32 partials (T*k, SPLIT, H) added in order and rounded
    to out's dtype.  Read past L1 (``.cg``): in the down GEMM's fused combine other
    programs wrote them in this launch.  A slot at a time, in a GEMM program's registers;
    :func:`_combine_kernel` loads a token's slots at once."""
    t = tl.arange(0, TB).to(tl.int64) + t0
    tm = t < T
    j, valid, rank = slot_ranks(t, tm, ids_ptr, E, TOPK, KP)
    acc = tl.zeros((TB, cols.shape[0]), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        sel = rank == r
        slot = tl.sum(tl.where(sel, j[None, :], 0), 1)
        ok = (tl.sum(tl.where(sel & valid, 1, 0), 1) > 0) & tm
        wt = tl.load(w_ptr + t * TOPK + slot, mask=tm, other=0.0).to(tl.float32)
        mask = ok[:, None] & cmask[None, :]
        if SPLIT > 1:
            rows = ((t * TOPK + slot) * SPLIT)[:, None] * H + cols[None, :]
            part = tl.zeros((TB, cols.shape[0]), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                part += tl.load(part_ptr + rows + s * H, mask=mask, other=0.0, cache_modifier=".cg")
            yv = round_to(part, out_ptr.dtype.element_ty).to(tl.float32)
        else:
            yv = tl.load(y_ptr + (t * TOPK + slot)[:, None] * H + cols[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        acc += tl.where(ok[:, None], yv * wt[:, None], 0.0)
    tl.store(out_ptr + t[:, None] * H + cols[None, :], round_to(acc, out_ptr.dtype.element_ty),
             mask=tm[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(
    y_ptr,       # (T*k, H) activation dtype, slot order (row t*k + j); sentinel rows never read
    ids_ptr,     # (T, k) int expert ids, contiguous
    w_ptr,       # (T, k) float routing weights, contiguous
    out_ptr,     # (T, H)
    T, H, E,
    addr_ptr,    # ADDRS: int64 addresses of ids, w and out (:func:`fed_pointers`)
    TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr, ADDRS: tl.constexpr,
):
    """out[t, cols] of one token t and BLOCK_H columns, as :func:`combine_tokens` sums
    them; its slots' rows loaded in one (KP, BLOCK_H) load, all in flight at once.  (That
    function's loop compiles to one or two slots' loads at a time, which left the memory
    idle at 512-2048 tokens, where an SM holds few programs: docs/benchmarks.md.)"""
    if ADDRS:
        ids_ptr, w_ptr, out_ptr = fed_pointers(addr_ptr, ids_ptr, w_ptr, out_ptr)
    tok = tl.program_id(0).to(tl.int64)
    t = tok + tl.arange(0, 1)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    j, valid, rank = slot_ranks(t, t < T, ids_ptr, E, TOPK, KP)
    # the token's slots in rank order (KP,): slot[r], and whether it has an expert
    sel = rank[:, None, :] == j[None, :, None]  # (1, rank r, slot j)
    slot = tl.sum(tl.sum(tl.where(sel, j[None, None, :], 0), 2), 0)
    ok = tl.sum(tl.sum(tl.where(sel & valid[:, None, :], 1, 0), 2), 0) > 0
    row = tok * TOPK + slot
    wt = tl.load(w_ptr + row, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row[:, None] * H + cols[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
    terms = y.to(tl.float32) * wt[:, None]  # rank r's in row r; 0.0 past the token's real slots
    acc = tl.zeros((BLOCK_H, ), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        # row r alone: the other rows' -0.0 add nothing, whatever row r holds (a lane's KP rows
        # are its own registers, so this compiles to picking one)
        acc += tl.sum(tl.where(j[:, None] == r, terms, -0.0), 0)
    tl.store(out_ptr + tok * H + cols, round_to(acc, out_ptr.dtype.element_ty), mask=cmask)


def slots_block(topk: int) -> int:
    """KP: the power of two (>= 2) the kernels pad a token's k slots to."""
    return next_power_of_2(max(topk, 2))


def combine_launch_shape(T: int, H: int, topk: int) -> tuple[tuple[int, int], int, int]:
    """(grid, KP, BLOCK_H): a program per token and block of up to 2048 columns (against
    1024: 10-15 % faster at H = 7168 and 2048 on the H200, ``bench/aux_kernels.py``); past
    8 slots per token proportionally fewer, so that a program's (KP, BLOCK_H) tile of y
    stays the size measured at k = 8 (16 values a lane; larger tiles were not measured)."""
    kp = slots_block(topk)
    block_h = min(2048 * 8 // max(kp, 8), next_power_of_2(H))
    return (T, cdiv(H, block_h)), kp, block_h


def combine_call(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                 out: torch.Tensor, addresses: torch.Tensor | None = None) -> KernelCall:
    """The launch of :func:`combine` (``top_k_index`` / ``top_k_weights`` contiguous);
    with ``addresses`` (int64 (3,), written earlier in the forward) the kernel reads the
    addresses of those two and ``out`` from there."""
    T, k = top_k_index.shape
    H = y.shape[1]
    grid, kp, block_h = combine_launch_shape(T, H, k)
    table = y if addresses is None else addresses
    return KernelCall(_combine_kernel, grid, (y, top_k_index, top_k_weights, out, T, H, num_experts, table),
                      dict(TOPK=k, KP=kp, BLOCK_H=block_h, ADDRS=addresses is not None),
                      dict(enable_fp_fusion=False))


def combine(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
            out: torch.Tensor) -> torch.Tensor:
    """out (T, H) = the weighted combine of y (T * k, H) (slot order); ids outside
    [0, num_experts) add nothing."""
    launch(combine_call(y, top_k_index.contiguous(), top_k_weights.contiguous(), num_experts, out))
    return out
