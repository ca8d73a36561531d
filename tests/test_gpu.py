"""CUDA-only tests (marked ``gpu``, skipped without a GPU; run them on the H200 with
``python -m pytest tests/test_gpu.py -q``).  Correctness against the CPU reference at
many shapes lives in ``tests/test_gpu_kernels.py``; these are the properties that need a
device: compile modes, AOTInductor on CUDA, determinism, 64-bit indexing, peak memory,
and a property test against the CPU reference."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8_moe_ops
from fp8_moe_ops.demo import plain_package_crashes

from helpers import LARGE_WEIGHTS, make_experts_inputs, random_fp8_weights, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
OPS = torch.ops.fp8_moe
# Hopper's fp8 MMA sums each K step in reduced precision before the float32 rescale:
# whole-layer outputs differ from the CPU reference by ~5e-3 (docs/benchmarks.md).
GPU_REL_BOUND = 2e-2


def _cuda(args):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _experts_module(E=8, H=256, I=128, static=False):
    g = torch.Generator().manual_seed(0)
    m = fp8_moe_ops.FP8Experts.from_float(torch.randn(E, 2 * I, H, generator=g) * 0.05,
                                          torch.randn(E, H, I, generator=g) * 0.05,
                                          block_size=(128, 128), dispatch="grouped")
    hidden = torch.randn(40, H, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(40, E, generator=g), -1), 2)
    if static:
        fp8_moe_ops.calibrate_static_scales(m, [(hidden, idx, w)])
    return m.cuda(), hidden.cuda(), idx.cuda(), w.cuda()


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
@pytest.mark.parametrize("static", [False, True])
def test_compile_modes_match_eager(mode, static):
    torch._dynamo.reset()
    m, hidden, idx, w = _experts_module(static=static)
    eager = m(hidden, idx, w)
    compiled = torch.compile(m, mode=mode)
    for _ in range(3):  # reduce-overhead records, then replays a CUDA graph
        assert torch.equal(compiled(hidden, idx, w), eager)


def _run_subprocess(code: str, tmp: str):
    # AOTInductor has crashed the process on CUDA: run in a child (which gets ``tmp`` as
    # argv[1]) so a crash is a test result, not a dead test run.  When the child dies
    # from a signal and a package of a plain nn.Linear crashes the same way, AOTInductor
    # itself is broken in this environment (torch 2.11.0+cu130 on the H200 machine,
    # docs/export.md): skip.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), tmp], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode < 0 and plain_package_crashes("cuda", tmp):
        pytest.skip(f"AOTInductor crashes (signal {-proc.returncode}) loading a plain nn.Linear CUDA package too")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_aoti_package_on_cuda(tmp_path):
    _run_subprocess("""
        import sys, torch, fp8_moe_ops
        from test_gpu import _experts_module
        m, hidden, idx, w = _experts_module(static=True)
        T = torch.export.Dim("T", min=1)
        ep = torch.export.export(m, (hidden, idx, w), dynamic_shapes=({0: T}, {0: T}, {0: T}))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1] + "/experts.pt2")
        runner = torch._inductor.aoti_load_package(path)
        for t in (40, 7, 1):
            assert torch.equal(runner(hidden[:t], idx[:t], w[:t]), m(hidden[:t], idx[:t], w[:t])), t
    """, str(tmp_path))


@pytest.mark.parametrize("static", [False, True])
def test_deterministic_run_to_run(static):
    args = _cuda(make_experts_inputs(3000, 64, 512, 256, 8, [128, 128], static=static))
    first = OPS.grouped_experts(**args)
    for _ in range(3):
        assert torch.equal(OPS.grouped_experts(**args), first)
    assert torch.equal(OPS.batched_experts(**args), first)


def test_index_arithmetic_is_64_bit():
    # S * K > 2^31 activation elements and E * N * K > 2^31 weight elements.
    E, N, K = 160, 2048, 7168            # 2.35e9 weight elements (2.3 GB fp8)
    S = 2**31 // K + 4096                # 2.18e9 activation elements (4.4 GB bf16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).mul_(0.05).to(torch.float8_e4m3fn)
    ws = torch.full((E, N // 128, K // 128), 0.5, device="cuda")
    x = torch.randn(S, K, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(E, dtype=torch.int64)
    counts[-1] = S - 8                   # the last expert's rows sit past 2^31 elements
    counts[0] = 8
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    out = OPS.grouped_mm(x, w, ws, offsets, [128, 128])
    for rows, e in ((slice(0, 8), 0), (slice(S - 8, S), E - 1)):
        ref = fp8_moe_ops.reference.linear(x[rows].cpu(), w[e].cpu(), ws[e].cpu(), [128, 128])
        assert rel_err(out[rows].cpu(), ref) < GPU_REL_BOUND


@LARGE_WEIGHTS
def test_peak_memory_is_output_plus_bounded_workspace():
    # deepseek_v3-sized layer: the weights (11 GB) must never be copied or expanded.
    T, E, H, I, k = 512, 256, 7168, 2048, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    gu = random_fp8_weights(E, 2 * I, H, gen, std=0.02)
    dp = random_fp8_weights(E, H, I, gen, std=0.02)
    gus = torch.ones(E, 2 * I // 128, H // 128, device="cuda")
    dps = torch.ones(E, H // 128, I // 128, device="cuda")
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device="cuda"), -1), k)
    OPS.grouped_experts(hidden, idx, w, gu, gus, dp, dps, [128, 128])  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    OPS.grouped_experts(hidden, idx, w, gu, gus, dp, dps, [128, 128])
    peak = torch.cuda.max_memory_allocated() - base
    S = T * k
    # output + quantised input + h (S, 2I) + quantised a (S, I) + y (S, H) + scales/ids
    bound = 2 * (T * H * 2 + T * H + S * 2 * I * 2 + S * I + S * H * 2) + (8 << 20)
    assert peak <= bound, (peak, bound)


@st.composite
def _cases(draw):
    return dict(T=draw(st.integers(0, 300)), E=draw(st.integers(1, 17)), H=draw(st.sampled_from([128, 200, 256])),
                I=draw(st.sampled_from([64, 128, 136])), k=draw(st.integers(1, 8)), block_size=[128, 128],
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
                scale_dtype=draw(st.sampled_from([torch.float32, torch.float8_e8m0fnu])),
                static=draw(st.booleans()), routing=draw(st.sampled_from(["uniform", "one", "sentinel"])),
                per_tensor=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_property_cuda_matches_cpu_reference(case):
    args = make_experts_inputs(**case)
    ref = OPS.grouped_experts(**args)
    got = OPS.grouped_experts(**_cuda(args)).cpu()
    assert torch.equal(got, OPS.batched_experts(**_cuda(args)).cpu())
    assert not torch.isnan(got).any()
    if case["T"]:
        assert rel_err(got, ref) < GPU_REL_BOUND


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("T,static", [(1, False), (1, True), (64, False), (300, True)])
def test_ops_on_another_gpu_than_the_current_one(T, static):
    # a model spread over GPUs in one process: the ops run on their tensors' GPU whichever
    # is current, through their launch plans and (up to 512 slots) plan graphs captured on
    # that GPU (six calls), equal to the same calls on the current GPU bitwise, and leave
    # the current device as it was
    from fp8_moe_ops.kernels import plans

    args = make_experts_inputs(T=T, E=7, H=256, I=192, k=4, block_size=[128, 128], static=static, seed=T)
    on = {d: {k: v.to(d) if isinstance(v, torch.Tensor) else v for k, v in args.items()} for d in ("cuda:0", "cuda:1")}
    x, w, ws = on["cuda:1"]["hidden"], on["cuda:1"]["gate_up_proj"][0], on["cuda:1"]["gate_up_scale_inv"][0]
    torch.cuda.set_device(0)
    for _ in range(6):
        want = OPS.grouped_experts(**on["cuda:0"])
        got = OPS.grouped_experts(**on["cuda:1"])
        assert got.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
        assert torch.equal(got.cpu(), want.cpu())
        lin = OPS.linear(x, w, ws, [128, 128])
        assert lin.device == torch.device("cuda:1")
        assert torch.equal(lin.cpu(), OPS.linear(x.to("cuda:0"), w.to("cuda:0"), ws.to("cuda:0"), [128, 128]).cpu())
    if T * 4 <= 512:  # graphs captured on the second GPU's own capture stream, on a workspace there
        assert isinstance(plans._CAPTURE_STREAMS.get((1, 0)), torch.cuda.ExternalStream)
        assert any(key[0] == 1 for key in plans._ARENAS)


def test_demo_on_cuda():
    # The whole demo: the pass on a dynamic, a static and a ModuleList loop, then
    # AOTInductor (the demo itself reports that step as skipped where AOTInductor
    # crashes on any package).
    # Last in the file: minutes on a cold machine, so a time-boxed run still gets the
    # kernel tests above (on 2026-11-30 a 420 s run was cut here, before them).
    proc = subprocess.run([sys.executable, "-m", "fp8_moe_ops", "demo"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout
