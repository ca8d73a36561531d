"""How often the eager loop and the grouped op differ on CPU, and by how much.

    python bench/dispatch_agreement.py

CPU vectorised erf/exp make an element's last bit depend on its position in the
tensor; the loop's per-expert tensors put rows at other positions than the grouped
op's.  Scans 200 seeds x 3 activations x 2 dtypes of a small layer (E=4, H=8, I=13,
block 16) and prints the count of layers that differ and the worst relative error.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fp8_moe_ops  # noqa: E402
from helpers import make_experts_inputs, rel_err  # noqa: E402


def main() -> None:
    differ, total, worst = 0, 0, 0.0
    for seed in range(200):
        for activation in ("silu", "gelu", "gelu_tanh"):
            for dtype in (torch.float32, torch.bfloat16):
                args = make_experts_inputs(7, 4, 8, 13, 1, [16, 16], dtype=dtype, seed=seed)
                grouped = torch.ops.fp8_moe.grouped_experts(**args, activation=activation)
                m = fp8_moe_ops.FP8Experts(4, 8, 13, [16, 16], activation)
                m.gate_up_proj.data, m.gate_up_proj_scale_inv.data = args["gate_up_proj"], args["gate_up_scale_inv"]
                m.down_proj.data, m.down_proj_scale_inv.data = args["down_proj"], args["down_scale_inv"]
                eager = m(args["hidden"], args["top_k_index"], args["top_k_weights"])
                total += 1
                if not torch.equal(grouped, eager):
                    differ += 1
                    worst = max(worst, rel_err(grouped, eager))
    print(f"{differ} of {total} layers differ; worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
