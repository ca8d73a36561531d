"""Device-side routing helpers: sort slots by expert, offsets.  No host sync.

Everything here is a fixed sequence of torch ops on tensors of routing-independent
shape, so it runs inside CUDA graphs and under ``torch.compile`` without graph
breaks (no ``.item()``, ``nonzero``, ``bincount`` or ``histc``: see NOTES.md).
The per-tile map of the grouped GEMM is computed inside the kernel from ``offsets``.
"""

from __future__ import annotations

import torch

from .reference import sort_by_expert


def sort_slots(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of slots by expert id, sentinels (ids outside [0, E)) last.

    Args:
        expert_ids: (T, k) or (S,) integer expert ids.
        num_experts: E.

    Returns:
        ``perm`` (T*k,) int64, sorted position -> flat slot index (token = slot // k),
        and ``offsets`` (E,) int32, inclusive cumsum of slots per expert (the grouped
        ops' layout; sentinel slots sit past ``offsets[-1]``).
    """
    return sort_by_expert(expert_ids.reshape(-1, 1), num_experts)
