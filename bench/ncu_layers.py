"""Hardware counters of the experts forward's kernels (Nsight Compute), at decode and prefill.

On the GPU machine (ncu reads the counters there; leave the clocks alone):

    PYTHONPATH=.:bench ncu --profile-from-start off --clock-control none \\
        --kernel-name regex:"grouped_gemm|ws_gemm|sort_quant|gated_act" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis \\
        --metrics sm__cycles_active.max,sm__cycles_active.min,sm__cycles_active.avg,dram__bytes_read.sum \\
        --csv --page details python bench/ncu_layers.py > OUT/ncu.csv

runs one dynamic-scale layer per case of ``CASES`` (uniform routing, the bench's weights;
``--static``: static activation scales, random, one per expert and GEMM, instead),
twice outside the profiled range (compiles, launch plans) and once inside it.  ``--cases
"deepseek_v3:8192"`` runs others; ``--ways "group_m=8;group_m=16"`` runs each case once per
way (in that order, inside the range; the outputs must be equal bitwise), a way being
settings of the Gluon GEMM (``fp8_moe_ops/kernels/ws_gemm.py``): ``group_m`` (its launches'
``GROUP_M``), ``max_programs`` (of its persistent launch; 0: one program per tile) or a
module constant of ``ws_gemm`` (``WIDE=0``, or one a patch of docs/benchmarks adds).  The
prefill GEMMs' DRAM and L2 bytes per way, for example:

    PYTHONPATH=.:bench ncu --profile-from-start off --clock-control none --kernel-name regex:ws_gemm \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct \
        --csv --page details python bench/ncu_layers.py --cases deepseek_v3:8192 \
        --ways "group_m=8;group_m=4;group_m=16" > OUT/ncu.csv

Then, anywhere:

    python bench/ncu_layers.py --summarize OUT/ncu.csv > OUT/ncu_summary.json

keeps, per kernel, the metrics ``SUMMARY`` names (ncu's CSV is about 250 KB).  Given the
run's ``--cases`` and ``--ways`` (and ``--static``) beside ``--summarize``, it also labels
each kernel with its ``way``, ``case`` ("model:T"), ``gemm`` (gate_up / down) and
``scheme``: for a run whose kernel filter kept the two Gluon GEMMs of each layer only
(``--kernel-name regex:ws_gemm``, at T where both run), as in the second command.
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
           "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction", "gpu__time_duration.sum",
           "lts__t_bytes.sum", "lts__t_sector_hit_rate.pct", "sm__cycles_elapsed.avg.per_second",
           "lts__t_sectors_srcunit_tex.sum", "lts__t_sectors_srcunit_ltcfabric.sum",
           "lrc__request_sectors_op_read_coalescable.sum",
           "lrc__request_sectors_op_read_coalescing_achieved_type_hardware.sum")
LAUNCH = ("group_m", "max_programs")  # ws_gemm_call's keyword arguments a way may set


def parse_ways(text: str) -> list[dict[str, int]]:
    """``"group_m=8;WIDE=0,group_m=4"`` -> [{"group_m": 8}, {"WIDE": 0, "group_m": 4}]: each
    way's settings (integers), checked against what the Gluon GEMM's module has."""
    from fp8_moe_ops.kernels import ws_gemm

    ways = []
    for way in text.split(";"):
        settings = {}
        for item in way.split(","):
            name, _, value = item.partition("=")
            known = name in LAUNCH or (name.isupper() and hasattr(ws_gemm, name))
            if not known or not value.isdigit() or (name == "group_m" and int(value) < 1):
                raise ValueError(f"ways: expected NAME=INT (>= 0; group_m >= 1) with NAME one of {LAUNCH} or a "
                                 f"constant of ws_gemm, got {item!r}")
            settings[name] = int(value)
        ways.append(settings)
    return ways


def way_setter(ways: list[dict[str, int]]):
    """A function that sets one of ``ways`` on the Gluon GEMM's module, from the shipped
    settings each time: a constant another way changed goes back to its shipped value
    unless this way names it."""
    from common import ws_launch_with
    from fp8_moe_ops.kernels import ws_gemm

    call = ws_gemm.ws_gemm_call
    shipped = {name: getattr(ws_gemm, name) for way in ways for name in way if name not in LAUNCH}

    def set_way(way: dict[str, int]) -> None:
        launch = {name: way[name] or None for name in LAUNCH if name in way}  # max_programs 0: None
        ws_gemm.ws_gemm_call = ws_launch_with(call, **launch) if launch else call
        for name, value in shipped.items():
            setattr(ws_gemm, name, type(value)(way.get(name, value)))

    return set_way


def profiled_run(cases, ways, static: bool = False) -> None:
    import torch

    import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
    from common import BLOCK, MODELS, layer_inputs, layer_weights, static_scales
    from fp8_moe_ops.kernels import experts

    gen = torch.Generator(device="cuda").manual_seed(5)
    fns = []
    for name, tokens in cases:
        weights = layer_weights(MODELS[name], gen)
        act = static_scales(MODELS[name], gen) if static else (None, None)
        for T in tokens:
            x, idx, wts = layer_inputs(MODELS[name], T, gen)
            fns.append(lambda x=x, idx=idx, wts=wts, w=weights, act=act:
                       experts.grouped_experts(x, idx, wts, *w, BLOCK, "silu", *act))
    set_way = way_setter(ways)
    for way in ways:
        set_way(way)
        for fn in fns:
            fn()
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    outs = []
    for way in ways:
        set_way(way)
        outs.append([fn() for fn in fns])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for way, out in zip(ways[1:], outs[1:]):
        if not all(torch.equal(a, b) for a, b in zip(out, outs[0])):
            raise AssertionError(f"the outputs of way {way} differ from those of {ways[0]}")


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


def label(kernels: list[dict], cases: list[tuple[str, list[int]]], ways: str | None, static: bool) -> list[dict]:
    """``kernels`` (:func:`summarize`'s, in launch order) with the ``way``, ``case``, ``gemm``
    and ``scheme`` of each: the profiled range runs each way's layers, case after case,
    each layer's gate_up GEMM then its down GEMM (:func:`profiled_run`).  Raises
    ValueError where the kernels are not two Gluon GEMMs per layer."""
    names = ways.split(";") if ways else ["shipped"]
    layers = [f"{model}:{T}" for model, tokens in cases for T in tokens]
    expected = [(way, case, gemm) for way in names for case in layers for gemm in ("gate_up", "down")]
    gluon = all("ws_gemm" in k["kernel"] for k in kernels)
    if len(kernels) != len(expected) or not gluon:
        raise ValueError(f"labels: expected {len(expected)} Gluon GEMM launches ({len(names)} ways x {len(layers)} "
                         f"layers x gate_up, down), got {len(kernels)} kernels "
                         f"({sorted({k['kernel'] for k in kernels})})")
    scheme = "static" if static else "dynamic"
    return [{"way": way, "case": case, "gemm": gemm, "scheme": scheme, **k}
            for (way, case, gemm), k in zip(expected, kernels)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", metavar="CSV", help="summarise ncu's CSV instead of running the layers")
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--ways", default=None, help="ways of the Gluon GEMM, e.g. group_m=8;group_m=16 (default: one, "
                   "as shipped)")
    p.add_argument("--static", action="store_true", help="static activation scales (default: dynamic)")
    args = p.parse_args()
    if args.cases:
        from common import parse_sweep

        cases = list(parse_sweep(args.cases).items())
    else:
        cases = CASES
    if args.summarize:
        kernels = summarize(args.summarize)
        if args.cases or args.ways or args.static:  # the run's own arguments: label its kernels
            try:
                kernels = label(kernels, cases, args.ways, args.static)
            except ValueError as e:
                p.error(str(e))
        json.dump(kernels, sys.stdout, indent=1)
        print()
    else:
        try:
            ways = parse_ways(args.ways) if args.ways else [{}]
        except ValueError as e:
            p.error(str(e))
        profiled_run(cases, ways, args.static)
    return 0


if __name__ == "__main__":
    sys.exit(main())
