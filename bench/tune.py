"""Sweep of grouped-GEMM launch configs on whole MoE layers (CUDA graph replay times).

    PYTHONPATH=. python bench/tune.py --out-dir OUT [--models "deepseek_v3:4096,16384;qwen3_30b_a3b:1"]
        [--candidates "128,128,8,4;64,128,4,4"]

For each (model, T) of the sweep, every candidate config (BM, BN, num_warps,
num_stages) is forced on both GEMMs of the ``grouped_experts`` forward (dynamic scheme,
uniform routing) and the layer is timed as the median replay of a CUDA graph (GPU time,
not launch overhead); variant ``default`` is the shipped table (which may give the two
GEMMs different tiles, e.g. a narrower ``BN`` at decode).  The forward is the kernels'
entry without launch plans (``fp8_moe_ops.kernels.grouped_experts``): through the op,
whose plans are kept per argument signature, every candidate after the first would
replay the first one's launches.  A candidate that does not
compile or run (e.g. out of shared memory) is a failed case: the sweep goes on and
exits 1.  The winners per bucket of rows per expert go into
``fp8_moe_ops/kernels/configs/h200.json`` by hand (see docs/benchmarks.md).
Writes ``OUT/<--name>.json`` / ``.md`` (default ``tune``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (BLOCK, MODELS, ExperimentConfig, Runner, graph_ms, layer_inputs, layer_weights, markdown_table,
                    parse_sweep)
from fp8_moe_ops import kernels
from fp8_moe_ops.kernels import moe

CANDIDATES = [  # BM, BN, num_warps, num_stages
    (16, 128, 4, 4), (16, 64, 4, 4), (16, 32, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 5),
    (64, 256, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3),
]
SWEEP = {"deepseek_v3": [1, 8, 64, 512, 1024, 4096, 8192, 16384],
         "qwen3_30b_a3b": [1, 8, 64, 512, 1024, 4096, 8192, 16384],
         "mixtral_8x7b": [1, 8, 64, 512, 4096, 16384]}


def forced(candidate, fn) -> dict:
    """Graph time of ``fn`` with ``candidate`` on every grouped GEMM (the table restored after)."""
    bm, bn, nw, ns = candidate
    default = moe.gemm_config
    moe.gemm_config = lambda S, E, N, K, split_k=False, sms=None: {"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": nw,
                                                                   "num_stages": ns}
    try:
        return {"graph_ms": graph_ms(fn)}
    finally:
        moe.gemm_config = default


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default=None, help="model:T,T;model:T (default: the whole SWEEP)")
    p.add_argument("--candidates", default=None, help="BM,BN,warps,stages;... (default: CANDIDATES)")
    p.add_argument("--name", default="tune", help="output files OUT/<name>.json and .md")
    args = p.parse_args()
    sweep = parse_sweep(args.models) if args.models else SWEEP
    candidates = ([tuple(int(v) for v in c.split(",")) for c in args.candidates.split(";")]
                  if args.candidates else CANDIDATES)
    runner = Runner(args.name, args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, tokens in sweep.items():
        model = MODELS[name]
        w = layer_weights(model, gen)
        for T in tokens:
            x, idx, wts = layer_inputs(model, T, gen)
            fn = lambda: kernels.grouped_experts(x, idx, wts, *w, BLOCK)  # noqa: E731
            rows = T * model.top_k / min(model.E, T * model.top_k)
            for cand in candidates:
                runner.run(ExperimentConfig("tune", name, T, ",".join(map(str, cand)),
                                            params=(("rows_per_expert", rows),)), lambda: forced(cand, fn))
            runner.run(ExperimentConfig("tune", name, T, "default", params=(("rows_per_expert", rows),)),
                       lambda: {"graph_ms": graph_ms(fn)})
        del w
        torch.cuda.empty_cache()
        runner.save(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    """Per (model, T): the default's time, the best candidate and its time."""
    cases = {}
    for r in runner.results:
        c = cases.setdefault((r.config.model, r.config.tokens), {"model": r.config.model, "T": r.config.tokens})
        if not r.ok:
            c["failed"] = c.get("failed", 0) + 1
        elif r.config.variant == "default":
            c["default_ms"] = r.metrics["graph_ms"]
        elif r.metrics["graph_ms"] < c.get("best_ms", float("inf")):
            c["best_ms"], c["best"] = r.metrics["graph_ms"], r.config.variant
    return markdown_table(list(cases.values()), [("model", "model", ""), ("T", "T", ""),
                                                 ("default ms", "default_ms", ".3f"),
                                                 ("best BM,BN,warps,stages", "best", ""), ("best ms", "best_ms", ".3f"),
                                                 ("failed candidates", "failed", "")])


if __name__ == "__main__":
    sys.exit(main())
