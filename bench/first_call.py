"""Where the first call of a fresh process goes: CUDA start-up, then each kernel's
Triton compile (front end, LLVM, ptxas, the C launcher built with the host compiler).

    PYTHONPATH=. python bench/first_call.py --out OUT/first_call.json

Run it in a fresh process with an empty Triton cache (``TRITON_CACHE_DIR`` pointing at
a new folder) to see the worst case a user meets; the script refuses a non-empty one.
Times the import of ``torch._dynamo`` that any custom op's first call pays, then the
first ``grouped_experts`` call of each PERF.md model at T = 1 (each model
has new K / N constexprs, so new GEMM kernels), then a second token count of the
last model (a new config bucket), and profiles the very first call with cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import sys
import time

t_start = time.perf_counter()
import torch  # noqa: E402

import fp8_moe_ops  # noqa: E402,F401

t_import = time.perf_counter() - t_start

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import BLOCK, DEV, MODELS, layer_inputs, layer_weights  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cache = os.environ.get("TRITON_CACHE_DIR", "")
    if not cache or (os.path.isdir(cache) and os.listdir(cache)):
        print("set TRITON_CACHE_DIR to a new, empty folder", file=sys.stderr)
        return 2
    res = {"import_s": t_import, "torch": torch.__version__}
    t0 = time.perf_counter()
    torch.zeros(1, device=DEV)
    torch.cuda.synchronize()
    res["cuda_init_s"] = time.perf_counter() - t0
    # a custom op's first call imports torch._dynamo (torch wraps every custom-op
    # kernel in a disable-Dynamo decorator that imports it lazily): timed on its own,
    # so the first call below is the Triton compiles
    t0 = time.perf_counter()
    importlib.import_module("torch._dynamo")
    res["torch_dynamo_import_s"] = time.perf_counter() - t0
    gen = torch.Generator(device=DEV).manual_seed(0)
    calls = [(m, 1) for m in MODELS] + [("mixtral_8x7b", 4096)]
    for i, (model, T) in enumerate(calls):
        args_ = (*layer_inputs(model, T, gen), *layer_weights(model, gen))
        torch.cuda.synchronize()
        prof = cProfile.Profile() if i == 0 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        torch.ops.fp8_moe.grouped_experts(*args_, BLOCK)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        res[f"first_call_{model}_T{T}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.ops.fp8_moe.grouped_experts(*args_, BLOCK)
        torch.cuda.synchronize()
        res[f"second_call_{model}_T{T}_s"] = time.perf_counter() - t0
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
            res["profile_first_call"] = out.getvalue().splitlines()
        print({k_: v for k_, v in res.items() if k_ != "profile_first_call"}, flush=True)
        del args_
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
