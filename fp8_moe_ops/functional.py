"""Torch building blocks of the expert forward, shared by the modules, the
integrations and the graph pass (any device, no Triton).

These are production code, written apart from :mod:`fp8_moe_ops.reference` on
purpose: the reference is the numerics oracle the kernels and these functions are
tested against, so nothing that runs in production may call it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import ACT_DTYPES, check_choice, check_swiglu_limit
from .routing import combine, sort_slots

__all__ = ["ACTIVATIONS", "FP8_MAX", "cdiv", "gated_activation", "grouped_pipeline", "batched_pipeline"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")

_ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "relu": F.relu,
}


def cdiv(a: int, b: int) -> int:
    """Ceil division of ints (the block-scale grid of an (N, K) matrix is cdiv by the block)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


_H_DTYPES = (*ACT_DTYPES, torch.float64)  # gated_activation's h: float64 too, fp8 dtypes not


def gated_activation(h: torch.Tensor, activation: str, swiglu_limit: float | None = None) -> torch.Tensor:
    """h (M, 2I) gate_up product (gate columns first) -> ``act(gate) * up`` (M, I).

    Computed in float32 from the rounded ``h`` and rounded once to ``h.dtype``, the
    rounding of an unfused loop; ``swiglu_limit`` clamps gate (max) and up (both
    sides) first, as transformers' experts do."""
    fn = _ACT_FNS[check_choice("activation", activation, ACTIVATIONS)]
    if not isinstance(h, torch.Tensor) or h.dtype not in _H_DTYPES:
        got = h.dtype if isinstance(h, torch.Tensor) else type(h).__name__
        raise TypeError(f"h: expected a float16/bfloat16/float32/float64 tensor (the gate_up product), got {got}")
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"h: expected shape (..., 2I) (I gate columns, then I up columns), got shape {tuple(h.shape)}")
    check_swiglu_limit(swiglu_limit)
    # chunk the float32 copy (not float32 copies of the halves): on CPU, vectorised
    # exp/erf give a result whose last bit depends on the memory layout, and the CPU
    # implementation of the ops computes on views of one float32 tensor
    gate, up = h.float().chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (fn(gate) * up).to(h.dtype)


GroupedGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_pipeline(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     num_experts: int, gate_up_gemm: GroupedGemm, down_gemm: GroupedGemm,
                     activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
    """The expert forward around two grouped GEMMs, for callers that need one GEMM op
    per projection (e.g. two block sizes): sort slots by expert, gate_up, activation,
    down, combine.  ``gate_up_gemm(x_sorted, offsets)`` / ``down_gemm(a_sorted,
    offsets)`` take rows sorted by expert and the (E,) inclusive ``offsets``.
    hidden (T, H) -> (T, H)."""
    k = top_k_index.shape[1]
    perm, offsets = sort_slots(top_k_index, num_experts)
    h = gate_up_gemm(hidden.index_select(0, perm // k), offsets)
    y_sorted = down_gemm(gated_activation(h, activation, swiglu_limit), offsets)
    y = torch.empty_like(y_sorted).index_copy_(0, perm, y_sorted)  # back to slot order
    return combine(y, top_k_index, top_k_weights, num_experts, hidden.dtype)


def batched_pipeline(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     num_experts: int, gate_up_gemm: GroupedGemm, down_gemm: GroupedGemm,
                     activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
    """As :func:`grouped_pipeline`, slots in their own order: ``gate_up_gemm(x, ids)``
    and ``down_gemm(a, ids)`` are batched GEMMs over ``ids`` (T*k,) slot -> expert."""
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)
    h = gate_up_gemm(hidden.repeat_interleave(k, dim=0), ids)
    y = down_gemm(gated_activation(h, activation, swiglu_limit), ids)
    return combine(y, top_k_index, top_k_weights, num_experts, hidden.dtype)
