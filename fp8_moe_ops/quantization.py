"""Weight quantisation for checkpoints built from float weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference
from ._checks import check_block_size, check_scale_dtype, fail, shape_str

_FLOAT32_MAX = torch.finfo(torch.float32).max
# the smallest block maximum that UE8M0 scales cannot dequantise finitely: its scale is
# 2^120 and amax / 2^120 >= 240, the e4m3 midpoint that rounds (to even) up to 256
_E8M0_LIMIT = 240.0 * 2.0 ** 120


def quantize_weight(
    w: torch.Tensor,
    block_size: Sequence[int] | None = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise weights to fp8 (DeepSeek-V3 layout).

    Args:
        w: (N, K) or (E, N, K) float weights (any float dtype).
        block_size: ``[bn, bk]``; N and K need not be multiples of it.  ``None``: one
            scale per matrix (per-tensor weights), a (..., 1, 1) grid that every op
            accepts with any ``block_size``.
        scale_dtype: ``torch.float32`` (``amax / 448``) or ``torch.float8_e8m0fnu``
            (UE8M0, ``2 ** ceil(log2(amax / 448))``, so no weight saturates).

    Returns:
        ``(w_fp8, scale_inv)``: ``w_fp8`` e4m3 of ``w``'s shape, ``scale_inv``
        (..., ceil(N/bn), ceil(K/bk)) of ``scale_dtype``; the real weight is
        ``w_fp8.float() * scale_inv`` of its block.  No autograd history.  A block
        whose ``amax / 448`` is below the scale dtype's smallest positive value (2^-149,
        UE8M0 2^-127) gets that value; an all-zero block gets 1.

    Raises ``ValueError`` for NaN or Inf, for values beyond float32's range (float64
    weights: the scales are float32) and, with UE8M0 scales, for magnitudes of
    240 * 2^120 or more (the block's largest value would round to 256 * 2^120, which
    dequantises to inf).
    """
    return quantize_named(w, block_size, scale_dtype, "w")


def quantize_named(w: torch.Tensor, block_size: Sequence[int] | None, scale_dtype: torch.dtype,
                   name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight`, its errors naming the weight ``name`` (the caller's
    argument: ``gate_up_proj``, ``linear.weight``)."""
    if not isinstance(w, torch.Tensor):
        fail(TypeError, name, "a Tensor", type(w).__name__)
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        fail(TypeError, name, "a float32/bfloat16/float16 tensor", w.dtype)
    if w.dim() not in (2, 3):
        fail(ValueError, name, "a 2-D (N, K) or 3-D (E, N, K) tensor", shape_str(w))
    # per-tensor: one block the matrix's size (at least 1 x 1, for an empty one)
    block_size = [max(n, 1) for n in w.shape[-2:]] if block_size is None else check_block_size(block_size)
    check_scale_dtype(scale_dtype)
    if w.device.type == "meta":
        fail(ValueError, name, "a tensor with values to quantise", "a tensor on the meta device")
    w = w.detach()  # quantisation has no gradient: the outputs carry no autograd history
    if not bool(torch.isfinite(w).all()):
        fail(ValueError, name, "finite values", "NaN or Inf")
    if w.numel():
        amax = float(w.abs().max())
        if amax > _FLOAT32_MAX:  # a float64 weight: its scales are float32
            fail(ValueError, name, f"values within float32's range (|w| <= {_FLOAT32_MAX:.4g})", f"max |w| {amax:.4g}")
        if scale_dtype == torch.float8_e8m0fnu and amax >= _E8M0_LIMIT:
            fail(ValueError, name, f"|w| below {_E8M0_LIMIT:.4g} for UE8M0 scales (such a block's largest value "
                 "rounds to 256 * 2^120, which overflows float32 when dequantised)", f"max |w| {amax:.4g}")
    return reference.quantize_weight_blockwise(w, tuple(int(b) for b in block_size), scale_dtype)
