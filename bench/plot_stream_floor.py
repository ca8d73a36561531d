"""The T=1 decode GEMMs' times against the floor of one kernel reading as many bytes.

    PYTHONPATH=bench python bench/plot_stream_floor.py --out PNG STREAM_FLOOR_JSON DECODE_FORMS_JSON...

The floor: the fastest launch shape per size of ``bench/stream_floor.py``'s JSON.  The
GEMMs: ``bench/decode_forms.py``'s JSONs, their T=1 dynamic cases, the shipped launches
and those without their fused epilogue (forms ``gate_up:epilogue=0`` / ``down:epilogue=0``),
the median over rounds, each at the bytes of the weights it reads (the top_k experts one
token hits, (N, K) e4m3 each).  Prints the ratios to the floor (interpolated between the
floor's sizes, log-log).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from common import MODELS, gemm_shape, log, plot_lines, read_json


def floor_points(path: str) -> list[tuple[float, float]]:
    best = {}
    for r in read_json(path)[1]:
        if r.ok:
            mb = float(r.config.model.split()[0])
            best[mb] = min(best.get(mb, math.inf), r.metrics["us"])
    return sorted(best.items())


def gemm_mb(model: str, gemm: str) -> float:
    m = MODELS[model]
    n, k = gemm_shape(m, gemm)
    return m.top_k * n * k / 1e6


def gemm_points(paths) -> dict[str, dict[tuple[str, str], float]]:
    """{"shipped" | "epilogue=0": {(model, gemm): median µs}} of the T=1 dynamic cases."""
    times: dict[str, dict[tuple[str, str], list[float]]] = {"shipped": {}, "epilogue=0": {}}
    for path in paths:
        for r in read_json(path)[1]:
            form = dict(r.config.params).get("form")
            if not r.ok or r.config.tokens != 1 or r.config.variant != "dynamic":
                continue
            for gemm in ("gate_up", "down"):
                way = "shipped" if form == "shipped" else "epilogue=0" if form == f"{gemm}:epilogue=0" else None
                if way is not None and f"{gemm}_us" in r.metrics:
                    times[way].setdefault((r.config.model, gemm), []).append(r.metrics[f"{gemm}_us"])
    return {way: {key: statistics.median(v) for key, v in got.items()} for way, got in times.items()}


def interpolate(points: list[tuple[float, float]], mb: float) -> float:
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if b[0] >= mb), points[-2:])
    t = (math.log(mb) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("floor")
    p.add_argument("gemms", nargs="+")
    args = p.parse_args()
    floor = floor_points(args.floor)
    gemms = gemm_points(args.gemms)
    for way, got in gemms.items():
        for (model, gemm), us in sorted(got.items()):
            mb = gemm_mb(model, gemm)
            log(f"{way:10s} {model} {gemm}: {mb:.1f} MB, {us:.1f} µs, {us / interpolate(floor, mb):.2f}x the floor")
    series = {"one kernel reading the bytes (fastest launch shape)": floor}
    for way, label in (("shipped", "T=1 decode GEMM, shipped"), ("epilogue=0", "same, without its fused epilogue")):
        series[label] = [(gemm_mb(model, gemm), us) for (model, gemm), us in gemms[way].items()]
    plot_lines(args.out, "T=1 decode GEMMs against one kernel reading their weights (cold)", series,
               "MB read", "µs per launch (CUDA graph)", caption=" ".join(sys.argv[1:]),
               dashed=[next(iter(series))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
