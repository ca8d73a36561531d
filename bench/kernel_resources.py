"""Registers, spills, shared memory and SASS instructions of every launch of one
``grouped_experts`` call, compiled for the H200 (sm_90a) on this machine: no GPU needed.

    PYTHONPATH=. python bench/kernel_resources.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8;..."] [--table KEY=VALUE,...]
        [--slots ACT_SLOTS=0]

The launches are the forward's own (``fp8_moe_ops.kernels.experts.shape_calls``: the
op's launch list for the shape, built on placeholders, nothing runs).  Each kernel is
compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the launch's
compile-time values and options and the JIT's specialisation of the run-time arguments
(every pointer 16-byte aligned, as the workspace's buffers and the weights are;
integers equal to 1 constant, multiples of 16 known as such); ``ptxas -v`` of Triton's
wheel reports the registers and spills; its ``cuobjdump -sass`` gives the instructions
(the kernel's code, without out-of-line slow paths: a count of the code, not of what
runs, which loops multiply) and the IEEE divisions compiled.  A program of 4 warps over
168 registers per thread leaves room for 2 programs per SM (65536 registers).  Writes
``OUT/kernel_resources.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common import (BLOCK, MODELS, ExperimentConfig, Runner, markdown_table, parse_sweep, slots_override,
                    table_override)
from fp8_moe_ops.kernels.experts import shape_calls

CASES = {"deepseek_v3": [1, 8, 8192], "qwen3_30b_a3b": [1, 8, 8192], "mixtral_8x7b": [1, 8, 8192]}
TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float8_e4m3fn: "*fp8e4nv", torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
          torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


def resources(call) -> dict:
    """``call`` (a :class:`~fp8_moe_ops.kernels.launch.KernelCall`) compiled for sm_90a:
    its name, registers per thread, spilled bytes (stores + loads), shared memory bytes,
    warps, and :func:`sass_counts`."""
    fn = call.kernel
    runtime = [n for n in fn.arg_names if n not in call.constexprs]
    constexprs, sig, divisible = dict(call.constexprs), {}, set()
    for name, a in zip(runtime, call.args):
        if isinstance(a, TensorDescriptor):  # a Gluon kernel's TMA descriptor (kernels/ws_gemm.py)
            sig[name] = f"tensordesc<{_TYPES[a.base.dtype][1:]}{list(a.block_shape)},{a.layout!r}>"
        elif isinstance(a, torch.Tensor):
            sig[name] = _TYPES[a.dtype]
            divisible.add(name)  # as the workspace's buffers and the weights are
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif a is None:
            constexprs[name] = None  # an argument the launch form does not use (the JIT's constexpr None)
        elif a == 1:
            constexprs[name] = 1  # the JIT's specialisation of integers: 1 a constant,
        else:
            sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
            if a % 16 == 0:  # multiples of 16 known as such
                divisible.add(name)
    sig.update({n: "constexpr" for n in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in divisible}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    compiled = triton.compile(source(fn, sig, constexprs, attrs), target=TARGET, options=dict(call.options))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(tmp, "k.cubin")
        report = subprocess.run([triton.knobs.nvidia.ptxas.path, f"-arch=sm_{TARGET.arch}a", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.findall(r"Used (\d+) registers", report)[-1])
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return {"kernel": fn.__name__, "registers": regs, "spill_bytes": spills, "shared_bytes": compiled.metadata.shared,
            "warps": call.options.get("num_warps", 4), **sass_counts(sass)}


def sass_counts(sass: str) -> dict:
    """Counts in a kernel's SASS (``cuobjdump -sass``): ``instructions`` up to its last
    ``EXIT`` (the out-of-line subroutines after it, such as IEEE division's slow path,
    left out; NOPs too), ``divisions``, its IEEE divisions (``div.rn``: one ``FCHK``
    range check each), and ``mma_loop_local_ops``, the local-memory loads and stores
    (``LDL`` / ``STL``: spills) inside the innermost loops around its warpgroup MMAs (a
    Gluon GEMM's K loops; each such load or store runs at every K step)."""
    # (address, opcode, operands) of each instruction
    code = [(int(at, 16), op, args) for at, op, args in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*)", sass)]
    ops = [op for _, op, _ in code]
    last_exit = max((i for i, op in enumerate(ops) if op == "EXIT"), default=len(ops) - 1)
    main = ops[: last_exit + 1]
    # a loop: a branch back to an address before it, [target, branch]
    targets = [(int(to.group(1), 16), at) for at, op, args in code
               if op == "BRA" and (to := re.match(r"\s+0x([0-9a-f]+)", args))]
    loops = [(to, at) for to, at in targets if to < at]
    mma_loops = set()
    for at, op, _ in code:
        if "GMMA" in op:
            around = [lp for lp in loops if lp[0] <= at <= lp[1]]
            if around:
                mma_loops.add(min(around, key=lambda lp: lp[1] - lp[0]))
    local = sum(op.startswith(("LDL", "STL")) and any(a <= at <= b for a, b in mma_loops) for at, op, _ in code)
    return {"instructions": sum(op != "NOP" for op in main), "divisions": sum(op.startswith("FCHK") for op in main),
            "mma_loop_local_ops": local}


def _summary(launches: list[dict]) -> dict:
    return {"max_registers": max(x["registers"] for x in launches),
            "spill_bytes": sum(x["spill_bytes"] for x in launches), "launches": launches}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: CASES)")
    p.add_argument("--table", default=None,
                   help="[N,K:]KEY=VALUE,... set on the launch-config table first (common.table_override)")
    p.add_argument("--slots", default=None,
                   help="NAME=VALUE,... the experts forward's ACT_SLOTS / COMBINE_SLOTS first (common.slots_override)")
    args = p.parse_args()
    if args.table:
        table_override(args.table)
    if args.slots:
        slots_override(args.slots)
    runner = Runner("kernel_resources", args.out_dir)
    for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
        model = MODELS[name]
        for T in tokens:
            for scheme in ("dynamic", "static"):
                calls = shape_calls(T, model.top_k, model.E, model.H, model.I, tuple(BLOCK), scheme == "static")
                runner.run(ExperimentConfig("resources", name, T, scheme),
                           lambda calls=calls: _summary([dict(resources(c), programs=math.prod(c.grid))
                                                         for c in calls]))
        runner.save(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    """One line per launch of every case (a failed case: one line with its error)."""
    rows = []
    for r in runner.results:
        row = {k: v for k, v in r.flat().items() if k not in r.metrics}
        rows += [{**row, "launch": i + 1, **launch} for i, launch in enumerate(r.metrics.get("launches", []))] or [row]
    return markdown_table(rows, [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", ""),
                                 ("launch", "launch", ""), ("kernel", "kernel", ""), ("registers", "registers", ""),
                                 ("spilled B", "spill_bytes", ""), ("shared B", "shared_bytes", ""),
                                 ("warps", "warps", ""), ("programs", "programs", ""),
                                 ("SASS instructions", "instructions", ""), ("div.rn", "divisions", ""),
                                 ("LDL/STL in MMA loops", "mma_loop_local_ops", ""),
                                 ("error", "error", "")])


if __name__ == "__main__":
    sys.exit(main())
