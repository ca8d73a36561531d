"""Whole-MoE-layer benchmark of ``fp8_moe::grouped_experts`` on the PERF.md shapes.

Run on a CUDA machine (never in CI):

    PYTHONPATH=. python bench/bench_moe.py --out-dir OUT [--models deepseek_v3,...] [--tokens 1,64,...]

Writes ``OUT/bench_moe.json`` (every measurement), ``OUT/benchmarks_table.md`` (the
tables of docs/benchmarks.md) and ``OUT/<model>.png`` (time vs tokens, log-log).
Beside ours (dynamic and static activation scales, uniform and one skewed routing)
it times, at the same shapes in the same run:

* ``bf16``: a whole layer on ``torch._grouped_mm`` with dequantised bf16 weights;
* ``fp8_rowwise``: a whole layer on ``torch._scaled_grouped_mm`` (rowwise fp8 scales,
  activations quantised with torch ops) — a coarser recipe than 128x128 blocks;
* ``eager``: this package's ``FP8Experts(dispatch="eager")`` loop, small T only.

Timing: median of ``triton.testing.do_bench`` (CUDA events), and for T <= 1024 also the
median replay of a CUDA graph of the call (launch gaps removed).  Floors as PERF.md:
max(weight bytes / 4.22 TB/s, FLOPs / 1357 TFLOP/s) with weight bytes = experts hit
* 3 * H * I (fp8) plus their scales, FLOPs = 6 * T * k * H * I.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

import fp8_moe_ops
from fp8_moe_ops import reference

COPY_BW = 4.22e12
FP8_RATE = 1357e12
MODELS = {  # name: (E, H, I, top_k)
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "mixtral_8x7b": (8, 4096, 14336, 2),
}
TOKENS = [1, 8, 64, 512, 1024, 4096, 8192, 16384]
BLOCK = [128, 128]
DEV = "cuda"
OPS = torch.ops.fp8_moe


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- inputs


def make_weights(E, N, K, gen):
    """Random e4m3 weights (E, N, K), float32 block scales, built one expert at a
    time (no float copy of the whole tensor), never zeros."""
    w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=DEV)
    for e in range(E):
        w[e] = (torch.randn(N, K, device=DEV, generator=gen, dtype=torch.bfloat16) * 32).to(torch.float8_e4m3fn)
    s = torch.rand(E, triton.cdiv(N, BLOCK[0]), triton.cdiv(K, BLOCK[1]), device=DEV, generator=gen) * 2e-4 + 1e-4
    return w, s


def layer_weights(model, gen):
    """(gate_up, its scales, down, its scales) of a PERF.md model: (E, 2I, H), (E, H, I)."""
    E, H, I, _ = MODELS[model]
    return (*make_weights(E, 2 * I, H, gen), *make_weights(E, H, I, gen))


def layer_inputs(model, T, gen, kind="uniform"):
    """(hidden (T, H) bf16, top_k_index, top_k_weights) for T tokens of a PERF.md model."""
    E, H, _, k = MODELS[model]
    x = torch.randn(T, H, device=DEV, generator=gen, dtype=torch.bfloat16)
    return (x, *make_routing(T, E, k, kind, gen))


def parse_sweep(text: str) -> dict[str, list[int]]:
    """``"model:T,T;model:T"`` -> {model: [T, ...]} (the scripts' --models / --cases)."""
    return {m: [int(t) for t in ts.split(",")] for m, ts in (part.split(":") for part in text.split(";"))}


def dequant_bf16(w, s):
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=DEV)
    for e in range(w.shape[0]):
        out[e] = reference.dequantize_weight(w[e], s[e], BLOCK).to(torch.bfloat16)
    return out


def rowwise_scales(w, s):
    """Per-(expert, output row) fp32 scale for the rowwise baseline (a coarser recipe:
    the block scales' row maximum; the numbers are for timing, not accuracy)."""
    return s.amax(dim=2).repeat_interleave(BLOCK[0], dim=1)[:, : w.shape[1]].contiguous()


def make_routing(T, E, k, kind, gen):
    logits = torch.randn(T, E, device=DEV, generator=gen)
    if kind == "skewed":  # Zipf-like: a few hot experts
        logits = logits + 2.0 * -torch.log(torch.arange(1, E + 1, device=DEV, dtype=torch.float32))
    probs = torch.softmax(logits, dim=-1)
    w, idx = torch.topk(probs, k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).float()


# --------------------------------------------------------------------------- baselines


def bf16_layer(x, idx, wts, gu, dp):
    T, k = idx.shape
    perm, offsets = reference.sort_by_expert(idx, gu.shape[0])
    tok = perm // k
    h = torch._grouped_mm(x[tok], gu.transpose(1, 2), offs=offsets)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g.float()) * u.float()).to(torch.bfloat16), dp.transpose(1, 2), offs=offsets)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=DEV)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[perm, None])
    return out.to(x.dtype)


def _rowwise_quant(x):
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s.squeeze(-1)


def fp8_rowwise_layer(x, idx, wts, gu, gu_rs, dp, dp_rs):
    T, k = idx.shape
    perm, offsets = reference.sort_by_expert(idx, gu.shape[0])
    tok = perm // k
    q, sa = _rowwise_quant(x[tok])
    h = torch._scaled_grouped_mm(q, gu.transpose(1, 2), sa, gu_rs, offs=offsets, out_dtype=torch.bfloat16,
                                 use_fast_accum=True)
    g, u = h.chunk(2, dim=-1)
    q2, sa2 = _rowwise_quant((F.silu(g.float()) * u.float()).to(torch.bfloat16))
    y = torch._scaled_grouped_mm(q2, dp.transpose(1, 2), sa2, dp_rs, offs=offsets, out_dtype=torch.bfloat16,
                                 use_fast_accum=True)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=DEV)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[perm, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------- timing


def bench(fn, rep_ms=200):
    return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def bench_graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def try_time(name, fn, graph=False, rep_ms=200):
    """{"ms", "graph_ms"}; a baseline that does not run (or cannot be captured in a
    CUDA graph) here is reported, not fatal."""
    res = {}
    timers = {"ms": lambda: bench(fn, rep_ms)}
    if graph:
        timers["graph_ms"] = lambda: bench_graph(fn)
    for key, timer in timers.items():
        try:
            res[key] = timer()
        except Exception as e:
            log(f"  {name} ({key}): {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            res[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            torch.cuda.synchronize()
    if "ms" not in res:
        res["error"] = res.pop("ms_error")
    return res


def run_model(name, tokens, gen, results, eager_max_t, skip_baselines=False):
    E, H, I, k = MODELS[name]
    t0 = time.time()
    gu, gus, dp, dps = layer_weights(name, gen)
    gu_a = torch.rand(E, device=DEV, generator=gen) * 0.01 + 0.01
    dp_a = torch.rand(E, device=DEV, generator=gen) * 0.01 + 0.01
    gu16, dp16 = (None, None) if skip_baselines else (dequant_bf16(gu, gus), dequant_bf16(dp, dps))
    gu_rs, dp_rs = rowwise_scales(gu, gus), rowwise_scales(dp, dps)
    torch.cuda.synchronize()
    log(f"{name}: weights ready in {time.time() - t0:.1f} s")
    eager_mod = fp8_moe_ops.FP8Experts(E, H, I, BLOCK, dispatch="eager", device=DEV)
    eager_mod.gate_up_proj.data, eager_mod.gate_up_proj_scale_inv.data = gu, gus
    eager_mod.down_proj.data, eager_mod.down_proj_scale_inv.data = dp, dps
    for T in tokens:
        for kind in ("uniform", "skewed"):
            x, idx, wts = layer_inputs(name, T, gen, kind)
            hit = int(torch.unique(idx).numel())
            flops = 6 * T * k * H * I
            wbytes = hit * 3 * H * I + hit * (gus[0].numel() + dps[0].numel()) * 4
            floor_ms = max(wbytes / COPY_BW, flops / FP8_RATE) * 1e3
            row = {"model": name, "T": T, "routing": kind, "experts_hit": hit, "flops": flops,
                   "weight_bytes": wbytes, "floor_ms": floor_ms}
            graph = T <= 1024  # beyond, launch overhead is noise next to the kernels
            dyn = lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK)  # noqa: E731
            t1 = time.perf_counter()
            dyn()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t1
            row["ours_dynamic"] = try_time("ours_dynamic", dyn, graph)
            if kind == "uniform":
                st = lambda: OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, BLOCK, "silu", gu_a, dp_a)  # noqa: E731
                row["ours_static"] = try_time("ours_static", st, graph)
            if kind == "uniform" and not skip_baselines:
                row["bf16"] = try_time("bf16", lambda: bf16_layer(x, idx, wts, gu16, dp16), graph)
                row["fp8_rowwise"] = try_time(
                    "fp8_rowwise", lambda: fp8_rowwise_layer(x, idx, wts, gu, gu_rs, dp, dp_rs), graph)
                if T <= eager_max_t:
                    row["eager"] = try_time("eager", lambda: eager_mod(x, idx, wts), rep_ms=50)
            results.append(row)
            d = row["ours_dynamic"]
            log(f"{name} T={T} {kind}: ours dyn {d.get('ms', float('nan')):.3f} ms "
                f"(graph {d.get('graph_ms', float('nan')):.3f}), static "
                f"{row.get('ours_static', {}).get('ms', float('nan')):.3f}, bf16 "
                f"{row.get('bf16', {}).get('ms', float('nan')):.3f}, rowwise "
                f"{row.get('fp8_rowwise', {}).get('ms', float('nan')):.3f}, floor {floor_ms:.3f}, "
                f"first call {row['first_call_s']:.2f} s")
    del gu, gus, dp, dps, gu16, dp16, eager_mod
    torch.cuda.empty_cache()


def run_grouped_op(gen, results):
    """The grouped GEMM alone at PERF.md's shape: 32 experts x 2048 rows, N=4096, K=7168."""
    E, M, N, K = 32, 2048, 4096, 7168
    w, ws = make_weights(E, N, K, gen)
    x = torch.randn(E * M, K, device=DEV, generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * M
    flops = 2 * E * M * N * K
    row = {"model": "grouped_mm_op", "T": E * M, "flops": flops}
    row["ours_dynamic"] = try_time("ours grouped_mm", lambda: OPS.grouped_mm(x, w, ws, offsets, BLOCK))
    q, sa = _rowwise_quant(x)
    rs = rowwise_scales(w, ws)
    row["fp8_rowwise"] = try_time("scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
        q, w.transpose(1, 2), sa, rs, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True))
    w16 = dequant_bf16(w, ws)
    row["bf16"] = try_time("grouped_mm bf16", lambda: torch._grouped_mm(x, w16.transpose(1, 2), offs=offsets))
    for key in ("ours_dynamic", "fp8_rowwise", "bf16"):
        if "ms" in row[key]:
            log(f"grouped op {key}: {row[key]['ms']:.3f} ms, {flops / row[key]['ms'] / 1e9:.0f} TFLOP/s")
    results.append(row)


# --------------------------------------------------------------------------- report


def _fmt(v, spec):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_table(results, path, cmd):
    lines = [f"Command: `{cmd}`", ""]
    for model in MODELS:
        rows = [r for r in results if r["model"] == model]
        if not rows:
            continue
        E, H, I, k = MODELS[model]
        lines += [f"### {model} (E={E}, H={H}, I={I}, top_k={k})", "",
                  "| T | routing | ours dyn ms | graph ms | static ms | TFLOP/s | weight TB/s | % of floor | floor ms "
                  "| bf16 ms | x bf16 | rowwise ms | x rowwise | eager ms | first call s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            d = r["ours_dynamic"].get("ms")
            best = min(v for v in (d, r["ours_dynamic"].get("graph_ms")) if v is not None) if d else None
            tf = r["flops"] / best / 1e9 if best else None
            tb = r["weight_bytes"] / best / 1e9 if best else None
            pct = 100 * r["floor_ms"] / best if best else None

            def ms(key, field="ms"):
                return r.get(key, {}).get(field)

            def ratio(key):
                b = ms(key)
                if b is None or best is None:
                    return "—" if key not in r else ("err" if "error" in r[key] else "—")
                b = min(v for v in (b, ms(key, "graph_ms")) if v is not None)
                return f"{b / best:.2f}"

            lines.append(
                f"| {r['T']} | {r['routing']} | {_fmt(d, '.3f')} | {_fmt(ms('ours_dynamic', 'graph_ms'), '.3f')} | "
                f"{_fmt(ms('ours_static'), '.3f')} | {_fmt(tf, '.0f')} | {_fmt(tb, '.2f')} | {_fmt(pct, '.0f')} | "
                f"{r['floor_ms']:.3f} | {_fmt(ms('bf16'), '.3f')} | {ratio('bf16')} | {_fmt(ms('fp8_rowwise'), '.3f')} | "
                f"{ratio('fp8_rowwise')} | {_fmt(ms('eager'), '.2f')} | {r['first_call_s']:.2f} |")
        lines.append("")
    op = [r for r in results if r["model"] == "grouped_mm_op"]
    if op:
        r = op[0]
        lines += ["### grouped GEMM alone (32 experts x 2048 rows, N=4096, K=7168)", "",
                  "| implementation | ms | TFLOP/s |", "| --- | --- | --- |"]
        for key, label in (("ours_dynamic", "fp8_moe::grouped_mm (128x128 blocks, incl. act quant)"),
                           ("fp8_rowwise", "torch._scaled_grouped_mm rowwise (pre-quantised)"),
                           ("bf16", "torch._grouped_mm bf16")):
            v = r[key].get("ms")
            lines.append(f"| {label} | {_fmt(v, '.3f')} | {_fmt(r['flops'] / v / 1e9 if v else None, '.0f')} |"
                         if v else f"| {label} | {r[key].get('error', '—')} | |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(results, out_dir, cmd):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for model in MODELS:
        rows = [r for r in results if r["model"] == model and r["routing"] == "uniform"]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        Ts = [r["T"] for r in rows]
        for key, label in (("ours_dynamic", "fp8_moe grouped (dynamic)"), ("ours_static", "fp8_moe grouped (static)"),
                           ("bf16", "bf16 torch._grouped_mm"), ("fp8_rowwise", "torch._scaled_grouped_mm rowwise"),
                           ("eager", "fp8_moe eager loop")):
            pts = [(r["T"], r[key]["ms"]) for r in rows if key in r and "ms" in r[key]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.plot(Ts, [r["floor_ms"] for r in rows], "k--", label="floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{model}: whole MoE layer, H200")
        ax.legend(fontsize=8)
        fig.text(0.01, 0.01, cmd, fontsize=6)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(os.path.join(out_dir, f"{model}.png"), dpi=110)
        plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--eager-max-t", type=int, default=64)
    p.add_argument("--grouped-op", action="store_true", help="also time the grouped GEMM alone")
    p.add_argument("--baselines-from", default=None,
                   help="skip the baselines; copy them from this earlier bench_moe.json (same script and machine kind)")
    p.add_argument("--eager-from", default=None,
                   help="copy the eager-loop times (not re-run past --eager-max-t) from this earlier bench_moe.json")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    cmd = "PYTHONPATH=. python bench/bench_moe.py " + " ".join(sys.argv[1:])
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: list[dict] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": cmd, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for model in args.models.split(","):
        try:
            run_model(model, [int(t) for t in args.tokens.split(",")], gen, results, args.eager_max_t,
                      skip_baselines=args.baselines_from is not None)
            if args.baselines_from:
                copy_baselines(results, args.baselines_from, ("bf16", "fp8_rowwise", "eager"))
            if args.eager_from:
                copy_baselines(results, args.eager_from, ("eager",))
        except Exception:
            traceback.print_exc()
        save(results, meta, args.out_dir, cmd)  # after each model: a timeout keeps what was measured
    if args.grouped_op:
        try:
            run_grouped_op(gen, results)
        except Exception:
            traceback.print_exc()
        save(results, meta, args.out_dir, cmd)
    return 0


def copy_baselines(results, path, keys):
    with open(path) as f:
        old = {(r["model"], r["T"], r.get("routing")): r for r in json.load(f)["results"]}
    for r in results:
        prev = old.get((r["model"], r["T"], r.get("routing")), {})
        for key in keys:
            if key in prev and key not in r:
                r[key] = dict(prev[key], copied_from=path)


def save(results, meta, out_dir, cmd):
    with open(os.path.join(out_dir, "bench_moe.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    write_table(results, os.path.join(out_dir, "benchmarks_table.md"), cmd)
    plot(results, out_dir, cmd)


if __name__ == "__main__":
    sys.exit(main())
