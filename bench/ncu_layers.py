"""Hardware counters of the experts forward's kernels (Nsight Compute), at decode and prefill.

On the GPU machine (ncu reads the counters there; leave the clocks alone):

    PYTHONPATH=.:bench ncu --profile-from-start off --clock-control none \\
        --kernel-name regex:"grouped_gemm|ws_gemm|sort_quant|gated_act" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis \\
        --metrics sm__cycles_active.max,sm__cycles_active.min,sm__cycles_active.avg,dram__bytes_read.sum \\
        --csv --page details python bench/ncu_layers.py > OUT/ncu.csv

runs one dynamic-scale layer per case of ``CASES`` (uniform routing, the bench's weights),
twice outside the profiled range (compiles, launch plans) and once inside it.  Then, anywhere:

    python bench/ncu_layers.py --summarize OUT/ncu.csv > OUT/ncu_summary.json

keeps, per kernel, the metrics ``SUMMARY`` names (ncu's CSV is about 250 KB).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

CASES = [("deepseek_v3", [1, 8192]), ("qwen3_30b_a3b", [1, 8]), ("mixtral_8x7b", [1])]
SUMMARY = ("Duration", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread", "Grid Size",
           "Waves Per SM", "Block Limit Registers", "Block Limit Shared Mem", "Achieved Occupancy",
           "sm__cycles_active.max", "sm__cycles_active.min", "sm__cycles_active.avg", "dram__bytes_read.sum",
           "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction")


def profiled_run() -> None:
    import torch

    import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
    from common import BLOCK, MODELS, layer_inputs, layer_weights
    from fp8_moe_ops.kernels import experts

    gen = torch.Generator(device="cuda").manual_seed(5)
    fns = []
    for name, tokens in CASES:
        weights = layer_weights(MODELS[name], gen)
        for T in tokens:
            x, idx, wts = layer_inputs(MODELS[name], T, gen)
            fns.append(lambda x=x, idx=idx, wts=wts, w=weights: experts.grouped_experts(x, idx, wts, *w, BLOCK, "silu"))
    for fn in fns:
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def summarize(path: str) -> list[dict]:
    """ncu's ``--csv --page details`` output -> per kernel launch, in launch order (the
    cases of ``CASES`` one after the other): its name and the ``SUMMARY`` metrics as
    printed (value and unit)."""
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))  # ncu's notes come first
    rows = list(csv.reader(lines[start:]))
    col = {h: i for i, h in enumerate(rows[0])}
    kernels: dict[str, dict] = {}
    for r in rows[1:]:
        if len(r) <= col["Metric Value"]:  # not a metric's row
            continue
        entry = kernels.setdefault(r[col["ID"]], {"kernel": r[col["Kernel Name"]]})
        if r[col["Metric Name"]] in SUMMARY:
            entry[r[col["Metric Name"]]] = f'{r[col["Metric Value"]]} {r[col["Metric Unit"]]}'.strip()
    return list(kernels.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", metavar="CSV", help="summarise ncu's CSV instead of running the layers")
    args = p.parse_args()
    if args.summarize:
        json.dump(summarize(args.summarize), sys.stdout, indent=1)
        print()
    else:
        profiled_run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
