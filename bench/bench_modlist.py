"""``fp8_moe::grouped_experts_list`` (per-expert weight lists, as ``nn.ModuleList``
experts hold them) against ``fp8_moe::grouped_experts`` on the stacked weights, same
shapes, same run.

    PYTHONPATH=. python bench/bench_modlist.py --out-dir OUT [--models deepseek_v3,...] [--tokens 1,64,...]

Writes ``OUT/bench_modlist.json`` and ``OUT/bench_modlist.md``.  Per model and token
count: GPU time (median of CUDA events, ``do_bench``) eagerly and as a CUDA graph
replay, for the stacked op, the list op with one fused (2I, H) gate_up matrix per expert
(``fused``) and with separate gate and up matrices (``separate``: Mixtral's w1 / w3),
each expert's tensors allocated on their own (as a ModuleList's are); plus, at small T,
the host (CPU) time of one eager call: 100 back-to-back calls timed before the final
synchronize, / 100 (with 768 to 1024 tensors per call at 256 experts, the per-call
Python work over the lists shows here).  Outputs are checked bitwise against the
stacked op before timing.  About 3 minutes on an H200 for the default sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BLOCK, MODELS, graph_ms, host_us_per_call, layer_inputs, layer_weights, log, time_ms  # noqa: E402

OPS = torch.ops.fp8_moe
TOKENS = [1, 64, 1024, 16384]
HOST_TOKENS = (1, 64)  # larger T would fill the launch queue and time the GPU instead
FORMS = ("stacked", "fused", "separate")


def weight_lists(gu, gus, dp, dps):
    """{form: (gate_up list, its scales, down list, its scales)}, every tensor its own allocation."""
    E, two_i, _ = gu.shape
    I, g = two_i // 2, gus.shape[1] // 2
    down = ([dp[e].clone() for e in range(E)], [dps[e].clone() for e in range(E)])
    fused = ([gu[e].clone() for e in range(E)], [gus[e].clone() for e in range(E)], *down)
    separate = ([gu[e, :I].clone() for e in range(E)] + [gu[e, I:].clone() for e in range(E)],
                [gus[e, :g].clone() for e in range(E)] + [gus[e, g:].clone() for e in range(E)], *down)
    return {"fused": fused, "separate": separate}


def run_model(model, tokens, gen, results):
    m = MODELS[model]
    E, H, I, k = m.E, m.H, m.I, m.top_k
    t0 = time.time()
    stacked = layer_weights(m, gen)
    lists = weight_lists(*stacked)
    operands = {"stacked": (OPS.grouped_experts, stacked), **{f: (OPS.grouped_experts_list, w) for f, w in lists.items()}}
    for T in tokens:
        x, idx, w = layer_inputs(m, T, gen)
        row = {"model": model, "E": E, "H": H, "I": I, "top_k": k, "T": T}
        want = None
        for form in FORMS:
            op, weights = operands[form]

            def call(op=op, weights=weights):
                return op(x, idx, w, *weights, BLOCK)

            out = call()
            if want is None:
                want = out
            row[f"{form}_bitwise"] = bool(torch.equal(out, want))
            row[f"{form}_ms"] = time_ms(call, rep_ms=100)
            row[f"{form}_graph_ms"] = graph_ms(call)
            if T in HOST_TOKENS:
                row[f"{form}_host_us"] = host_us_per_call(call)[0]
        for form in ("fused", "separate"):
            row[f"{form}_ratio"] = row[f"{form}_ms"] / row["stacked_ms"]
            row[f"{form}_graph_ratio"] = row[f"{form}_graph_ms"] / row["stacked_graph_ms"]
        log(f"{model} T={T}: " + ", ".join(
            f"{f} {row[f + '_ms']:.3f}/{row[f + '_graph_ms']:.3f} ms"
            + (f" host {row[f + '_host_us']:.0f} us" if f + "_host_us" in row else "")
            + ("" if row[f + "_bitwise"] else " NOT BITWISE") for f in FORMS))
        results.append(row)
    del stacked, lists, operands
    torch.cuda.empty_cache()
    log(f"{model}: {time.time() - t0:.0f} s")


def write_table(results, path, cmd):
    lines = [
        "# ModuleList (per-expert weight lists) vs stacked weights", "",
        f"`{cmd}`", "",
        "Times in ms (eager / CUDA graph), list op / stacked op as a ratio; host = CPU time of one eager call "
        "(us, 100 back-to-back calls / 100). Every list op output was bitwise equal to the stacked op's "
        "unless marked.", "",
        "| model | T | stacked | fused | separate | fused ratio (eager / graph) | separate ratio (eager / graph) "
        "| host stacked / fused / separate |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        host = " / ".join(f"{r[f + '_host_us']:.0f}" for f in FORMS) if "stacked_host_us" in r else ""
        cells = [f"{r[f + '_ms']:.3f} / {r[f + '_graph_ms']:.3f}" + ("" if r[f + "_bitwise"] else " (NOT BITWISE)")
                 for f in FORMS]
        ratios = [f"{r[f + '_ratio']:.3f} / {r[f + '_graph_ratio']:.3f}" for f in ("fused", "separate")]
        lines.append(f"| {r['model']} | {r['T']} | " + " | ".join(cells + ratios) + f" | {host} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("bench_modlist.py needs a CUDA device")
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    cmd = "python bench/bench_modlist.py " + " ".join(sys.argv[1:])
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: list[dict] = []
    tokens = [int(t) for t in args.tokens.split(",")]
    for model in args.models.split(","):
        run_model(model, tokens, gen, results)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cmd": cmd}
    with open(os.path.join(args.out_dir, "bench_modlist.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    write_table(results, os.path.join(args.out_dir, "bench_modlist.md"), cmd)
    bad = [r for r in results if not all(r[f + "_bitwise"] for f in FORMS)]
    if bad:
        log(f"{len(bad)} rows where the list op differs from the stacked op (see the table)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
