"""Weight quantisation for checkpoints built from float weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference
from ._checks import check_block_size, check_scale_dtype


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
        ``w_fp8.float() * scale_inv`` of its block.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w: expected a Tensor, got {type(w).__name__}")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        raise TypeError(f"w: expected a float32/bfloat16/float16 tensor, got {w.dtype}")
    if w.dim() not in (2, 3):
        raise ValueError(f"w: expected a 2-D (N, K) or 3-D (E, N, K) tensor, got shape {tuple(w.shape)}")
    block_size = w.shape[-2:] if block_size is None else check_block_size(block_size)
    check_scale_dtype(scale_dtype)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w: expected finite values, got NaN or Inf")
    return reference.quantize_weight_blockwise(w, tuple(int(b) for b in block_size), scale_dtype)
