"""The decode GEMMs of one layer in launch forms the table does not ship, each timed on
cold weights: the column tile, the K split, the fused epilogues.

    PYTHONPATH=. python bench/decode_forms.py --out-dir OUT [--cases "qwen3_30b_a3b:1,8"]
        [--forms "gate_up:epilogue=0;gate_up:BN=128,SPLIT=4,epilogue=0;down:BN=64,SPLIT=2"]
        [--layers 6] [--rounds 2] [--name decode_forms]

For each (model, T, scheme) the script runs the experts forward once on its own buffers
and takes its launches (``experts_forward``).  A form changes one GEMM's launch (``gate_up``
or ``down``): ``BN`` (its column tile), ``SPLIT`` (K ranges summed into float32 partials;
the down GEMM's fused combine adds them), ``num_warps``, ``num_stages``, ``maxnreg``
(``none`` drops the cap), ``epilogue=0``: the gate_up GEMM without its fused gated
activation, the down GEMM without its fused combine, and ``read=1``: in place of the GEMM,
``bench/stream_floor.py``'s read kernel over as many weight bytes (timing only: the layer
is then incomplete).  A form may change both GEMMs (``gate_up:read=1&down:read=1``: the
layer's floor with its launches as they are).  The kernel has no split-K gated
activation, so a gate_up form with ``SPLIT`` > 1 needs ``epilogue=0``.  Every form is
timed as

- ``gate_up_us`` / ``down_us``: a CUDA graph of ``--layers`` launches of the GEMM, each on its own copy of
  the weights (a decode step never finds a layer's weights in L2) and each after a memset
  of the forward's counters (which the sort zeroes in the layer), less a graph of the
  memsets alone, per launch;
- ``layer_us``: a graph of ``--layers`` whole forwards with the form in place of the
  shipped launch, per layer (as ``bench/profile_layer.py``'s graph of layers);

beside the shipped launches (form ``shipped``, which times both GEMMs), all of them
``--rounds`` times in turn.
A form that keeps its epilogue also reports ``max_rel_diff``: the layer's output against
the shipped launch's, max |a - b| / max |b| (a split sums K in another order).
``programs`` is the launch's grid.  Writes ``OUT/<--name>.json`` / ``.md``; exits 1 if
any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from common import (BLOCK, ExperimentConfig, Runner, each_scheme_case, graph_ms, log, parse_sweep,
                    results_table)
from fp8_moe_ops.functional import cdiv
from fp8_moe_ops.kernels.experts import _stacked, _stacked_sources
from fp8_moe_ops.kernels.grouped_gemm import _grouped_gemm_kernel
from fp8_moe_ops.kernels.launch import KernelCall, launch
from stream_floor import FAST, read_kernel, read_shape

CASES = {"qwen3_30b_a3b": [1]}
FORMS = "gate_up:epilogue=0;down:epilogue=0"
INT_KEYS = ("BN", "SPLIT", "num_warps", "num_stages", "maxnreg", "epilogue", "read")


def parse_forms(text: str) -> list[dict[str, dict]]:
    """``"gate_up:BN=128,SPLIT=4;gate_up:read=1&down:read=1"`` -> [{gemm: {key: int or
    None}}]: forms separated by ``;``, a form's GEMMs by ``&`` (``""``: none)."""
    forms = []
    for form in filter(None, text.split(";")):
        changed = {}
        for part in form.split("&"):
            gemm, _, spec = part.partition(":")
            if gemm not in ("gate_up", "down") or gemm in changed:
                raise ValueError(f"--forms: expected gate_up: or down: (each once) before each change, got {form!r}")
            changes = changed[gemm] = {}
            for item in filter(None, spec.split(",")):
                key, _, value = item.partition("=")
                if key not in INT_KEYS:
                    raise ValueError(f"--forms: expected keys from {INT_KEYS}, got {key!r} in {part!r}")
                changes[key] = None if value == "none" else int(value)
        forms.append(changed)
    return forms


def form_label(form: dict[str, dict]) -> str:
    return "&".join(gemm + ":" + ",".join(f"{k}={'none' if v is None else v}" for k, v in changes.items())
                    for gemm, changes in form.items()) or "shipped"


def read_instead(call: KernelCall, experts_hit: int, sms: int) -> KernelCall:
    """``bench/stream_floor.py``'s read kernel over as many bytes as the GEMM ``call``
    reads of its weights at decode (``experts_hit`` (N, K) e4m3 matrices: the first ones
    of the stacked tensor), at its fastest launch shape: what no GEMM of these bytes can beat."""
    w = _named_args(call)["w_ptr"]
    if call.constexprs["W_TABLE"]:
        raise ValueError("read=1: expected stacked weights, got a weight table")
    x = w.reshape(-1)[:experts_hit * w[0].numel()].view(torch.int32)
    per_sm, block, warps = FAST
    chunk, programs = read_shape(x.numel(), per_sm * sms, block)
    out = torch.empty(programs, dtype=torch.int32, device=x.device)
    return KernelCall(read_kernel, (programs,), (x, out, x.numel()), dict(CHUNK=chunk, BLOCK=block),
                      dict(num_warps=warps))


def _named_args(call: KernelCall) -> dict:
    """The grouped GEMM launch's run-time arguments by parameter name, in order."""
    return dict(zip((n for n in _grouped_gemm_kernel.arg_names if n not in call.constexprs), call.args))


def reformed(call: KernelCall, changes: dict) -> KernelCall:
    """The grouped GEMM's ``call`` with ``changes`` (module doc): its grid, compile-time
    values, options and (for a new K split) a partials buffer of its own."""
    meta = dict(call.constexprs)
    args = _named_args(call)
    options = dict(call.options)
    if changes.get("epilogue", 1) == 0:
        meta.update(GATED=False, COMBINE=False)
    BN, SPLIT = changes.get("BN", meta["BN"]), changes.get("SPLIT", meta["SPLIT"])
    if meta["GATED"] and SPLIT > 1:
        raise ValueError("the gated activation has no split-K form: give epilogue=0 with SPLIT > 1")
    S, N = args["S"], args["N"]
    if SPLIT > 1 and (SPLIT != meta["SPLIT"] or not meta["COMBINE"]):
        args["part_ptr"] = torch.empty((S, SPLIT, N * (2 if meta["W_SPLIT"] else 1)), dtype=torch.float32,
                                       device=args["out_ptr"].device)
    meta.update(BN=BN, SPLIT=SPLIT, KS=cdiv(cdiv(meta["K"], meta["BK"]), SPLIT) * meta["BK"])
    if meta["GATED"]:
        meta["NG"] = cdiv(BN - 1, meta["BK_SCALE"]) + 1
    if meta["BN_SCALE"] % BN:
        raise ValueError(f"BN: expected a divisor of the weight block {meta['BN_SCALE']}, got {BN}")
    for key in ("num_warps", "num_stages", "maxnreg"):
        if key in changes:
            if changes[key] is None:
                options.pop(key, None)
            else:
                options[key] = changes[key]
    grid = (args["num_pid_m"] * cdiv(N, BN) * (2 if meta["W_SPLIT"] else 1) * SPLIT,)
    return KernelCall(call.kernel, grid, tuple(args.values()), meta, options)


def on_weights(call: KernelCall, swap: dict) -> KernelCall:
    """``call`` with each tensor argument in ``swap`` (by data pointer) replaced, a view of
    another dtype (the read kernel's) by the same view of its replacement."""
    def swapped(a):
        if not isinstance(a, torch.Tensor) or a.data_ptr() not in swap:
            return a
        b = swap[a.data_ptr()]
        return b if b.dtype == a.dtype else b.reshape(-1).view(a.dtype)[:a.numel()].view(a.shape)
    return call._replace(args=tuple(map(swapped, call.args)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cases", default=None, help="model:T,T;... (default: qwen3_30b_a3b:1)")
    p.add_argument("--forms", default=FORMS, help="gemm:KEY=VALUE,...;... (module doc)")
    p.add_argument("--layers", type=int, default=6, help="weight copies: the launches of each graph")
    p.add_argument("--rounds", type=int, default=2, help="the forms timed in turn this many times")
    p.add_argument("--name", default="decode_forms", help="output files OUT/<name>.json and .md")
    args = p.parse_args()
    forms = [{}] + parse_forms(args.forms)  # {}: the shipped launches
    runner = Runner(args.name, args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(5)
    copies = []

    def run(name, T, w, inputs, scheme, scales):
        if not copies:
            copies.extend([w, *(type(w)(*(t.clone() for t in w)) for _ in range(args.layers - 1))])
        op_args = (*inputs, *w, BLOCK, "silu", *scales, None)
        out, env, _, calls = _stacked(op_args, _stacked_sources(op_args))
        gemms = [i for i, c in enumerate(calls) if c.kernel is _grouped_gemm_kernel]
        if len(gemms) != 2:
            raise RuntimeError(f"expected the two GEMMs on the Triton kernel, got {len(gemms)} of {len(calls)}")
        at = dict(gate_up=gemms[0], down=gemms[1])
        counters = env.get("counters")
        swaps = [{a.data_ptr(): b for a, b in zip(w, c)} for c in copies]
        shipped_out = out.clone()

        def zero():
            if counters is not None:
                counters.zero_()

        hit = inputs[1].unique().numel()  # the experts the T tokens hit (all of them read at decode)
        sms = torch.cuda.get_device_properties(0).multi_processor_count

        def measure(form):
            new = list(calls)
            for gemm, changes in form.items():
                new[at[gemm]] = read_instead(calls[at[gemm]], hit, sms) if changes.get("read") else \
                    reformed(calls[at[gemm]], changes)
            layers = [[on_weights(c, s) for c in new] for s in swaps]
            metrics = {}
            if all(changes.get("epilogue", 1) != 0 and not changes.get("read") for changes in form.values()):
                for c in layers[0]:
                    launch(c)
                ref = shipped_out.float()
                metrics["max_rel_diff"] = ((env["out"].float() - ref).abs().max() / ref.abs().max()).item()
            for which in ("gate_up", "down"):
                if not form or which in form:
                    one = [layer[at[which]] for layer in layers]

                    def kernels(one=one):
                        for c in one:
                            zero()
                            launch(c)

                    memsets = graph_ms(lambda: [zero() for _ in one])
                    metrics[f"{which}_us"] = (graph_ms(kernels) - memsets) * 1e3 / len(one)
                    metrics[f"{which}_programs"] = one[0].grid[0]

            def whole():
                for layer in layers:
                    for c in layer:
                        launch(c)

            metrics["layer_us"] = graph_ms(whole) * 1e3 / len(layers)
            return metrics

        for r in range(args.rounds):
            for form in forms:
                runner.run(ExperimentConfig("decode_forms", name, T, scheme,
                                            params=(("form", form_label(form)), ("round", r))),
                           lambda: measure(form))

    def after_model():
        copies.clear()
        torch.cuda.empty_cache()
        runner.save(table(runner))

    each_scheme_case(parse_sweep(args.cases) if args.cases else CASES, gen, run, after_model=after_model)
    log(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    return results_table(runner.results, [("model", "model", ""), ("T", "tokens", ""), ("scheme", "variant", ""),
                                          ("form", "form", ""), ("round", "round", ""),
                                          ("gate_up µs", "gate_up_us", ".1f"),
                                          ("programs", "gate_up_programs", ".0f"),
                                          ("down µs", "down_us", ".1f"), ("programs", "down_programs", ".0f"),
                                          ("layer µs", "layer_us", ".1f"), ("max rel diff", "max_rel_diff", ".2e")])


if __name__ == "__main__":
    sys.exit(main())
