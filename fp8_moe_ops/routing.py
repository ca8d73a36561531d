"""Device-side routing helpers: sort slots by expert, offsets, combine.  No host sync.

Everything here is a fixed sequence of torch ops on tensors of routing-independent
shape, so it runs inside CUDA graphs and under ``torch.compile`` without graph
breaks (no ``.item()``, ``nonzero``, ``bincount`` or ``histc``: their output sizes
depend on data, and ``histc`` raises on CUDA under deterministic algorithms).
The per-tile map of the grouped GEMM is computed inside the kernel from ``offsets``.

Layout: S = T * k slots; slot ``t*k + j`` is token t's j-th choice.  Expert ids
outside [0, E) are sentinels (an expert-parallel peer's experts): they sort last and
contribute nothing.
"""

from __future__ import annotations

import torch

from ._checks import _is_int, fail


def _sort_key(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, valid): ids as int64 with every sentinel mapped to E (sorts last)."""
    ids = ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids, num_experts), valid


def sort_slots(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of slots by expert id, sentinels last.

    Args:
        expert_ids: (T, k) or (S,) integer expert ids.
        num_experts: E.

    Returns:
        ``perm`` (S,) int64, sorted position -> flat slot index (token = slot // k),
        and ``offsets`` (E,) int32, inclusive cumsum of slots per expert (the grouped
        ops' layout; sentinel slots sit past ``offsets[-1]``).
    """
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.is_floating_point() or expert_ids.is_complex() \
            or expert_ids.dtype == torch.bool:
        fail(TypeError, "expert_ids", "an integer tensor (expert ids)",
             expert_ids.dtype if isinstance(expert_ids, torch.Tensor) else type(expert_ids).__name__)
    if not _is_int(num_experts):
        fail(TypeError, "num_experts", "a non-negative int", repr(num_experts))
    if num_experts < 0:
        fail(ValueError, "num_experts", "a non-negative int", repr(num_experts))
    key, _ = _sort_key(expert_ids.reshape(-1), num_experts)
    sorted_key, perm = torch.sort(key, stable=True)
    # offsets[e] = number of slots with key <= e = first sorted position with key > e
    upper = torch.arange(1, num_experts + 1, device=key.device)
    return perm, torch.searchsorted(sorted_key, upper).to(torch.int32)


def sorted_positions(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`sort_slots`' ``perm``: (S,) int64, flat slot index -> its
    sorted position (where a kernel stores the slot's row in expert order)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def combine(y: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
            out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of per-slot expert outputs, float32, deterministic (no atomics).

    y (T*k, H) in slot order, rounded to the activation dtype; each token adds its
    slots' ``y * weight`` (float32 products) in ascending expert id, the order of an
    eager loop's ``index_add_`` over ``range(E)``, and rounds once to ``out_dtype``.
    Sentinel slots add nothing (their rows of ``y`` may hold anything, NaN included).
    """
    T, k = top_k_index.shape
    H = y.shape[-1]
    key, valid = _sort_key(top_k_index, num_experts)
    order = torch.argsort(key, dim=1, stable=True)  # (T, k) slot positions in expert order
    ys = y.view(T, k, H).gather(1, order[..., None].expand(T, k, H))
    ws = top_k_weights.gather(1, order).float()
    keep = valid.gather(1, order)
    acc = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    for j in range(k):
        acc += torch.where(keep[:, j, None], ys[:, j].float() * ws[:, j, None], 0.0)
    return acc.to(out_dtype)
