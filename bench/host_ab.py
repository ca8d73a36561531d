"""CPU time of two ways of one call, interleaved in one process (the host's drift cancels).

    PYTHONPATH=. python bench/host_ab.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8;..."] [--rounds 200]

The H200 machine's host changes speed by up to 2x between processes and within one
(``bench/host_overhead.py``'s medians of separate processes moved by more than the
changes they were to measure).  Here each pair of ways runs in alternating batches of
20 calls (the order flipped every round, each batch from an idle GPU queue), and the
median per-call CPU time of each way over ``--rounds`` rounds is reported with their
difference.  Pairs, per layer and T (uniform routing, dynamic scales):

* ``stacked op: guarded / keyed``: ``fp8_moe_ops.kernels.StackedPlans`` (what
  ``torch.ops.fp8_moe.grouped_experts`` runs on CUDA below the dispatcher) replaying a
  plan found through its C++ metadata guard, against the same table made to find it
  by the Python key (``meta_key``) on every call;
* ``FP8Experts: checks guarded / every call``: the module (``dispatch="grouped"``),
  its input checks skipped behind a guard, against the checks run on every call;
* ``op / launch plan``: ``torch.ops.fp8_moe.grouped_experts`` against
  ``kernels.planned_experts`` (the plan called directly, no dispatcher or key);
* ``call_experts / op``: ``fp8_moe_ops.ops.call_experts`` (what the modules call: the
  op's CUDA kernel without the dispatcher, where nothing between would act) against
  the op;
* ``op: plan graphs / every launch``: ``torch.ops.fp8_moe.grouped_experts`` replaying its
  plan's launches after the first as a CUDA graph (``fp8_moe_ops.kernels.plans.GRAPHS``,
  the default) against launching every kernel (``GRAPHS = False``);
* ``op: graphs by cuGraphLaunch / replay()``: the op with those graphs launched through
  the driver's ``cuGraphLaunch`` (``ctypes``; the default where there) against torch's
  ``CUDAGraph.replay()`` (``plans._DRIVER_LAUNCH = False``).  In these two pairs both
  ways set their setting around each call (``common.with_plan_setting``), so neither
  pays for that alone;
* ``linear op / forward``: ``torch.ops.fp8_moe.linear`` on the T rows and the first
  expert's gate_up matrix (what ``FP8Linear`` calls: the dispatcher, then a launch plan
  found through a guard) against ``kernels.linear`` (the forward built and launched on
  every call, without the dispatcher or the checks).

Writes ``OUT/host_ab.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, experts_module, layer_inputs, layer_weights,
                    markdown_table, parse_sweep, with_plan_setting)
from fp8_moe_ops import kernels, ops
from fp8_moe_ops.kernels import plans

CASES = {"deepseek_v3": [1], "qwen3_30b_a3b": [1, 8], "mixtral_8x7b": [1]}
BATCH = 20


class KeyedPlans(kernels.StackedPlans):
    """A plan table that never remembers a guard: the Python key on every call."""

    def _remember(self, *args) -> None:
        pass


def interleaved(a, b, rounds: int) -> tuple[float, float]:
    """Median CPU µs per call of ``a`` and ``b``, in alternating batches."""
    times = {a: [], b: []}
    for fn in (a, b):  # warm: compiles, records plans, remembers guards
        for _ in range(5):
            fn()
    for r in range(rounds):
        for fn in ((a, b) if r % 2 == 0 else (b, a)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(BATCH):
                fn()
            times[fn].append((time.perf_counter() - t0) / BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[a]), statistics.median(times[b])


def pairs(experts, experts_checked, w, x, idx, wts) -> dict:
    args = (x, idx, wts, *w, BLOCK, "silu", None, None, None)
    linear = (x, w[0][0], w[1][0], BLOCK)  # the first expert's gate_up matrix as a dense layer's
    guarded, keyed = kernels.StackedPlans(ops.check_experts), KeyedPlans(ops.check_experts)
    states = {}
    op = lambda: torch.ops.fp8_moe.grouped_experts(*args)  # noqa: E731
    return {
        "stacked op: guarded / keyed": (lambda: guarded(args), lambda: keyed(args)),
        "FP8Experts: checks guarded / every call": (lambda: experts(x, idx, wts), lambda: experts_checked(x, idx, wts)),
        "op / launch plan": (op, lambda: kernels.planned_experts(states, "sig", args)),
        "call_experts / op": (lambda: ops.call_experts("grouped_experts", args), op),
        "op: plan graphs / every launch": (with_plan_setting("GRAPHS", True, op),
                                           with_plan_setting("GRAPHS", False, op)),
        "op: graphs by cuGraphLaunch / replay()": (with_plan_setting("_DRIVER_LAUNCH", plans._driver_launch(), op),
                                                   with_plan_setting("_DRIVER_LAUNCH", False, op)),
        "linear op / forward": (lambda: torch.ops.fp8_moe.linear(*linear), lambda: kernels.linear(*linear)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: deepseek_v3 and mixtral_8x7b at T=1, "
                                                 "qwen3_30b_a3b at T=1, 8)")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    runner = Runner("host_ab", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        w = layer_weights(model, gen)
        experts = experts_module(model, w, dispatch="grouped")
        experts_checked = experts_module(model, w, dispatch="grouped")
        experts_checked._check_inputs_once = experts_checked._check_inputs  # every call checks
        for T in tokens:
            x, idx, wts = layer_inputs(model, T, gen)
            for variant, (a, b) in pairs(experts, experts_checked, w, x, idx, wts).items():
                def measure(a=a, b=b):
                    us_a, us_b = interleaved(a, b, args.rounds)
                    return {"a_us": us_a, "b_us": us_b, "a_minus_b_us": us_a - us_b}
                runner.run(ExperimentConfig("host_ab", name, T, variant), measure)
        del w, experts, experts_checked
        torch.cuda.empty_cache()
    runner.save(markdown_table([r.flat() for r in runner.results], [
        ("model", "model", ""), ("T", "tokens", ""), ("a / b", "variant", ""), ("a: CPU µs / call", "a_us", ".1f"),
        ("b: CPU µs / call", "b_us", ".1f"), ("a - b µs", "a_minus_b_us", "+.1f"), ("error", "error", "")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
