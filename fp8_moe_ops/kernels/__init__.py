"""Triton kernels of the ``fp8_moe`` ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Modules: :mod:`.quant` (activation quantisation), :mod:`.grouped_gemm` (block-scaled
grouped GEMM with a device-side tile map), :mod:`.activation` (gated activation fused
with the down projection's quantisation), :mod:`.combine` (deterministic combine),
:mod:`.ws_gemm` (the warp-specialised Gluon GEMM taking prefill GEMMs on Hopper; its
source :mod:`.gluon_gemm`),
:mod:`.config` (checked-in launch configs), :mod:`.launch` (cached launches), :mod:`.moe`
(the launches the GEMM ops and the experts forward share), :mod:`.gemms` (the GEMM ops and
their launch plans), :mod:`.experts` (the whole-experts forward and its launch
plans), :mod:`.moe_list` (the entry point on per-expert weight lists), :mod:`.plans` (the
launch plans those three record and replay).
"""

from .experts import StackedPlans, batched_experts, grouped_experts, planned_experts
from .gemms import GemmPlans, batched_mm, grouped_mm, linear
from .moe_list import grouped_experts_list

__all__ = ["linear", "grouped_mm", "batched_mm", "grouped_experts", "batched_experts", "grouped_experts_list",
           "planned_experts", "StackedPlans", "GemmPlans"]
