"""Where the host time of one ``grouped_experts_list`` call goes: the pieces, timed one by one.

    PYTHONPATH=. python bench/list_parts.py --out-dir OUT [--device cuda]

The list op takes four lists of per-expert tensors (4E to 6E of them), so its host
time grows with the expert count.  Cases: 256 experts with fused gate_up matrices (1024
tensors) and with separate gate and up (1536), and 8 experts fused (32); small
matrices (H = 256, I = 128, 128x128 blocks), T = 1, top-k 8 (2 at 8 experts): the
pieces' cost does not depend on the matrices' size.  Per case, µs of CPU per call
(``common.host_us_per_call``):

* ``op``: ``torch.ops.fp8_moe.grouped_experts_list`` (CUDA only: on CPU the op runs
  the reference);
* ``boxing``: an op of the same schema whose kernel returns its first argument: what
  the dispatcher costs to hand the lists to a Python kernel;
* ``check_experts_list``: the metadata checks of every tensor (what every CUDA call ran
  before ``ListChecks``);
* ``ListChecks``: the checks as CUDA calls run them (a guard of the checked tensors'
  metadata, then the routing tensors' checks);
* ``address_table``: the cached table of the tensors' addresses (reads every address);
* ``addresses, torch's C++ compare``: the same addresses compared in one C++ call,
  ``torch._C._tensors_data_ptrs_at_indices_equal`` (what CUDA-graph trees check their
  static inputs with; CUDA builds of torch only), against the table's
  ``tuple(map(Tensor.data_ptr, ...))``;
* ``kernel entry``: ``fp8_moe_ops.kernels.grouped_experts_list`` without the checks
  (the table, the launch plan's replay, the launches; CUDA only).

Writes ``OUT/list_parts.json`` / ``.md``; exits 1 if any part failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import ExperimentConfig, Runner, host_us_per_call, markdown_table
from fp8_moe_ops import ops
from fp8_moe_ops.kernels.moe_list import address_table

H, I, BLOCK = 256, 128, [128, 128]
CASES = [(256, "fused"), (256, "separate"), (8, "fused")]  # (experts, gate_up form)


def case_args(E: int, form: str, device: str) -> tuple:
    """The op's twelve arguments in schema order: E experts' own tensors (weights of
    random bytes, scales in [0.5, 1.5)), one token routed to top-k of them."""
    gen = torch.Generator(device=device).manual_seed(E)
    f8 = torch.float8_e4m3fn
    separate = form == "separate"
    n_gate_up, rows = (2 * E, I) if separate else (E, 2 * I)

    def weight(n, k):
        return torch.randn(n, k, device=device, generator=gen).to(f8)

    def scales(n, k):
        return torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), device=device, generator=gen) + 0.5

    gate_up = [weight(rows, H) for _ in range(n_gate_up)]
    gate_up_s = [scales(rows, H) for _ in range(n_gate_up)]
    down = [weight(H, I) for _ in range(E)]
    down_s = [scales(H, I) for _ in range(E)]
    hidden = torch.randn(1, H, device=device, dtype=torch.bfloat16, generator=gen)
    weights, index = torch.topk(torch.rand(1, E, device=device, generator=gen), min(8, E // 4 or 1))
    return (hidden, index, weights, gate_up, gate_up_s, down, down_s, BLOCK, "silu", None, None, None)


def parts(args: tuple, boxing_op) -> dict:
    hidden = args[0]
    lists = args[3:7]
    checks = ops.ListChecks(ops.check_experts_list)
    fns = {
        "boxing": lambda: boxing_op(*args),
        "check_experts_list": lambda: ops.check_experts_list(*args),
        "ListChecks": lambda: checks(*args),
        "address_table": lambda: address_table(lists, hidden.device),
    }
    compare = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if compare is not None:
        tensors = [t for ts in lists for t in ts]
        ptrs, indices = [t.data_ptr() for t in tensors], list(range(len(tensors)))
        fns["addresses, torch's C++ compare"] = lambda: compare(tensors, ptrs, indices)
    if hidden.is_cuda:
        from fp8_moe_ops import kernels

        fns = {"op": lambda: torch.ops.fp8_moe.grouped_experts_list(*args), **fns,
               "kernel entry": lambda: kernels.grouped_experts_list(*args)}
    return fns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--experts", type=int, default=None, help="one expert count instead of CASES (e.g. a quick CPU run)")
    args = p.parse_args()
    lib = torch.library.Library("list_parts", "DEF")  # kept alive while its op is timed
    lib.define("boxing" + ops.EXPERTS_LIST_SCHEMA)
    lib.impl("boxing", lambda *a: a[0], "CUDA" if args.device == "cuda" else "CPU")
    runner = Runner("list_parts", args.out_dir)
    cases = [(args.experts, form) for form in ("fused", "separate")] if args.experts else CASES
    for E, form in cases:
        op_args = case_args(E, form, args.device)
        for name, fn in parts(op_args, torch.ops.list_parts.boxing).items():
            runner.run(ExperimentConfig("list_parts", f"E={E} {form}", 1, name),
                       lambda fn=fn: {"cpu_us": host_us_per_call(fn, args.calls)[0],
                                      "tensors": sum(map(len, op_args[3:7]))})
    rows = [r.flat() for r in runner.results]
    runner.save(markdown_table(rows, [("case", "model", ""), ("tensors", "tensors", ""), ("part", "variant", ""),
                                      ("CPU µs / call", "cpu_us", ".1f"), ("error", "error", "")]))
    del lib
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
