"""GPU time per kernel of one ``fp8_moe::grouped_experts`` call (torch.profiler).

    PYTHONPATH=. python bench/profile_layer.py --out OUT/profile_layer.json [--cases qwen3_30b_a3b:1,8;...]

For each (model, T), dynamic and static activation scales: the median over 20 calls of every kernel's device time, their
sum, and the CUDA-graph replay time of the whole call (so the gap between them is
the cost of launches and of the GPU idling between six dependent kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fp8_moe_ops  # noqa: F401

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import BLOCK, DEV, MODELS, OPS, bench_graph, layer_inputs, layer_weights, parse_sweep  # noqa: E402

CASES = {"deepseek_v3": [1, 8, 16384], "qwen3_30b_a3b": [1, 8, 64, 16384], "mixtral_8x7b": [1, 8, 16384]}
CALLS = 20


def _profile(model, T, scheme, gen, gu, gus, dp, dps) -> dict:
    E = MODELS[model][0]
    x, idx, wts = layer_inputs(model, T, gen)
    act = [None, None] if scheme == "dynamic" else [torch.rand(E, device=DEV, generator=gen) * 0.01 + 0.01
                                                    for _ in range(2)]
    fn = lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK, "silu", *act)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    per_call = len(evs) // CALLS
    # the i-th kernel of every call (the two GEMMs share a name, not a position)
    kernels = [(evs[i].name, statistics.median(evs[c * per_call + i].device_time_total for c in range(CALLS)))
               for i in range(per_call)]
    return {"model": model, "T": T, "scheme": scheme, "kernels_us": kernels, "launches_per_call": len(evs) / CALLS,
            "sum_us": sum(t for _, t in kernels), "graph_us": bench_graph(fn) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    args = p.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(5)
    rows = []
    for model, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        gu, gus, dp, dps = layer_weights(model, gen)
        for T in tokens:
            for scheme in ("dynamic", "static"):
                rows.append(_profile(model, T, scheme, gen, gu, gus, dp, dps))
                print(json.dumps(rows[-1]), flush=True)
        del gu, gus, dp, dps
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
