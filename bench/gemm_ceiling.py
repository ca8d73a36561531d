"""Our grouped GEMM against the dense block-scaled cuBLAS ceiling, in the same run.

    PYTHONPATH=. python bench/gemm_ceiling.py --out-dir OUT [--cases "deepseek_v3:8192,16384;qwen3_30b_a3b:4096,16384"]

For the gate_up (N = 2I, K = H) and down (N = H, K = I) GEMMs of deepseek_v3 and
qwen3_30b_a3b at token counts with >= 256 rows per expert (M = T * top_k rows, spread
evenly over the E experts), times:

* ``dense_blockwise``: one dense (M, K) x (K, N) fp8 GEMM with DeepSeek block scales,
  ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` activations (scale_a (M, K/128),
  column-major) x ``BlockWise128x128`` weights (scale_b (K/128, N/128), column-major);
  when that call is refused, the same with scale_b's rows padded to a multiple of 4,
  then ``torch._scaled_mm`` with the same scales.  The metric ``api`` says which call
  ran; its output is checked against a float32 matmul of the dequantised operands
  (``dense_rel_err``) so a misread scale layout cannot pass as a ceiling;
* ``dense_tensorwise``: ``torch._scaled_mm`` with one scale per tensor (the plain fp8 rate);
* ``ours``: ``torch.ops.fp8_moe.grouped_mm`` on bf16 activations (its dynamic
  activation quantisation included) with E experts' (N, K) weights and 128x128 block
  scales; ``gemm_kernel_ms`` is the grouped GEMM kernel's own device time
  (torch.profiler), without the quantisation.

The table reports TFLOP/s (2 M N K / time) and ours / dense_blockwise.  Writes
``OUT/gemm_ceiling.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import (BLOCK, MODELS, PROJS, ExperimentConfig, Runner, cuda_events, gemm_shape, log, make_weights,
                    markdown_table, parse_sweep, tensorwise_fp8_ms, time_ms)

CASES = {"deepseek_v3": [8192, 16384], "qwen3_30b_a3b": [4096, 16384]}
FP8 = torch.float8_e4m3fn


def _recipe(name_new: str, name_old: str):
    # torch spells the enum members BlockWise1x128 (pybind) or Blockwise_1x128 (a Python Enum) by version
    kinds = F.ScalingType
    return getattr(kinds, name_new) if hasattr(kinds, name_new) else getattr(kinds, name_old)


def _blockwise_calls(a, sa, b_nk, sb_grid):
    """Candidate dense block-scaled calls, in order of preference: (api, fn).

    a (M, K) e4m3 row-major, sa (M, K/128) float32, b_nk (N, K) e4m3 row-major (the
    GEMM's (K, N) operand is its transpose, column-major), sb_grid (N/128, K/128)."""
    M, K = a.shape
    sa_cm = sa.t().contiguous().t()  # (M, K/128) with strides (1, M)
    b = b_nk.t()
    kb = sb_grid.shape[1]
    sb = sb_grid.t()  # (K/128, N/128) column-major
    padded = torch.zeros(sb_grid.shape[0], -(-kb // 4) * 4, device=sb_grid.device)
    padded[:, :kb] = sb_grid
    sb_pad = padded.t()  # (round_up(K/128, 4), N/128) column-major
    calls = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        r_a, r_b = _recipe("BlockWise1x128", "Blockwise_1x128"), _recipe("BlockWise128x128", "Blockwise_128x128")
        for tag, s in (("", sb), (" (scale_b rows padded to 4)", sb_pad)):
            calls.append((f"F.scaled_mm BlockWise1x128 x BlockWise128x128{tag}",
                          lambda s=s: F.scaled_mm(a, b, sa_cm, r_a, s, r_b, output_dtype=torch.bfloat16)))
    for tag, s in (("", sb), (" (scale_b rows padded to 4)", sb_pad)):
        calls.append((f"torch._scaled_mm 1x128 x 128x128 scales{tag}",
                      lambda s=s: torch._scaled_mm(a, b, sa_cm, s, out_dtype=torch.bfloat16)))
    return calls


def _dequant_reference(a, sa, b_nk, sb_grid, rows: int) -> torch.Tensor:
    """float32 (rows, N) product of the dequantised operands (the first ``rows`` of A)."""
    a32 = a[:rows].float() * sa[:rows].repeat_interleave(128, 1)[:, : a.shape[1]]
    N, K = b_nk.shape
    b32 = b_nk.float() * sb_grid.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return a32 @ b32.t()


def dense_blockwise(a, sa, b_nk, sb_grid, flops) -> dict:
    ref = _dequant_reference(a, sa, b_nk, sb_grid, rows=256)
    refused = []
    for api, fn in _blockwise_calls(a, sa, b_nk, sb_grid):
        try:
            out = fn()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            refused.append(f"{api}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
            log(f"  refused: {refused[-1]}")
            continue
        err = ((out[:256].float() - ref).norm() / ref.norm()).item()
        if err > 2e-2:
            refused.append(f"{api}: wrong result (rel err {err:.2e} vs dequantised float32): scale layout misread")
            log(f"  {refused[-1]}")
            continue
        ms = time_ms(fn)
        return {"api": api, "ms": ms, "tflops": flops / ms / 1e9, "dense_rel_err": err, "refused": refused}
    raise RuntimeError("no dense block-scaled GEMM ran: " + " | ".join(refused))


def dense_tensorwise(a, b_nk, flops) -> dict:
    ms = tensorwise_fp8_ms(a, b_nk)
    return {"api": "torch._scaled_mm tensorwise", "ms": ms, "tflops": flops / ms / 1e9}


def gemm_kernel_ms(fn, calls: int = 10) -> float:
    """Median device time per call of the kernels whose name holds ``gemm``."""
    times = [ev.device_time_total for ev in cuda_events(fn, calls) if "gemm" in ev.name.lower()]
    if len(times) < calls:
        raise RuntimeError(f"expected a gemm kernel per call in the profile, found {len(times)} in {calls} calls")
    per_call = len(times) // calls
    return statistics.median(sum(times[c * per_call:(c + 1) * per_call]) for c in range(calls)) / 1e3


def ours(x, w, ws, offsets, flops) -> dict:
    fn = lambda: torch.ops.fp8_moe.grouped_mm(x, w, ws, offsets, BLOCK)  # noqa: E731
    ms = time_ms(fn)
    kernel = gemm_kernel_ms(fn)
    return {"ms": ms, "tflops": flops / ms / 1e9, "gemm_kernel_ms": kernel, "kernel_tflops": flops / kernel / 1e9}


def run_shape(runner: Runner, model, T: int, proj: str, N: int, K: int, gen) -> None:
    M = T * model.top_k
    rows = M // model.E
    params = (("proj", proj), ("M", M), ("N", N), ("K", K), ("rows_per_expert", rows))
    flops = 2 * M * N * K
    w, ws = make_weights(model.E, N, K, gen)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, model.E + 1, device="cuda", dtype=torch.int32) * rows
    a = (torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 32).to(FP8)
    sa = torch.rand(M, -(-K // 128), device="cuda", generator=gen) * 2e-3 + 1e-3

    def config(variant):
        return ExperimentConfig("gemm_ceiling", model.name, T, variant, params=params)

    runner.run(config("dense_blockwise"), lambda: dense_blockwise(a, sa, w[0], ws[0], flops))
    runner.run(config("dense_tensorwise"), lambda: dense_tensorwise(a, w[0], flops))
    runner.run(config("ours"), lambda: ours(x, w, ws, offsets, flops))
    del w, ws, x, a, sa
    torch.cuda.empty_cache()


def table(runner: Runner) -> str:
    rows = {}
    for r in runner.results:
        f = r.flat()
        row = rows.setdefault((f["model"], f["tokens"], f["proj"]), {
            k: f[k] for k in ("model", "tokens", "proj", "M", "N", "K", "rows_per_expert")})
        if r.error:
            row[f["variant"] + "_error"] = r.error
            continue
        row[f["variant"]] = f["tflops"]
        if f["variant"] == "dense_blockwise":
            row["api"] = f["api"]
        if f["variant"] == "ours":
            row["kernel"] = f["kernel_tflops"]
    for row in rows.values():
        dense = row.get("dense_blockwise")
        if dense:
            row["ratio"] = row["ours"] / dense if row.get("ours") else None
            row["kernel_ratio"] = row["kernel"] / dense if row.get("kernel") else None
        row["errors"] = "; ".join(f"{k[:-6]}: {v}" for k, v in row.items() if k.endswith("_error")) or None
    return markdown_table(list(rows.values()), [
        ("model", "model", ""), ("T", "tokens", ""), ("GEMM", "proj", ""), ("M", "M", ""), ("N", "N", ""),
        ("K", "K", ""), ("rows/expert", "rows_per_expert", ""),
        ("dense block-scaled TFLOP/s", "dense_blockwise", ".0f"),
        ("dense tensorwise TFLOP/s", "dense_tensorwise", ".0f"), ("ours TFLOP/s (incl. act quant)", "ours", ".0f"),
        ("ours GEMM kernel TFLOP/s", "kernel", ".0f"), ("ours / dense", "ratio", ".2f"),
        ("kernel / dense", "kernel_ratio", ".2f"), ("dense call", "api", ""), ("errors", "errors", "")])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    args = p.parse_args()
    runner = Runner("gemm_ceiling", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(17)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        for T in tokens:
            if T * model.top_k % model.E:
                p.error(f"--cases: T * top_k must split evenly over the {model.E} experts of {name}, got T={T}")
            for proj in PROJS:
                run_shape(runner, model, T, proj, *gemm_shape(model, proj), gen)
            runner.save(table(runner))
    log(table(runner))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
