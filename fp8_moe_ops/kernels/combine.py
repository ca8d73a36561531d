"""Deterministic weighted combine of the per-slot expert outputs (no atomics).

out[t] = sum over token t's slots, in ascending expert id (ties by slot), of
``y[t*k + j].float() * w[t, j].float()``, sentinel slots adding 0.0, in float32,
rounded once: :func:`fp8_moe_ops.reference.combine` term by term.  Launched with
``enable_fp_fusion=False`` so ``acc + y * w`` is not contracted into an FMA (the
reference rounds the product first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2
from .launch import KernelCall, launch
from .quant import round_to


@triton.jit
def _combine_kernel(
    y_ptr,       # (T*k, H) activation dtype, slot order (row t*k + j); sentinel rows never read
    ids_ptr,     # (T, k) int expert ids, contiguous
    w_ptr,       # (T, k) float routing weights, contiguous
    out_ptr,     # (T, H)
    H, E,
    TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    j = tl.arange(0, KP)
    jm = j < TOPK
    ids = tl.load(ids_ptr + t * TOPK + j, mask=jm, other=E)
    valid = (ids >= 0) & (ids < E) & jm
    key = tl.where(valid, ids, E)
    # stable rank of each slot by (key, slot): the reference's argsort(stable=True)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        sel = rank == r
        slot = tl.sum(tl.where(sel, j, 0), 0)
        ok = tl.sum(tl.where(sel & valid, 1, 0), 0) > 0
        wt = tl.load(w_ptr + t * TOPK + slot).to(tl.float32)
        yv = tl.load(y_ptr + (t * TOPK + slot) * H + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        acc += tl.where(ok, yv * wt, 0.0)
    tl.store(out_ptr + t * H + cols, round_to(acc, out_ptr.dtype.element_ty), mask=cmask)


def combine_launch_shape(T: int, H: int, topk: int) -> tuple[tuple[int, int], int, int]:
    """(grid, KP, BLOCK_H)."""
    block_h = min(1024, next_power_of_2(H))
    return (T, cdiv(H, block_h)), next_power_of_2(max(topk, 2)), block_h


def combine_call(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                 out: torch.Tensor) -> KernelCall:
    """The launch of :func:`combine` (``top_k_index`` / ``top_k_weights`` contiguous)."""
    T, k = top_k_index.shape
    H = y.shape[1]
    grid, kp, block_h = combine_launch_shape(T, H, k)
    return KernelCall(_combine_kernel, grid, (y, top_k_index, top_k_weights, out, H, num_experts),
                      dict(TOPK=k, KP=kp, BLOCK_H=block_h), dict(enable_fp_fusion=False))


def combine(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
            out: torch.Tensor) -> torch.Tensor:
    """out (T, H) = the weighted combine of y (T * k, H) (slot order); ids outside
    [0, num_experts) add nothing."""
    launch(combine_call(y, top_k_index.contiguous(), top_k_weights.contiguous(), num_experts, out))
    return out
