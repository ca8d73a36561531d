"""Pure-torch numerical reference for every ``fp8_moe`` op.

This module is the definition of the numerics (docs/ops.md, "Numerics"):
the CPU implementations of the ops call it, the Triton kernels are tested against
it, and the benchmarks use it as ground truth.  It imports nothing else of the
package, takes plain tensors and does no argument checking (``ops.py`` checks).

Conventions used throughout:

* weights ``w`` (N, K) ``float8_e4m3fn``, ``w_scale_inv`` (ceil(N/bn), ceil(K/bk))
  or (1, 1) (one scale for the whole matrix), float32 or ``float8_e8m0fnu``;
* activations quantised per token and per ``bk``-wide group of K (dynamic) or with
  one float32 scale (static, per expert);
* float32 accumulation; every GEMM result rounded to its output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _within(block: int, size: int) -> int:
    """A block (or group) length clamped to the dimension it tiles: the same blocks, and
    padding (below) that grows with the dimension, not with a block far larger than it
    (one block of a matrix of any size is legal: per-tensor checkpoints)."""
    return min(block, max(size, 1))


# --------------------------------------------------------------------------- quantisation


def quantize_act_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group fp8 quantisation of activations.

    x (M, K) float -> (x_fp8 (M, K) e4m3, scale (M, ceil(K/group_size)) float32), with
    ``real = x_fp8.float() * scale`` per group.  ``scale = amax / 448``; an all-zero
    group has scale 0 and quantises to zeros (no 0/0).  A NaN in a group makes that
    group's scale NaN, so the NaN stays in its own row.
    """
    M, K = x.shape
    group_size = _within(group_size, K)
    G = cdiv(K, group_size)
    xf = x.float()
    pad = G * group_size - K
    xg = F.pad(xf, (0, pad)).view(M, G, group_size)
    amax = xg.abs().amax(dim=-1)  # propagates NaN
    scale = amax / FP8_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.div(xg, safe[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, G * group_size)[:, :K], scale


def quantize_act_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static fp8 quantisation: ``clamp(x / scale, -448, 448)`` cast to e4m3.

    ``scale`` broadcasts against ``x`` ((), (1,) or (M, 1)); it is the dequant
    multiplier.  Inf saturates to +-448; NaN stays NaN.
    """
    return torch.div(x.float(), scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _expand_scale_grid(scale_inv: torch.Tensor, shape: Sequence[int], block_size: Sequence[int]) -> torch.Tensor:
    """(gn, gk) block scales -> (N, K) float32, one value per weight element.

    A (1, 1) grid is one scale for the whole matrix (per-tensor checkpoints)."""
    N, K = shape
    bn, bk = _within(block_size[0], N), _within(block_size[1], K)
    s = scale_inv.float()
    if s.shape[-2:] == (1, 1):
        return s.expand(*s.shape[:-2], N, K)
    s = s.repeat_interleave(bn, dim=-2)[..., :N, :]
    return s.repeat_interleave(bk, dim=-1)[..., :K]


def dequantize_weight(w: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """w (..., N, K) e4m3 with its block scales -> float32 real weights."""
    return w.float() * _expand_scale_grid(scale_inv, w.shape[-2:], block_size)


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_act_dynamic`: q (M, K), scale (M, G) -> float32."""
    K = q.shape[1]
    return q.float() * scale.repeat_interleave(_within(group_size, K), dim=1)[:, :K]


def quantize_weight_blockwise(w: torch.Tensor, block_size: Sequence[int], scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise weight quantisation: w (..., N, K) float -> (e4m3, scale_inv grid).

    float32 scales are ``amax / 448`` (below 2^-126, where that quotient has fewer bits,
    one ulp above it where it rounded down and would saturate the block's largest weight);
    UE8M0 scales are ``2 ** ceil(log2(amax / 448))``
    (rounded up, so no weight saturates).  An all-zero block gets scale 1.  A block so
    small that its scale would fall below the scale dtype's smallest positive value
    (float32: 2^-149; UE8M0: 2^-127) gets that value: its weights stay unsaturated
    and the scale stays positive."""
    *lead, N, K = w.shape
    bn, bk = _within(block_size[0], N), _within(block_size[1], K)
    gn, gk = cdiv(N, bn), cdiv(K, bk)
    wf = F.pad(w.float(), (0, gk * bk - K, 0, gn * bn - N))
    blocks = wf.reshape(*lead, gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # (..., gn, gk)
    scale = amax / FP8_MAX
    if scale_dtype == torch.float8_e8m0fnu:
        scale = torch.exp2(torch.ceil(torch.log2(scale)).clamp_min(-127))
    else:
        scale = scale.clamp_min(2.0 ** -149)  # float32's smallest positive value
        # below 2^-126 the quotient has fewer bits: rounded down, it would divide the block's
        # largest weight to more than 448 (saturated, up to 12 % off); one ulp up cannot
        scale = torch.where((scale < 2.0 ** -126) & (amax / scale > FP8_MAX), torch.nextafter(scale, amax), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = torch.div(blocks, scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, gn * bn, gk * bk)[..., :N, :K].contiguous()
    return q, scale.to(scale_dtype)


# --------------------------------------------------------------------------- GEMMs


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: Sequence[int],
    act_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (M, K) @ dequant(w (N, K))^T -> (M, N), activations quantised to fp8 first
    (dynamic per-token groups, or static with the one-element ``act_scale``)."""
    return _linear_real(x, dequantize_weight(w, w_scale_inv, block_size), block_size[1], act_scale, out_dtype)


def _linear_real(x, wd, bk, act_scale, out_dtype) -> torch.Tensor:
    """:func:`linear` on the real (dequantised, float32) weight ``wd`` (N, K)."""
    # Elementwise ops keep the input's layout and the GEMM's summation order depends on
    # it: a contiguous copy makes the result independent of how x is strided.
    x = x.contiguous()
    if act_scale is None:
        q, s = quantize_act_dynamic(x, bk)
        xd = dequantize_act(q, s, bk)
    else:
        xd = quantize_act_static(x, act_scale.reshape(())).float() * act_scale.float().reshape(())
    return (xd @ wd.t()).to(out_dtype or x.dtype)


def grouped_mm(x, w, w_scale_inv, offsets, block_size, act_scale=None, out_dtype=None) -> torch.Tensor:
    """x (S, K) sorted by expert; rows [offsets[e-1], offsets[e]) use expert e.

    Rows at or past ``offsets[-1]`` belong to no expert and are zeros."""
    S = x.shape[0]
    out = x.new_zeros((S, w.shape[1]), dtype=out_dtype or x.dtype)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        end = min(end, S)
        if end > start:
            a = None if act_scale is None else act_scale[e]
            out[start:end] = linear(x[start:end], w[e], w_scale_inv[e], block_size, a, out_dtype)
        start = max(start, end)
    return out


def batched_mm(x, w, w_scale_inv, expert_ids, block_size, act_scale=None, out_dtype=None) -> torch.Tensor:
    """x (S, K), row i uses expert ``expert_ids[i]``; ids outside [0, E) give zero rows.

    Rows of one expert go through one GEMM (the same arithmetic as the eager loop)."""
    E = w.shape[0]
    out = x.new_zeros((x.shape[0], w.shape[1]), dtype=out_dtype or x.dtype)
    ids = expert_ids.long()
    for e in range(E):
        (rows,) = torch.where(ids == e)
        if rows.numel():
            a = None if act_scale is None else act_scale[e]
            out[rows] = linear(x[rows], w[e], w_scale_inv[e], block_size, a, out_dtype)
    return out


# --------------------------------------------------------------------------- experts


def gated_activation(h: torch.Tensor, activation: str, swiglu_limit: float | None = None) -> torch.Tensor:
    """h (M, 2I) gate_up product -> act(gate) * up, computed in float32 from ``h`` and
    rounded to ``h.dtype`` (the rounding an unfused loop does)."""
    gate, up = h.float().chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    if activation == "silu":
        a = F.silu(gate)
    elif activation == "gelu":
        a = F.gelu(gate)
    elif activation == "gelu_tanh":
        a = F.gelu(gate, approximate="tanh")
    elif activation == "relu":
        a = F.relu(gate)
    else:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return (a * up).to(h.dtype)


def combine(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of the per-slot expert outputs, in float32, deterministic.

    y (T*k, H) in slot order (row ``t*k + j`` is token t's j-th choice).  Each token
    sums its slots in ascending expert id (the order of the eager loop's
    ``index_add_`` over ``range(E)``); sentinel slots contribute nothing."""
    T, k = top_k_index.shape
    H = y.shape[-1]
    ids = top_k_index.long()
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, num_experts)
    order = torch.argsort(key, dim=1, stable=True)
    yv = y.view(T, k, H)
    rows = torch.arange(T, device=y.device)
    acc = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    for j in range(k):
        slot = order[:, j]
        contrib = yv[rows, slot].float() * top_k_weights[rows, slot].float()[:, None]
        acc += torch.where(valid[rows, slot][:, None], contrib, 0.0)
    return acc.to(out_dtype)


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of the flattened (T*k) slots by expert id, sentinels last.

    Returns ``perm`` (T*k,) sorted position -> slot index, and ``offsets`` (E,)
    int32 inclusive cumsum of slots per expert (sentinels not counted)."""
    ids = top_k_index.reshape(-1).long()
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    sorted_key, perm = torch.sort(key, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=ids.device)
    offsets = torch.searchsorted(sorted_key, bounds, right=False).to(torch.int32)
    return perm, offsets


def grouped_pipeline(hidden, top_k_index, top_k_weights, num_experts, gate_up_gemm, down_gemm,
                     activation="silu", swiglu_limit=None) -> torch.Tensor:
    """The grouped expert forward around two GEMMs: sort slots by expert, gate_up,
    activation, down, routing weight, combine.  ``gate_up_gemm(x_sorted, offsets)`` and
    ``down_gemm(a_sorted, offsets)`` are grouped GEMMs over the (E,) inclusive
    ``offsets`` (the reference's, or ``torch.ops.fp8_moe.grouped_mm`` with a block size
    of its own per projection).  hidden (T, H) -> (T, H)."""
    k = top_k_index.shape[1]
    perm, offsets = sort_by_expert(top_k_index, num_experts)
    h = gate_up_gemm(hidden[perm // k], offsets)
    a = gated_activation(h, activation, swiglu_limit)
    y_sorted = down_gemm(a, offsets)
    y = torch.empty_like(y_sorted)
    y[perm] = y_sorted  # back to slot order
    return combine(y, top_k_index, top_k_weights, num_experts, hidden.dtype)


def batched_pipeline(hidden, top_k_index, top_k_weights, num_experts, gate_up_gemm, down_gemm,
                     activation="silu", swiglu_limit=None) -> torch.Tensor:
    """As :func:`grouped_pipeline`, slots in their own order: ``gate_up_gemm(x, ids)``
    and ``down_gemm(a, ids)`` are batched GEMMs over ``ids`` (T*k,) slot -> expert."""
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)
    h = gate_up_gemm(hidden.repeat_interleave(k, dim=0), ids)
    a = gated_activation(h, activation, swiglu_limit)
    y = down_gemm(a, ids)
    return combine(y, top_k_index, top_k_weights, num_experts, hidden.dtype)


def grouped_experts(
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
    block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None,
) -> torch.Tensor:
    """Whole expert forward through :func:`grouped_mm`: sort slots by expert, gate_up,
    activation, down, routing weight, combine.  hidden (T, H) -> (T, H)."""
    return grouped_pipeline(
        hidden, top_k_index, top_k_weights, gate_up_proj.shape[0],
        lambda x, offsets: grouped_mm(x, gate_up_proj, gate_up_scale_inv, offsets, block_size, gate_up_act_scale),
        lambda a, offsets: grouped_mm(a, down_proj, down_scale_inv, offsets, block_size, down_act_scale),
        activation, swiglu_limit,
    )


def batched_experts(
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
    block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None,
) -> torch.Tensor:
    """Whole expert forward through :func:`batched_mm`, slots in their own order."""
    return batched_pipeline(
        hidden, top_k_index, top_k_weights, gate_up_proj.shape[0],
        lambda x, ids: batched_mm(x, gate_up_proj, gate_up_scale_inv, ids, block_size, gate_up_act_scale),
        lambda a, ids: batched_mm(a, down_proj, down_scale_inv, ids, block_size, down_act_scale),
        activation, swiglu_limit,
    )


def _list_grouped_mm(x, real_weight, N, offsets, block_size, act_scale=None) -> torch.Tensor:
    """:func:`grouped_mm` with expert e's real (N, K) weight from ``real_weight(e)``,
    dequantised only for experts with rows."""
    S = x.shape[0]
    out = x.new_zeros((S, N))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        end = min(end, S)
        if end > start:
            a = None if act_scale is None else act_scale[e]
            out[start:end] = _linear_real(x[start:end], real_weight(e), block_size[1], a, None)
        start = max(start, end)
    return out


def grouped_experts_list(
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
    block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None,
) -> torch.Tensor:
    """:func:`grouped_experts` on per-expert weight lists, expert by expert (no stacked copy).

    ``down_proj`` / ``down_scale_inv``: E tensors (H, I) and their grids.
    ``gate_up_proj`` / ``gate_up_scale_inv``: E fused (2I, H) matrices, or 2E (I, H)
    matrices, the gate of every expert then the up of every expert (Mixtral's w1 then
    w3); a separate gate and up act as their concatenation (in real weights), so the
    result is bitwise that of :func:`grouped_experts` on the stacked tensors."""
    E = len(down_proj)
    separate = len(gate_up_proj) == 2 * E
    H, I = down_proj[0].shape

    def gate_up_real(e):
        if separate:
            return torch.cat([dequantize_weight(gate_up_proj[i], gate_up_scale_inv[i], block_size)
                              for i in (e, E + e)])
        return dequantize_weight(gate_up_proj[e], gate_up_scale_inv[e], block_size)

    def down_real(e):
        return dequantize_weight(down_proj[e], down_scale_inv[e], block_size)

    return grouped_pipeline(
        hidden, top_k_index, top_k_weights, E,
        lambda x, offsets: _list_grouped_mm(x, gate_up_real, 2 * I, offsets, block_size, gate_up_act_scale),
        lambda a, offsets: _list_grouped_mm(a, down_real, H, offsets, block_size, down_act_scale),
        activation, swiglu_limit,
    )
