"""Plots the host (CPU) time per eager call of ``bench_modlist`` runs: one point per run
(one process each), grouped by model and weight form (stacked op, list op with fused
or separate gate / up), one colour per label.  The host's speed moves between
processes, so before / after comparisons alternate processes and show every one.

    python bench/plot_modlist_host.py --out docs/benchmarks/bench_modlist_checks.png \\
        "before=docs/benchmarks/modlist_host_base_1.json" "after=docs/benchmarks/modlist_host_new_1.json" ...

Needs matplotlib (the ``bench`` extra); no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

from plot_host import save_figure

FORMS = ("stacked", "fused", "separate")


def host_points(path: str, tokens: int) -> dict[tuple[str, str], float]:
    """(model, form) -> host µs per call at ``tokens`` in one ``bench_modlist.json``."""
    with open(path) as f:
        results = json.load(f)["results"]
    return {(r["model"], form): r[f"{form}_host_us"] for r in results if r["T"] == tokens for form in FORMS
            if f"{form}_host_us" in r}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("runs", nargs="+", help="label=path of a bench_modlist.json (labels repeat: one per process)")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--title", default="grouped_experts_list: host time per eager call, T={tokens} "
                   "(H200 host, one point per process)", help="{tokens}: the token count")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, host_points(path, args.tokens)) for label, path in (r.split("=", 1) for r in args.runs)]
    labels = list(dict.fromkeys(label for label, _ in runs))
    cases = sorted(set.intersection(*(set(points) for _, points in runs)), key=lambda c: (c[0], FORMS.index(c[1])))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(cases)), 4.5))
    for i, label in enumerate(labels):
        offset = (i - (len(labels) - 1) / 2) * 0.25
        xs, ys = [], []
        for run_label, points in runs:
            if run_label == label:
                xs += [c + offset for c in range(len(cases))]
                ys += [points[case] for case in cases]
        ax.scatter(xs, ys, s=14, label=label, color=f"C{i}")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{model.split('_')[0]}\n{form}" for model, form in cases], fontsize=8)
    ax.set_ylabel("host µs per call")
    ax.set_ylim(bottom=0)
    save_figure(fig, ax, args.title.format(tokens=args.tokens), args.out)
    print(f"wrote {args.out} ({len(cases)} cases, {len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
