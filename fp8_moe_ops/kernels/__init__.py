"""Triton kernels of the ``fp8_moe`` ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Modules: :mod:`.quant` (activation quantisation), :mod:`.grouped_gemm` (block-scaled
grouped GEMM with a device-side tile map), :mod:`.activation` (gated activation fused
with the down projection's quantisation), :mod:`.combine` (deterministic combine),
:mod:`.config` (checked-in launch configs), :mod:`.moe` (the op entry points).
"""

from .moe import batched_experts, batched_mm, grouped_experts, grouped_mm, linear

__all__ = ["linear", "grouped_mm", "batched_mm", "grouped_experts", "batched_experts"]
