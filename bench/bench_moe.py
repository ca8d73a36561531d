"""Whole-MoE-layer benchmark of ``fp8_moe::grouped_experts`` on the three benchmark layers.

    PYTHONPATH=. python bench/bench_moe.py --out-dir OUT [--models deepseek_v3,...] [--tokens 1,64,...]
        [--grouped-op] [--copy-from EARLIER/bench_moe.json --copy eager] [--ceilings measured|h200]

Writes ``OUT/bench_moe.json`` (every case, failed ones with their error), ``OUT/bench_moe.md``
(one table per model) and ``OUT/<model>.png`` (time vs tokens, log-log).  Beside ours
(dynamic and static activation scales; uniform and skewed routing) it times, at the
same shapes in the same run:

* ``bf16``: a whole layer on ``torch._grouped_mm`` with dequantised bf16 weights;
* ``fp8_rowwise``: a whole layer on ``torch._scaled_grouped_mm`` (rowwise fp8 scales,
  activations quantised with torch ops): a coarser recipe than 128x128 blocks;
* ``eager``: this package's ``FP8Experts(dispatch="eager")`` loop, T <= --eager-max-t.

Timing: median of CUDA-event timings, and for T <= 1024 also the median replay of a
CUDA graph of the call, each case's SM clock beside it (``common.GpuClocks``: a GPU at its
power limit runs slower).  Floor: ``common.floor_ms`` with this GPU's ceilings measured at
the start (``--ceilings measured``, in the JSON's meta) or the H200's constants.  Exits 1
if any case failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import (BLOCK, CEILING_KINDS, MODELS, ROUTINGS, TOKENS, Ceilings, ExperimentConfig, GpuClocks, Runner,
                    ceilings_for, dequant_bf16, experts_module, floor_ms, graph_ms, layer_flops, layer_inputs,
                    layer_weights, log, make_weights, markdown_table, plot_lines, read_json, static_scales, time_ms,
                    weight_bytes)
from fp8_moe_ops.routing import sort_slots

OPS = torch.ops.fp8_moe
GRAPH_MAX_T = 1024  # beyond, launch gaps are noise next to the kernels
VARIANTS = ("ours_dynamic", "ours_static", "bf16", "fp8_rowwise", "eager")


# --------------------------------------------------------------------------- baselines


def bf16_layer(x, idx, wts, gu, dp):
    T, k = idx.shape
    perm, offsets = sort_slots(idx, gu.shape[0])
    tok = perm // k
    h = torch._grouped_mm(x[tok], gu.transpose(1, 2), offs=offsets)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g.float()) * u.float()).to(torch.bfloat16), dp.transpose(1, 2), offs=offsets)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[perm, None])
    return out.to(x.dtype)


def rowwise_quant(x):
    """Per-row e4m3 quantisation with torch ops -> (q, scale (rows,))."""
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s.squeeze(-1)


def rowwise_scales(w, s):
    """Per-(expert, output row) fp32 scale for the rowwise baseline: the block scales'
    row maximum (the numbers are for timing, not accuracy)."""
    return s.amax(dim=2).repeat_interleave(BLOCK[0], dim=1)[:, : w.shape[1]].contiguous()


def fp8_rowwise_layer(x, idx, wts, gu, gu_rs, dp, dp_rs):
    T, k = idx.shape
    perm, offsets = sort_slots(idx, gu.shape[0])
    tok = perm // k
    q, sa = rowwise_quant(x[tok])
    h = torch._scaled_grouped_mm(q, gu.transpose(1, 2), sa, gu_rs, offs=offsets, out_dtype=torch.bfloat16,
                                 use_fast_accum=True)
    g, u = h.chunk(2, dim=-1)
    q2, sa2 = rowwise_quant((F.silu(g.float()) * u.float()).to(torch.bfloat16))
    y = torch._scaled_grouped_mm(q2, dp.transpose(1, 2), sa2, dp_rs, offs=offsets, out_dtype=torch.bfloat16,
                                 use_fast_accum=True)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[perm, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------- experiment


def _timed(fn, graph: bool, rep_ms: int = 200) -> dict:
    with GpuClocks() as clocks:
        res = {"ms": time_ms(fn, rep_ms)}
    res.update(clocks.metrics())
    if graph:
        res["graph_ms"] = graph_ms(fn)
    return res


def run_model(runner: Runner, model, tokens, gen, eager_max_t: int, skip: set[str], ceilings: Ceilings) -> None:
    t0 = time.time()
    w = layer_weights(model, gen)
    gu_a, dp_a = static_scales(model, gen)
    gu16, dp16 = ((dequant_bf16(w.gate_up, w.gate_up_scale), dequant_bf16(w.down, w.down_scale))
                  if "bf16" not in skip else (None, None))
    gu_rs, dp_rs = rowwise_scales(w.gate_up, w.gate_up_scale), rowwise_scales(w.down, w.down_scale)
    eager_mod = experts_module(model, w, dispatch="eager")
    torch.cuda.synchronize()
    log(f"{model.name}: weights ready in {time.time() - t0:.1f} s")
    for T in tokens:
        for kind in ROUTINGS:
            x, idx, wts = layer_inputs(model, T, gen, kind)
            hit = int(torch.unique(idx).numel())
            flops, nbytes = layer_flops(model, T), weight_bytes(model, hit)
            shape = {"flops": flops, "weight_bytes": nbytes, "experts_hit": hit,
                     "floor_ms": floor_ms(flops, nbytes, ceilings)}
            graph = T <= GRAPH_MAX_T
            cases = {"ours_dynamic": lambda: OPS.grouped_experts(x, idx, wts, *w, BLOCK)}
            if kind == "uniform":
                cases["ours_static"] = lambda: OPS.grouped_experts(x, idx, wts, *w, BLOCK, "silu", gu_a, dp_a)
                cases["bf16"] = lambda: bf16_layer(x, idx, wts, gu16, dp16)
                cases["fp8_rowwise"] = lambda: fp8_rowwise_layer(x, idx, wts, w.gate_up, gu_rs, w.down, dp_rs)
                if T <= eager_max_t:
                    cases["eager"] = lambda: eager_mod(x, idx, wts)
            for variant, fn in cases.items():
                if variant in skip:
                    continue

                def measure(fn=fn, variant=variant):
                    first = {}
                    if variant == "ours_dynamic":
                        t1 = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        first["first_call_s"] = time.perf_counter() - t1
                    if variant == "eager":
                        return {**shape, **_timed(fn, False, rep_ms=50)}
                    return {**shape, **first, **_timed(fn, graph)}

                runner.run(ExperimentConfig("layer", model.name, T, variant, kind), measure)
    del w, gu16, dp16, eager_mod
    torch.cuda.empty_cache()


GROUPED_OP = (32, 2048, 4096, 7168)  # experts x rows per expert, N, K: a compute-bound grouped GEMM


def run_grouped_op(runner: Runner, gen) -> None:
    E, M, N, K = GROUPED_OP
    w, ws = make_weights(E, N, K, gen)
    x = torch.randn(E * M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M
    flops = 2 * E * M * N * K
    q, sa = rowwise_quant(x)
    rs = rowwise_scales(w, ws)
    w16 = dequant_bf16(w, ws)
    cases = {
        "ours (fp8_moe::grouped_mm, 128x128 blocks, incl. act quant)": lambda: OPS.grouped_mm(x, w, ws, offsets, BLOCK),
        "torch._scaled_grouped_mm rowwise (pre-quantised)": lambda: torch._scaled_grouped_mm(
            q, w.transpose(1, 2), sa, rs, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True),
        "torch._grouped_mm bf16": lambda: torch._grouped_mm(x, w16.transpose(1, 2), offs=offsets),
    }
    for variant, fn in cases.items():
        def measure(fn=fn):
            ms = time_ms(fn)
            return {"ms": ms, "tflops": flops / ms / 1e9}

        runner.run(ExperimentConfig("grouped_mm", f"{E}x{M} N={N} K={K}", E * M, variant), measure)


# --------------------------------------------------------------------------- report


def _layer_rows(results, model_name):
    """One row per (T, routing): every variant's times side by side."""
    rows = {}
    for r in results:
        c = r.config
        if c.experiment != "layer" or c.model != model_name:
            continue
        row = rows.setdefault((c.tokens, c.routing), {"T": c.tokens, "routing": c.routing})
        for key in ("floor_ms", "flops", "weight_bytes"):
            if row.get(key) is None:  # a failed case has no metrics: take them from another
                row[key] = r.metrics.get(key)
        row[c.variant] = "err" if r.error else r.metrics.get("ms")
        row[c.variant + "_graph"] = r.metrics.get("graph_ms")
        if c.variant == "ours_dynamic":
            row["first_call_s"] = r.metrics.get("first_call_s")
            row["clock_mhz"] = r.metrics.get("clock_sm_mhz_median")
    for row in rows.values():
        def best(v):
            times = [t for t in (row.get(v), row.get(v + "_graph")) if isinstance(t, float)]
            return min(times) if times else None

        ours = best("ours_dynamic")
        if ours:
            row["tflops"] = row["flops"] / ours / 1e9
            row["tbps"] = row["weight_bytes"] / ours / 1e9
            row["pct_floor"] = 100 * row["floor_ms"] / ours
            for v in ("bf16", "fp8_rowwise"):
                row[f"x_{v}"] = best(v) / ours if best(v) else None
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], ROUTINGS.index(k[1])))]


COLUMNS = [("T", "T", ""), ("routing", "routing", ""), ("ours dyn ms", "ours_dynamic", ".3f"),
           ("graph ms", "ours_dynamic_graph", ".3f"), ("static ms", "ours_static", ".3f"),
           ("TFLOP/s", "tflops", ".0f"), ("weight TB/s", "tbps", ".2f"), ("% of floor", "pct_floor", ".0f"),
           ("floor ms", "floor_ms", ".3f"), ("bf16 ms", "bf16", ".3f"), ("x bf16", "x_bf16", ".2f"),
           ("rowwise ms", "fp8_rowwise", ".3f"), ("x rowwise", "x_fp8_rowwise", ".2f"), ("eager ms", "eager", ".2f"),
           ("first call s", "first_call_s", ".2f"), ("SM MHz (ours dyn)", "clock_mhz", ".0f")]


def report(runner: Runner) -> str:
    ceilings = runner.meta.get("ceilings")
    parts = [f"Floor: max(weight bytes / {ceilings['copy_bandwidth'] / 1e12:.2f} TB/s, FLOPs / "
             f"{ceilings['fp8_dense_rate'] / 1e12:.0f} TFLOP/s) ({ceilings['source']}).", ""] if ceilings else []
    for m in MODELS.values():
        rows = _layer_rows(runner.results, m.name)
        if rows:
            parts += [f"### {m.name} (E={m.E}, H={m.H}, I={m.I}, top_k={m.top_k})", "",
                      markdown_table(rows, COLUMNS), ""]
    op = [r.flat() for r in runner.results if r.config.experiment == "grouped_mm"]
    if op:
        parts += [f"### grouped GEMM alone ({op[0]['model']})", "",
                  markdown_table(op, [("implementation", "variant", ""), ("ms", "ms", ".3f"),
                                      ("TFLOP/s", "tflops", ".0f"), ("error", "error", "")]), ""]
    return "\n".join(parts)


def plot(runner: Runner) -> None:
    for m in MODELS.values():
        rows = [r for r in runner.results if r.config.experiment == "layer" and r.config.model == m.name
                and r.config.routing == "uniform" and r.ok]
        if not rows:
            continue
        series = {v: [(r.config.tokens, r.metrics["ms"]) for r in rows if r.config.variant == v] for v in VARIANTS}
        series["floor"] = [(r.config.tokens, r.metrics["floor_ms"]) for r in rows if r.config.variant == "ours_dynamic"]
        plot_lines(os.path.join(runner.out_dir, f"{m.name}.png"), f"{m.name}: whole MoE layer", series, "tokens T",
                   "ms (median)", runner.meta["command"], dashed=("floor",))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--eager-max-t", type=int, default=64)
    p.add_argument("--grouped-op", action="store_true", help="also time the grouped GEMM alone")
    p.add_argument("--copy-from", help="an earlier bench_moe.json (same script, same machine kind)")
    p.add_argument("--copy", default="", help="variants taken from --copy-from instead of run, e.g. eager,bf16")
    p.add_argument("--ceilings", default="measured", choices=CEILING_KINDS,
                   help="the floor's copy bandwidth and fp8 rate: this GPU's, measured first, or the H200's")
    args = p.parse_args()
    skip = {v for v in args.copy.split(",") if v}
    if skip - set(VARIANTS) or bool(skip) != bool(args.copy_from):
        p.error(f"--copy: expected variants of {VARIANTS} together with --copy-from, got {args.copy!r}")
    runner = Runner("bench_moe", args.out_dir)
    ceilings = ceilings_for(args.ceilings)
    runner.meta["ceilings"] = asdict(ceilings)
    log(f"ceilings: copy {ceilings.copy_bandwidth / 1e12:.2f} TB/s, fp8 {ceilings.fp8_dense_rate / 1e12:.0f} TFLOP/s "
        f"({ceilings.source})")
    gen = torch.Generator(device="cuda").manual_seed(0)
    models = [MODELS[name] for name in args.models.split(",")]
    if args.copy_from:
        _, earlier = read_json(args.copy_from)
        runner.add(type(r)(r.config, {**r.metrics, "copied_from": args.copy_from}, r.error) for r in earlier
                   if r.config.variant in skip and r.config.model in {m.name for m in models})
    for model in models:
        run_model(runner, model, [int(t) for t in args.tokens.split(",")], gen, args.eager_max_t, skip, ceilings)
        runner.save(report(runner))  # after each model: a run cut short keeps what it measured
    if args.grouped_op:
        run_grouped_op(runner, gen)
    runner.save(report(runner))
    plot(runner)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
