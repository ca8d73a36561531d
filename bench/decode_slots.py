"""The threshold of the one-launch gate_up half at decode
(``fp8_moe_ops.kernels.experts.DECODE_SLOTS``, :mod:`fp8_moe_ops.kernels.decode`): each
case run under every threshold of ``--values``, CUDA-graph time interleaved over rounds,
and whether each output equals the first threshold's bitwise.

    PYTHONPATH=. python bench/decode_slots.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8;..."]
        [--values 0,16,64]

A case of T * top_k slots up to a threshold runs the decode launch under it (2 launches
with the fused combine), above it the sort, the gate_up GEMM (the activation in its
launch up to ``ACT_SLOTS``) and the down GEMM (3-4 launches); 0 never runs the decode
launch.  Calls the kernels' entry point (no launch plans, so the threshold is read on
every call).  Writes ``OUT/decode_slots.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import BLOCK, ExperimentConfig, Runner, each_scheme_case, graph_ms, parse_sweep, results_table
from fp8_moe_ops.kernels import experts as kernels

CASES = {"deepseek_v3": [1, 2, 8], "qwen3_30b_a3b": [1, 2, 8], "mixtral_8x7b": [1, 2, 8, 32]}
ROUNDS = 3


def compare(fn, values: list[int], shape: tuple) -> dict:
    """``fn`` (a forward of ``shape``: (T, k, E, H, I, block)) under each threshold:
    median graph µs over interleaved rounds, launches per call, and whether each output
    equals the first threshold's bitwise."""
    shipped = kernels.DECODE_SLOTS
    try:
        outs, times, launches = {}, {v: [] for v in values}, {}
        for v in values:
            kernels.DECODE_SLOTS = v
            outs[v] = fn().clone()
            launches[v] = len(kernels.shape_calls(*shape))
        for _ in range(ROUNDS):
            for v in values:
                kernels.DECODE_SLOTS = v
                times[v].append(graph_ms(fn, rep_ms=100) * 1e3)
    finally:
        kernels.DECODE_SLOTS = shipped
    first = outs[values[0]].view(torch.int16)
    res = {}
    for v in values:
        res[f"us_{v}"] = statistics.median(times[v])
        res[f"launches_{v}"] = launches[v]
        res[f"ratio_{v}"] = res[f"us_{v}"] / statistics.median(times[values[0]])
        res[f"equal_{v}"] = torch.equal(outs[v].view(torch.int16), first)
    return res



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--values", default="0,16,64", help="thresholds, the first the baseline (at most 64)")
    args = p.parse_args()
    values = [int(v) for v in args.values.split(",")]
    runner = Runner("decode_slots", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(5)

    def run(name, T, w, inputs, scheme, scales):
        E, two_i, H = w[0].shape
        shape = (T, inputs[1].shape[1], E, H, two_i // 2, tuple(BLOCK))
        runner.run(ExperimentConfig("decode_slots", name, T, scheme, params=(("values", args.values),)),
                   lambda: compare(lambda: kernels.grouped_experts(*inputs, *w, BLOCK, "silu", *scales), values, shape))

    each_scheme_case(parse_sweep(args.cases) if args.cases else CASES, gen, run)
    columns = [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", "")]
    for v in values:
        columns += [(f"graph µs, {v}", f"us_{v}", ".1f"), (f"launches, {v}", f"launches_{v}", "d")]
    columns += [(f"/ {values[0]}, {v}", f"ratio_{v}", ".3f") for v in values[1:]]
    columns += [(f"equal, {v}", f"equal_{v}", "") for v in values[1:]]
    runner.save(results_table(runner.results, columns))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
