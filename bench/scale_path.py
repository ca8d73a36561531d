"""A/B of the grouped GEMM's weight-scale path: one scale per tile and K step
(``W_SCALE_PER_TILE``, taken when ``BN`` divides ``bn``) against one per column.

    PYTHONPATH=. python bench/scale_path.py --out-dir OUT

Same kernel, same configs; only the constexpr is forced off for the B side.  Times the
grouped op alone (32 experts x 2048 rows, N=4096, K=7168) and whole layers at the
compute-bound token counts, where the rescale competes with the tensor cores (the
layers through ``fp8_moe_ops.kernels.grouped_experts``, which builds its launches on
every call: an op call may replay a launch plan recorded before the kernel was swapped).  Writes
``OUT/scale_path.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import (BLOCK, MODELS, ExperimentConfig, Runner, layer_flops, layer_inputs, layer_weights, make_weights,
                    results_table, time_ms)
from fp8_moe_ops import kernels
from fp8_moe_ops.kernels import moe

OPS = torch.ops.fp8_moe
LAYERS = {"deepseek_v3": (8192, 16384), "qwen3_30b_a3b": (8192, 16384), "mixtral_8x7b": (16384,)}


class _PerColumn:
    """``moe._grouped_gemm_kernel`` with ``W_SCALE_PER_TILE`` forced off."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names  # read by fp8_moe_ops.kernels.launch.Launch

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kw: launch(*args, **{**kw, "W_SCALE_PER_TILE": False})


def ab(fn, flops: int) -> dict:
    per_tile = time_ms(fn)
    kernel = moe._grouped_gemm_kernel
    moe._grouped_gemm_kernel = _PerColumn(kernel)
    try:
        fn()  # compile outside the timing
        per_column = time_ms(fn)
    finally:
        moe._grouped_gemm_kernel = kernel
    return {"per_tile_ms": per_tile, "per_column_ms": per_column, "speedup": per_column / per_tile,
            "tflops": flops / per_tile / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    runner = Runner("scale_path", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(3)
    E, M, N, K = 32, 2048, 4096, 7168
    w, ws = make_weights(E, N, K, gen)
    x = torch.randn(E * M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M
    runner.run(ExperimentConfig("scale_path", f"grouped_mm {E}x{M} N={N} K={K}", E * M, "per_tile_vs_per_column"),
               lambda: ab(lambda: OPS.grouped_mm(x, w, ws, offsets, BLOCK), 2 * E * M * N * K))
    del w, ws, x
    for name, tokens in LAYERS.items():
        model = MODELS[name]
        lw = layer_weights(model, gen)
        for T in tokens:
            xt, idx, wts = layer_inputs(model, T, gen)
            runner.run(ExperimentConfig("scale_path", name, T, "per_tile_vs_per_column"),
                       lambda: ab(lambda: kernels.grouped_experts(xt, idx, wts, *lw, BLOCK), layer_flops(model, T)))
        del lw
        torch.cuda.empty_cache()
        runner.save(results_table(runner.results, [("case", "model", ""), ("T", "tokens", ""),
                                                   ("per tile ms", "per_tile_ms", ".3f"),
                                                   ("per column ms", "per_column_ms", ".3f"),
                                                   ("speed-up", "speedup", ".3f"), ("TFLOP/s", "tflops", ".0f")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
