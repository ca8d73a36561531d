"""Plots ``bench/ws_gemm_ab.py`` runs: the Gluon prefill kernel against the Triton kernel.

    python bench/plot_ws_gemm.py --out docs/benchmarks/ws_gemm_ab.png \\
        --kernels docs/benchmarks/ws_gemm_ab_kernels.json --layers docs/benchmarks/ws_gemm_ab.json

Left: per GEMM (gate_up, down) of each model and T, the Triton kernel's device time over
the Gluon kernel's (``--kernels``: a run with the ways ``triton`` and ``ws``; > 1: the
Gluon kernel is faster), dynamic activation scales.  Right: the layer's time with the
Triton kernel over its time as shipped (``--layers``: ways ``triton`` and ``shipped``),
dynamic and static.  Needs matplotlib (the ``bench`` extra); no GPU.
"""

from __future__ import annotations

import argparse
import sys

from common import MODELS, read_json
from plot_host import save_figure


def ratios(path: str, num: str, den: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(model, scheme) -> [(T, metrics[num] / metrics[den])] of one run, by T."""
    _, results = read_json(path)
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in results:
        if r.ok:
            out.setdefault((r.config.model, r.config.variant), []).append(
                (r.config.tokens, r.metrics[num] / r.metrics[den]))
    return {key: sorted(points) for key, points in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--kernels", required=True, help="ws_gemm_ab JSON with the ways triton and ws")
    p.add_argument("--layers", required=True, help="ws_gemm_ab JSON with the ways triton and shipped")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = dict(zip(MODELS, ("tab:blue", "tab:orange", "tab:green")))
    for gemm, style in (("gate_up", "-"), ("down", "--")):
        for (model, scheme), points in ratios(args.kernels, f"triton_{gemm}_ms", f"ws_{gemm}_ms").items():
            if scheme == "dynamic":
                left.plot(*zip(*points), style, marker="o", color=colors[model], label=f"{model} {gemm}")
    for (model, scheme), points in ratios(args.layers, "triton_ms", "shipped_ms").items():
        right.plot(*zip(*points), "-" if scheme == "dynamic" else ":", marker="o", color=colors[model],
                   label=f"{model} {scheme}")
    for ax, ylabel in ((left, "Triton kernel time / Gluon kernel time"), (right, "layer time: Triton / shipped")):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(ylabel)
    left.set_title("each GEMM, dynamic scales (> 1: Gluon faster)", fontsize=10)
    left.legend(fontsize=7)
    save_figure(fig, right, "grouped_experts layer as shipped (Gluon where the table says)", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
