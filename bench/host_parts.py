"""Where the CPU time of one experts-op call goes: the pieces, timed one by one.

    PYTHONPATH=. python bench/host_parts.py --out-dir OUT

On qwen3_30b_a3b's layer at T=1 (uniform routing, dynamic scales), µs of CPU per call
(``common.host_us_per_call``: back-to-back calls timed before the final synchronize):

* ``custom_op no-op`` / ``Library no-op``: an op taking seven of the layer's tensors and
  returning an empty one, defined with ``torch.library.custom_op`` / on a
  ``torch.library.Library`` with a CUDA kernel: the registration's own cost;
* ``check_experts``: the experts ops' metadata checks;
* ``torch.empty``: one (8, 4096) bf16 allocation;
* ``JIT launch`` / ``cached launch``: one combine kernel launch through
  ``kernel[grid](...)`` and through ``fp8_moe_ops.kernels.launch.Launch`` (after its
  first call);
* ``Triton's launcher``: the same launch through the compiled kernel's launcher object
  with the argument list ready (addresses as integers);
* ``compiled launcher``: the same, through the C function behind that object
  (``fp8_moe_ops.kernels.launch.direct``): what a launch plan does per kernel;
* ``graph replay, N kernels``: ``torch.cuda.CUDAGraph.replay()`` of a graph of N such
  combine launches (captured once); ``cuGraphLaunch, N kernels``: the same graph's
  executable launched through the driver with ``ctypes`` (where torch exposes it):
  what a plan replayed as a graph would pay per call instead of N launches;
* ``cuStreamWriteValue64``: one 64-bit value written to device memory in stream order
  (the driver through ``ctypes``): what handing such a graph a call's address costs;
* ``signature key``: the op's key of its arguments' metadata (``ops.meta_key``);
* ``launch plan``: the op's launch plan for the call, called directly;
* ``op``: ``torch.ops.fp8_moe.grouped_experts``, for scale.

Writes ``OUT/host_parts.json`` / ``.md``; exits 1 if any part failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, host_us_per_call, layer_inputs, layer_weights,
                    markdown_table)
from fp8_moe_ops import kernels, ops
from fp8_moe_ops.kernels.combine import _combine_kernel, combine_launch_shape
from fp8_moe_ops.kernels.launch import Launch


def parts(model_name: str) -> dict:
    model = MODELS[model_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = layer_weights(model, gen)
    x, idx, wts = layer_inputs(model, 1, gen)
    seven = (x, idx, wts, *w[:4])

    @torch.library.custom_op("host_parts::noop", mutates_args=())
    def noop(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, e: torch.Tensor,
             f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, device=a.device)

    lib = torch.library.Library("host_parts_lib", "DEF")
    lib.define("noop(Tensor a, Tensor b, Tensor c, Tensor d, Tensor e, Tensor f, Tensor g) -> Tensor")
    lib.impl("noop", lambda a, *rest: torch.empty(0, device=a.device), "CUDA")

    T, H, k = 1, model.H, model.top_k
    y = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    ids, weights = idx.contiguous(), wts.contiguous()
    grid, kp, block_h = combine_launch_shape(T, H, k)
    constexprs = dict(TOPK=k, KP=kp, BLOCK_H=block_h, ADDRS=False)
    args = (y, ids, weights, out, T, H, model.E, y)
    compiled = _combine_kernel[grid](*args, **constexprs, enable_fp_fusion=False)
    cached = Launch(_combine_kernel, grid, constexprs, enable_fp_fusion=False)
    cached(*args)
    (launcher, head, packed), _ = cached.compiled()
    full = cached.full_args([a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
    c_args = (full,) if packed else full  # launch.Direct: one sequence from Triton 3.7, else one by one
    g = cached.grid
    stream = torch.cuda.current_stream().cuda_stream
    graphs = {}
    for n in (1, 3, 5):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            for _ in range(n):
                launcher(*g, side.cuda_stream, *head, *c_args)
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        graphs[n] = graph
    driver_calls = _driver_calls(graphs, stream)
    op_args = (x, idx, wts, *w, BLOCK, "silu", None, None, None)
    plans = {}
    for _ in range(2):  # the second call records the plan
        kernels.planned_experts(plans, "sig", op_args)
    return {
        "custom_op no-op": lambda: torch.ops.host_parts.noop(*seven),
        "Library no-op": lambda: torch.ops.host_parts_lib.noop(*seven),
        "check_experts": lambda: ops.check_experts(x, idx, wts, *w, BLOCK, "silu", None, None, None),
        "torch.empty": lambda: torch.empty((8, 4096), dtype=torch.bfloat16, device="cuda"),
        "JIT launch": lambda: _combine_kernel[grid](*args, **constexprs, enable_fp_fusion=False),
        "cached launch": lambda: cached(*args),
        "Triton's launcher": lambda: compiled.run(*g, stream, compiled.function, compiled.packed_metadata, None, None,
                                                  None, *full),
        "compiled launcher": lambda: launcher(*g, stream, *head, *c_args),
        **{f"graph replay, {n} kernels": graph.replay for n, graph in graphs.items()},
        **driver_calls,
        "signature key": lambda: ops.meta_key(op_args),
        "launch plan": lambda: kernels.planned_experts(plans, "sig", op_args),
        "op": lambda: torch.ops.fp8_moe.grouped_experts(x, idx, wts, *w, BLOCK),
    }, (lib, graphs)


def _driver_calls(graphs: dict, stream: int) -> dict:
    """``cuGraphLaunch`` of each graph's executable (as the launch plans make it) and one
    ``cuStreamWriteValue64``, through ``ctypes`` (empty where the driver lacks them)."""
    import ctypes

    from fp8_moe_ops.kernels import plans as launch_plans

    graph_launch = launch_plans._driver_launch()
    write = getattr(launch_plans._libcuda(), "cuStreamWriteValue64_v2", None)
    if not graph_launch or write is None:
        return {}
    write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    write.restype = ctypes.c_int
    cell = torch.zeros(1, dtype=torch.int64, device="cuda")
    calls = {"cuStreamWriteValue64": lambda: write(stream, cell.data_ptr(), 7, 0)}
    for n, graph in graphs.items():
        exe = launch_plans._executable(graph)
        if exe is not None:
            calls[f"cuGraphLaunch, {n} kernels"] = lambda exe=exe: graph_launch(exe, stream)
    for name, fn in calls.items():
        if fn() != 0:
            raise RuntimeError(f"{name}: CUDA driver error {fn()}")
    torch.cuda.synchronize()
    return calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    runner = Runner("host_parts", args.out_dir)
    model = "qwen3_30b_a3b"
    fns, keep = parts(model)  # keep: the Library and graphs, alive while they are timed
    for name, fn in fns.items():
        runner.run(ExperimentConfig("host_parts", model, 1, name),
                   lambda: dict(zip(("cpu_us", "wall_us"), host_us_per_call(fn, args.calls))))
    rows = [r.flat() for r in runner.results]
    runner.save(markdown_table(rows, [("part", "variant", ""), ("CPU µs / call", "cpu_us", ".1f"),
                                      ("wall µs / call", "wall_us", ".1f"), ("error", "error", "")]))
    del keep
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
