"""A/B of the grouped GEMM's weight-scale path: one scale per tile and K step
(``W_SCALE_PER_TILE``, taken when ``BN`` divides ``bn``) against one per column.

    PYTHONPATH=. python bench/scale_path.py --out OUT/scale_path.json

Same kernel, same configs; only the constexpr is forced off for the B side.  Times
(median of ``triton.testing.do_bench``) the grouped op alone at PERF.md's shape and
whole layers at the compute-bound token counts, where the rescale competes with the
tensor cores.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import fp8_moe_ops  # noqa: F401
from fp8_moe_ops.kernels import moe

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import BLOCK, DEV, MODELS, OPS, bench, layer_inputs, layer_weights, make_weights  # noqa: E402


class _PerColumn:
    """``moe._grouped_gemm_kernel`` with ``W_SCALE_PER_TILE`` forced off."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kw: launch(*args, **{**kw, "W_SCALE_PER_TILE": False})


def _ab(fn) -> dict:
    per_tile = bench(fn)
    kernel = moe._grouped_gemm_kernel
    moe._grouped_gemm_kernel = _PerColumn(kernel)
    try:
        fn()  # compile outside the timing
        per_column = bench(fn)
    finally:
        moe._grouped_gemm_kernel = kernel
    return {"per_tile_ms": per_tile, "per_column_ms": per_column, "speedup": per_column / per_tile}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(3)
    rows = []
    E, M, N, K = 32, 2048, 4096, 7168  # PERF.md's grouped-op shape
    w, ws = make_weights(E, N, K, gen)
    x = torch.randn(E * M, K, device=DEV, generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * M
    r = _ab(lambda: OPS.grouped_mm(x, w, ws, offsets, BLOCK))
    r.update(case="grouped_mm 32x2048, N=4096, K=7168", tflops=2 * E * M * N * K / r["per_tile_ms"] / 1e9)
    rows.append(r)
    print(r, flush=True)
    del w, ws, x
    for model, tokens in (("deepseek_v3", (8192, 16384)), ("qwen3_30b_a3b", (8192, 16384)),
                          ("mixtral_8x7b", (16384,))):
        _, H, I, k = MODELS[model]
        gu, gus, dp, dps = layer_weights(model, gen)
        for T in tokens:
            x, idx, wts = layer_inputs(model, T, gen)
            r = _ab(lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK))
            r.update(case=f"{model} T={T}", tflops=6 * T * k * H * I / r["per_tile_ms"] / 1e9)
            rows.append(r)
            print(r, flush=True)
        del gu, gus, dp, dps
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
