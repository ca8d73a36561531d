"""The memory-bound kernels around a prefill layer's GEMMs, alone, against their bytes.

    PYTHONPATH=. python bench/aux_kernels.py --out-dir OUT [--cases "deepseek_v3:8192;..."] [--ceilings measured|h200]

Three kernels of a prefill forward (``fp8_moe_ops.kernels.experts``), each launched
alone on one layer's tensors (uniform routing, dynamic scales): the input quantisation
as the Gluon GEMM's path runs it (each token quantised once and stored at its k slots'
expert-sorted rows, ``DEST``), the gated activation + quantisation, and the combine.
Each runs with the forward's launch shape (``shipped``) and with others: rows or
columns per program, warps.  Reported: GPU µs (median of ``do_bench``), the time its
bytes take at the copy bandwidth (``--ceilings``: this GPU's, measured first, or the H200's 4.22 TB/s), their
ratio, and whether the output equals the shipped shape's bitwise (the same arithmetic
per element, so it must).  Nothing in the package changes: the experiment that would
decide a launch shape.  Writes
``OUT/aux_kernels.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import torch

from common import (CEILING_KINDS, MODELS, ExperimentConfig, Runner, ceilings_for, log, make_routing, parse_sweep,
                    results_table, time_ms)
from fp8_moe_ops import routing
from fp8_moe_ops.functional import cdiv
from fp8_moe_ops.kernels.activation import gated_act_quant_call
from fp8_moe_ops.kernels.combine import combine_call
from fp8_moe_ops.kernels.launch import KernelCall, launch
from fp8_moe_ops.kernels.moe import _quant_call

CASES = {"deepseek_v3": [8192], "qwen3_30b_a3b": [16384], "mixtral_8x7b": [16384]}
BK = 128
# (rows or columns per program, warps) tried per kernel besides the shipped shape
SHAPES = {
    "quant": [(r, w) for r in (2, 4, 8, 16) for w in (4, 8)],
    "act": [(r, w) for r in (8, 16, 32) for w in (4, 8)],
    "combine": [(c, w) for c in (512, 1024, 2048) for w in (4, 8)],
}


def _tensors(model, T: int, gen: torch.Generator, dev: str = "cuda") -> dict:
    E, H, I, k = model.E, model.H, model.I, model.top_k
    S = T * k
    ids, weights = make_routing(T, E, k, "uniform", gen, dev)
    perm, offsets = routing.sort_slots(ids, E)
    slot_rows = routing.sorted_positions(perm)  # each slot's sorted row, as the forward's
    return dict(
        ids=ids, weights=weights, slot_rows=slot_rows, offsets=offsets,
        x=torch.randn(T, H, device=dev, generator=gen, dtype=torch.bfloat16),
        q=torch.empty(S, H, dtype=torch.float8_e4m3fn, device=dev), q_scale=torch.empty(S, cdiv(H, BK), device=dev),
        h=(torch.randn(S, 2 * I, device=dev, generator=gen) * 4).to(torch.bfloat16),
        a_q=torch.empty(S, I, dtype=torch.float8_e4m3fn, device=dev), a_s=torch.empty(S, cdiv(I, BK), device=dev),
        y=torch.randn(S, H, device=dev, generator=gen, dtype=torch.bfloat16),
        out=torch.empty(T, H, dtype=torch.bfloat16, device=dev))


def _calls(model, T: int, t: dict) -> dict:
    """kernel -> (its shipped KernelCall, (rows or columns, warps) -> that call reshaped,
    the tensors it writes, its bytes)."""
    E, H, I, k = model.E, model.H, model.I, model.top_k
    S = T * k
    quant = _quant_call(t["x"], t["q"], t["q_scale"], T, BK, topk=k, ids=t["ids"], num_experts=E,
                        dest=t["slot_rows"])
    act = gated_act_quant_call(t["h"], t["a_q"], t["a_s"], t["offsets"], E, BK, "silu", None, False)
    combine = combine_call(t["y"], t["ids"], t["weights"], E, t["out"])

    def rows_shape(call, rows):
        def reshaped(r, w):
            return call._replace(grid=(cdiv(rows, r), call.grid[1]), constexprs={**call.constexprs, "BLOCK_R": r},
                                 options={**call.options, "num_warps": w})
        return reshaped

    def combine_shape(c, w):
        return combine._replace(grid=(T, cdiv(H, c)), constexprs={**combine.constexprs, "BLOCK_H": c},
                                options={**combine.options, "num_warps": w})

    return {
        "quant": (quant, rows_shape(quant, T), (t["q"], t["q_scale"]), T * H * 2 + S * H + S * cdiv(H, BK) * 4),
        "act": (act, rows_shape(act, S), (t["a_q"], t["a_s"]), S * 2 * I * 2 + S * I + S * cdiv(I, BK) * 4),
        "combine": (combine, combine_shape, (t["out"],), S * H * 2 + T * H * 2),
    }


def _shape_of(kernel: str, call: KernelCall) -> tuple[int, int]:
    size = call.constexprs["BLOCK_H" if kernel == "combine" else "BLOCK_R"]
    return size, call.options.get("num_warps", 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--ceilings", default="measured", choices=CEILING_KINDS)
    args = p.parse_args()
    runner = Runner("aux_kernels", args.out_dir)
    ceilings = ceilings_for(args.ceilings)
    runner.meta["ceilings"] = asdict(ceilings)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        for T in tokens:
            tensors = _tensors(model, T, gen)
            for kernel, (shipped, reshaped, outputs, nbytes) in _calls(model, T, tensors).items():
                launch(shipped)
                reference = [o.clone() for o in outputs]
                base = _shape_of(kernel, shipped)
                for size, warps in [base, *(s for s in SHAPES[kernel] if s != base)]:
                    call = shipped if (size, warps) == base else reshaped(size, warps)

                    def measure(call=call):
                        for o in outputs:
                            o.fill_(0)
                        launch(call)
                        equal = all(torch.equal(o.view(torch.uint8), r.view(torch.uint8))
                                    for o, r in zip(outputs, reference))
                        us = time_ms(lambda: launch(call), rep_ms=100, warmup_ms=25) * 1e3
                        floor = nbytes / ceilings.copy_bandwidth * 1e6
                        return {"us": us, "bytes_floor_us": floor, "ratio": us / floor, "equal_to_shipped": equal}

                    variant = "shipped" if call is shipped else "other"
                    runner.run(ExperimentConfig("aux_kernels", name, T, variant,
                                                params=(("kernel", kernel), ("size", size), ("warps", warps))),
                               measure)
            del tensors
            torch.cuda.empty_cache()
        runner.save(table(runner))
    log(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    return results_table(runner.results, [
        ("model", "model", ""), ("T", "tokens", ""), ("kernel", "kernel", ""),
        ("rows / columns per program", "size", ""), ("warps", "warps", ""), ("launch", "variant", ""),
        ("µs", "us", ".1f"), ("bytes at 4.22 TB/s, µs", "bytes_floor_us", ".1f"), ("ratio", "ratio", ".2f"),
        ("equal to shipped", "equal_to_shipped", "")])


if __name__ == "__main__":
    sys.exit(main())
