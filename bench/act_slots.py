"""The threshold of the activation fused into the gate_up GEMM's launch
(``fp8_moe_ops.kernels.experts.ACT_SLOTS``): each case run with the shipped threshold
and with a larger one, CUDA-graph time interleaved over rounds, and whether the two
outputs are bitwise equal.

    PYTHONPATH=. python bench/act_slots.py --out-dir OUT [--cases "qwen3_30b_a3b:2,8;..."] [--slots 64]

A case of T * top_k slots between the two thresholds runs the activation in its own launch
with the first and in the GEMM's launch with the second.  Calls the kernels' entry point
(no launch plans, so the threshold is read on every call).  Writes
``OUT/act_slots.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import BLOCK, ExperimentConfig, Runner, each_scheme_case, graph_ms, parse_sweep, results_table
from fp8_moe_ops.kernels import experts as kernels

CASES = {"deepseek_v3": [2, 8], "qwen3_30b_a3b": [2, 8], "mixtral_8x7b": [2, 8, 32]}
ROUNDS = 3


def compare(fn, thresholds: tuple[int, int]) -> dict:
    """``fn`` (a forward) under each threshold: median graph µs over interleaved rounds,
    and whether the outputs are bitwise equal."""
    shipped = kernels.ACT_SLOTS
    try:
        outs, times = {}, {t: [] for t in thresholds}
        for t in thresholds:
            kernels.ACT_SLOTS = t
            outs[t] = fn().clone()
        for _ in range(ROUNDS):
            for t in thresholds:
                kernels.ACT_SLOTS = t
                times[t].append(graph_ms(fn, rep_ms=100) * 1e3)
    finally:
        kernels.ACT_SLOTS = shipped
    a, b = thresholds
    us_a, us_b = statistics.median(times[a]), statistics.median(times[b])
    return {"us_shipped": us_a, "us_larger": us_b, "ratio": us_b / us_a,
            "bitwise_equal": torch.equal(outs[a].view(torch.int16), outs[b].view(torch.int16))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--slots", type=int, default=64, help="the larger threshold (at most COMBINE_SLOTS)")
    args = p.parse_args()
    runner = Runner("act_slots", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(5)
    thresholds = (kernels.ACT_SLOTS, args.slots)

    def run(name, T, w, inputs, scheme, scales):
        runner.run(ExperimentConfig("act_slots", name, T, scheme, params=(("slots", args.slots),)), lambda: compare(
            lambda: kernels.grouped_experts(*inputs, *w, BLOCK, "silu", *scales), thresholds))

    each_scheme_case(parse_sweep(args.cases) if args.cases else CASES, gen, run)
    runner.save(results_table(runner.results, [
        ("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", ""),
        ("graph µs, shipped", "us_shipped", ".1f"), ("graph µs, larger", "us_larger", ".1f"),
        ("larger / shipped", "ratio", ".3f"), ("bitwise equal", "bitwise_equal", "")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
