"""CPU time and kernel launches per MoE layer call at decode token counts.

    PYTHONPATH=. python bench/host_overhead.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8;..."] [--calls 100]

For each benchmark layer and T in {1, 8, 64} (uniform routing, dynamic scales), per
entry point:

* ``op grouped_experts`` / ``op batched_experts``: ``torch.ops.fp8_moe.*`` (the custom
  op: dispatcher, argument checks, then the Triton entry point);
* ``launch plan``: the plan the op replays from the third call of a signature
  (``fp8_moe_ops.kernels.plans.LaunchPlan``), called directly: the difference to
  the op is the op's wrapper (dispatcher, autograd kernel, signature key);
* ``kernels.grouped_experts``: the Triton forward without a plan (every launch's
  config, grid, views and cache key built on each call), no op wrapper, no checks;
* ``FP8Experts.forward``: the module (``dispatch="grouped"``) around the op.

Metrics: ``cpu_us``, the wall time of ``--calls`` back-to-back calls *before* the final
synchronize divided by the count (a few launches per call never fill the GPU's
queue, so this is the CPU's time per call); ``wall_us`` the same including the
synchronize; ``launches``, the GPU kernels (memsets and copies included) per call,
counted by ``torch.profiler``; ``graph_ms``, the GPU time of one call replayed in a
CUDA graph (the op entry points).  Writes ``OUT/host_overhead.json`` / ``.md``; exits
1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, experts_module, graph_ms, host_us_per_call,
                    kernels_per_call, layer_inputs, layer_weights, markdown_table, parse_sweep)
from fp8_moe_ops import kernels

CASES = {name: [1, 8, 64] for name in MODELS}


def entry_points(experts, w, x, idx, wts) -> dict:
    args = (x, idx, wts, *w, BLOCK, "silu", None, None, None)
    plans = {}
    for _ in range(2):  # the second call records the plan
        kernels.planned_experts(plans, "sig", args)
    return {
        "op grouped_experts": lambda: torch.ops.fp8_moe.grouped_experts(*args),
        "op batched_experts": lambda: torch.ops.fp8_moe.batched_experts(*args),
        "launch plan": lambda: kernels.planned_experts(plans, "sig", args),
        "kernels.grouped_experts": lambda: kernels.grouped_experts(*args),
        "FP8Experts.forward": lambda: experts(x, idx, wts),
    }


def measure(fn, calls: int, graph: bool) -> dict:
    fn()  # compiles
    cpu_us, wall_us = host_us_per_call(fn, calls)
    launches, names = kernels_per_call(fn)
    res = {"cpu_us": cpu_us, "wall_us": wall_us, "launches": launches, "kernels": names}
    if graph:
        res["graph_ms"] = graph_ms(fn)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: every model at T = 1, 8, 64)")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    runner = Runner("host_overhead", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        w = layer_weights(model, gen)
        experts = experts_module(model, w, dispatch="grouped")
        for T in tokens:
            x, idx, wts = layer_inputs(model, T, gen)
            for variant, fn in entry_points(experts, w, x, idx, wts).items():
                runner.run(ExperimentConfig("host_overhead", name, T, variant),
                           lambda: measure(fn, args.calls, graph=variant.startswith("op ")))
        del w, experts
        torch.cuda.empty_cache()
        runner.save(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    """One row per case; ``vs op µs``: the CPU time beyond the op's at the same (model, T)."""
    op = {(r.config.model, r.config.tokens): r.metrics["cpu_us"] for r in runner.results
          if r.ok and r.config.variant == "op grouped_experts"}
    rows = []
    for r in runner.results:
        row = r.flat()
        base = op.get((r.config.model, r.config.tokens))
        row["vs_op_us"] = row["cpu_us"] - base if r.ok and base is not None else None
        rows.append(row)
    columns = [("model", "model", ""), ("T", "tokens", ""), ("entry point", "variant", ""),
               ("CPU µs / call", "cpu_us", ".1f"), ("vs op µs", "vs_op_us", "+.1f"), ("wall µs / call", "wall_us", ".1f"),
               ("launches / call", "launches", ".1f"), ("graph ms", "graph_ms", ".4f"), ("error", "error", "")]
    return markdown_table(rows, columns)


if __name__ == "__main__":
    sys.exit(main())
