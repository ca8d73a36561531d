"""GPU time per kernel of one ``fp8_moe::grouped_experts`` call (torch.profiler).

    PYTHONPATH=. python bench/profile_layer.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8;..."]
        [--table [N,K:][own.|dense.]maxnreg=none] [--slots COMBINE_SLOTS=128] [--name profile_layer]

For each (model, T), dynamic and static activation scales: the median over 20 calls of
every kernel's device time, their sum, and the CUDA-graph replay time of one call.  Also
the time per layer of one graph of ``--layers`` calls, each on its own copy of the
weights (as a decode step's graph runs one layer after another; the copies keep a layer
from finding the previous one's weights in L2): a one-call graph's replay also pays for
starting the graph, and reads weights its previous replay left in L2.  The 20 profiled
calls take the copies in turn, so with the default four each call's weights were last
read three calls before: out of the 50 MB L2 of an H100 or H200 for every benchmark
model (qwen3_30b_a3b's T=1 layer reads 38 MB; before the thirty-eighth session every
profiled call read the same copy, and the small layers' kernel times were partly L2
reads).  The gap between the graph of layers and the kernels' sum is then the cost of
launches and of the GPU idling between dependent kernels.  Beside it, the GPU's median SM
clock while it was timed and the share of that time a power or thermal limit held the clock
down (``common.GpuClocks``, where ``nvidia-smi`` runs).  ``--table`` changes the launch-config table for the run
(:func:`common.table_override`), and ``--slots`` the experts forward's fusion thresholds
(:func:`common.slots_override`): the experiments that decide a setting.  Writes
``OUT/<--name>.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import (BLOCK, ExperimentConfig, GpuClocks, Runner, cuda_events, each_scheme_case, graph_ms,
                    parse_sweep, results_table, slots_override, table_override)

CASES = {"deepseek_v3": [1, 8, 16384], "qwen3_30b_a3b": [1, 8, 64, 16384], "mixtral_8x7b": [1, 8, 16384]}
CALLS = 20


def kernel_times(layer_fns) -> dict:
    """``layer_fns``: calls of the same shapes, each on its own weights."""
    turn = itertools.cycle(layer_fns)
    evs = cuda_events(lambda: next(turn)(), CALLS)
    per_call = len(evs) // CALLS
    # the i-th kernel of every call (the two GEMMs share a name, not a position)
    kernels = [(evs[i].name, statistics.median(evs[c * per_call + i].device_time_total for c in range(CALLS)))
               for i in range(per_call)]
    with GpuClocks() as clocks:  # the clocks of the graph of layers' timing
        per_layer_ms = graph_ms(lambda: [f() for f in layer_fns]) / len(layer_fns)
    return {"launches_per_call": len(evs) / CALLS, "sum_us": sum(t for _, t in kernels),
            "graph_us": graph_ms(layer_fns[0]) * 1e3, "graph_per_layer_us": per_layer_ms * 1e3,
            **clocks.metrics(), "kernels_us": kernels}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--table", default=None,
                   help="[N,K:]KEY=VALUE,... set on every entry of the launch-config table, or of one weight "
                        "shape's list; own.KEY / dense.KEY on one form of an entry only (e.g. maxnreg=none, "
                        "7168,2048:min_programs=896, own.maxnreg=none; common.table_override)")
    p.add_argument("--slots", default=None,
                   help="NAME=VALUE,... the experts forward's ACT_SLOTS / COMBINE_SLOTS for the run")
    p.add_argument("--name", default="profile_layer", help="output files OUT/<name>.json and .md")
    p.add_argument("--layers", type=int, default=4,
                   help="weight copies: the calls of the multi-layer graph, taken in turn by the profiled calls")
    args = p.parse_args()
    if args.table:
        table_override(args.table)
    if args.slots:
        slots_override(args.slots)
    runner = Runner(args.name, args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(5)

    copies = []  # the model's weights and their clones: one per layer of the graph (freed after each model)

    def run(name, T, w, inputs, scheme, scales):
        if not copies:
            copies.extend([w, *(type(w)(*(t.clone() for t in w)) for _ in range(args.layers - 1))])

        def call(weights):
            return lambda: torch.ops.fp8_moe.grouped_experts(*inputs, *weights, BLOCK, "silu", *scales)

        runner.run(ExperimentConfig("profile", name, T, scheme),
                   lambda: kernel_times([call(c) for c in copies]))

    def after_model():
        copies.clear()
        torch.cuda.empty_cache()
        runner.save(table(runner))

    each_scheme_case(parse_sweep(args.cases) if args.cases else CASES, gen, run, after_model=after_model)
    return runner.exit_code()


def table(runner: Runner) -> str:
    return results_table(runner.results, [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", ""),
                                          ("launches", "launches_per_call", ".0f"),
                                          ("sum of kernels µs", "sum_us", ".1f"),
                                          ("graph µs", "graph_us", ".1f"),
                                          ("graph of layers, µs per layer", "graph_per_layer_us", ".1f"),
                                          ("its SM MHz", "clock_sm_mhz_median", ".0f"),
                                          ("its capped share", "clock_capped", ".2f")])


if __name__ == "__main__":
    sys.exit(main())
