"""Where the first call of a fresh process goes: CUDA start-up, then each kernel's
Triton compile (front end, LLVM, ptxas, the C launcher built with the host compiler).

    TRITON_CACHE_DIR=$(mktemp -d)/tc PYTHONPATH=. python bench/first_call.py --out-dir OUT

Run it in a fresh process with an empty Triton cache (``TRITON_CACHE_DIR`` pointing at
a new folder) to see the worst case a user meets; the script refuses a non-empty one.
Times the import of ``torch._dynamo`` that any custom op's first call pays, then the
first and second ``grouped_experts`` call of each benchmark layer at T = 1 (each model
has new K / N constexprs, so new GEMM kernels), then a second token count of the last
model (a new config bucket), and profiles the very first call with cProfile.  Writes
``OUT/first_call.json`` / ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import time

t_start = time.perf_counter()
import argparse  # noqa: E402
import cProfile  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import fp8_moe_ops  # noqa: E402,F401

t_import = time.perf_counter() - t_start

from common import (BLOCK, MODELS, ExperimentConfig, Runner, layer_inputs, layer_weights,  # noqa: E402
                    results_table)

CALLS = [(name, 1) for name in MODELS] + [("mixtral_8x7b", 4096)]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def cuda_init() -> dict:
    t0 = time.perf_counter()  # no synchronize before: it would start CUDA outside the timing
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return {"s": time.perf_counter() - t0}


def first_and_second(model, T, gen, with_profile: bool) -> dict:
    args = (*layer_inputs(model, T, gen), *layer_weights(model, gen), BLOCK)
    call = lambda: torch.ops.fp8_moe.grouped_experts(*args)  # noqa: E731
    res = {}
    if with_profile:
        prof = cProfile.Profile()
        res["first_call_s"] = timed(lambda: prof.runcall(call))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
        res["profile_first_call"] = out.getvalue().splitlines()
    else:
        res["first_call_s"] = timed(call)
    res["second_call_s"] = timed(call)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    cache = os.environ.get("TRITON_CACHE_DIR", "")
    if not cache or (os.path.isdir(cache) and os.listdir(cache)):
        p.error("set TRITON_CACHE_DIR to a new, empty folder")
    runner = Runner("first_call", args.out_dir)
    runner.run(ExperimentConfig("first_call", "-", 0, "import torch + fp8_moe_ops"), lambda: {"s": t_import})
    runner.run(ExperimentConfig("first_call", "-", 0, "CUDA init"), cuda_init)
    # a custom op's first call imports torch._dynamo (torch wraps every custom-op kernel
    # in a disable-Dynamo decorator that imports it lazily): timed on its own, so the
    # calls below are the Triton compiles
    runner.run(ExperimentConfig("first_call", "-", 0, "import torch._dynamo"),
               lambda: {"s": timed(lambda: importlib.import_module("torch._dynamo"))})
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, (name, T) in enumerate(CALLS):
        runner.run(ExperimentConfig("first_call", name, T, "grouped_experts"),
                   lambda: first_and_second(MODELS[name], T, gen, with_profile=i == 0))
        torch.cuda.empty_cache()
    runner.save(results_table(runner.results, [("what", "variant", ""), ("model", "model", ""), ("T", "tokens", ""),
                                               ("s", "s", ".2f"), ("first call s", "first_call_s", ".2f"),
                                               ("second call s", "second_call_s", ".4f")]))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
