"""Plots one metric of several benchmark runs side by side; by default the CPU time per
``grouped_experts`` op call of ``host_overhead`` runs.

    python bench/plot_host.py --out docs/benchmarks/host_overhead_history.png \\
        "2026-11-30=docs/benchmarks/host_overhead.json" \\
        "2026-12-01 Library=docs/benchmarks/host_overhead_2026-12-01.json" \\
        "2026-12-01 plans=docs/benchmarks/host_overhead_plans.json"

One group of bars per (model, T) present in every run, one bar per run (label=path,
JSON files written by the ``bench/`` scripts), and a target as a line.  ``--metric``,
``--variant``, ``--target`` (0: none), ``--ylabel`` and ``--title`` select another
measurement, e.g. the CUDA-graph time of ``profile_layer`` runs (``graph_us``, variant
``dynamic``); ``--relative`` plots each run as a fraction of the first run's value (a
before / after of cases from decode to prefill in one figure), ``--min-tokens`` leaves out
smaller T.  ``label=path@metric`` plots that run's ``metric`` instead (both ways of one
``host_ab`` run: ``a_us`` and ``b_us``).  ``--variants "A;B;..."`` makes one group per
variant instead (each run's first result of it: runs of one case, such as
``module_overhead``'s parts).  Needs matplotlib (the ``bench`` extra); no GPU.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from common import read_json


def metric(path: str, name: str, variant: str) -> dict[tuple[str, int], float]:
    """(model, T) -> the metric ``name`` of ``variant`` in one run."""
    _, results = read_json(path)
    return {(r.config.model, r.config.tokens): r.metrics[name]
            for r in results if r.ok and r.config.variant == variant}


def save_figure(fig, ax, title: str, out: str) -> None:
    """Title, legend and layout of the bench figures; writes ``out`` and closes ``fig``."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("runs", nargs="+", help="label=path of a bench JSON, or label=path@metric")
    p.add_argument("--metric", default="cpu_us")
    p.add_argument("--variant", default="op grouped_experts")
    p.add_argument("--target", type=float, default=40.0, help="a horizontal line at this value (0: none)")
    p.add_argument("--ylabel", default="CPU µs per op call")
    p.add_argument("--min-tokens", type=int, default=0, help="only cases with at least this many tokens")
    p.add_argument("--relative", action="store_true", help="each run divided by the first run")
    p.add_argument("--variants", default=None, help="';'-separated: one group of bars per variant, not per case")
    p.add_argument("--title", default="torch.ops.fp8_moe.grouped_experts: host time per eager call (H200 host)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    variants = args.variants.split(";") if args.variants else None
    for label, path in (r.split("=", 1) for r in args.runs):
        path, _, name = path.partition("@")
        if variants:
            runs.append((label, {v: next(iter(metric(path, name or args.metric, v).values())) for v in variants}))
        else:
            runs.append((label, metric(path, name or args.metric, args.variant)))
    cases = variants or sorted(c for c in set.intersection(*(set(data) for _, data in runs))
                               if c[1] >= args.min_tokens)
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(8.0, (1.4 if variants else 0.8) * len(cases)), 4.5))
    base = runs[0][1]
    shown = []
    for i, (label, data) in enumerate(runs):
        values = [data[case] / base[case] if args.relative else data[case] for case in cases]
        ax.bar([c + i * width for c in range(len(cases))], values, width, label=label)
        shown += values
    if args.target:
        ax.axhline(args.target, color="k", linestyle="--", label=f"target {args.target:g}")
    if args.relative:  # the differences are a few per cent: no axis from 0
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylim(min(shown) - 0.02, max(shown) + 0.02)
    ax.set_xticks([c + width * (len(runs) - 1) / 2 for c in range(len(cases))])
    ax.set_xticklabels([textwrap.fill(c, 16) for c in cases] if variants else
                       [f"{model.split('_')[0]}\nT={T}" for model, T in cases], fontsize=8)
    ax.set_ylabel(args.ylabel)
    save_figure(fig, ax, args.title, args.out)
    print(f"wrote {args.out} ({len(cases)} cases, {len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
