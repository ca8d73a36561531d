"""CPU time that ``FP8Experts.forward`` adds around the experts op, on any device.

    PYTHONPATH=. python bench/module_overhead.py --out-dir OUT [--device cpu] [--calls 20000]

The module (``dispatch="grouped"``, 8 experts, H=256, I=128, one token, top-2) is
called with ``fp8_moe_ops.ops.experts`` replaced by a stub that returns its input, so
what is timed is the module's own work: ``nn.Module.__call__``, the input checks
(``_check_inputs``), the weights and settings handed to the op (``expert_weights``)
and the reshapes.  The sizes do not matter to it (no tensor data is touched); the
parts are timed on their own too.  Where transformers 5.x with its FP8 experts interface
is installed, also the plug-in forward's work before the op on one of transformers' own
``FP8Experts`` (``fp8_moe_ops.integrations.transformers``: the module's attributes read
and checked, the op's arguments and block sizes derived).  And what the dispatcher costs
an experts op call: an op of the experts ops' schema whose kernels do nothing
(``fp8_moe::noop_experts``, registered by ``ops._experts_op`` for this process) called
as ``torch.ops.fp8_moe.noop_experts`` and through ``ops.call_experts`` (the kernel
directly, where nothing between would act), and a GEMM op of ``fp8_moe::linear``'s
schema defined by ``ops._gemm_op`` with no checks and a kernel returning an empty tensor
(``fp8_moe::noop_linear``), with grad enabled, under ``torch.no_grad()`` and under
``torch.inference_mode()``.  And the real ``fp8_moe::linear`` on one token (32 x 32, the
CPU reference's kernel) through the dispatcher and through ``ops.call_linear``, as
``FP8Linear`` calls it (a tenth of ``--calls``).  µs per call:
``common.host_us_per_call`` (the median of 7 runs of ``--calls`` back-to-back calls).
Writes ``OUT/module_overhead.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import ExperimentConfig, Runner, host_us_per_call, markdown_table
from fp8_moe_ops import FP8Experts, FP8Linear, ops, reference


def parts(scheme: str, device: str) -> dict:
    m = FP8Experts(8, 256, 128, activation_scheme=scheme, dispatch="grouped", device=device)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(1, 2, dtype=torch.int64, device=device)
    w = torch.ones(1, 2, device=device)
    return {
        "forward, op stubbed": lambda: m(x, idx, w),
        "_check_inputs": lambda: m._check_inputs(x, idx, w),
        "expert_weights": m.expert_weights,
    }


def plugin_parts() -> dict:
    """The transformers plug-in forward's reads and checks, the op left out ({} without
    transformers' FP8 experts interface)."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.integrations.finegrained_fp8 import FP8Experts as TfFP8Experts

        from fp8_moe_ops.integrations import transformers as integration
    except ImportError:
        return {}
    module = TfFP8Experts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8),
                          block_size=(128, 128))

    def prepare():
        get = integration._attr  # as the forward reads outside torch.compile
        integration._check_fp8_experts(module, get)
        integration._op_args(module, get)
        integration._blocks(module, get)

    return {"transformers plug-in: reads and checks": prepare}


def _noop_linear_check(x, w, w_scale_inv, block_size, act_scale=None, out_dtype=None):
    """``fp8_moe::noop_linear``'s checks: none (the signature is the op's)."""


def dispatch_parts(device: str) -> dict:
    """(grad mode, way) -> a call of ``fp8_moe::noop_experts`` with one token's arguments,
    or of ``fp8_moe::noop_linear``."""
    if not hasattr(torch.ops.fp8_moe, "noop_experts"):
        reference.noop_experts = lambda hidden, *_: hidden  # its CPU kernel; CUDA's is the real op's own
        ops._experts_op("noop_experts", ops.EXPERTS_SCHEMA, lambda *_: None, lambda *_: None)
        ops._gemm_op("noop_linear", ops.LINEAR_SCHEMA, _noop_linear_check, lambda x, *_: x.new_empty(0))
    m = FP8Experts(8, 256, 128, dispatch="grouped", device=device)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=device)
    args = (x, torch.zeros(1, 2, dtype=torch.int64, device=device), torch.ones(1, 2, device=device),
            *m.expert_weights())
    op, linear = torch.ops.fp8_moe.noop_experts, torch.ops.fp8_moe.noop_linear
    linear_args = (x, m.gate_up_proj[0], torch.empty(0, device=device), [128, 128])  # no scale values to check
    modes = {"grad enabled": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    return {(mode, way): (ctx, fn) for mode, ctx in modes.items()
            for way, fn in (("through the dispatcher", lambda: op(*args)),
                            ("ops.call_experts", lambda: ops.call_experts("noop_experts", args)),
                            ("noop_linear", lambda: linear(*linear_args)))}


def linear_parts(device: str) -> dict:
    """A one-token ``fp8_moe::linear`` call (32 x 32, the CPU reference's kernel on CPU)
    through the dispatcher and through ``ops.call_linear`` (what ``FP8Linear`` calls)."""
    lin = FP8Linear(32, 32, block_size=(32, 32), device=device)
    args = (torch.zeros(1, 32, dtype=torch.bfloat16, device=device), lin.weight, lin.weight_scale_inv, [32, 32], None)
    return {"linear, one token: through the dispatcher": lambda: torch.ops.fp8_moe.linear(*args),
            "linear, one token: ops.call_linear": lambda: ops.call_linear(*args)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    runner = Runner("module_overhead", args.out_dir)
    real = ops.experts
    ops.experts = lambda hidden, *_, **__: hidden
    try:
        for scheme in ("dynamic", "static"):
            for name, fn in parts(scheme, args.device).items():
                runner.run(ExperimentConfig("module_overhead", "FP8Experts", 1, f"{scheme} {name}"),
                           lambda fn=fn: {"cpu_us": host_us_per_call(fn, args.calls)[0]})
    finally:
        ops.experts = real
    for name, fn in plugin_parts().items():
        runner.run(ExperimentConfig("module_overhead", "transformers FP8Experts", 1, name),
                   lambda fn=fn: {"cpu_us": host_us_per_call(fn, args.calls)[0]})
    if args.device == "cpu":  # on CUDA the op's kernel is the real one
        for (mode, way), (ctx, fn) in dispatch_parts(args.device).items():
            def measure(ctx=ctx, fn=fn):
                with ctx():
                    return {"cpu_us": host_us_per_call(fn, args.calls)[0]}
            runner.run(ExperimentConfig("module_overhead", "noop_experts", 1, f"{mode}: {way}"), measure)
        for name, fn in linear_parts(args.device).items():
            runner.run(ExperimentConfig("module_overhead", "FP8Linear", 1, name),
                       lambda fn=fn: {"cpu_us": host_us_per_call(fn, max(1, args.calls // 10))[0]})
    rows = [r.flat() for r in runner.results]
    runner.save(markdown_table(rows, [("part", "variant", ""), ("CPU µs / call", "cpu_us", ".2f"),
                                      ("error", "error", "")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
