"""CPU time of an experts-op call, layer by layer from the launch plan up, with the GPU
idle between calls and with it kept busy.

    PYTHONPATH=. python bench/host_layers.py --out-dir OUT [--models qwen3_30b_a3b,...] [--rounds 9]

For each benchmark layer at T=1 (uniform routing, dynamic scales), the same call through
each layer of the package, from the outside in:

* ``module``: ``FP8Experts.forward`` (``dispatch="grouped"``): its input checks behind a
  guard, then ``ops.call_experts``;
* ``op``: ``torch.ops.fp8_moe.grouped_experts``: the dispatcher and the autograd kernel,
  then the op's CUDA kernel;
* ``call_experts``: ``fp8_moe_ops.ops.call_experts`` (the op's CUDA kernel without the
  dispatcher, as the modules call it);
* ``StackedPlans``: the op's table of launch plans (``kernels.StackedPlans``), found
  through its C++ metadata guard;
* ``launch plan``: the plan called directly under a fixed key (``kernels.planned_experts``);
* ``empty_like``: one allocation like hidden's, for scale.

Each is timed as ``bench/host_overhead.py`` times a call (back-to-back calls, timed before
the final synchronize, divided by their count), in two modes: ``idle``, the calls started
on an idle GPU, as the CPU-time target is measured (where a call's kernels take longer than
its CPU time, as deepseek_v3's and mixtral_8x7b's, the GPU is idle only at the first);
``busy``, with a spin kernel of about 20 ms queued before the calls, so that none of their
work starts or completes while they are timed.  The layers alternate in ``--rounds``
rounds of ``--calls`` calls (the host's speed drifts within a process), each layer's two
modes one after the other, in turns first; each case reports the median and the least
per-call time over its rounds.  A layer that raises has its cases recorded as failed.
Writes ``OUT/host_layers.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, experts_module, layer_inputs, layer_weights,
                    markdown_table)
from fp8_moe_ops import kernels, ops

MODES = ("idle", "busy")
SPIN_CYCLES = 40_000_000  # about 20 ms at the H100's and H200's 1.98 GHz: longer than any batch timed here


def layers(model, w, x, idx, wts) -> dict:
    args = (x, idx, wts, *w, BLOCK, "silu", None, None, None)
    experts = experts_module(model, w, dispatch="grouped")
    plans = {}
    for _ in range(2):  # the second call records the plan
        kernels.planned_experts(plans, "sig", args)
    table = kernels.StackedPlans(ops.check_experts)
    return {
        "module": lambda: experts(x, idx, wts),
        "op": lambda: torch.ops.fp8_moe.grouped_experts(*args),
        "call_experts": lambda: ops.call_experts("grouped_experts", args),
        "StackedPlans": lambda: table(args),
        "launch plan": lambda: kernels.planned_experts(plans, "sig", args),
        "empty_like": lambda: torch.empty_like(x),
    }


def per_call_us(fn, calls: int, busy: bool) -> float:
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(SPIN_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def summary(us: list, error: Exception | None) -> dict:
    """A case's median and least µs per call over its rounds; raises the layer's error."""
    if error is not None:
        raise error
    return {"cpu_us": statistics.median(us), "cpu_us_min": min(us)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default="qwen3_30b_a3b,deepseek_v3,mixtral_8x7b")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    runner = Runner("host_layers", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for name in args.models.split(","):
        model = MODELS[name]
        w = layer_weights(model, gen)
        x, idx, wts = layer_inputs(model, 1, gen)
        fns = layers(model, w, x, idx, wts)
        times = {(layer, mode): [] for layer in fns for mode in MODES}
        failed = {}  # layer -> its exception: its cases are recorded as failed, the others go on
        for layer, fn in fns.items():  # compiles, records the plans and guards, warms up
            try:
                for _ in range(30):
                    fn()
            except Exception as e:  # noqa: BLE001 - recorded below
                failed[layer] = e
        for r in range(args.rounds):
            for layer, fn in fns.items():
                for mode in MODES if r % 2 == 0 else MODES[::-1]:  # neither mode always runs first
                    if layer not in failed:
                        try:
                            times[(layer, mode)].append(per_call_us(fn, args.calls, mode == "busy"))
                        except Exception as e:  # noqa: BLE001 - recorded below
                            failed[layer] = e
        for (layer, mode), us in times.items():
            runner.run(ExperimentConfig("host_layers", name, 1, f"{layer} {mode}"),
                       lambda: summary(us, failed.get(layer)))
        del w, fns
        torch.cuda.empty_cache()
        runner.save(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    """One row per model and layer: the median (least) µs per call, idle and busy."""
    got = {(r.config.model, r.config.variant): r.metrics for r in runner.results if r.ok}
    rows = []
    for model, variant in got:
        layer, mode = variant.rsplit(" ", 1)
        if mode != MODES[0]:
            continue
        row = {"model": model, "layer": layer}
        for m in MODES:
            metrics = got.get((model, f"{layer} {m}"), {})
            row[m] = f"{metrics['cpu_us']:.1f} ({metrics['cpu_us_min']:.1f})" if metrics else "—"
        rows.append(row)
    columns = [("model", "model", ""), ("layer", "layer", ""), ("idle µs / call, median (least)", "idle", ""),
               ("busy µs / call, median (least)", "busy", "")]
    return markdown_table(rows, columns)


if __name__ == "__main__":
    sys.exit(main())
