"""Prefill layers with and without the Hopper GEMM kernel (``fp8_moe_ops/kernels/ws_gemm.py``).

    PYTHONPATH=. python bench/ws_gemm_ab.py --out-dir OUT [--cases "deepseek_v3:4096,8192;..."]
        [--ways triton,ws,ws_tiles,ws_down_only,ws_mid,ws_col,ws_nolag,ws_narrow,ws_wide_any_k,ws_wide_k2048,
                ws_row_groups,ws_store_mma,ws_store_rows,ws_sorted_all,ws_group<G>,shipped]

For every case (model, T, dynamic / static activation scales, uniform routing) one
process times the ``grouped_experts`` forward several ways, on the same inputs:

* ``triton``: ``FP8_MOE_GLUON=0``, the grouped Triton kernel for both GEMMs (the
  layer as it ran before the Gluon kernel);
* ``ws``: the Gluon kernel for every GEMM ``ws_gemm.usable`` takes (the gate_up
  GEMM's A then quantised per sorted row), whatever the launch table says;
* ``ws_tiles``: as ``ws`` with one program per tile instead of the persistent launch
  (one program per SM, each taking every SM-count-th tile);
* ``ws_down_only``: the Gluon kernel for the down GEMM only (the gate_up GEMM gathers);
* ``ws_mid``: as ``ws``, with the launch table's mid-size entries (64-row tiles, up to
  128-384 rows per expert) replaced by its prefill entry's tiles, so the Gluon kernel
  takes those GEMMs too;
* ``ws_col``: as ``ws`` with the Gluon kernel's ``GROUP_M`` = 1 (each row tile's
  column tiles in a row) instead of the table's 8;
* ``ws_nolag``: as ``shipped`` with the Gluon kernel's ``LAG`` off (each consumer
  warpgroup waits for a K step's MMAs before it issues the next step's);
* ``ws_narrow``: as ``shipped`` with the Gluon kernel's ``WIDE`` off (output tiles of
  128 x 128 everywhere, not 128 x 256 where N is a multiple of 256);
* ``ws_wide_any_k`` / ``ws_wide_k2048``: as ``shipped`` with 128 x 256 output tiles where N
  allows at every K and any rows per expert (``WIDE_MAX_K`` lifted) / only up to K = 2048
  (``WIDE_LONG_MAX_K`` 2048: the limit before the forty-fourth session);
* ``ws_row_groups``: as ``shipped`` with the Gluon kernel's tiles in groups of the table's
  ``GROUP_M`` row tiles (``BY_EXPERT`` off), not expert by expert;
* ``ws_group<G>`` (``ws_group16``, ...): as ``shipped`` with the Gluon kernel's
  ``GROUP_M`` = G (G row tiles of an expert take each column tile in turn) instead of
  the table's;
* ``ws_store_mma`` / ``ws_store_rows``: as ``shipped`` with the Gluon kernel's output
  stored from the MMA layout (``EPILOGUE`` 0: 4 bytes of a row per store, its form
  before the TMA store) / as whole rows through shared memory everywhere (1: no TMA);
* ``ws_sorted_all``: as ``shipped`` with the gate_up GEMM's rows in place (the Gluon
  kernel then takes it) at 2048 slots or fewer from any rows per expert
  (``experts.SORTED_A_MIN_ROWS`` 0), not only from the shipped threshold;
* ``shipped``: the launch table's choice (``"ws"`` in its entries).

Each way runs the op's path below the dispatcher with a table of launch plans of its own
(``experts.planned_experts``; the op's table keeps one plan per ``FP8_MOE_GLUON``
setting, so through it a way that differs in a module constant would replay an earlier
way's plan).  Per way, measured twice (the ways in order, then in reverse: a drift of the
clocks over the case falls on every way alike) and averaged: the layer's median time (CUDA
events, back-to-back calls), and from the profiler the device time of the gate_up
GEMM, the down GEMM (the kernels whose name holds ``gemm``, in launch order) and the
quantisation kernels (``quant``: the activations' and the gated activation's); beside
the layer's time, the GPU's median SM clock while it was timed and the fraction of that
time a power or thermal limit held the clock down (``common.GpuClocks``; where
``nvidia-smi`` runs: an H100 at its 700 W cap ran the prefill layers at 1.1-2.0 GHz,
docs/benchmarks.md).  Every way's output must equal the first way's bitwise.  Writes
``OUT/ws_gemm_ab.json`` / ``.md``; exits 1 if a case failed or differed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import statistics
import sys
from unittest import mock

import torch

from common import (BLOCK, MODELS, ExperimentConfig, GpuClocks, Runner, cuda_events, each_scheme_case, layer_flops,
                    log, markdown_table, parse_sweep, time_ms, ws_launch_with)
from fp8_moe_ops.kernels import config, experts, ws_gemm

CASES = {"deepseek_v3": [4096, 8192, 16384], "qwen3_30b_a3b": [4096, 8192, 16384],
         "mixtral_8x7b": [2048, 4096, 16384]}
WAYS = ("triton", "ws", "ws_tiles", "ws_down_only", "ws_mid", "ws_col", "ws_nolag", "ws_narrow", "ws_wide_any_k",
        "ws_wide_k2048", "ws_row_groups", "ws_store_mma", "ws_store_rows", "ws_sorted_all", "shipped")
SHIPPED_LIKE = ("shipped", "ws_nolag", "ws_narrow", "ws_wide_any_k", "ws_wide_k2048", "ws_row_groups",
                "ws_store_mma", "ws_store_rows", "ws_sorted_all")  # the launch table decides
GROUP_WAY = re.compile(r"ws_group([1-9]\d*)")  # ws_group<G>: the Gluon GEMM's GROUP_M = G


def check_ways(ways: list[str]) -> None:
    """Refuses a way this script does not know (it would time ``shipped`` under its name)."""
    unknown = [w for w in ways if w not in WAYS and not GROUP_WAY.fullmatch(w)]
    if unknown:
        raise ValueError(f"ways: expected names of {WAYS} or ws_group<G>, got {unknown}")


@contextlib.contextmanager
def _way(way: str):
    """The environment switch, the gate_up GEMM's A and the Gluon kernel's GROUP_M and
    programs of one way (every module global it sets is restored on exit)."""
    with contextlib.ExitStack() as stack:
        def patch(module, name, value):
            stack.enter_context(mock.patch.object(module, name, value))

        group = GROUP_WAY.fullmatch(way)
        if way not in SHIPPED_LIKE and not group:
            stack.enter_context(mock.patch.dict(os.environ, {"FP8_MOE_GLUON": "0" if way == "triton" else "1"}))
        real_call = ws_gemm.ws_gemm_call
        if way == "ws_col" or group:
            group_m = int(group[1]) if group else 1
            patch(ws_gemm, "ws_gemm_call", ws_launch_with(real_call, group_m=group_m))
        if way == "ws_tiles":
            patch(ws_gemm, "ws_gemm_call", ws_launch_with(real_call, max_programs=None))
        if way == "ws_nolag":
            patch(ws_gemm, "LAG", False)
        if way == "ws_row_groups":
            patch(ws_gemm, "BY_EXPERT", False)
        if way == "ws_narrow":
            patch(ws_gemm, "WIDE", False)
        if way == "ws_wide_any_k":
            patch(ws_gemm, "WIDE_MAX_K", 1 << 30)
        if way == "ws_wide_k2048":
            patch(ws_gemm, "WIDE_LONG_MAX_K", 2048)
        if way in ("ws_store_mma", "ws_store_rows"):
            patch(ws_gemm, "EPILOGUE", 0 if way == "ws_store_mma" else 1)
        if way == "ws_sorted_all":
            patch(experts, "SORTED_A_MIN_ROWS", 0)
        if way == "ws_down_only":
            patch(experts, "_sorted_a", lambda *a: False)
        if way == "ws_mid":
            shipped = config._table()
            prefill = {**shipped["default"][-1], "max_rows": None}

            def mid(entries):
                return [{**prefill, "max_rows": e["max_rows"]} if e["BM"] == 64 else e for e in entries]

            table = {"default": mid(shipped["default"]), "shapes": {k: mid(v) for k, v in shipped["shapes"].items()}}
            patch(config, "_table", lambda: table)
        yield


def kernel_ms(fn, calls: int = 10) -> dict:
    """Median device ms per call of the gate_up GEMM, the down GEMM (the first and second
    kernel whose name holds ``gemm``) and the quantisation kernels (``quant``)."""
    events = cuda_events(fn, calls)
    gemms = [ev.device_time_total for ev in events if "gemm" in ev.name.lower()]
    quants = [ev.device_time_total for ev in events if "quant" in ev.name.lower()]
    if len(gemms) != 2 * calls or len(quants) % calls:
        raise RuntimeError(f"expected two GEMM kernels per call, found {len(gemms)} in {calls} calls")
    per = len(quants) // calls
    return {"gate_up_ms": statistics.median(gemms[0::2]) / 1e3, "down_ms": statistics.median(gemms[1::2]) / 1e3,
            "quant_ms": statistics.median(sum(quants[c * per:(c + 1) * per]) for c in range(calls)) / 1e3}


def measure(weights, inputs, scales, flops: int, ways) -> dict:
    x, idx, wts = inputs
    args = (x, idx, wts, weights.gate_up, weights.gate_up_scale, weights.down, weights.down_scale, BLOCK, "silu",
            *scales, None)
    # each way through its own table of launch plans: the op keeps one per FP8_MOE_GLUON
    # setting, so a way that differs in a module constant would replay an earlier way's plan
    plans = {way: {} for way in ways}
    samples, outs = {way: [] for way in ways}, {}
    for way in [*ways, *reversed(ways)]:  # each way twice, in mirrored order: drifts in clock cancel
        fn = functools.partial(experts.planned_experts, plans[way], "layer", args)
        with _way(way):
            if way not in outs:
                outs[way] = fn()
            with GpuClocks() as clocks:
                ms = time_ms(fn)
            samples[way].append({"ms": ms, **clocks.metrics(), **kernel_ms(fn)})
    res = {}
    for way, runs in samples.items():
        keys = set.intersection(*(set(r) for r in runs))  # the clocks only where nvidia-smi sampled both runs
        res.update({f"{way}_{key}": statistics.mean(r[key] for r in runs) for key in sorted(keys)})
        res[f"{way}_gemm_tflops"] = flops / (res[f"{way}_gate_up_ms"] + res[f"{way}_down_ms"]) / 1e9
    differ = [way for way in ways if not torch.equal(outs[way], outs[ways[0]])]
    if differ:
        raise AssertionError(f"outputs of {differ} differ from {ways[0]}'s")
    for way in ways[1:]:
        res[f"{way}_speedup"] = res[f"{ways[0]}_ms"] / res[f"{way}_ms"]
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--ways", default=",".join(WAYS), help="the first is the one the others are compared with")
    args = p.parse_args()
    ways = args.ways.split(",")
    try:
        check_ways(ways)
    except ValueError as e:
        p.error(str(e))
    runner = Runner("ws_gemm_ab", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run(name, T, weights, inputs, scheme, scales):
        flops = layer_flops(MODELS[name], T)
        runner.run(ExperimentConfig("ws_gemm_ab", name, T, scheme),
                   lambda: measure(weights, inputs, scales, flops, ways))

    each_scheme_case(parse_sweep(args.cases) if args.cases else CASES, gen, run)
    cols = [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", "")]
    cols += [(f"{w} ms", f"{w}_ms", ".3f") for w in ways]
    cols += [(f"{w} {part}", f"{w}_{part}_ms", ".3f") for w in ways for part in ("gate_up", "down", "quant")]
    cols += [(f"{w} speedup", f"{w}_speedup", ".3f") for w in ways[1:]]
    cols += [(f"{w} {name}", f"{w}_clock_{key}", fmt) for w in ways
             for name, key, fmt in (("SM MHz", "sm_mhz_median", ".0f"), ("capped", "capped", ".2f"))]
    cols += [("error", "error", "")]
    text = markdown_table([r.flat() for r in runner.results], cols)
    runner.save(text)
    log(text)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
