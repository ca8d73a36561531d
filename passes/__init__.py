"""The MoE-loop graph pass (installed as ``fp8_moe_ops.passes``)."""
