"""Sweep of grouped-GEMM launch configs on whole MoE layers (CUDA graph replay times).

    PYTHONPATH=. python bench/tune.py --out OUT/tune.json [--models deepseek_v3:4096,16384;qwen3_30b_a3b:1]
        [--candidates 128,128,8,4;64,128,4,4]

For each (model, T) of the sweep, every candidate config is forced on both GEMMs of
``fp8_moe::grouped_experts`` (dynamic scheme, uniform routing) and the layer is timed
as the median replay of a CUDA graph, so the numbers are GPU time, not launch
overhead; ``default_ms`` is the shipped table (which may give the two GEMMs different
tiles, e.g. a narrower ``BN`` at decode).  The winners per bucket of rows per expert go into
``fp8_moe_ops/kernels/configs/h200.json`` by hand (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import fp8_moe_ops  # noqa: F401
from fp8_moe_ops.kernels import moe

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import BLOCK, DEV, MODELS, OPS, bench_graph, layer_inputs, layer_weights, parse_sweep  # noqa: E402

CANDIDATES = [  # BM, BN, num_warps, num_stages
    (16, 128, 4, 4), (16, 64, 4, 4), (16, 32, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 5),
    (64, 256, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3),
]
SWEEP = {"deepseek_v3": [1, 8, 64, 512, 1024, 4096, 8192, 16384],
         "qwen3_30b_a3b": [1, 8, 64, 512, 1024, 4096, 8192, 16384],
         "mixtral_8x7b": [1, 8, 64, 512, 4096, 16384]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=None, help="model:T,T;model:T (default: the whole SWEEP)")
    p.add_argument("--candidates", default=None, help="BM,BN,warps,stages;... (default: CANDIDATES)")
    args = p.parse_args()
    sweep = parse_sweep(args.models) if args.models else SWEEP
    candidates = ([tuple(int(v) for v in c.split(",")) for c in args.candidates.split(";")]
                  if args.candidates else CANDIDATES)
    gen = torch.Generator(device=DEV).manual_seed(1)
    results = []
    default = moe.gemm_config
    for model, tokens in sweep.items():
        E, _, _, k = MODELS[model]
        gu, gus, dp, dps = layer_weights(model, gen)
        for T in tokens:
            x, idx, wts = layer_inputs(model, T, gen)
            row = {"model": model, "T": T, "rows_per_expert": T * k / min(E, T * k), "times": {}}
            for bm, bn, nw, ns in candidates:
                moe.gemm_config = lambda S, E_, N, K: {"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": nw,
                                                       "num_stages": ns}
                try:
                    ms = bench_graph(lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK))
                except Exception as e:  # e.g. out of shared memory
                    ms = None
                    print(f"  {bm},{bn},{nw},{ns}: {type(e).__name__}", flush=True)
                row["times"][f"{bm},{bn},{nw},{ns}"] = ms
            moe.gemm_config = default
            row["default_ms"] = bench_graph(lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK))
            best = min((v, c) for c, v in row["times"].items() if v is not None)
            print(f"{model} T={T}: default {row['default_ms']:.3f} ms, best {best[1]} {best[0]:.3f} ms  "
                  + " ".join(f"{c}:{v:.3f}" for c, v in row["times"].items() if v is not None), flush=True)
            results.append(row)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        del gu, gus, dp, dps
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"tune: {time.time() - t0:.0f} s")
    sys.exit(rc)
