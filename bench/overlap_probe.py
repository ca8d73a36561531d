"""Can one warpgroup overlap the block-scaled rescale with its next MMAs on sm_90?  A probe.

    PYTHONPATH=. python bench/overlap_probe.py --out-dir OUT            # H200: time it
    PYTHONPATH=. python bench/overlap_probe.py --out-dir OUT --offline  # any machine: compile it

The grouped GEMM's K loop (:mod:`fp8_moe_ops.kernels.grouped_gemm`) waits for each K
step's MMAs before the float32 rescale ``acc += dot * scale``, so the tensor cores idle
while the FMAs run.  Triton 3.6 cannot do otherwise: its pipeliner keeps a ``tl.dot``
asynchronous only when nothing but another dot reads the result in the next iteration,
and ``tl.range(warp_specialize=True)`` does nothing on sm_90.  This script holds the same
GEMM written in Gluon (Triton's lower-level dialect, ``triton.experimental.gluon``): a
TMA + mbarrier ring of ``STAGES`` K steps, two K steps per trip, each step's MMAs into
their own registers (``use_acc=False``), the second step's MMAs issued before the first
step's rescale.  ``lag1`` waits only for the first step's MMAs before rescaling it (the
overlap); ``lag0`` waits for both.

``ws`` / ``ws6`` (4 / 6 ring slots) are the same GEMM warp-specialised: a producer
warp issues the TMA loads, two consumer warpgroups take 64 rows of the tile each and meet
only at the ring's mbarriers, so one rescales while the other's MMAs run (the structure
of the fastest Hopper GEMMs).  Every form takes the tile's column tiles first (grid axis
0), so a row tile's activations stay in L2.  ``ws`` became the package's prefill kernel
(``fp8_moe_ops/kernels/ws_gemm.py``, with the device-side tile map and the whole
contract); the probe's ``ws`` forms use its producer warp.

``--offline`` compiles every form for sm_90a (as ``kernel_resources.py`` does) and
reports registers, warps, shared memory, ptxas' C7514 warning (wgmma serialised) and,
for ``lag1``, how many FFMAs per thread the SASS keeps before the next step's wait.
Without ``--offline`` (CUDA): on the gate_up / down shapes of the three benchmark layers
(uniform routing, rows per expert a multiple of 128, activations in expert order; the
tile map is built on the host), the GEMM kernel time of every form, of
``torch.ops.fp8_moe.grouped_mm``'s kernel on the same fp8 bytes and scales (its own
quantisation), and of cuBLAS's dense block-scaled GEMM (``gemm_ceiling.dense_blockwise``),
and whether each output equals ``grouped_mm``'s bitwise.  Writes ``OUT/overlap_probe.json`` /
``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from common import MODELS, ExperimentConfig, Runner, gemm_shape, log, make_weights, markdown_table
from fp8_moe_ops.kernels.gluon_gemm import load_tile, ring  # the shipped kernel's ring and its TMA loads

CASES = [("deepseek_v3", 8192, "down"), ("deepseek_v3", 8192, "gate_up"), ("qwen3_30b_a3b", 16384, "down"),
         ("qwen3_30b_a3b", 16384, "gate_up"), ("mixtral_8x7b", 16384, "down"), ("mixtral_8x7b", 16384, "gate_up")]
BM = BN = BK = 128
STAGES = 4
WARPS = 8


@gluon.jit
def _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, BN: gl.constexpr):
    """The program's first column, expert, rows [row0, row1) and first weight row (in
    the (E * N, K) view).  Column tiles first (grid axis 0): a row tile's A stays in L2
    for all of them."""
    n0 = gl.program_id(0) * BN
    pid_m = gl.program_id(1)
    e = gl.load(tile_e_ptr + pid_m)
    return n0, e, gl.load(tile_r0_ptr + pid_m), gl.load(tile_r1_ptr + pid_m), e * N + n0


@gluon.jit
def _refill(a_desc, w_desc, a_smem, w_smem, bars, step, row0, wrow, KT, STAGES: gl.constexpr):
    """Load K step ``step`` (if there is one) into its ring slot."""
    s = step % STAGES
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    mbarrier.expect(bars.index(s), nbytes, pred=step < KT)
    tma.async_copy_global_to_shared(a_desc, [row0, step * a_desc.block_type.shape[1]], bars.index(s), a_smem.index(s),
                                    pred=step < KT)
    tma.async_copy_global_to_shared(w_desc, [wrow, step * a_desc.block_type.shape[1]], bars.index(s), w_smem.index(s),
                                    pred=step < KT)


@gluon.jit
def _mma_step(a_smem, w_smem, bars, step, zero, STAGES: gl.constexpr):
    s = step % STAGES
    mbarrier.wait(bars.index(s), (step // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), w_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def probe_gemm_kernel(a_desc, w_desc, as_ptr, ws_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, KT, NB,
                      STAGES: gl.constexpr, LAG: gl.constexpr, num_warps: gl.constexpr):
    """out[r, n] = sum_k a[r, k] w[e, n, k] * a_s[r, k // 128] * w_s[e, n // 128, k // 128] for the rows
    [row0, row1) of program pid_m's tile (expert e); KT (K / 128) even."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    n0, e, row0, row1, wrow = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, BN)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 32])
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        _refill(a_desc, w_desc, a_smem, w_smem, bars, j, row0, wrow, KT, STAGES)

    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    rmask = rows < row1
    as_row = as_ptr + rows.to(gl.int64) * KT
    ws_row = ws_ptr + (e * NB + n0 // 128) * KT
    acc = gl.zeros((BM, BN), gl.float32, mma)
    zero = gl.zeros((BM, BN), gl.float32, mma)
    for jj in range(KT // 2):
        i = 2 * jj
        t0 = _mma_step(a_smem, w_smem, bars, i, zero, STAGES)
        t1 = _mma_step(a_smem, w_smem, bars, i + 1, zero, STAGES)
        scale0 = gl.load(as_row + i, mask=rmask, other=0.0) * gl.load(ws_row + i)
        scale1 = gl.load(as_row + i + 1, mask=rmask, other=0.0) * gl.load(ws_row + i + 1)
        p0 = warpgroup_mma_wait(num_outstanding=LAG, deps=(t0, ))  # LAG=1: step i + 1's MMAs may still run
        _refill(a_desc, w_desc, a_smem, w_smem, bars, i + STAGES, row0, wrow, KT, STAGES)
        acc = acc + p0 * scale0[:, None]
        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1, acc))[0]
        _refill(a_desc, w_desc, a_smem, w_smem, bars, i + 1 + STAGES, row0, wrow, KT, STAGES)
        acc = acc + p1 * scale1[:, None]
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


@gluon.jit
def _ws_consumer(a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, row0, row1, e, n0, N, KT, NB,
                 HALF: gl.constexpr, STAGES: gl.constexpr):
    HM: gl.constexpr = a_smem.type.shape[1] // 2
    BN: gl.constexpr = w_smem.type.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows = row0 + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
    rmask = rows < row1
    as_row = as_ptr + rows.to(gl.int64) * KT
    ws_row = ws_ptr + (e * NB + n0 // 128) * KT
    acc = gl.zeros((HM, BN), gl.float32, mma)
    zero = gl.zeros((HM, BN), gl.float32, mma)
    for i in range(KT):
        s = i % STAGES
        scale = gl.load(as_row + i, mask=rmask, other=0.0) * gl.load(ws_row + i)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        t = warpgroup_mma(a_smem.index(s).slice(HALF * HM, HM, dim=0), w_smem.index(s).permute((1, 0)), zero,
                          use_acc=False, is_async=True)
        t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + t * scale[:, None]
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


@gluon.jit
def _ws_producer(a_desc, w_desc, a_smem, w_smem, ready, empty, row0, wrow, KT, STAGES: gl.constexpr):
    """The producer warp of one tile: its K steps' TMA loads into the ring."""
    load_tile(a_desc, w_desc, a_smem, w_smem, ready, empty, row0, wrow, KT, gl.to_tensor(0), STAGES)


@gluon.jit
def ws_gemm_kernel(a_desc, w_desc, as_ptr, ws_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, KT, NB,
                   STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """The same GEMM warp-specialised: a producer warp issues the TMA loads into the ring,
    two consumer warpgroups (the default partition's 4 warps and 4 more) each take 64 rows
    of the tile and wait for their own MMAs, then release the slot (``empty``, two
    arrivals) and rescale, so one rescales while the other's MMAs run; they meet only at
    the ring's mbarriers."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    n0, e, row0, row1, wrow = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, BN)
    a_smem, w_smem, ready, empty = ring(a_desc, w_desc, STAGES)
    gl.warp_specialize([
        (_ws_consumer, (a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, row0, row1, e, n0, N, KT, NB, 0, STAGES)),
        (_ws_consumer, (a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, row0, row1, e, n0, N, KT, NB, 1, STAGES)),
        (_ws_producer, (a_desc, w_desc, a_smem, w_smem, ready, empty, row0, wrow, KT, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 40])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(empty.index(j))


# form -> (kernel, its compile-time arguments, warps of the launch)
FORMS = {"lag0": (probe_gemm_kernel, {"STAGES": STAGES, "LAG": 0}, WARPS),
         "lag1": (probe_gemm_kernel, {"STAGES": STAGES, "LAG": 1}, WARPS),
         "ws": (ws_gemm_kernel, {"STAGES": STAGES, "CONSUMER_REGS": 232}, 4),
         "ws6": (ws_gemm_kernel, {"STAGES": 6, "CONSUMER_REGS": 232}, 4)}


def _layouts():
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv))


def offline(form: str) -> dict:
    """One form compiled for sm_90a here: registers, ptxas' serialisation warning, and
    (for the lagged form) how many FFMAs the SASS keeps before the next step's wait."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel, consts, warps = FORMS[form]
    al, wl = _layouts()
    sig = {"a_desc": f"tensordesc<fp8e4nv[{BM}, {BK}],{al!r}>", "w_desc": f"tensordesc<fp8e4nv[{BN}, {BK}],{wl!r}>",
           "as_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16", "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32",
           "tile_r1_ptr": "*i32", "N": "i32", "KT": "i32", "NB": "i32"}
    sig.update({name: "constexpr" for name in consts}, num_warps="constexpr")
    attrs = {(i, ): [["tt.divisibility", 16]] for i in range(2, 9)}
    compiled = triton.compile(GluonASTSource(kernel, sig, {**consts, "num_warps": warps}, attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    tools = os.path.dirname(triton.knobs.nvidia.ptxas.path)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    # the K loop's waits (with their argument: 0x1 = at most one group in flight) and FFMAs, in order
    seq = re.findall(r"(WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x\d|FFMA)\b", sass)
    lag_wait = next((i for i, op in enumerate(seq) if op.endswith("0x1")), None)
    overlapped = None
    if lag_wait is not None:  # FFMAs after the wait for step i, before the wait for step i + 1
        nxt = next(i for i in range(lag_wait + 1, len(seq)) if seq[i].startswith("WARPGROUP"))
        overlapped = nxt - lag_wait - 1
    return {"registers": int(re.findall(r"Used (\d+) registers", report)[-1]), "warps": compiled.metadata.num_warps,
            "shared_bytes": compiled.metadata.shared, "serialised": "C7514" in report, "ffma_overlapped": overlapped}


def timed(model, T: int, proj: str, gen: torch.Generator) -> dict:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp8_moe_ops.kernels.moe import _quantize
    from gemm_ceiling import dense_blockwise, gemm_kernel_ms

    N, K = gemm_shape(model, proj)
    M = T * model.top_k
    rows = M // model.E
    flops = 2 * M * N * K
    w, ws = make_weights(model.E, N, K, gen)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, model.E + 1, device="cuda", dtype=torch.int32) * rows
    a, sa = _quantize(x, 128, M)  # the op's own quantisation: same fp8 bytes and scales
    assert sa.shape == (M, K // BK) and sa.is_contiguous()
    ours = lambda: torch.ops.fp8_moe.grouped_mm(x, w, ws, offsets, [128, 128])  # noqa: E731
    ref = ours()
    res = {"M": M, "N": N, "K": K, "ours_ms": gemm_kernel_ms(ours)}
    tiles = [(e, r0, (e + 1) * rows) for e in range(model.E) for r0 in range(e * rows, (e + 1) * rows, BM)]
    te, t0, t1 = (torch.tensor(col, dtype=torch.int32, device="cuda") for col in zip(*tiles))
    al, wl = _layouts()
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], al)
    w_desc = TensorDescriptor.from_tensor(w.view(model.E * N, K), [BN, BK], wl)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    for form, (kernel, consts, warps) in FORMS.items():
        def probe(kernel=kernel, consts=consts, warps=warps):
            kernel[(triton.cdiv(N, BN), len(tiles))](a_desc, w_desc, sa, ws, out, te, t0, t1, N, K // BK, ws.shape[1],
                                                     **consts, num_warps=warps)
        out.zero_()
        probe()
        res[f"{form}_ms"] = gemm_kernel_ms(probe)
        res[f"{form}_max_diff"] = float((out.float() - ref.float()).abs().max())
        res[f"{form}_bitwise"] = torch.equal(out, ref)
    res["cublas_ms"] = dense_blockwise(a, sa, w[0], ws[0], flops)["ms"]
    for key in [k for k in res if k.endswith("_ms")]:
        res[key[:-3] + "_tflops"] = flops / res[key] / 1e9
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU needed)")
    args = p.parse_args()
    runner = Runner("overlap_probe", args.out_dir)
    if args.offline:
        for form in FORMS:
            runner.run(ExperimentConfig("overlap_probe", "-", 0, form), lambda form=form: offline(form))
        cols = [("form", "variant", ""), ("registers", "registers", ""), ("warps", "warps", ""),
                ("shared B", "shared_bytes", ""), ("ptxas serialised wgmma", "serialised", ""),
                ("FFMA per thread before the wait for the next step", "ffma_overlapped", "")]
    else:
        gen = torch.Generator(device="cuda").manual_seed(0)
        for name, T, proj in CASES:
            runner.run(ExperimentConfig("overlap_probe", name, T, proj), lambda: timed(MODELS[name], T, proj, gen))
            torch.cuda.empty_cache()
        cols = [("model", "model", ""), ("T", "tokens", ""), ("GEMM", "variant", ""), ("M", "M", ""), ("N", "N", ""),
                ("K", "K", ""), ("ours TFLOP/s", "ours_tflops", ".0f")]
        cols += [(form, f"{form}_tflops", ".0f") for form in FORMS]
        cols += [("cuBLAS dense", "cublas_tflops", ".0f")]
        cols += [(f"{form} bitwise", f"{form}_bitwise", "") for form in FORMS]
    text = markdown_table([r.flat() for r in runner.results], cols + [("error", "error", "")])
    runner.save(text)
    log(text)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
