"""How often the eager loop and the grouped op differ on CPU, and by how much.

    PYTHONPATH=. python bench/dispatch_agreement.py [--out-dir OUT]

CPU vectorised erf/exp make an element's last bit depend on its position in the
tensor; the loop's per-expert tensors put rows at other positions than the grouped
op's.  Scans 200 seeds x 3 activations x 2 dtypes of a small layer (T=7, E=4, H=8,
I=13, top-1, block 16) and reports the count of layers that differ and the worst
relative (Frobenius) error.  Runs on CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fp8_moe_ops
from common import ExperimentConfig, Model, Runner, make_routing, results_table

LAYER = Model("small", E=4, H=8, I=13, top_k=1)
T, BLOCK_SIZE, SEEDS = 7, [16, 16], 200


def layer(seed: int, dtype: torch.dtype, activation: str):
    """(the eager-loop module, hidden, top_k_index, top_k_weights) of one random layer."""
    gen = torch.Generator().manual_seed(seed)
    m = fp8_moe_ops.FP8Experts.from_float(torch.randn(LAYER.E, 2 * LAYER.I, LAYER.H, generator=gen) * 0.1,
                                          torch.randn(LAYER.E, LAYER.H, LAYER.I, generator=gen) * 0.1,
                                          BLOCK_SIZE, activation, dispatch="eager")
    hidden = torch.randn(T, LAYER.H, generator=gen).to(dtype)
    return (m, hidden, *make_routing(T, LAYER.E, LAYER.top_k, "uniform", gen, device="cpu"))


def scan(dtype: torch.dtype, activation: str) -> dict:
    differ, worst = 0, 0.0
    for seed in range(SEEDS):
        m, hidden, idx, wts = layer(seed, dtype, activation)
        eager = m(hidden, idx, wts)
        grouped = torch.ops.fp8_moe.grouped_experts(
            hidden, idx, wts, m.gate_up_proj, m.gate_up_proj_scale_inv, m.down_proj, m.down_proj_scale_inv,
            m.block_size, activation)
        if not torch.equal(grouped, eager):
            differ += 1
            diff = (grouped.double() - eager.double()).norm() / eager.double().norm().clamp(min=1e-300)
            worst = max(worst, diff.item())
    return {"layers": SEEDS, "differ": differ, "worst_rel_err": worst}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    runner = Runner("dispatch_agreement", args.out_dir)
    for activation in ("silu", "gelu", "gelu_tanh"):
        for dtype in (torch.float32, torch.bfloat16):
            runner.run(ExperimentConfig("dispatch_agreement", LAYER.name, T, activation,
                                        params=(("dtype", str(dtype)),)), lambda: scan(dtype, activation))
    table = results_table(runner.results, [("activation", "variant", ""), ("dtype", "dtype", ""),
                                           ("layers", "layers", ""), ("differ", "differ", ""),
                                           ("worst rel err", "worst_rel_err", ".2e")])
    print(table)
    runner.save(table)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
