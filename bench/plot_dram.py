"""The prefill GEMMs' DRAM bytes per way, against the bytes they must read at least.

    PYTHONPATH=bench python bench/plot_dram.py --out PNG --case deepseek_v3:8192 NCU_JSON...

Each NCU_JSON is a file of docs/benchmarks written from ``bench/ncu_layers.py``'s Nsight
Compute runs (``--ways``): {"meta", "runs": [{"command", "kernels"}]} or {"meta",
"command" in meta, "kernels"}, each kernel a dict with ``way``, ``gemm`` (gate_up / down)
and ``dram__bytes_read.sum`` as ncu prints it ("9,971,815,424 byte").  A kernel's case is
its own ``case`` ("model:T", where its run's command had several), else its run's
command's ``--cases model:T``; only the kernels of ``--case`` are drawn.  One panel per
GEMM: a bar per (file, way), the mean over the way's repeats, and a dashed line at the
least bytes (the weights of all E experts, E N K, and the S = T top_k rows of A, S K, one
byte each; scales and the output's writes aside).  Prints the ratios.  No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

from common import MODELS, PROJS, gemm_shape, log


def least_bytes(model: str, T: int, gemm: str) -> int:
    """The e4m3 weights of every expert and the A rows of one GEMM of a layer."""
    m = MODELS[model]
    n, k = gemm_shape(m, gemm)
    return m.E * n * k + T * m.top_k * k


def dram_bytes(paths: list[str], case: str) -> dict[str, dict[str, float]]:
    """{gemm: {"<file stem>: <way>": mean DRAM bytes read}} of the runs of ``case``
    ("model:T") in ``paths``, in the order the files and ways come."""
    out: dict[str, dict[str, list[float]]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        runs = data.get("runs") or [{"command": data["meta"]["command"], "kernels": data["kernels"]}]
        stem = os.path.basename(path).removesuffix(".json")
        for run in runs:
            cases = re.search(r"--cases\s+(\S+)", run["command"])
            for k in run["kernels"]:
                if k.get("case", cases and cases[1]) != case:
                    continue
                label = f"{stem}: {k['way']}"
                out.setdefault(k["gemm"], {}).setdefault(label, []).append(
                    float(k["dram__bytes_read.sum"].split()[0].replace(",", "")))
    return {gemm: {label: statistics.mean(v) for label, v in ways.items()} for gemm, ways in out.items()}


def plot(path: str, case: str, data: dict[str, dict[str, float]], caption: str) -> None:
    try:
        import matplotlib
    except ImportError:
        log(f"matplotlib not installed: no {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, T = case.split(":")
    gemms = [g for g in PROJS if g in data]
    rows = max(len(data[g]) for g in gemms)
    fig, axes = plt.subplots(1, len(gemms), figsize=(7 * len(gemms), 1.2 + 0.32 * rows), squeeze=False)
    for ax, gemm in zip(axes[0], gemms):
        labels = list(data[gemm])
        ax.barh(range(len(labels)), [data[gemm][lab] / 1e9 for lab in labels], color="tab:blue")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        least = least_bytes(model, int(T), gemm) / 1e9
        ax.axvline(least, color="k", linestyle="--", label=f"least bytes {least:.2f} GB")
        ax.set_xlabel("GB read from DRAM")
        ax.set_title(f"{model} T={T}: {gemm} GEMM", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.text(0.01, 0.01, caption, fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--case", required=True, help="model:T, as the runs' --cases")
    p.add_argument("files", nargs="+")
    args = p.parse_args()
    model, _, T = args.case.partition(":")
    if model not in MODELS or not T.isdigit():
        p.error(f"--case: expected model:T with a model of {list(MODELS)}, got {args.case!r}")
    data = dram_bytes(args.files, args.case)
    if not data:
        p.error(f"no run of {args.case} in {args.files}")
    for gemm, ways in data.items():
        least = least_bytes(model, int(T), gemm)
        for label, nbytes in ways.items():
            log(f"{gemm:8s} {label}: {nbytes / 1e9:.2f} GB, {nbytes / least:.2f}x the least bytes")
    plot(args.out, args.case, data, "PYTHONPATH=bench python bench/plot_dram.py --out " + os.path.basename(args.out)
         + f" --case {args.case} " + " ".join(os.path.basename(f) for f in args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
