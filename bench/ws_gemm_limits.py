"""Where the Gluon prefill GEMM's time goes: the kernel alone, and variants of it that
each leave one part of the work out.

    PYTHONPATH=. python bench/ws_gemm_limits.py --out-dir OUT [--cases "deepseek_v3:8192;qwen3_30b_a3b:16384"]
        [--variants shipped,store_mma,store_rows,narrow,no_rescale,no_loads,no_rescale+no_loads,no_store,static,
                    kmajor,one_scale_row,wide,wide4_tma,wide4_mma]
        [--routing even|uniform]
    python bench/ws_gemm_limits.py --plot OUT/ws_gemm_limits.json --png FIGURE.png   # no GPU; needs matplotlib

For the gate_up (N = 2I, K = H) and down (N = H, K = I) GEMMs of each case (M = T * top_k
rows, activations already sorted and quantised, dynamic scales, row-major as the down
GEMM reads them), it times ``kernels/gluon_gemm.py``'s kernel launched as the op launches
it (``ws_gemm.ws_gemm_call``: one program per SM), and copies of that source with one
edit each, compiled beside it:

* ``store_mma`` / ``store_rows``: the shipped kernel with its output stored from the MMA
  layout (``ws_gemm.EPILOGUE`` 0) / as whole rows through shared memory (1), not by TMA;
* ``narrow``: the shipped kernel with output tiles of 128 x 128 (``ws_gemm.WIDE`` off)
  where it would take 128 x 256;

The edits below are made to the K loop of 128 x 128 tiles: these variants run with
``WIDE`` off, so they compare with ``narrow``.

* ``no_rescale``: each K step's MMAs accumulate in place (``use_acc``) and no scale is
  read or multiplied: the bare block GEMM over the same ring and tile map;
* ``no_loads``: the producer issues no TMA load; it arrives at each slot's ``ready``
  barrier instead, so the MMAs read whatever the ring holds: what the consumers alone
  allow, with no data moved into shared memory;
* ``no_store``: no output written: the TMA store never chosen, the row store
  predicated off (its layout conversion and address arithmetic stay);
* ``a+b``: both edits.

Three variants of the activation scales, with output tiles as shipped (128 x 256 where N
allows):

* ``static``: the shipped kernel launched with static activation scales (one per expert,
  read once per tile) on the same fp8 bytes: what reading each row's own scale every K
  step costs;
* ``kmajor``: the shipped kernel launched with the same scales laid out K-group major
  (as the gate_up GEMM reads them at prefill), which its producer copies into shared
  memory beside each K step's A tile;
* ``one_scale_row``: every row of a tile reads its first row's scales (one address per
  load instead of up to 8 rows' cache lines per warp): what a scale layout with a tile's
  rows side by side could gain at most.

The rows are spread over the E experts evenly (``--routing even``: M / E each, whole
tiles where that is a multiple of 128), or as the layer benchmarks route them
(``uniform``: the per-expert counts of ``common.make_routing``, so experts' last tiles
are partly empty, as in a layer).

Three variants with output tiles of 128 x 256 at every K and row count (``WIDE_ANY_K``):

* ``wide``: the shipped wide form (a ring of three 48 KB slots, four TMA staging buffers);
* ``wide4_tma``: a ring of four slots, one staging buffer per consumer warpgroup (its two
  column blocks stored in turn), the halves TMA cannot store written from the MMA layout;
* ``wide4_mma``: a ring of four slots, every store from the MMA layout.

Only ``shipped``, the two stores, ``narrow``, ``kmajor`` and the wide variants compute the product (``static``
computes one with other scales); the other variants' outputs are meaningless by design
(the GPU tests check the shipped kernel against the reference).  Beside them, in the
same run, the dense cuBLAS rates at the same M, N, K (``gemm_ceiling.py``'s block-scaled
and tensorwise calls).  Times are medians of back-to-back launches
(``triton.testing.do_bench``, L2 flushed between launches).  Writes
``OUT/ws_gemm_limits.json`` / ``.md``; exits 1 if any case failed.  ``--plot`` draws a
run's TFLOP/s per GEMM and variant, cuBLAS's block-scaled rate beside them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import os
import sys
import tempfile

import torch

from common import (MODELS, PROJS, ExperimentConfig, Runner, gemm_shape, log, make_routing, make_weights,
                    markdown_table, parse_sweep, read_json, time_ms)
from fp8_moe_ops.kernels import gluon_gemm, ws_gemm
from gemm_ceiling import FP8, dense_blockwise, dense_tensorwise

CASES = {"deepseek_v3": [8192], "qwen3_30b_a3b": [16384]}

# (text of kernels/gluon_gemm.py, its replacement); every text must be found
_EDITS = {
    "no_rescale": [
        ("use_acc=False, is_async=True)", "use_acc=True, is_async=True)"),
        ("""                    w_s0 = _step_weight_scale(i, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                    w_s1 = _step_weight_scale(i + 1, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                    r_s0 = _row_scale(i, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                    r_s1 = _row_scale(i + 1, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                    t0 = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES)
                    t1 = _start_mma(a_smem, w_smem, ready, it + 1, zero, HALF, STAGES)
                    scale0 = _act_scale(r_s0, as_smem, it, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s0
                    scale1 = _act_scale(r_s1, as_smem, it + 1, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s1
                    t0 = warpgroup_mma_wait(num_outstanding=1, deps=(t0, ))
                    mbarrier.arrive(empty.index(it % STAGES), count=1)
                    acc = acc + t0 * scale0[:, None]
                    t1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1, ))
                    mbarrier.arrive(empty.index((it + 1) % STAGES), count=1)
                    acc = acc + t1 * scale1[:, None]
""", """                    acc = _start_mma(a_smem, w_smem, ready, it, acc, HALF, STAGES)
                    acc = _start_mma(a_smem, w_smem, ready, it + 1, acc, HALF, STAGES)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    mbarrier.arrive(empty.index(it % STAGES), count=1)
                    mbarrier.arrive(empty.index((it + 1) % STAGES), count=1)
"""),
        ("""                w_s = _step_weight_scale(i, BK, BK_SCALE, ws_tile, stride_wsk, SCALE_E8M0)
                r_s = _row_scale(i, BK, BK_SCALE, as_row, rmask, ROW_MAJOR)
                t = _start_mma(a_smem, w_smem, ready, it, zero, HALF, STAGES)
                scale = _act_scale(r_s, as_smem, it, rmask, a_s, HALF, STAGES, STATIC, KMAJOR) * w_s
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
                mbarrier.arrive(empty.index(it % STAGES), count=1)
                acc = acc + t * scale[:, None]  # contracted to one FMA, as the grouped kernel's tl.fma
""", """                acc = _start_mma(a_smem, w_smem, ready, it, acc, HALF, STAGES)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(it % STAGES), count=1)
"""),
    ],
    "no_loads": [
        ("""        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, i * BK], ready.index(s), a_smem.index(s))
        tma.async_copy_global_to_shared(w_desc, [wrow, i * BK], ready.index(s), w_smem.index(s))
""", """        mbarrier.arrive(ready.index(s), count=1)
"""),
    ],
    "one_scale_row": [
        ("as_row = as_ptr + rows.to(gl.int64) * stride_as",
         "as_row = as_ptr + (rows * 0 + row0).to(gl.int64) * stride_as"),
    ],
    "wide4_tma": [  # one staging buffer per consumer warpgroup: its two column blocks stored in turn; the
        # halves TMA cannot store, from the MMA layout (no conversion's scratch beside the ring)
        ("[2 * WN] + out_desc.block_type.shape", "[2] + out_desc.block_type.shape"),
        ("_store_rows(vals, out_ptr, stride_om, orow, rmask, n0, N, EPILOGUE)",
         "_store_rows(vals, out_ptr, stride_om, orow, rmask, n0, N, 0)"),
        ("N, HALF, HALF * WN, True,", "N, HALF, HALF, True,"),
        ("N, HALF, HALF * WN + 1, False,", "N, HALF, HALF, True,"),
    ],
    "no_store": [
        ("if (first + HM <= row1) | (row1 == S):", "if row0 < 0:"),
        ("mask=m[:, None] & (cols < N)[None, :])", "mask=m[:, None] & (cols < N)[None, :] & (n0 < 0))"),
    ],
}
STORES = {"store_mma": 0, "store_rows": 1}  # variants of ws_gemm.EPILOGUE
# variants with output tiles of 128 x 256 at every K (ws_gemm.WIDE_MAX_K lifted): (their
# ring's slots, ws_gemm.EPILOGUE); four slots of 48 KB leave room for one staging buffer
# per consumer warpgroup (wide4_tma's edit) or none (0: stored from the MMA layout)
WIDE_ANY_K = {"wide": (None, None), "wide4_mma": (4, 0), "wide4_tma": (4, 2)}
EXACT = (*STORES, "narrow", "kmajor", *WIDE_ANY_K)  # variants of the launch alone: the shipped kernel, its product
SCALES = ("static", "one_scale_row")  # variants of the activation scales, with tiles as shipped
UNEDITED = ("shipped", "static", *(v for v in EXACT if v not in _EDITS))  # variants that run the shipped source
VARIANTS = ("shipped", *EXACT, "no_rescale", "no_loads", "no_rescale+no_loads", "no_store", *SCALES)
ROUTINGS = ("even", "uniform")


@functools.cache
def variant_kernel(variant: str, workdir: str):
    """The Gluon kernel of ``variant``: ``kernels/gluon_gemm.py``'s source with the
    variant's edits, loaded as a module of its own (the JIT reads its source file); one
    module per variant and run, so each compiles once per specialisation."""
    if variant in UNEDITED:
        return gluon_gemm._ws_gemm_kernel
    source = inspect.getsource(gluon_gemm)
    for part in variant.split("+"):
        for old, new in _EDITS[part]:
            if old not in source:
                raise RuntimeError(f"variant {part}: its edit no longer matches kernels/gluon_gemm.py: {old[:80]!r}")
            source = source.replace(old, new)
    path = os.path.join(workdir, f"gluon_{variant.replace('+', '_')}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"gluon_{variant.replace('+', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._ws_gemm_kernel


def run_shape(runner: Runner, model, T: int, proj: str, N: int, K: int, variants, workdir: str, gen,
              routing: str = "even") -> None:
    M = T * model.top_k
    rows = M // model.E
    if routing == "even":
        offsets = torch.arange(1, model.E + 1, device="cuda", dtype=torch.int32) * rows
    else:  # the layer benchmarks' routing: one expert-id draw per shape
        ids = make_routing(T, model.E, model.top_k, routing, gen)[0]
        offsets = torch.bincount(ids.flatten(), minlength=model.E).cumsum(0).to(torch.int32)
    counts = offsets.diff(prepend=offsets.new_zeros(1))
    params = (("proj", proj), ("M", M), ("N", N), ("K", K), ("rows_per_expert", rows), ("routing", routing),
              ("row_tiles", int(((counts + 127) // 128).sum())))  # of 128 rows, each within one expert
    flops = 2 * M * N * K
    w, ws = make_weights(model.E, N, K, gen)
    a = (torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 32).to(FP8)
    sa = torch.rand(M, -(-K // 128), device="cuda", generator=gen) * 2e-3 + 1e-3
    sa_expert = torch.rand(model.E, device="cuda", generator=gen) * 2e-3 + 1e-3  # the ``static`` variant's
    sa_kmajor = sa.t().contiguous().t()  # the ``kmajor`` variant's: the same scales, K-group major
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def make_call(variant):
        real = ws_gemm.EPILOGUE, ws_gemm.WIDE, ws_gemm.WIDE_MAX_K, ws_gemm.WIDE_STAGES
        ws_gemm.EPILOGUE = STORES.get(variant, real[0])
        # the K-loop edits are to the narrow K loop; the scale variants' edit is to both
        ws_gemm.WIDE = real[1] and variant in ("shipped", *STORES, "kmajor", *SCALES, *WIDE_ANY_K)
        if variant in WIDE_ANY_K:
            stages, epilogue = WIDE_ANY_K[variant]
            ws_gemm.WIDE_MAX_K = K
            ws_gemm.WIDE_STAGES = stages or real[3]
            ws_gemm.EPILOGUE = real[0] if epilogue is None else epilogue
        static = variant == "static"
        try:
            scales = sa_expert if static else sa_kmajor if variant == "kmajor" else sa
            return ws_gemm.ws_gemm_call(a, scales, w, ws, ws.stride(), (128, 128), out,
                                        offsets=offsets, perm=None, scatter_out=False, static=static, e8m0=False,
                                        num_pid_m=-(-M // 128) + model.E, group_m=8,
                                        max_programs=ws_gemm.programs(out.device))
        finally:
            ws_gemm.EPILOGUE, ws_gemm.WIDE, ws_gemm.WIDE_MAX_K, ws_gemm.WIDE_STAGES = real

    def config(variant):
        return ExperimentConfig("ws_gemm_limits", model.name, T, variant, params=params)

    def timed(variant):
        call = make_call(variant)
        kernel = variant_kernel(variant, workdir)

        def launch():
            kernel[call.grid](*call.args, **call.constexprs, **call.options)
        ms = time_ms(launch)
        res = {"ms": ms, "tflops": flops / ms / 1e9}
        if variant in EXACT:  # the same product as shipped's, bitwise
            res["equals_shipped"] = bool(torch.equal(out, reference))
        return res

    runner.run(config("dense_blockwise"), lambda: dense_blockwise(a, sa, w[0], ws[0], flops))
    runner.run(config("dense_tensorwise"), lambda: dense_tensorwise(a, w[0], flops))
    shipped = make_call("shipped")
    shipped.kernel[shipped.grid](*shipped.args, **shipped.constexprs, **shipped.options)
    reference = out.clone()
    for v in variants:
        runner.run(config(v), lambda v=v: timed(v))


def table(runner: Runner, variants) -> str:
    rows = {}
    for r in runner.results:
        f = r.flat()
        row = rows.setdefault((f["model"], f["tokens"], f["proj"]), {
            k: f[k] for k in ("model", "tokens", "proj", "M", "N", "K", "rows_per_expert", "routing", "row_tiles")})
        row[f["variant"]] = None if r.error else f["tflops"]
    columns = [("model", "model", ""), ("T", "tokens", ""), ("GEMM", "proj", ""), ("M", "M", ""), ("N", "N", ""),
               ("K", "K", ""), ("rows/expert", "rows_per_expert", ""), ("routing", "routing", ""),
               ("row tiles", "row_tiles", ""),
               ("cuBLAS dense block-scaled", "dense_blockwise", ".0f"),
               ("cuBLAS dense tensorwise", "dense_tensorwise", ".0f")]
    columns += [(v, v, ".0f") for v in variants]
    note = "only `shipped`, `narrow`, the two stores, `kmajor` and the wide variants compute the product"
    return f"TFLOP/s (2 M N K / time; {note})\n\n" + markdown_table(list(rows.values()), columns)


def plot(path: str, png: str) -> None:
    """Bars of TFLOP/s, one group per GEMM of the run at ``path``, one bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plot_host import save_figure

    meta, results = read_json(path)
    shapes, rates = [], {}
    for r in results:
        shape = f"{r.config.model} T={r.config.tokens}\n{dict(r.config.params)['proj']}"
        if shape not in shapes:
            shapes.append(shape)
        if r.ok:
            rates.setdefault(r.config.variant, {})[shape] = r.metrics["tflops"]
    fig, ax = plt.subplots(figsize=(11, 4.6))
    width = 0.8 / len(rates)
    for i, (variant, by_shape) in enumerate(rates.items()):
        xs = [j + (i - (len(rates) - 1) / 2) * width for j, shape in enumerate(shapes) if shape in by_shape]
        ax.bar(xs, [by_shape[s] for s in shapes if s in by_shape], width, label=variant)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.set_ylabel("TFLOP/s (2 M N K / time)")
    save_figure(fig, ax, f"the Gluon GEMM alone and its variants ({meta.get('device', '?')}, {meta.get('date', '?')})",
                png)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--cases", default=None, help='e.g. "deepseek_v3:8192;qwen3_30b_a3b:16384"')
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--routing", default="even", choices=ROUTINGS, help="rows per expert: M / E each, or routed")
    ap.add_argument("--plot", default=None, help="a run's JSON to draw (no GPU needed), with --png")
    ap.add_argument("--png", default=None, help="the figure --plot writes")
    args = ap.parse_args()
    if args.plot:
        if not args.png:
            ap.error("--plot needs --png (the figure to write)")
        plot(args.plot, args.png)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in UNEDITED and not set(v.split("+")) <= set(_EDITS)]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; expected {', '.join(UNEDITED)} or any of {sorted(_EDITS)} "
                 "joined by '+'")
    if not torch.cuda.is_available() or not ws_gemm.AVAILABLE:
        print("ws_gemm_limits: needs a CUDA GPU and Triton 3.6's Gluon", file=sys.stderr)
        return 1
    runner = Runner("ws_gemm_limits", args.out_dir)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        for name, tokens in (parse_sweep(args.cases) if args.cases else CASES).items():
            model = MODELS[name]
            for T in tokens:
                for proj in PROJS:
                    log(f"{name} T={T} {proj}")
                    run_shape(runner, model, T, proj, *gemm_shape(model, proj), variants, workdir, gen,
                              args.routing)
                    torch.cuda.empty_cache()  # the shape's tensors, freed on return
    runner.save(table(runner, variants))
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
