"""The slots' sort by expert alone: the package's GPU sort against torch's.

    PYTHONPATH=. python bench/sort_slots.py --out-dir OUT [--cases "qwen3_30b_a3b:512,16384;..."]

For each benchmark layer and T (uniform and skewed routing, ``common.make_routing``),
the two ways of sorting its T * k slots by expert that the forward has had:
``kernels`` (``fp8_moe_ops.kernels.gemms._sort_slots``: one launch up to 2048 slots, two
beyond) and ``torch`` (``fp8_moe_ops.routing.sort_slots``, the forward's sort past 2048
slots before the three-launch sort, with the inverse permutation that the prefill path
also needs: ``routing.sorted_positions``).  Metrics: GPU µs of a CUDA-graph replay,
kernel launches per call (``torch.profiler``), CPU µs per call (back-to-back calls
before the final synchronize); a case whose permutation or offsets differ from torch's
fails (a stable sort is unique).  Writes ``OUT/sort_slots.json`` / ``.md``; exits
1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (MODELS, ExperimentConfig, Runner, graph_ms, host_us_per_call, kernels_per_call, make_routing,
                    parse_sweep, results_table)
from fp8_moe_ops import routing
from fp8_moe_ops.kernels.gemms import _sort_slots

CASES = {"deepseek_v3": [256, 512, 8192, 32768], "qwen3_30b_a3b": [512, 1024, 2048, 16384, 131072],
         "mixtral_8x7b": [2048, 16384]}


def ways(ids: torch.Tensor, E: int) -> dict:
    def torch_sort():
        perm, offsets = routing.sort_slots(ids, E)
        return perm, offsets, routing.sorted_positions(perm)

    return {"kernels": lambda: _sort_slots(ids, E), "torch": torch_sort}


def measure(fn, ids: torch.Tensor, E: int) -> dict:
    perm, offsets = fn()[:2]
    want_perm, want_offsets = routing.sort_slots(ids, E)
    if not (torch.equal(perm.long(), want_perm) and torch.equal(offsets, want_offsets)):
        raise AssertionError("the permutation or the offsets differ from torch's sort")
    cpu_us, _ = host_us_per_call(fn, calls=50)
    launches, _ = kernels_per_call(fn)
    return {"graph_us": graph_ms(fn) * 1e3, "cpu_us": cpu_us, "launches": launches}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    args = p.parse_args()
    runner = Runner("sort_slots", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        for T in tokens:
            for kind in ("uniform", "skewed"):
                ids = make_routing(T, model.E, model.top_k, kind, gen)[0]
                for way, fn in ways(ids, model.E).items():
                    runner.run(ExperimentConfig("sort_slots", name, T, way, kind), lambda: measure(fn, ids, model.E))
            torch.cuda.empty_cache()
    runner.save(results_table(runner.results, [
        ("model", "model", ""), ("T", "tokens", ""), ("routing", "routing", ""), ("way", "variant", ""),
        ("GPU µs (graph)", "graph_us", ".1f"), ("launches", "launches", ".0f"), ("CPU µs / call", "cpu_us", ".1f")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
