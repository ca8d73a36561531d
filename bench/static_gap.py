"""Why the static scheme is slower than the dynamic one at large T: the scales or the kernels.

    PYTHONPATH=. python bench/static_gap.py --out-dir OUT [--cases "qwen3_30b_a3b:8192;deepseek_v3:8192"]

The benchmarks' static activation scales (``common.static_scales``: uniform in [0.01,
0.02), whatever the activations) are not what a calibrated checkpoint holds.  Per case
(uniform routing), three schemes of one layer on the same weights and inputs:
``dynamic``; ``static random`` (the benchmarks' scales); ``static calibrated`` (per
expert, the amax of the inputs that expert's GEMMs see in the dynamic forward of this
very call, turned into scales by ``fp8_moe_ops.calibrate_static_scales``'s rule: what
calibration on these inputs finds, up to the gate_up GEMM's own rounding).  Metrics:
``graph_us``, the layer in a CUDA graph; ``down_us``, the down GEMM's launch alone
(CUDA events); ``saturated``, the fraction of the down GEMM's fp8 inputs at +-448
(the largest e4m3 value: inputs clipped by too small a scale); and for the static
schemes ``down_us_dynamic_bytes``, the same static launch reading the dynamic scheme's
fp8 bytes instead of its own (the kernel is the same; only the data changes).
Writes ``OUT/static_gap.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, graph_ms, layer_inputs, layer_weights, markdown_table,
                    parse_sweep, static_scales, time_ms)
from fp8_moe_ops.calibration import _scale_from_amax
from fp8_moe_ops.functional import FP8_MAX
from fp8_moe_ops.kernels import experts as X
from fp8_moe_ops.kernels.launch import launch

CASES = {"qwen3_30b_a3b": [8192], "deepseek_v3": [8192]}


def op_args(weights, inputs, scales) -> tuple:
    """The experts ops' twelve arguments for one layer call (silu, no limit)."""
    return (*inputs, *weights, BLOCK, "silu", *scales, None)


def forward(args: tuple):
    """(out, env, the down GEMM's launch) of one forward on :func:`op_args`."""
    sources = X._stacked_sources(args)
    out, env, _, calls = X._stacked(args, sources)
    # the last GEMM: the Triton kernel's, or the Hopper one's at prefill on an sm_90 GPU
    down = [c for c in calls if c.kernel.__name__ in ("_grouped_gemm_kernel", "_ws_gemm_kernel")][-1]
    return out, env, down


def segment_amax(rows: torch.Tensor, offsets: torch.Tensor, E: int) -> torch.Tensor:
    """(E,) amax of |rows| (sorted rows, ``offsets`` the inclusive ends per expert); 0
    for an expert without rows."""
    ends = offsets.long().tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([rows[s:e].abs().amax() if e > s else rows.new_zeros(()) for s, e in zip(starts, ends)])


def calibrated(env: dict, E: int, I: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (gate_up, down) act scales from a dynamic forward's buffers: the amax
    of each expert's rows of hidden and of silu(gate) * up, as calibration turns them
    into scales (/ 448; an expert without rows takes its projection's largest)."""
    perm, offsets = env["perm"].long(), env["offsets"]
    x_rows = env["hidden"][perm // k].float()
    h = env["h"].float()
    act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    n = int(offsets[-1])
    amax = torch.stack([segment_amax(x_rows[:n], offsets, E), segment_amax(act[:n], offsets, E)])
    gate_up, down = _scale_from_amax(amax)
    return gate_up.contiguous(), down.contiguous()


def saturated(a_q: torch.Tensor, rows: int) -> float:
    return (a_q[:rows].float().abs() == FP8_MAX).float().mean().item()


def measure_case(name: str, T: int, gen: torch.Generator) -> dict:
    model = MODELS[name]
    weights = layer_weights(model, gen)
    inputs = layer_inputs(model, T, gen)
    random_scales = static_scales(model, gen)
    _, env_dyn, down_dyn = forward(op_args(weights, inputs, (None, None)))
    rows = int(env_dyn["offsets"][-1])
    schemes = {"dynamic": (None, None), "static random": random_scales,
               "static calibrated": calibrated(env_dyn, model.E, model.I, model.top_k)}
    res = {}
    for scheme, scales in schemes.items():
        args = op_args(weights, inputs, scales)
        _, env, down = forward(args) if scheme != "dynamic" else (None, env_dyn, down_dyn)
        m = {"graph_us": graph_ms(lambda: torch.ops.fp8_moe.grouped_experts(*args)) * 1e3,
             "down_us": time_ms(lambda: launch(down)) * 1e3,
             "saturated": saturated(env["a_q"], rows)}
        if scheme != "dynamic":
            own = env["a_q"].clone()
            env["a_q"].copy_(env_dyn["a_q"])  # same routing, so the same sorted rows
            m["down_us_dynamic_bytes"] = time_ms(lambda: launch(down)) * 1e3
            env["a_q"].copy_(own)
        res[scheme] = m
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    args = p.parse_args()
    runner = Runner("static_gap", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        for T in tokens:
            measured = {}
            # the dynamic entry measures all three schemes (they share its forward); the
            # static entries report theirs, or fail with it
            runner.run(ExperimentConfig("static_gap", name, T, "dynamic"),
                       lambda: measured.update(measure_case(name, T, gen)) or measured["dynamic"])
            for scheme in ("static random", "static calibrated"):
                runner.run(ExperimentConfig("static_gap", name, T, scheme), lambda scheme=scheme: measured[scheme])
            torch.cuda.empty_cache()
    rows = [r.flat() for r in runner.results]
    runner.save(markdown_table(rows, [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", ""),
                                      ("graph µs", "graph_us", ".1f"), ("down GEMM µs", "down_us", ".1f"),
                                      ("down GEMM µs, dynamic's bytes", "down_us_dynamic_bytes", ".1f"),
                                      ("inputs at ±448", "saturated", ".4f"), ("error", "error", "")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
