"""Speed of a compiled MoE layer before and after the graph pass, on two benchmark layers.

Run on a CUDA machine (never in CI):

    PYTHONPATH=. python bench/bench_pass.py --out-dir OUT [--models qwen3_30b_a3b,deepseek_v3]

The layer is the demo's (``fp8_moe_ops.demo.MoELayer``): a float32 router, top-k
softmax and ``FP8Experts(dispatch="eager")`` — a Python loop over all E experts — with
random block-quantised weights.  For each model it measures, at several token counts:

* ``eager``: the loop, not compiled;
* ``off``: ``torch.compile(layer, dynamic=True)`` as a user gets it today: Dynamo
  breaks the graph at each expert's data-dependent ``torch.where``;
* ``off_capture``: the same with ``capture_dynamic_output_shape_ops`` on (what
  ``passes.install()`` sets) but no pass: Inductor compiles the whole unrolled loop,
  one ``nonzero`` and device sync per expert remain;
* ``on``: with ``fp8_moe_ops.passes`` installed (one grouped op).

Each (model, pass state) compiles and checks accuracy in its own process, in parallel;
then, once all are done (a process still compiling at ``--barrier-s`` is stopped and
reported), they time one at a time under a file lock, so no compile competes with a
timing for the CPU (the eager loop's time is mostly host time).  Timing: median of
``triton.testing.do_bench`` (CUDA events around each call; the loop's device syncs are
inside the timed region, as a user would see them).  Writes ``OUT/bench_pass.json``,
``OUT/bench_pass.png`` (time vs tokens, log-log) and prints markdown tables;
``--from-json FILE`` redraws both from an earlier run's JSON without a GPU.  Exits 1
when a (model, pass state) process failed or was stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time

from common import MODELS as ALL_MODELS

MODELS = {name: ALL_MODELS[name] for name in ("deepseek_v3", "qwen3_30b_a3b")}
TOKENS = [1, 64, 512, 4096]


@contextlib.contextmanager
def _timing_lock(path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_layer(model):
    import torch
    from torch import nn

    import fp8_moe_ops
    from fp8_moe_ops.demo import MoELayer

    E, H, k = model.E, model.H, model.top_k
    torch.manual_seed(0)  # the router and the tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = fp8_moe_ops.FP8Experts(E, H, model.I, device="cuda")  # dispatch="eager", dynamic scheme
    for e in range(E):  # one expert at a time: no float copy of the whole weight tensor
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            q, s = fp8_moe_ops.quantize_weight(torch.randn(w.shape[1:], device="cuda", generator=gen) * 0.02,
                                               experts.block_size)
            w[e].copy_(q)
            getattr(experts, name + "_scale_inv")[e].copy_(s)
    router = nn.Linear(H, E, bias=False, device="cuda")
    return MoELayer(experts, router, k).eval()


def _wait_for_go(out_dir: str, name: str) -> bool:
    """Mark this process ready to time, wait for the parent's go; True if every process
    had compiled (none was stopped for compiling too long)."""
    open(os.path.join(out_dir, f".ready_{name}"), "w").close()
    go = os.path.join(out_dir, ".go")
    while not os.path.exists(go):
        time.sleep(0.5)
    with open(go) as f:
        return f.read() == "all"


STATES = ("off", "off_capture", "on")


def child(model: str, state: str, tokens: list[int], out_dir: str) -> dict:
    import torch
    import torch._dynamo.config
    import triton
    from torch._dynamo.utils import counters

    import fp8_moe_ops.passes as passes

    torch._inductor.config.force_disable_caches = True  # a cache hit would skip the pass
    layer = _build_layer(MODELS[model])
    x = torch.randn(max(tokens), MODELS[model].H, device="cuda", dtype=torch.bfloat16)
    res = {"model": model, "state": state, "eager_ms": {}, "compiled_ms": {}}
    if state == "on":
        passes.install()
    elif state == "off_capture":
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    compiled = torch.compile(layer, dynamic=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(x[: tokens[0]])
        torch.cuda.synchronize()
        res["compile_s"] = time.perf_counter() - t0
        res["counters"] = dict(counters["fp8_moe"])
        eager = {t: layer(x[:t]).float() for t in tokens}
        res["max_abs_err_vs_eager"] = max((compiled(x[:t]).float() - eager[t]).abs().max().item() for t in tokens)
        res["ref_max_abs"] = max(eager[t].abs().max().item() for t in tokens)
        res["graph_breaks"] = sum(counters["graph_break"].values())
        res["timed_after_all_compiles"] = _wait_for_go(out_dir, f"{model}_{state}")
        with _timing_lock(os.path.join(out_dir, ".timing.lock")):
            for t in tokens:
                xt = x[:t]
                res["compiled_ms"][t] = triton.testing.do_bench(lambda: compiled(xt), warmup=25, rep=200,
                                                                return_mode="median")
                if state == "on":  # the eager loop is timed once, in one of the processes
                    res["eager_ms"][t] = triton.testing.do_bench(lambda: layer(xt), warmup=5, rep=200,
                                                                 return_mode="median")
    return res


def _release_when_compiled(procs: dict, out_dir: str, barrier_s: float, wait_file: str | None) -> set:
    """Write ``.go`` once every process is ready to time (or has exited) and
    ``wait_file`` exists.  At ``barrier_s`` the processes still compiling are killed
    (returned) and the rest go: no timing ever shares the machine with a compile."""
    while True:
        ready = {name for name in procs if os.path.exists(os.path.join(out_dir, ".ready_{}_{}".format(*name)))}
        waiting = {name for name, proc in procs.items() if name not in ready and proc.poll() is None}
        if not waiting and (wait_file is None or os.path.exists(wait_file)):
            stopped = set()
            break
        if time.monotonic() - START >= barrier_s:
            for name in waiting:
                procs[name].kill()
            stopped = waiting
            break
        time.sleep(1)
    with open(os.path.join(out_dir, ".go"), "w") as f:
        f.write("partial" if stopped else "all")
    return stopped


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--timeout", type=float, default=540, help="seconds for the whole run")
    p.add_argument("--barrier-s", type=float, default=360,
                   help="seconds for every process to compile and check accuracy; those not ready by then are "
                        "stopped (reported), so that no compile ever runs beside a timing")
    p.add_argument("--wait-file", help="also wait (up to the barrier) for this file before timing: another job "
                                       "sharing the GPU writes it when done")
    p.add_argument("--from-json", help="only redraw the tables and the plot from this bench_pass.json")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "STATE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    os.makedirs(a.out_dir, exist_ok=True)
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)
        plot(results, os.path.join(a.out_dir, "bench_pass.png"))
        print(table(results))
        return 0
    if a.child:
        res = child(a.child[0], a.child[1], tokens, a.out_dir)
        with open(os.path.join(a.out_dir, f"pass_{a.child[0]}_{a.child[1]}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    for f in os.listdir(a.out_dir):
        if f.startswith(".ready_") or f == ".go":
            os.remove(os.path.join(a.out_dir, f))
    procs = {(m, s): subprocess.Popen([sys.executable, __file__, "--out-dir", a.out_dir, "--tokens", a.tokens,
                                       "--child", m, s])
             for m in a.models.split(",") for s in STATES}
    stopped = _release_when_compiled(procs, a.out_dir, a.barrier_s, a.wait_file)
    results = []
    for (m, s), proc in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, a.timeout - (time.monotonic() - START)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        if (m, s) in stopped:
            rc = f"stopped: not compiled within {a.barrier_s:.0f} s"
        path = os.path.join(a.out_dir, f"pass_{m}_{s}.json")
        if rc == 0 and os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"model": m, "state": s, "error": rc if isinstance(rc, str) else f"exit {rc}"})
    with open(os.path.join(a.out_dir, "bench_pass.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(a.out_dir, "bench_pass.png"))
    print(table(results))
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"FAILED: {r['model']} {r['state']}: {r['error']}")
    return 1 if failed else 0


def table(results) -> str:
    by = {(r["model"], r["state"]): r for r in results}
    rows = ["| model | T | eager loop ms | compiled, pass off ms | pass off, loop captured ms | compiled with the pass ms "
            "| speed-up vs pass off | vs captured |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in MODELS:
        on = by.get((m, "on"), {})
        for t, ms_on in on.get("compiled_ms", {}).items():
            cells = [m, t, f"{on['eager_ms'][t]:.3f}"]
            base = [by.get((m, s), {}).get("compiled_ms", {}).get(t) for s in ("off", "off_capture")]
            cells += [f"{b:.3f}" if b else by.get((m, s), {}).get("error", "-") for b, s in zip(base, ("off", "off_capture"))]
            cells += [f"{ms_on:.3f}"] + [f"{b / ms_on:.1f}x" if b else "-" for b in base]
            rows.append("| " + " | ".join(map(str, cells)) + " |")
    rows += ["", "| model | state | compile s (first call) | graph breaks | counters | max abs err vs eager "
             "| timed after all compiles |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "compile_s" in r:
            rows.append(f"| {r['model']} | {r['state']} | {r['compile_s']:.1f} | {r['graph_breaks']} | {r['counters']} "
                        f"| {r['max_abs_err_vs_eager']:.3g} (output max {r['ref_max_abs']:.3g}) "
                        f"| {r['timed_after_all_compiles']} |")
    return "\n".join(rows)


LABELS = {"eager": "eager loop (not compiled)", "off": "torch.compile, pass off (graph breaks)",
          "off_capture": "torch.compile, pass off, loop captured", "on": "torch.compile with the pass"}


def plot(results, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["model"], r["state"]): r for r in results}
    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 4.5))
    for ax, model in zip(axes, MODELS):
        series = {"eager": by.get((model, "on"), {}).get("eager_ms", {})}
        series.update({s: by.get((model, s), {}).get("compiled_ms", {}) for s in STATES})
        for key, ms in series.items():
            if ms:
                ax.plot([int(t) for t in ms], list(ms.values()), marker="o", label=LABELS[key])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("ms per layer call (median)")
        ax.set_title(f"{model} MoE layer, H200")
        ax.legend(fontsize=7)
    fig.text(0.01, 0.01, "PYTHONPATH=. python bench/bench_pass.py --out-dir OUT", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


START = time.monotonic()
if __name__ == "__main__":
    sys.exit(main())
