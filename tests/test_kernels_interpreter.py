"""The Triton kernels run on CPU under ``TRITON_INTERPRET=1``, against the reference.

``triton.jit`` decides at decoration time whether a function is interpreted, Triton's
own ``tl.sum`` / ``tl.cdiv`` / ... included (decorated when ``triton`` is imported).
``conftest.py`` sets the variable for the session on a machine without a GPU, before
any test imports Triton.  On a GPU machine Triton runs compiled: this module's tests
are skipped in that process and :func:`test_in_fresh_interpreter_process` runs this
file in a fresh process with the variable set, so the suite checks the kernels either
way.  Tiny shapes and small blocks ([16, 16], [32, 32]) keep the interpreter fast.

Interpreter caveats (docs/notes.md): its float32 -> e4m3 cast is wrong (126.24 -> 64,
ties away from zero, subnormals -> 0, NaN -> a number) and its float32 -> bf16 cast
truncates.  Under the interpreter the kernels never rely on either: they round in
float32 / integer arithmetic (``round_to_e4m3``, ``round_to``) and only cast exact
values (on the GPU those helpers are the cast instructions, which round as torch
does).  So the quantised bytes are compared *bitwise* with torch here, and the GEMM
outputs differ from the reference only by float32 summation order (at most one ulp
of the output dtype after rounding).  ``tests/test_gpu_kernels.py`` (marked ``gpu``)
repeats these checks on the H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from helpers import (FAKE_HEAD, division_cases, division_matches, fma_cases, fresh_graph_workspaces,
                     make_expert_weights, make_routing, record_with_fake_launchers, rel_err, replay_keeping_workspace, row_experts, run_elementwise,
                     static_scale_cases, static_slot_ids, with_split_k)

INTERPRETED = isinstance(tl.cdiv, InterpretedFunction)
if INTERPRETED:
    from fp8_moe_ops import kernels, reference
    from fp8_moe_ops.kernels import experts, gemms, moe, quant
    from fp8_moe_ops.kernels.grouped_gemm import _grouped_gemm_kernel
    from fp8_moe_ops.kernels import sort
    from fp8_moe_ops.kernels.sort import _sort_quant_kernel
    from fp8_moe_ops.kernels.quant import expert_of_rows

    @triton.jit
    def _expert_of_rows_kernel(offsets_ptr, out_ptr, R, E, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.arange(0, BLOCK)
        tl.store(out_ptr + rows, expert_of_rows(rows, offsets_ptr, E, SEARCH_STEPS), mask=rows < R)
else:
    from fp8_moe_ops import reference



@pytest.fixture(autouse=True)
def _interpreted_only(request):
    if not INTERPRETED and request.node.name != "test_in_fresh_interpreter_process":
        pytest.skip("Triton runs compiled in this process (a GPU machine); "
                    "test_in_fresh_interpreter_process runs this file in a new process")


E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the kernels interpreted")
def test_in_fresh_interpreter_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "1 skipped" in summary, summary  # skipped: this test, in the child


def test_kernels_are_interpreted():
    # a compiled kernel cannot run on CPU tensors
    assert isinstance(_grouped_gemm_kernel, InterpretedFunction)


# --------------------------------------------------------------------------- builders


def _weights(gen, E, N, K, block, scale_dtype=torch.float32, per_tensor=False):
    return make_expert_weights(E, N, K, block, scale_dtype, per_tensor, gen=gen)


def _ulp_close(out, ref):
    """Equal up to one unit of the output dtype (float32 summation order, then
    rounding), with a tiny absolute slack for cancellation near zero."""
    eps = torch.finfo(out.dtype).eps
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=1e-5 * scale + 1e-30)


# --------------------------------------------------------------------------- quantisation


def _e4m3_edge_values():
    """Every finite e4m3 value, the midpoints between neighbours (ties: round to
    even), one float32 ulp either side of each midpoint, subnormals, +-0, +-448 and
    values past it (saturate)."""
    grid = torch.arange(0, 256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    ups, downs = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    v = torch.cat([grid, mids, ups, downs, torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-3, 126.24, 17.0])])
    return v


def test_static_quantisation_rounds_like_torch_bitwise():
    # one row per value, scale 1: every e4m3 rounding case incl. the interpreter's bad ones
    v = _e4m3_edge_values()
    x = v[:, None].expand(-1, 16).contiguous()
    offsets = torch.tensor([x.shape[0]], dtype=torch.int32)
    scale = torch.ones(1)
    q, _ = moe._quantize(x, 16, x.shape[0], offsets=offsets, act_scale=scale)
    ref = reference.quantize_act_static(x, scale)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))


def test_fma_rn_rounds_once():
    # the interpreter's tl.fma rounds the product first: fma_rn must not
    a, b, c, want = fma_cases()
    assert torch.equal(run_elementwise(a, b, c).view(torch.int32), want.view(torch.int32))
    assert not torch.equal((a * b + c).view(torch.int32), want.view(torch.int32))


def test_division_by_reciprocal_is_ieee_bitwise():
    # the quantisations' division: reciprocal once, two fma steps; torch's CPU division is IEEE
    x, d = division_cases()
    assert division_matches(run_elementwise(x, d), x, d)
    assert not division_matches(x * (1 / d), x, d)


def test_static_quantisation_at_any_scale_bitwise():
    # scales inside the fast division's bounds and outside them, several in a row block
    x, offsets, scales = static_scale_cases(16)
    q, _ = moe._quantize(x, 16, x.shape[0], offsets=offsets, act_scale=scales)
    ref = reference.quantize_act_static(x, scales[row_experts(offsets)][:, None])
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))


def test_static_slot_quantisation_at_any_scale_bitwise():
    # each token into its slots (the prefill path): slot 0 with its rows' scale (quotients
    # on the rounding boundaries), slot 1 another expert's, slot 2 no expert (skipped)
    x, offsets, scales = static_scale_cases(16)
    T, E = x.shape[0], scales.numel()
    ids = static_slot_ids(offsets)
    q = torch.zeros(T * 3, 16, dtype=FP8)
    moe.launch(moe._quant_call(x, q, scales, T, 16, static=True, topk=3, ids=ids, num_experts=E))
    q = q.view(T, 3, 16)
    for j in range(2):
        ref = reference.quantize_act_static(x, scales[ids[:, j].long()][:, None])
        assert torch.equal(q[:, j].view(torch.uint8), ref.view(torch.uint8)), j
    assert not q[:, 2].view(torch.uint8).any()


def test_dynamic_quantisation_of_extreme_magnitudes_bitwise():
    # group scales inside the fast division's bounds, at them and past them (2^-70, 2^70)
    gen = torch.Generator().manual_seed(5)
    mags = torch.tensor([2.0 ** -70, 2.0 ** -52, 1e-30, 1.0, 2.0 ** 51, 1e30, 2.0 ** 70, 3e36])
    x = torch.randn(8, 64, generator=gen) * mags[:, None]
    x[:, 16:32] *= 2.0 ** -20  # a group whose scale differs from its neighbours'
    q, s = moe._quantize(x, 16, 8)
    rq, rs = reference.quantize_act_dynamic(x, 16)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


@pytest.mark.parametrize("gpp", [2, 4])
def test_quantisation_programs_looping_over_k_groups_bitwise(gpp):
    # at prefill a static program quantises several K groups one after the other (its
    # rows' indices, experts, scales and reciprocals loaded once: quant.groups_per_program);
    # at interpreter shapes only with the launch's program floor lowered.  Three groups: 4
    # a program takes them all and skips a fourth; 2 leaves the second program one to do
    # and one to skip.  Static slots (scales in and out of the reciprocal's bounds) and
    # sorted rows; the dynamic forms (slots stored at their sorted rows, and rows) keep a
    # group a program.
    x, offsets, scales = static_scale_cases(48)
    T, E = x.shape[0], scales.numel()
    ids = static_slot_ids(offsets)
    dest = torch.randperm(T * 3, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    gen = torch.Generator().manual_seed(2)
    xd = torch.randn(T, 48, generator=gen) * torch.logspace(-3, 3, 48)
    xd[0, :16] = 0  # an all-zero group
    rq, rs = reference.quantize_act_dynamic(xd, 16)
    for rows, slots in ((T, 3), (T, 1)):
        (row_blocks, groups), _, _ = quant.quant_launch_shape(rows, 48, 16, slots)
        with mock.patch.object(quant, "QUANT_MIN_PROGRAMS", row_blocks * groups // gpp):
            q = torch.zeros(T * 3, 48, dtype=FP8)
            qd, sd = torch.zeros(T * 3, 48, dtype=FP8), torch.zeros(T * 3, 3)
            calls = [moe._quant_call(x, q, scales, T, 16, static=True, topk=3, ids=ids, num_experts=E),
                     moe._quant_call(xd, qd, sd, T, 16, topk=3, ids=ids, num_experts=E, dest=dest)]
            if slots == 1:
                calls = [moe._quant_call(x, q[:T], scales, T, 16, offsets=offsets, static=True),
                         moe._quant_call(xd, qd[:T], sd[:T], T, 16)]
            assert [(c.constexprs["GPP"], c.grid[1]) for c in calls] == [(gpp, 3 // gpp + 1), (1, 3)]
            for call in calls:
                moe.launch(call)
        if slots == 3:
            q = q.view(T, 3, 48)
            for j in range(2):
                ref = reference.quantize_act_static(x, scales[ids[:, j].long()][:, None])
                assert torch.equal(q[:, j].view(torch.uint8), ref.view(torch.uint8)), j
                assert torch.equal(qd[dest.view(T, 3)[:, j].long()].view(torch.uint8), rq.view(torch.uint8)), j
                assert torch.equal(sd[dest.view(T, 3)[:, j].long()], rs), j
        else:
            ref = reference.quantize_act_static(x, scales[row_experts(offsets)][:, None])
            assert torch.equal(q[:T].view(torch.uint8), ref.view(torch.uint8))
            assert torch.equal(qd[:T].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sd[:T], rs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,K,group", [
    (1, 16, 16),   # T=1
    (7, 40, 16),   # K not a multiple of the group (tail group of 8)
    (5, 96, 32),   # several groups
])
def test_dynamic_quantisation_bitwise(dtype, T, K, group):
    gen = torch.Generator().manual_seed(T * K)
    x = (torch.randn(T, K, generator=gen) * torch.logspace(-3, 3, K)).to(dtype)
    x[0, :group] = 0  # all-zero group: scale 0, q 0, no NaN
    q, s = moe._quantize(x, group, T)
    rq, rs = reference.quantize_act_dynamic(x, group)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    assert s[0, 0] == 0 and not q.float().isnan().any()


def test_nan_and_inf_quantise_to_torch_bytes():
    # dynamic: a NaN makes its group's scale and bytes NaN (torch's amax keeps NaN), an inf
    # its group's scale inf and itself NaN; static: NaN stays NaN (sign kept), inf saturates
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2))
    x[0, 3], x[1, 20], x[2, 40] = float("nan"), -float("nan"), float("inf")
    q, s = moe._quantize(x, 16, 4)
    rq, rs = reference.quantize_act_dynamic(x, 16)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    assert s.isnan().sum() == 2 and q.float().isnan().sum() == 33
    one = torch.ones(1)
    q, _ = moe._quantize(x, 16, 4, offsets=torch.tensor([4], dtype=torch.int32), act_scale=one)
    assert torch.equal(q.view(torch.uint8), reference.quantize_act_static(x, one).view(torch.uint8))


# --------------------------------------------------------------------------- GEMMs

_GEMM_CASES = {
    # name: (S, E, N, K, block)
    "T1": (1, 3, 40, 48, [16, 16]),
    "T_lt_block_prime_E": (9, 5, 24, 40, [16, 16]),  # K, N not multiples of the block
    "block32": (20, 3, 70, 96, [32, 32]),
    "bn_ne_bk": (12, 2, 50, 64, [48, 32]),  # bn not a power of two, bn != bk
}


@pytest.mark.parametrize("case", list(_GEMM_CASES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32", "ue8m0"])
def test_linear(case, static, scale_dtype):
    S, _, N, K, block = _GEMM_CASES[case]
    gen = torch.Generator().manual_seed(S + N)
    w, ws = _weights(gen, 1, N, K, block, scale_dtype)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    a = torch.tensor([0.01]) if static else None
    for out_dtype in (None, torch.float32):
        out = kernels.linear(x, w[0], ws[0], block, a, out_dtype)
        ref = reference.linear(x, w[0], ws[0], block, a, out_dtype)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        _ulp_close(out, ref)


def _counts_to_offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts,S", [
    ([3, 0, 5], 8),          # an expert with no rows
    ([0, 0, 9], 9),          # all rows on the last expert
    ([2, 1, 1, 3, 0, 4, 2], 17),  # prime E = 7, rows past offsets[-1] (-> zeros)
    ([1], 1),                # T = 1, E = 1
    ([0, 0], 3),             # no row belongs to any expert: all zeros
])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["blocks", "per_tensor"])
def test_grouped_mm(counts, S, static, per_tensor):
    E, N, K, block = len(counts), 24, 40, [16, 16]
    gen = torch.Generator().manual_seed(S * 31 + E)
    w, ws = _weights(gen, E, N, K, block, per_tensor=per_tensor)
    x = torch.randn(S, K, generator=gen).to(torch.float16)
    offsets = _counts_to_offsets(counts)
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    out = kernels.grouped_mm(x, w, ws, offsets, block, a)
    ref = reference.grouped_mm(x, w, ws, offsets, block, a)
    _ulp_close(out, ref)
    tail = int(offsets[-1])
    assert torch.equal(out[tail:], torch.zeros_like(out[tail:]))  # written, as zeros


def test_grouped_mm_scales_kmajor_past_max_slots_equal_row_major_bitwise():
    # past MAX_SLOTS rows (lowered here to an interpreter-sized 16) grouped_mm lays its
    # dynamic scales out K-group major, as the Hopper GEMM reads them fastest; the Triton
    # kernel reads them through their strides: the same output as row-major, bitwise
    E, S, N, K, block = 3, 37, 24, 40, [16, 16]
    gen = torch.Generator().manual_seed(37)
    w, ws = _weights(gen, E, N, K, block)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    offsets = _counts_to_offsets([11, 0, 20])
    launched = []
    real = gemms._gemm_call

    def spy(q, q_scale, *a, **k):
        launched.append(q_scale.stride())
        return real(q, q_scale, *a, **k)

    with mock.patch.object(gemms, "_gemm_call", spy):
        row_major = kernels.grouped_mm(x, w, ws, offsets, block)
        with mock.patch.object(gemms, "MAX_SLOTS", 16):
            kmajor = kernels.grouped_mm(x, w, ws, offsets, block)
    assert launched == [(3, 1), (1, 37)]
    assert torch.equal(kmajor, row_major) and row_major[:31].abs().sum() > 0
    _ulp_close(kmajor, reference.grouped_mm(x, w, ws, offsets, block))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32", "ue8m0"])
def test_batched_mm_with_sentinels(static, scale_dtype):
    E, S, N, K, block = 5, 19, 40, 48, [16, 16]
    gen = torch.Generator().manual_seed(7)
    w, ws = _weights(gen, E, N, K, block, scale_dtype)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (S,), generator=gen).to(torch.int32)
    ids[1] = 3  # expert 2 gets no row
    ids[ids == 2] = -1
    ids[::5] = E  # sentinels
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    out = kernels.batched_mm(x, w, ws, ids, block, a)
    ref = reference.batched_mm(x, w, ws, ids, block, a)
    _ulp_close(out, ref)
    sentinel = (ids < 0) | (ids >= E)
    assert torch.equal(out[sentinel], torch.zeros_like(out[sentinel]))


@pytest.mark.parametrize("BN", [16, 32, 64], ids=["tile_in_block", "tile_is_block", "tile_spans_blocks"])
@pytest.mark.parametrize("BM", [16, 64], ids=["rows16", "rows64"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32", "ue8m0"])
def test_weight_scale_per_tile_and_per_column(monkeypatch, BN, BM, static, scale_dtype):
    # bn = 32: BN = 16 / 32 take one weight scale per tile and K step
    # (W_SCALE_PER_TILE), BN = 64 one per column; N = 72 leaves a partial block.
    # Tiles of 64 rows load the dynamic scheme's scales a K step ahead
    E, S, N, K, block = 3, 11, 72, 40, [32, 16]
    gen = torch.Generator().manual_seed(BN + BM)
    w = torch.randn(E, N, K, generator=gen) * 0.1
    w[2, 32:64] *= 16  # neighbouring scale blocks differ a lot (UE8M0 too): a mixed-up block shows
    w[:, :, 16:32] /= 8  # and so do neighbouring K groups: a scale of the wrong K step shows
    w, ws = reference.quantize_weight_blockwise(w, block, scale_dtype)
    x = torch.randn(S, K, generator=gen)
    x[:, 32:] *= 64  # the last K group (partial: K = 40) has its own activation scales
    x = x.to(torch.bfloat16)
    offsets = _counts_to_offsets([4, 0, 6])  # an empty expert, one row past the last
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    monkeypatch.setattr(moe, "gemm_config", lambda *_: dict(BM=BM, BN=BN, GROUP_M=8, num_warps=4, num_stages=2))
    out = kernels.grouped_mm(x, w, ws, offsets, block, a)
    _ulp_close(out, reference.grouped_mm(x, w, ws, offsets, block, a))


@pytest.mark.parametrize("op", ["linear", "grouped_mm", "batched_mm"])
def test_gemm_zero_rows(op):
    # T = 0: an empty (0, N) result, no launch
    w, ws = _weights(torch.Generator().manual_seed(0), 2, 24, 32, [16, 16])
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    if op == "linear":
        out = kernels.linear(x, w[0], ws[0], [16, 16])
    elif op == "grouped_mm":
        out = kernels.grouped_mm(x, w, ws, torch.zeros(2, dtype=torch.int32), [16, 16])
    else:
        out = kernels.batched_mm(x, w, ws, torch.zeros(0, dtype=torch.long), [16, 16])
    assert out.shape == (0, 24) and out.dtype == torch.bfloat16


# --------------------------------------------------------------------------- experts

_EXPERT_CASES = {
    # name: (T, E, H, I, k, block, routing)
    "T1": (1, 4, 48, 32, 2, [16, 16], "uniform"),
    "T_lt_block_prime_E": (5, 7, 40, 24, 3, [16, 16], "uniform"),  # H, I not multiples of 16
    "empty_expert": (9, 4, 48, 40, 2, [16, 16], "empty"),  # experts 0 and 2 get no token
    "one_expert": (11, 3, 32, 16, 2, [16, 16], "one"),  # all tokens on the last expert
    "sentinels": (12, 5, 48, 24, 3, [16, 16], "sentinel"),
    "block32": (6, 3, 96, 48, 2, [32, 32], "uniform"),  # I = 48: a tail group of 16
}


def _experts_args(case, dtype, scale_dtype, static, per_tensor=False, seed=0):
    T, E, H, I, k, block, kind = _EXPERT_CASES[case] if isinstance(case, str) else case
    gen = torch.Generator().manual_seed(seed)
    gu, gus = _weights(gen, E, 2 * I, H, block, scale_dtype, per_tensor)
    dp, dps = _weights(gen, E, H, I, block, scale_dtype, per_tensor)
    idx, wts = make_routing(T, k, E, kind, gen=gen)
    args = [torch.randn(T, H, generator=gen).to(dtype), idx, wts, gu, gus, dp, dps, block]
    kw = {}
    if static:  # plausible calibrated scales, small enough that some values saturate
        kw = dict(gate_up_act_scale=torch.rand(E, generator=gen) * 0.005 + 0.004,
                  down_act_scale=torch.rand(E, generator=gen) * 0.0005 + 0.0003)
    return args, kw


def _check_experts(args, kw):
    # the activation in the gate_up GEMM's launch at every S the combine is fused at
    with mock.patch.object(experts, "ACT_SLOTS", experts.COMBINE_SLOTS):
        out = kernels.grouped_experts(*args, **kw)
    ref = reference.grouped_experts(*args, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    # A one-ulp difference in h (summation order) can move one element of the
    # re-quantised activation by one e4m3 step (6%): a relative bound, not bitwise.
    # Indexing or scaling bugs give errors of order 1.
    assert rel_err(out, ref) < 1e-2
    idx = args[1]
    E = args[3].shape[0]
    none = ((idx < 0) | (idx >= E)).all(dim=1)
    assert torch.equal(out[none], torch.zeros_like(out[none]))  # sentinel-only tokens: exactly 0
    # the activation in the gate_up GEMM's launch and the combine in the down GEMM's (these
    # S are all <= COMBINE_SLOTS) and their standalone kernels (larger S): the same arithmetic
    assert args[1].numel() <= experts.COMBINE_SLOTS
    with mock.patch.object(experts, "COMBINE_SLOTS", 0):
        assert torch.equal(kernels.grouped_experts(*args, **kw), out)
    return out


@pytest.mark.parametrize("case", list(_EXPERT_CASES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_experts_shapes(case, static):
    args, kw = _experts_args(case, torch.bfloat16, torch.float32, static)
    out = _check_experts(args, kw)
    # the path of S > MAX_SLOTS: the three-launch sort, then the quantisation in its own launch
    with mock.patch.object(experts, "COMBINE_SLOTS", 0), mock.patch.object(experts, "MAX_SLOTS", 0):
        assert torch.equal(kernels.grouped_experts(*args, **kw), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32", "ue8m0"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["blocks", "per_tensor"])
def test_experts_dtypes_and_scales(dtype, scale_dtype, per_tensor):
    _check_experts(*_experts_args("sentinels", dtype, scale_dtype, static=False, per_tensor=per_tensor, seed=3))


@pytest.mark.parametrize("activation,limit", [("silu", 0.5), ("gelu", None), ("gelu_tanh", None), ("relu", 1.0)])
def test_experts_activations(activation, limit):
    args, kw = _experts_args("T_lt_block_prime_E", torch.bfloat16, torch.float32, static=True, seed=5)
    args = args + [activation]
    kw["swiglu_limit"] = limit
    _check_experts(args, kw)


def test_experts_int32_ids_and_bf16_weights():
    args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, static=False, seed=9)
    args[1] = args[1].to(torch.int32)
    args[2] = args[2].to(torch.bfloat16)
    _check_experts(args, kw)


_SPLIT_CASES = {  # I = 88: 6 K steps of 16, the last one partial
    "sentinels": (7, 5, 40, 88, 3, [16, 16], "sentinel"),
    "empty_expert": (6, 4, 48, 88, 2, [16, 16], "empty"),
    "T1": (1, 8, 40, 88, 2, [16, 16], "uniform"),
}


# 7: one K step per range and an empty last range; 4: ranges of two steps, the last range's
# both past K, which 64-row tiles (the dynamic scheme's scales loaded a step ahead) read
@pytest.mark.parametrize("split,rows", [(2, None), (7, None), (4, 64)], ids=["2", "7", "4_rows64"])
@pytest.mark.parametrize("case", list(_SPLIT_CASES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_experts_split_k_down(case, static, split, rows, monkeypatch):
    # the down GEMM's K in ranges (decode with few experts): float32 partials that the
    # fused combine adds in order, then rounds
    real = moe.gemm_config
    monkeypatch.setattr(moe, "gemm_config", with_split_k(real, split, rows))
    args, kw = _experts_args(_SPLIT_CASES[case], torch.bfloat16, torch.float32, static, seed=split)
    E, H, I = args[3].shape[0], args[0].shape[1], args[5].shape[2]
    # the down scale grid inside NaN columns: a K step past I must not read a scale
    dps = args[6]
    padded = torch.full((*dps.shape[:2], dps.shape[2] + 4), float("nan"))
    padded[..., :dps.shape[2]] = dps
    args[6] = padded[..., :dps.shape[2]]
    assert moe.down_split(args[1].numel(), E, H, I) == split
    launches = experts.shape_calls(*args[1].shape, E, H, I, tuple(args[7]), static)
    assert not launches[-1].constexprs["TILE_MAP"]  # a split-K down GEMM scans the offsets
    out = kernels.grouped_experts(*args, **kw)
    assert rel_err(out, reference.grouped_experts(*args, **kw)) < 1e-2
    idx = args[1]
    none = ((idx < 0) | (idx >= E)).all(dim=1)
    assert none.any() == (case == "sentinels") and torch.equal(out[none], torch.zeros_like(out[none]))


@pytest.mark.parametrize("dynamic", ["gate_up_act_scale", "down_act_scale"])
def test_experts_with_one_static_scale(dynamic):
    # one GEMM's input static, the other's dynamic (the scale left out)
    args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, True, seed=2)
    del kw[dynamic]
    _check_experts(args, kw)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_experts_every_slot_a_sentinel(static):
    # no expert gets a row: the down GEMM has no row tile to count, and its first tail
    # program writes the (all-zero) combine
    args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, static, seed=4)
    args[1] = torch.where(args[1] < 0, args[1], args[1] + 100)
    out = kernels.grouped_experts(*args, **kw)
    assert torch.equal(out, torch.zeros_like(out))


def _recording_calls(launched: list):
    """``experts._calls`` patched to also append each forward's launches to ``launched``."""
    real = experts._calls

    def record(*a, **k):
        launched.append(real(*a, **k))
        return launched[-1]

    return mock.patch.object(experts, "_calls", record)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["sentinel", "empty"])
def test_experts_gate_up_a_quantised_in_sorted_order_equals_gathered_bitwise(static, kind):
    # at prefill on Hopper the gate_up GEMM reads its A in place (kernels/ws_gemm.py cannot
    # gather): each token quantised once and stored at its slots' sorted rows (dynamic
    # too), the same bytes and scales as the gathered rows, so the same output.  MAX_SLOTS
    # lowered: the three-launch sort's (prefill) path at an interpreter-sized S = 111
    args, kw = _experts_args((37, 7, 64, 48, 3, [16, 16], kind), torch.bfloat16, torch.float32, static, seed=3)
    launched = []
    with mock.patch.object(experts, "MAX_SLOTS", 16):
        gathered = kernels.grouped_experts(*args, **kw)
        with mock.patch.object(experts, "_sorted_a", lambda *_: True), _recording_calls(launched):
            in_place = kernels.grouped_experts(*args, **kw)
    hist, scan, scatter, quant, gate_up = launched[0][:5]
    assert hist.kernel.__name__ == "_sort_hist_kernel" and scatter.constexprs["SLOT_ROWS"]
    assert quant.args[10] is scatter.args[4]  # it stores each slot at the row the scatter wrote for it
    assert quant.constexprs["SLOTS"] and quant.constexprs["DEST"] and not gate_up.constexprs["GATHER_A"]
    assert quant.args[3].shape == (111, 64)  # q: one row per slot
    if not static:  # its scales K-group major, as the prefill path lays them out (experts._kmajor_scales)
        assert quant.args[4].shape == (111, 4) and quant.args[4].stride() == (1, 111)
        assert gate_up.args[2] is quant.args[4] and gate_up.args[3:5] == (1, 111)
        # the down GEMM's, which the activation writes, row-major (its rows are scattered)
        act = next(c for c in launched[0] if c.kernel.__name__ == "_gated_act_quant_kernel")
        down = [c for c in launched[0] if c.kernel.__name__ == "_grouped_gemm_kernel"][-1]
        assert act.args[3].shape == (111, 3) and act.args[3].stride() == (3, 1)  # it writes them contiguous
        assert down.args[2] is act.args[3] and down.args[3:5] == (3, 1) and down.constexprs["SCATTER_OUT"]
    assert torch.equal(in_place, gathered)
    assert gathered.abs().sum() > 0


@pytest.mark.parametrize("case", list(_EXPERT_CASES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_gemms_reading_the_tile_map_equal_the_offsets_scan_bitwise(case, static):
    # at S <= MAX_SLOTS both GEMMs take their tile and rows from the sort's tile map; a
    # map of 8-row tiles (no GEMM's height) leaves them to scan the offsets and load perm
    # as before: the same rows, so the same bytes, fused launches or not
    args, kw = _experts_args(case, torch.bfloat16, torch.float32, static, seed=6)
    launched = []
    for slots in (experts.COMBINE_SLOTS, 0):
        with mock.patch.object(experts, "COMBINE_SLOTS", slots), _recording_calls(launched):
            mapped = kernels.grouped_experts(*args, **kw)
            with mock.patch.object(experts, "_map_bm", lambda *_: 8):
                scanned = kernels.grouped_experts(*args, **kw)
        assert torch.equal(mapped, scanned) and mapped.abs().sum() > 0
        gemm_launches = [[c for c in calls if c.kernel is _grouped_gemm_kernel] for calls in launched[-2:]]
        assert all(c.constexprs["TILE_MAP"] for c in gemm_launches[0]) and len(gemm_launches[0]) == 2
        assert not any(c.constexprs["TILE_MAP"] for c in gemm_launches[1])


@pytest.mark.parametrize("case", ["empty_expert", "sentinels", "T_lt_block_prime_E"])
def test_tile_map_entries_past_the_rows_are_never_used(case):
    # every allocation filled with 0x7f bytes first (int32 2139062143, e4m3 NaN): the
    # map's unwritten entries (past the real tiles, past an expert's last row in its last
    # tile) would send a GEMM out of bounds or into NaN
    args, kw = _experts_args(case, torch.bfloat16, torch.float32, False, seed=8)
    real_empty = torch.empty

    def poisoned(*a, **k):
        t = real_empty(*a, **k)
        t.view(-1).view(torch.uint8).fill_(0x7F)
        return t

    clean = kernels.grouped_experts(*args, **kw)
    with mock.patch.object(torch, "empty", poisoned):
        assert torch.equal(kernels.grouped_experts(*args, **kw), clean)


@pytest.mark.parametrize("T,k,E,kind,H", [
    (1, 1, 1, "uniform", 48),         # T = 1, k = 1 (slots padded to 2 lanes), E = 1
    (13, 3, 7, "uniform", 100),       # prime E, k padded to 4, H not a power of two
    (9, 2, 5, "empty", 64),           # experts without tokens
    (6, 2, 3, "one", 40),             # both slots of a token on one expert: ties by slot
    (12, 3, 5, "sentinel", 48),       # ids outside [0, E) on both sides; token 0 with none valid
    (5, 6, 4, "uniform", 32),         # k > E: the extra slots are sentinels, k padded to 8
    (3, 8, 11, "uniform", 2100),      # k = 8; two column blocks, the second partial
    (2, 16, 21, "sentinel", 1100),    # k = 16: blocks of 1024 columns, the second partial
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_combine_kernel_is_the_reference_combine_bitwise(T, k, E, kind, H, dtype):
    from fp8_moe_ops.kernels.combine import combine
    gen = torch.Generator().manual_seed(T * 31 + k)
    idx, w = make_routing(T, k, E, kind, gen=gen)
    w[:, ::2] *= -1  # negative weights: products of -0.0 and 0.0 both occur
    y = torch.randn(T * k, H, generator=gen)
    y[:, ::5] = 0.0
    y[:, 1::5] = -0.0
    valid = ((idx >= 0) & (idx < E)).reshape(-1)
    y[valid.nonzero()[0, 0], 2] = float("inf")  # an infinite output: the first valid slot's token
    y[~valid] = float("nan")  # rows of sentinel slots must never be read
    y = y.to(dtype)
    out = combine(y, idx, w, E, torch.empty(T, H, dtype=dtype))
    expected = reference.combine(y, idx, w, E, dtype)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))  # signed zeros included
    assert not out.isnan().any() and out.isinf().any()


def test_experts_empty_tokens():
    args, _ = _experts_args("T1", torch.bfloat16, torch.float32, static=False)
    args[0], args[1], args[2] = args[0][:0], args[1][:0], args[2][:0]
    out = kernels.grouped_experts(*args)
    assert out.shape == (0, args[0].shape[1])


@pytest.mark.parametrize("op", ["grouped_experts", "batched_experts"])
def test_experts_of_hidden_size_zero_give_an_empty_output_as_the_reference(op):
    # H = 0: (T, 0) on every device (the launch configs divided by it)
    E, T, k, I = 3, 4, 2, 16
    args = dict(hidden=torch.randn(T, 0, dtype=torch.bfloat16), top_k_index=torch.tensor([[0, 1]] * T),
                top_k_weights=torch.rand(T, k), gate_up_proj=torch.zeros(E, 2 * I, 0, dtype=FP8),
                gate_up_scale_inv=torch.ones(E, 2, 0), down_proj=torch.zeros(E, 0, I, dtype=FP8),
                down_scale_inv=torch.ones(E, 0, 1), block_size=[16, 16])
    assert getattr(kernels, op)(**args).shape == getattr(torch.ops.fp8_moe, op)(**args).shape == (T, 0)


def _arg_names():
    from fp8_moe_ops.kernels.experts import ARG_NAMES

    return ARG_NAMES


def _positional(args, kw):
    """The experts ops' twelve arguments in schema order."""
    given = {**dict(zip(_arg_names(), args)), **kw}
    return tuple(given.get(name, "silu" if name == "activation" else None) for name in _arg_names())


def _recorded(first):
    """(a table of plans holding the plan of ``first``'s signature under the key "sig",
    the output of the call that recorded it: the signature's second)."""
    from fp8_moe_ops.kernels.plans import LaunchPlan

    states = {}
    kernels.planned_experts(states, "sig", first)
    out = kernels.planned_experts(states, "sig", first)
    assert isinstance(states["sig"], LaunchPlan)
    return states, out


@pytest.mark.parametrize("case,static,scale_dtype", [
    ("T1", False, torch.float32),
    ("sentinels", True, torch.float32),
    ("empty_expert", False, E8M0),
    ("T_lt_block_prime_E", True, E8M0),
])
def test_plan_replays_the_forward_bitwise(case, static, scale_dtype):
    # a plan recorded on one call replays another call of the same signature (other
    # values, routing and tensors) exactly as the forward itself computes it
    first = _positional(*_experts_args(case, torch.bfloat16, scale_dtype, static, seed=11))
    states, out = _recorded(first)
    assert torch.equal(out, kernels.grouped_experts(*first))
    second = _positional(*_experts_args(case, torch.bfloat16, scale_dtype, static, seed=12))
    assert not torch.equal(second[1], first[1])
    want = kernels.grouped_experts(*second)
    assert not torch.equal(want, out)
    assert torch.equal(kernels.planned_experts(states, "sig", second), want)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_plan_past_max_slots_replays_the_forward_bitwise(static):
    # past MAX_SLOTS (lowered here to 16, in blocks of 8 slots; COMBINE_SLOTS with it: the
    # fused combine's counters are zeroed by the one-launch sort) the sort takes three
    # launches, its histograms in the workspace: such a signature has a plan too, and its
    # replay on another call equals the forward, and the forward the one-launch sort's
    first = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, static, seed=21))
    second = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, static, seed=22))
    with mock.patch.object(experts, "COMBINE_SLOTS", 0):
        one_launch = kernels.grouped_experts(*second)
        with mock.patch.object(experts, "MAX_SLOTS", 16), mock.patch.object(sort, "LARGE_BLOCK", 8):
            states, out = _recorded(first)
            assert "hist" in [name for name, *_ in states["sig"]._layout.buffers]
            want = kernels.grouped_experts(*second)
            assert not torch.equal(want, out)
            assert torch.equal(kernels.planned_experts(states, "sig", second), want)
    assert torch.equal(want, one_launch)


def test_op_records_a_plan_on_a_signatures_second_call():
    # the CUDA kernel of the stacked ops (kernels.StackedPlans), driven here with CPU
    # tensors and the interpreted kernels: check + forward, then record, then replay
    from fp8_moe_ops import ops
    from fp8_moe_ops.kernels.plans import LaunchPlan

    checked = []

    def check(*args):
        checked.append(True)
        ops.check_experts(*args)

    plans = kernels.StackedPlans(check)
    calls = [_positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=s)) for s in (41, 42, 43)]
    states = []
    for args in calls:
        assert torch.equal(plans(args), kernels.grouped_experts(*args))
        states.append(type(next(iter(plans.states.values()))))
    assert states == [type(None), LaunchPlan, LaunchPlan]
    assert len(plans.states) == 1 and len(checked) == 1
    bad = list(calls[0])
    bad[2] = bad[2][:, :1]  # top_k_weights of another shape: a new key, checked, rejected
    with pytest.raises(ValueError, match="top_k_weights"):
        plans(tuple(bad))
    assert len(plans.states) == 1


def test_plans_are_kept_per_gluon_setting(monkeypatch):
    # FP8_MOE_GLUON decides which kernel runs a prefill GEMM, so a plan recorded under one
    # setting is never replayed under another, on the guarded path or the keyed one
    from fp8_moe_ops import ops
    from fp8_moe_ops.kernels.plans import LaunchPlan

    plans = kernels.StackedPlans(ops.check_experts)
    args = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=61))
    monkeypatch.setenv("FP8_MOE_GLUON", "0")
    for _ in range(3):
        plans(args)
    assert [(key[1], type(state)) for key, state in plans.states.items()] == [("0", LaunchPlan)]
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    with mock.patch.object(LaunchPlan, "run", side_effect=AssertionError("a plan of another setting replayed")):
        assert torch.equal(plans(args), kernels.grouped_experts(*args))
    assert sorted(key[1] for key in plans.states) == ["0", "1"]


def test_op_replays_a_plan_behind_its_metadata_guard():
    # once a key has a plan, a call with the same metadata skips the Python key (a C++
    # guard of the tensors' metadata and their alignment decide); a call that differs in
    # anything the key holds still takes the keyed path: checked, or its own key
    from fp8_moe_ops import ops
    from fp8_moe_ops._checks import meta_key

    if ops.metadata_guard([torch.zeros(1)]) is None:
        pytest.skip("this torch has no C++ tensor-metadata guard")
    plans = kernels.StackedPlans(ops.check_experts)
    calls = [_positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=s)) for s in (51, 52, 53)]
    for args in calls[:2]:
        plans(args)
    with mock.patch("fp8_moe_ops.kernels.plans.meta_key", wraps=meta_key) as keyed:
        assert torch.equal(plans(calls[2]), kernels.grouped_experts(*calls[2]))
        assert keyed.call_count == 0
        bad = list(calls[2])
        bad[2] = bad[2].double()  # top_k_weights' dtype: the guard refuses, the check raises
        with pytest.raises(TypeError, match="top_k_weights"):
            plans(tuple(bad))
        assert keyed.call_count == 1
        shifted = list(calls[2])  # hidden 2 bytes past a 16-byte boundary: its own key
        hidden = shifted[0]
        shifted[0] = torch.empty(hidden.numel() + 1, dtype=hidden.dtype)[1:].view(hidden.shape).copy_(hidden)
        assert torch.equal(plans(tuple(shifted)), kernels.grouped_experts(*calls[2]))
        assert keyed.call_count == 2
        assert torch.equal(plans(calls[0]), kernels.grouped_experts(*calls[0]))
        assert keyed.call_count == 2
        # the weights as Parameters (another type, so another guard) share the plan, and
        # are remembered beside the plain tensors: both replay without the key from then on
        params = list(calls[1])
        params[3:7] = [torch.nn.Parameter(t, requires_grad=False) for t in params[3:7]]
        for _ in range(2):
            assert torch.equal(plans(tuple(params)), kernels.grouped_experts(*calls[1]))
        assert torch.equal(plans(calls[1]), kernels.grouped_experts(*calls[1]))
        assert keyed.call_count == 3 and len(plans.states) == 2


def test_plans_name_a_bare_int_block_size():
    # ops.experts' ExpertWeights takes any value: a bare int block size reached the cheap
    # key's unpacking (a TypeError naming nothing) before the check that names it
    from fp8_moe_ops import ops

    args = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=71))
    x, w, ws = args[0], args[3][0], args[4][0]
    stacked, gemm = kernels.StackedPlans(ops.check_experts), kernels.GemmPlans("linear", ops.check_linear)
    for _ in range(3):  # the plans recorded and remembered behind their guards
        stacked(args), gemm((x, w, ws, args[7], None, None))
    with pytest.raises(TypeError, match=r"block_size: expected a pair \(bn, bk\)"):
        stacked((*args[:7], 16, *args[8:]))
    with pytest.raises(TypeError, match=r"block_size: expected a pair \(bn, bk\)"):
        gemm((x, w, ws, 16, None, None))


def test_grouped_gemm_clamps_negative_offsets_into_the_rows():
    # grouped_mm on CUDA checks no offset values: a negative one started a row tile before
    # row 0, whose loads and stores ran outside x and out (heap corruption here)
    gen = torch.Generator().manual_seed(9)
    E, N, K, S, block = 4, 24, 32, 6, [16, 16]
    w, ws = make_expert_weights(E, N, K, block, gen=gen)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    q, qs = moe._quantize(x, 16, S)
    for given, clamped in (([-1] * 4, [0] * 4), ([-3, -1, 4, 6], [0, 0, 4, 6])):
        rows = torch.full((3 * S, N), 7.0, dtype=torch.bfloat16)  # canary rows around out
        moe.launch(moe._gemm_call(q, qs, w, ws, block, rows[S:2 * S], offsets=torch.tensor(given, dtype=torch.int32)))
        assert (rows[:S] == 7).all() and (rows[2 * S:] == 7).all()
        want = kernels.grouped_mm(x, w, ws, torch.tensor(clamped, dtype=torch.int32), block)
        assert torch.equal(rows[S:2 * S], want)


def test_activations_whose_column_offsets_pass_int32_are_read_dense():
    # the quantisation's column offsets are 32-bit: a column-major x of 300k rows at
    # K = 7168 ((K - 1) * stride(1) >= 2^31) read outside x; its sources copy it dense
    huge = torch.empty_strided((2, 7168), (1, 300_000), device="meta")
    assert moe.activation_source(huge).stride() == (7168, 1)
    small = torch.empty_strided((2, 7168), (1, 2), device="meta")  # column-major, in range: read as it is
    assert moe.activation_source(small) is small
    assert gemms._sources("linear", (huge, torch.empty(3, 7168, device="meta"), torch.empty(1, 56, device="meta"),
                                     [128, 128], None, None))["x"].is_contiguous()
    assert experts.routing_sources(huge, torch.empty(2, 1, dtype=torch.int64), torch.empty(2, 1), None,
                                   None)["hidden"].is_contiguous()


def test_block_k_not_a_multiple_of_16_is_named():
    # the fp8 dot's smallest K: the Triton kernels' entry refuses a smaller bk by name
    w, ws = make_expert_weights(1, 32, 32, [16, 8], gen=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"^block_size: expected bk divisible by 16 for the Triton kernels"):
        kernels.linear(torch.ones(2, 32, dtype=torch.bfloat16), w[0], ws[0], [16, 8])


def test_plans_check_unhashable_and_equal_valued_arguments():
    # an unhashable value (a dict block size, a list activation) reached the plans' dict
    # lookups, a TypeError naming nothing; a value equal to a remembered one that the
    # checks refuse (True for 1.0, 16.0 for 16: equal keys) replayed without its check
    from fp8_moe_ops import ops

    case = (12, 5, 48, 24, 3, [16, 32], "sentinel")  # bn != bk: a dict of the two as keys unpacks as the block
    args = list(_positional(*_experts_args(case, torch.bfloat16, torch.float32, False, seed=72)))
    args[11] = 1.0  # swiglu_limit
    x, w, ws, (bn, bk) = args[0], args[3][0], args[4][0], args[7]
    stacked, gemm = kernels.StackedPlans(ops.check_experts), kernels.GemmPlans("linear", ops.check_linear)
    for _ in range(3):  # the plans recorded and remembered behind their guards
        stacked(tuple(args)), gemm((x, w, ws, [bn, bk], None, None))
    keys = dict.fromkeys([bn, bk])  # equal to the remembered block's values once unpacked
    for i, value, match, exc in ((7, {0: bn, 1: bk}, "block_size", TypeError), (8, ["silu"], "activation", ValueError),
                                 (11, [1.0], "swiglu_limit", TypeError), (11, True, "swiglu_limit", TypeError),
                                 (7, [float(bn), bk], "block_size", TypeError), (7, keys, "block_size", TypeError),
                                 (7, [bn], "block_size", ValueError)):
        with pytest.raises(exc, match=f"^{match}: expected"):
            stacked((*args[:i], value, *args[i + 1:]))
    for block in ({0: bn, 1: bk}, [float(bn), bk], keys):
        with pytest.raises(TypeError, match="^block_size: expected"):
            gemm((x, w, ws, block, None, None))


def test_plan_of_strided_arguments_reads_each_calls_copy():
    # a transposed top_k_index / top_k_weights is copied dense on every call, the plan's
    # replays included: the replay must not read the recording call's copy
    def strided(seed):
        args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, static=False, seed=seed)
        args[1], args[2] = args[1].t().contiguous().t(), args[2].t().contiguous().t()
        return _positional(args, kw)

    first, second = strided(21), strided(22)
    states, _ = _recorded(first)
    want = kernels.grouped_experts(*second)
    assert torch.equal(kernels.planned_experts(states, "sig", second), want)
    assert not torch.equal(want, kernels.grouped_experts(*first))


def test_op_tries_to_guard_a_strided_call_once():
    # a transposed top_k_index is copied dense on every call: such a key cannot be
    # guarded, and its calls stop trying after the first that has a plan
    from fp8_moe_ops import ops

    def strided(seed):
        args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, static=False, seed=seed)
        args[1] = args[1].t().contiguous().t()
        return _positional(args, kw)

    plans = kernels.StackedPlans(ops.check_experts)
    calls = [strided(s) for s in (61, 62, 63, 64)]
    with mock.patch.object(plans, "_remember", wraps=plans._remember) as remember:
        for args in calls:
            assert torch.equal(plans(args), kernels.grouped_experts(*args))
    assert remember.call_count == 1  # the second call (the first with a plan) only
    assert not plans._replays and len(plans._keyed_only) == 1


def test_sort_slots_layout():
    # perm: sorted position -> slot, stable; offsets: inclusive cumsum, sentinels excluded
    idx = torch.tensor([[2, -1], [0, 2], [5, 0]])
    perm, offsets = gemms._sort_slots(idx, 3)
    assert perm.tolist() == [2, 5, 0, 3, 1, 4]  # one launch (S <= 2048)
    assert offsets.tolist() == [2, 2, 4]


@pytest.mark.parametrize("S,E,kind", [
    (0, 4, "random"),       # no slot: offsets all zero, no launch
    (1, 3, "random"),
    (5, 1, "random"),       # one expert
    (8, 256, "random"),
    (128, 127, "random"),   # one full block; E + 1 = 128 bins exactly
    (129, 5, "one"),        # a second block of one slot; every slot on one expert
    (300, 7, "random"),
    (200, 9, "sentinel"),   # no slot on any expert
    (2048, 5, "random"),
    (2048, 255, "random"),  # the largest one-launch S, E + 1 = 256 bins
    (2049, 4, "random"),    # the three-launch sort, 256 slots per program: a one-slot block
    (2500, 256, "random"),  # 257 keys: 512 bins
])
def test_sort_kernel_matches_torch_sort(S, E, kind):
    # the one-launch sort (S <= 2048) and the three-launch sort beyond both give the
    # reference's stable permutation and offsets
    perm, offsets = gemms._sort_slots(_sort_ids(S, E, kind), E)
    rperm, roffsets = reference.sort_by_expert(_sort_ids(S, E, kind).reshape(-1, 1), E)
    assert perm.dtype == torch.int32 and torch.equal(perm.long(), rperm) and torch.equal(offsets, roffsets)


def test_decode_sort_runs_in_one_program_of_the_fewest_lanes():
    # (grid, lanes, bins, blocks each program histograms): up to 128 slots one program
    # of the next power of two >= S lanes (at least 16), beyond programs of 128
    assert sort.sort_launch_shape(1, 3) == ((1,), 16, 4, 1)
    assert sort.sort_launch_shape(8, 256) == ((1,), 16, 512, 1)
    assert sort.sort_launch_shape(37, 7) == ((1,), 64, 8, 1)
    assert sort.sort_launch_shape(128, 127) == ((1,), 128, 128, 1)
    assert sort.sort_launch_shape(129, 5) == ((2,), 128, 8, sort.MAX_SLOTS // 128)


def _sort_ids(S, E, kind):
    gen = torch.Generator().manual_seed(S)
    ids = torch.randint(-2, E + 2, (S,), generator=gen)  # incl. sentinels on both sides
    if kind == "one":
        ids.fill_(E // 2)
    elif kind == "sentinel":
        ids = torch.where(ids < E // 2, -1, E)
    return ids


@pytest.mark.parametrize("S,E,kind,block,scan_bins", [
    (1, 3, "random", 4, 8),         # one block, mostly padding
    (16, 5, "random", 4, 8),        # whole blocks only
    (17, 5, "one", 4, 8),           # a last block of one slot; every slot on one expert
    (50, 1, "random", 8, 8),        # one expert
    (97, 7, "random", 8, 8),        # prime E
    (60, 9, "sentinel", 8, 8),      # no slot on any expert
    (300, 256, "random", 4, 8),     # 512 bins: 64 scan programs of 8, 75 blocks in one step of 256
    (300, 255, "random", 4, 256),   # 256 bins: one scan program, ten steps of 8 blocks
    (300, 300, "random", 4, 256),   # 512 bins: two scan programs, ten steps of 8 blocks, the last of 3
])
def test_three_launch_sort_and_inverse(S, E, kind, block, scan_bins):
    # the sort of S > MAX_SLOTS at interpreter-sized S, in programs of `block` slots:
    # histograms, their prefix sums over the blocks (`scan_bins` bins a program), the
    # scatter; with slot_rows, also the inverse permutation
    ids = _sort_ids(S, E, kind)
    perm = torch.empty(S, dtype=torch.int32)
    offsets = torch.full((E,), -7, dtype=torch.int32)
    rows = torch.full((S,), -7, dtype=torch.int32)
    with mock.patch.object(sort, "LARGE_BLOCK", block), mock.patch.object(sort, "SCAN_BINS", scan_bins):
        hist = torch.full(moe.large_sort_hist_shape(S, E), -7, dtype=torch.int32)
        calls = moe._large_sort_calls(ids, perm, offsets, hist, rows, E)
        for call in calls:
            moe.launch(call)
    rperm, roffsets = reference.sort_by_expert(ids.reshape(-1, 1), E)
    assert torch.equal(perm.long(), rperm) and torch.equal(offsets, roffsets)
    assert torch.equal(rows.long(), torch.empty_like(rperm).scatter_(0, rperm, torch.arange(S)))
    blocks = -(-S // block)
    assert hist.shape[0] == blocks + 1 and [c.grid for c in calls][::2] == [(blocks,)] * 2
    keys = torch.where((ids >= 0) & (ids < E), ids, E)
    assert torch.equal(hist[-1, :E + 1], torch.bincount(keys, minlength=E + 1).int())  # the totals row


def test_three_launch_sort_refuses_keys_past_int32():
    # its in-block sort packs key * BLOCK + lane into an int32
    most = 2**31 // sort.LARGE_BLOCK - 1  # E + 1 keys, a power of two
    assert sort.large_sort_launch_shape(10**6, most)[2] == most + 1
    with pytest.raises(ValueError, match=f"expected at most {most}, got {most + 1}"):
        sort.large_sort_launch_shape(10**6, most + 1)


def _map_tiles(perm, offsets, S, bm):
    """The reference's tiles of ``bm`` rows: [(expert, first row, the expert's end, the
    tile's slots)]."""
    ends = offsets.clamp(max=S).tolist()
    tiles = []
    for e, end in enumerate(ends):
        start = ends[e - 1] if e else 0
        tiles += [(e, r0, end, perm[r0:min(r0 + bm, end)].tolist()) for r0 in range(start, end, bm)]
    return tiles


@pytest.mark.parametrize("S,E,kind,bm", [
    (1, 3, "random", 16),
    (5, 1, "random", 16),       # one expert
    (8, 256, "random", 16),     # E > S
    (37, 7, "random", 16),      # prime E, experts of several tiles with partial last ones
    (128, 127, "random", 16),   # one full sort block
    (129, 5, "one", 64),        # every slot on one expert; a second block of one slot
    (300, 7, "random", 64),
    (200, 9, "sentinel", 16),   # no slot on any expert: no tile
    (2048, 255, "random", 16),  # the largest one-launch S
])
def test_sort_writes_the_gemms_tile_map(S, E, kind, bm):
    # the one-launch sort's map of the GEMMs' row tiles: the header, each real tile's
    # (expert, first row, the expert's end) and its rows' slots, as the reference's sort
    # gives them; the entries past the real tiles are left unwritten
    ids = _sort_ids(S, E, kind).reshape(-1, 1)
    n_tiles = moe.max_row_tiles(S, E, bm, True)
    tile_map = torch.full((sort.tile_map_size(n_tiles, bm),), -7, dtype=torch.int32)
    perm, offsets = torch.empty(S, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
    x = torch.zeros(S, 16)
    q, q_scale = torch.empty(S, 16, dtype=FP8), torch.empty(S, 1)
    experts.launch(experts._sort_quant_call(ids, perm, offsets, None, moe.TileMap(tile_map, bm), E, x, q, q_scale,
                                            16, False, None))
    rperm, roffsets = reference.sort_by_expert(ids, E)
    assert torch.equal(perm.long(), rperm) and torch.equal(offsets, roffsets)
    tiles = _map_tiles(rperm, roffsets, S, bm)
    assert tile_map[:2].tolist() == [len(tiles), int(roffsets[-1])]
    for t, (e, r0, end, slots) in enumerate(tiles):
        assert tile_map[4 + 4 * t:7 + 4 * t].tolist() == [e, r0, end], t
        first = 4 + 4 * n_tiles + t * bm
        assert tile_map[first:first + len(slots)].tolist() == slots, t
        assert (tile_map[first + len(slots):first + bm] == -7).all(), t
    assert (tile_map[4 + 4 * len(tiles):4 + 4 * n_tiles] == -7).all()
    assert (tile_map[4 + 4 * n_tiles + len(tiles) * bm:] == -7).all()


@pytest.mark.parametrize("first", [0, 2], ids=["first_expert_empty", "first_expert_rows"])
@pytest.mark.parametrize("E", [1, 5, 8, 255, 256])  # E = 2^n needs n + 1 search steps
def test_expert_of_rows_is_searchsorted(E, first):
    # the binary search of the quant / activation kernels == torch.searchsorted(right=True)
    gen = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 3, (E,), generator=gen)
    counts[0] = first  # empty: row 0 belongs to a later expert; else answers start at 0
    offsets = counts.cumsum(0).to(torch.int32)
    R = int(offsets[-1]) + 5  # rows past offsets[-1]: expert E
    out = torch.empty(R, dtype=torch.int32)
    _expert_of_rows_kernel[(1,)](offsets, out, R, E, SEARCH_STEPS=E.bit_length(),
                                 BLOCK=triton.next_power_of_2(R))
    assert torch.equal(out, torch.searchsorted(offsets, torch.arange(R, dtype=torch.int32), right=True).int())


def test_strided_act_scale_and_offsets():
    # act scales / offsets passed as strided views are read as the values they show
    E, S, N, K, block = 3, 10, 24, 32, [16, 16]
    gen = torch.Generator().manual_seed(13)
    w, ws = _weights(gen, E, N, K, block)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    a = (torch.rand(2 * E, generator=gen) * 0.01 + 0.002)[::2]
    offsets = torch.tensor([3, 3, 0, 7, 0, 10], dtype=torch.int32)[1::2]  # [3, 7, 10]
    out = kernels.grouped_mm(x, w, ws, offsets, block, a)
    _ulp_close(out, reference.grouped_mm(x, w, ws, offsets, block, a))


# --------------------------------------------------------------------------- per-expert weight lists


_NAMES = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "gate_up_scale_inv", "down_proj",
          "down_scale_inv", "block_size")


@pytest.mark.parametrize("case,separate,static,scale_dtype,per_tensor", [
    ("T1", False, False, torch.float32, False),
    ("T_lt_block_prime_E", False, True, E8M0, False),
    ("sentinels", True, False, torch.float32, True),    # separate gate/up with (1, 1) scales
    ("one_expert", True, True, torch.float32, False),   # separate gate/up, I = 16 = bn
    ("empty_expert", False, False, torch.float32, True),
    ("block32", True, False, E8M0, True),
])
def test_experts_list_equals_stacked_bitwise(case, separate, static, scale_dtype, per_tensor):
    # the W_TABLE path reads each expert's base address from the table; otherwise the
    # same arithmetic as the stacked kernel, so the outputs agree bitwise
    from helpers import as_expert_lists

    args, kw = _experts_args(case, torch.bfloat16, scale_dtype, static, per_tensor, seed=11)
    stacked = kernels.grouped_experts(*args, **kw)
    lists = as_expert_lists(dict(zip(_NAMES, args)), separate)
    # copies: the experts' tensors at addresses of their own, not rows of one stacked tensor
    lists = {k: [t.clone() for t in v] if isinstance(v, list) and k != "block_size" else v for k, v in lists.items()}
    out = kernels.grouped_experts_list(**lists, **kw)
    assert torch.equal(out, stacked)


@pytest.mark.parametrize("separate,static", [(False, False), (True, True)], ids=["fused_dynamic", "separate_static"])
def test_experts_list_plan_replays_new_inputs_and_new_weights(separate, static):
    # the list op records a plan on a signature's first call; later calls replay it with
    # their own routing, and with a new address table where an expert's weight is a new tensor
    from fp8_moe_ops.kernels import moe_list
    from helpers import as_expert_lists

    def call(seed):  # per-tensor scales: a gate_up grid that splits at I (I = 24)
        args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, static, per_tensor=separate, seed=seed)
        lists = as_expert_lists(dict(zip(_NAMES, args)), separate)
        lists = {k: [t.clone() for t in v] if isinstance(v, list) and k != "block_size" else v for k, v in lists.items()}
        return args, kw, lists

    moe_list._PLANS.clear()
    args, kw, lists = call(31)
    want = kernels.grouped_experts(*args, **kw)
    assert torch.equal(kernels.grouped_experts_list(**lists, **kw), want)
    assert list(moe_list._PLANS.values()) == [None]  # seen once
    assert torch.equal(kernels.grouped_experts_list(**lists, **kw), want)
    assert [type(p).__name__ for p in moe_list._PLANS.values()] == ["LaunchPlan"]  # recorded
    args2, kw2, _ = call(32)  # other routing and activations, the same weights
    lists.update(hidden=args2[0], top_k_index=args2[1], top_k_weights=args2[2])
    args[:3] = args2[:3]
    assert torch.equal(kernels.grouped_experts_list(**lists, **kw), kernels.grouped_experts(*args, **kw))
    lists["down_proj"][1] = -lists["down_proj"][1].float()  # a new tensor for one expert's weight
    lists["down_proj"][1] = lists["down_proj"][1].to(torch.float8_e4m3fn)
    args[5] = torch.stack(lists["down_proj"])
    want = kernels.grouped_experts(*args, **kw)
    assert torch.equal(kernels.grouped_experts_list(**lists, **kw), want)
    assert len(moe_list._PLANS) == 1  # one signature, one plan, four calls


def test_experts_list_plan_of_one_act_scale_tensor_for_both_projections():
    # one (E,) tensor as both act scales: two sources of one recorded plan, which replays
    from fp8_moe_ops.kernels import moe_list
    from helpers import as_expert_lists

    moe_list._PLANS.clear()
    outs = []
    for seed in (33, 34, 35):
        args, kw = _experts_args("sentinels", torch.bfloat16, torch.float32, True, seed=seed)
        kw["down_act_scale"] = kw["gate_up_act_scale"]
        lists = as_expert_lists(dict(zip(_NAMES, args)), False)
        outs.append((kernels.grouped_experts_list(**lists, **kw), kernels.grouped_experts(*args, **kw)))
    assert [type(p).__name__ for p in moe_list._PLANS.values()] == ["LaunchPlan"]
    assert all(torch.equal(got, want) for got, want in outs)


@pytest.mark.parametrize("BN", [16, 64], ids=["tile_in_block", "tile_spans_blocks"])
def test_experts_list_weight_scale_per_tile_and_per_column(monkeypatch, BN):
    # bn = 32, I = 32: BN = 16 takes one weight scale per tile, BN = 64 one per column
    args, kw = _experts_args("block32", torch.bfloat16, torch.float32, False, seed=12)
    args[3], args[4] = _weights(torch.Generator().manual_seed(4), 3, 64, 96, [32, 32])
    args[5], args[6] = _weights(torch.Generator().manual_seed(5), 3, 96, 32, [32, 32])
    monkeypatch.setattr(moe, "gemm_config", lambda *_: dict(BM=16, BN=BN, GROUP_M=8, num_warps=4, num_stages=2))
    from helpers import as_expert_lists

    stacked = kernels.grouped_experts(*args, **kw)
    for separate in (False, True):
        out = kernels.grouped_experts_list(**as_expert_lists(dict(zip(_NAMES, args)), separate), **kw)
        assert torch.equal(out, stacked)


def test_launch_cache_keys_on_argument_specialisation():
    # one cached launch per (kernel, grid, compile-time values, argument specialisation):
    # the same call again adds none; a hidden state at an odd address adds the launch
    # of the kernel that reads it (the sort fused with the activation quantisation)
    from fp8_moe_ops.kernels import launch

    args, _ = _experts_args("T1", torch.bfloat16, torch.float32, static=False)
    launch._LAUNCHES.clear()
    out = kernels.grouped_experts(*args)
    first = dict(launch._LAUNCHES)
    assert len(first) == 3  # sort + quantise, gate_up + activation, down + combine (S <= ACT_SLOTS)
    assert torch.equal(kernels.grouped_experts(*args), out)
    assert launch._LAUNCHES.keys() == first.keys()
    hidden = args[0]
    args[0] = torch.empty(hidden.numel() + 1, dtype=hidden.dtype)[1:].view_as(hidden).copy_(hidden)
    assert torch.equal(kernels.grouped_experts(*args), out)
    added = [key for key in launch._LAUNCHES if key not in first]
    assert [key[0] for key in added] == [_sort_quant_kernel]


class _FakeLauncher:
    """A compiled kernel's launcher object without a compiled kernel: the attributes
    Triton's CUDA launcher has (3.6's and 3.7's), a ``launch`` that records its calls."""

    def __init__(self, global_scratch=0, profile_scratch=0):
        self.got = []
        self.launch = lambda *a: self.got.append(a)
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, True
        self.global_scratch_size = global_scratch
        self.profile_scratch_size = profile_scratch
        self.global_scratch_align = self.profile_scratch_align = 1
        self.arg_annotations, self.kernel_signature = "annotations", "signature"


class _Launcher36(_FakeLauncher):  # Triton 3.6's __call__ for a kernel without scratch memory
    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    metadata, launch_metadata, enter, exit_, *args)


class _Launcher37(_FakeLauncher):  # Triton 3.7's
    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, metadata,
                    launch_metadata, enter, exit_, None, None, self.arg_annotations, self.kernel_signature, args)


class _Reordered(_FakeLauncher):  # what another Triton version might do
    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_pdl, self.launch_cooperative_grid, None, None, *args)


def _launched_both_ways(cls) -> tuple:
    # one launch through the launcher object, one as launch.Launch makes it from
    # launch.direct's answer (the arguments as the list full_args gives); what the C
    # function got each time, a sequence of arguments as a tuple
    from fp8_moe_ops.kernels.launch import direct

    run = cls()
    run(2, 3, 1, 55, "function", "metadata", None, None, None, 1234, 7, None)
    fn, head, packed = direct(run, "function", "metadata")
    assert fn == run.launch
    full = [1234, 7, None]
    fn(2, 3, 1, 55, *head, *((full,) if packed else full))
    return tuple(tuple(tuple(a) if isinstance(a, list) else a for a in got) for got in run.got), packed


@pytest.mark.parametrize("version", ["installed", "3.6", "3.7"])
def test_direct_launch_passes_what_tritons_launcher_passes(version):
    # the C function behind Triton's CUDA launcher object gets the same arguments from
    # launch.direct as from the object itself: the installed Triton's __call__, and each
    # known version's (3.7 hands the arguments over as one sequence)
    from triton.backends.nvidia.driver import CudaLauncher

    cls = {"installed": type("Installed", (_FakeLauncher, CudaLauncher), {}), "3.6": _Launcher36,
           "3.7": _Launcher37}[version]
    (through_object, through_direct), packed = _launched_both_ways(cls)
    assert through_object == through_direct
    assert packed == (version == "3.7" or (version == "installed" and not triton.__version__.startswith("3.6.")))


def test_direct_launch_keeps_the_object_where_it_cannot_tell_or_needs_scratch():
    # a launcher class that passes the arguments otherwise, or a kernel with scratch
    # memory: the object itself, called as the JIT calls it
    from fp8_moe_ops.kernels.launch import Direct, direct

    for run in (_Launcher36(global_scratch=256), _Launcher37(profile_scratch=64), _Reordered()):
        assert direct(run, "function", "metadata") == Direct(run, ("function", "metadata", None, None, None), False)


@pytest.mark.parametrize("packed", [False, True])
def test_a_cached_launch_calls_its_compiled_launcher_with_grid_stream_head_and_arguments(monkeypatch, packed):
    # Launch's GPU path after its first call, with a fake compiled launcher: the grid, the
    # current stream, the head, then the arguments with the compile-time values in place
    # (one by one, or as one sequence); on another device, through the JIT again
    from types import SimpleNamespace

    from fp8_moe_ops.kernels import launch
    from fp8_moe_ops.kernels.combine import _combine_kernel

    current = [2]
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: current[0], get_current_stream=lambda index: 100 + index)))
    got, jit = [], []
    constexprs = dict(TOPK=2, KP=2, BLOCK_H=64)
    entry = launch.Launch(_combine_kernel, (3, 1), constexprs)
    entry._direct, entry._device = launch.Direct(lambda *a: got.append(a), ("f", "m"), packed), 2
    args = ("y", "ids", "weights", "out", 5, 64, 8)
    entry(*args)
    full = ["y", "ids", "weights", "out", 5, 64, 8, 2, 2, 64]
    assert entry.full_args(args) == full
    assert got == [(3, 1, 1, 102, "f", "m", *((full,) if packed else full))]
    current[0] = 0
    entry.kernel = type("Jit", (), {"__getitem__": lambda self, grid: lambda *a, **kw: jit.append((grid, a, kw))})()
    entry(*args)
    assert len(got) == 1 and jit == [((3, 1, 1), args, constexprs)]


@pytest.mark.parametrize("packed", [False, True])
def test_a_compiled_plan_hands_each_launcher_the_new_calls_addresses(monkeypatch, packed):
    # LaunchPlan's GPU path with fake launchers: each recorded launch gets its grid, the
    # current stream and its argument list (one by one, or as one sequence where the
    # launcher takes them so: Triton 3.7), every tensor replaced by the address of the
    # new call's tensor of the same name (the output and the workspace's buffers: this
    # replay's allocations, the buffers at the layout's offsets)
    from fp8_moe_ops.kernels import launch

    first = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, True, seed=11))
    second = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, True, seed=12))
    sources = experts._stacked_sources(first)
    _, env, layout, calls = experts._stacked(first, sources)
    plan, got = record_with_fake_launchers(monkeypatch, sources, env, layout, calls, device=3, packed=packed)
    assert plan.device == 3 and len(calls) == 4  # sort + quantise, gate_up, activation, down + combine
    new = experts._stacked_sources(second)
    out, ws = replay_keeping_workspace(monkeypatch, plan, list(new.values()), second[0])
    assert ws.numel() == layout.nbytes and len(got) == len(calls)

    offsets = {name: off for name, *_, off in layout.buffers}
    name_of = {id(env[name]): name for name in [*sources, "out", *offsets] if env.get(name) is not None}
    bases = set()
    for call, args in zip(calls, got):
        entry = launch.cached(call)
        assert args[:4 + len(FAKE_HEAD)] == (*entry.grid, 103, *FAKE_HEAD)
        passed = args[4 + len(FAKE_HEAD):]
        if packed:
            assert len(passed) == 1
            passed = passed[0]
        want = entry.full_args(call.args)
        assert len(passed) == len(want)
        for value, arg in zip(passed, want):
            if not isinstance(arg, torch.Tensor):
                assert value == arg
                continue
            name = name_of[id(arg)]
            if name in offsets:
                bases.add(value - offsets[name])  # one workspace: every buffer at its offset
            else:
                assert value == (out if name == "out" else new[name]).data_ptr(), name
    assert bases == {ws.data_ptr()}


@pytest.mark.parametrize("case,static", [
    ("T1", False),
    ("T_lt_block_prime_E", True),   # 15 slots: the activation in the gate_up GEMM's launch
    ("sentinels", False),           # 36 slots: the combine in the down GEMM's
    ((30, 5, 48, 24, 3, [16, 16], "sentinel"), True),  # 90 slots: the combine's own launch
])
def test_launches_after_the_first_read_the_calls_tensors_through_the_address_table(case, static):
    # what a plan's CUDA graph does (kernels.plans): the first launch on a new call's
    # tensors, the later ones on the recorded call's hidden, routing and output, with the
    # new call's workspace (poisoned first: nothing is left from its own forward); the
    # output must be the new call's, and the recorded call's output untouched
    first = _positional(*_experts_args(case, torch.bfloat16, torch.float32, static, seed=21))
    second = _positional(*_experts_args(case, torch.bfloat16, torch.float32, static, seed=22))
    second = (*second[:3], *first[3:])  # the same layer
    out1, env1, layout, _ = experts._stacked(first, experts._stacked_sources(first))
    kept = out1.clone()
    out2, env2, _, calls = experts._stacked(second, experts._stacked_sources(second))
    assert "addresses" in [name for name, *_ in layout.buffers]
    want = out2.clone()
    assert not torch.equal(want, kept)
    torch.empty(0, dtype=torch.uint8).set_(env2["perm"].untyped_storage()).fill_(255)  # NaN, -1
    out2.fill_(float("nan"))
    stale = {id(env2[name]): env1[name] for name in (*experts.FED, "out")}
    experts.launch(calls[0])
    for call in calls[1:]:
        experts.launch(call._replace(args=tuple(stale.get(id(a), a) for a in call.args)))
    assert torch.equal(out2, want)
    assert torch.equal(out1, kept)


def test_a_plan_whose_later_launches_take_a_calls_own_tensor_gets_no_graphs(monkeypatch):
    # a graph holds the addresses it was captured with: where a launch after the first
    # takes a fed source (hidden here) or the output itself and does not read them
    # through the address table (ADDRS), the plan launches every kernel on every call
    args = _positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=1))
    sources = experts._stacked_sources(args)
    _, env, layout, calls = experts._stacked(args, sources)
    plan, _ = record_with_fake_launchers(monkeypatch, sources, env, layout, calls, fed=experts.FED)
    assert plan._baked is not None
    assert not calls[1].constexprs["ADDRS"] and calls[-1].constexprs["ADDRS"]  # (the down GEMM's combine)
    for name in ("hidden", "out"):
        later = calls[1]._replace(args=(env[name], *calls[1].args[1:]))
        plan, _ = record_with_fake_launchers(monkeypatch, sources, env, layout, [calls[0], later, *calls[2:]],
                                             fed=experts.FED)
        assert plan is not None and plan._baked is None, name


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` over a list of fake launches: it holds the
    launches appended while it captures, and a replay appends ("graph", itself,
    "replay"); its executable's handle is its id (``executables``)."""

    launched: list = []
    executables: dict = {}
    failures: list = [0]  # how many captures from now on fail

    def capture_begin(self, capture_error_mode):
        assert capture_error_mode == "thread_local"
        self._start = len(self.launched)

    def capture_end(self):
        if self.failures[0] > 0:
            self.failures[0] -= 1
            raise RuntimeError("the capture failed")
        self.launches = self.launched[self._start:]

    def replay(self):
        self.launched.append(("graph", self, "replay"))

    def raw_cuda_graph_exec(self):
        self.executables[id(self)] = self
        return id(self)


@pytest.mark.parametrize("driver", [False, True], ids=["replay", "cuGraphLaunch"])
def test_a_plan_replays_its_later_launches_as_graphs_per_stream_thread_and_layer(monkeypatch, driver):
    # LaunchPlan's CUDA graphs with fake launchers and a fake graph: the first replay of
    # a layer (its weights' addresses) on a stream and thread launches every kernel on a
    # workspace of its own; the second captures the later launches on the workspace all
    # plans' graphs share on that stream and thread (allocated then, on another thread),
    # and it and every later one launch the first kernel on the call's tensors, then the
    # graph; another stream, thread or layer gets its own graph; a larger plan's graph
    # replaces the shared workspace (allocated on the call's stream), and the graphs on the
    # old one are captured again, as after all are released; a new stream's frees an ended
    # thread's; while the stream is being captured, past the limit with every thread
    # alive, or where the workspace could not be allocated, every kernel is launched as
    # without graphs; after a failed capture too, for a wait that grows eightfold with
    # each failure, and for good after the fourth.  Graphs are launched through the driver's
    # cuGraphLaunch on the call's stream (a fake here) where it is there, else replayed by
    # torch; a driver error raises.  They are captured on a stream of the call's priority,
    # made by the driver in the device's context where it is there (one per priority),
    # else taken from torch's pool
    import contextlib
    import threading
    from types import SimpleNamespace

    from fp8_moe_ops.kernels import plans

    def args_of(seed, layer, case="sentinels"):
        args = _positional(*_experts_args(case, torch.bfloat16, torch.float32, False, seed=seed))
        return (*args[:3], *layer[3:])

    layers = [_positional(*_experts_args("sentinels", torch.bfloat16, torch.float32, False, seed=s)) for s in (1, 2)]
    larger = (30, 5, 48, 24, 3, [16, 16], "sentinel")  # the same weights, more slots
    recorded, launched = {}, []
    for name, first in (("plan", layers[0]), ("larger", args_of(3, layers[0], larger))):
        sources = experts._stacked_sources(first)
        _, env, layout, calls = experts._stacked(first, sources)
        recorded[name], _ = record_with_fake_launchers(monkeypatch, sources, env, layout, calls, fed=experts.FED,
                                                       launched=launched)
        assert len(calls) == (4 if name == "plan" else 5)  # the larger one: the combine's own launch
    plan = recorded["plan"]
    assert recorded["larger"]._layout.nbytes > plan._layout.nbytes
    launched.clear()
    stream, capturing, priority = [103], [False], [0]
    monkeypatch.setattr(plans, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 3, get_current_stream=lambda index: stream[0])))
    fresh_graph_workspaces(monkeypatch)
    monkeypatch.setattr(plans, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(plans, "_ARENA_STEP", 16)
    monkeypatch.setattr(_FakeGraph, "launched", launched)
    monkeypatch.setattr(_FakeGraph, "executables", {})
    monkeypatch.setattr(_FakeGraph, "failures", [0])
    driver_error = [0]

    def cu_graph_launch(executable, on_stream):
        launched.append(("graph", _FakeGraph.executables[executable], on_stream))
        return driver_error[0]

    monkeypatch.setattr(plans, "_DRIVER_LAUNCH", cu_graph_launch if driver else False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    made_streams = []  # (how, device, priority) of each capture stream made

    def pool_stream(device, priority):
        made_streams.append(("pool", device, priority))
        return SimpleNamespace(cuda_stream=999 + priority)

    def create_stream(handle, flags, priority):  # cuStreamCreateWithPriority
        assert flags.value == 1  # non-blocking
        handle._obj.value = 999 + priority.value
        return 0

    context = [3]  # the device of the thread's current context

    def context_device(device):  # cuCtxGetDevice
        device._obj.value = context[0]
        return 0

    def external_stream(handle, device):
        made_streams.append(("driver", device.index, handle - 999))
        return SimpleNamespace(cuda_stream=handle)

    monkeypatch.setattr(plans, "_LIBCUDA", [SimpleNamespace(cuStreamCreateWithPriority=create_stream,
                                                            cuCtxGetDevice=context_device) if driver else None])
    monkeypatch.setattr(torch.cuda, "Stream", pool_stream)
    monkeypatch.setattr(torch.cuda, "ExternalStream", external_stream)

    class Current(tuple):  # ("current", the stream), and its priority
        @property
        def priority(self):
            return priority[0]

    entered = []  # (thread, stream) of each torch.cuda.stream context
    monkeypatch.setattr(torch.cuda, "stream", lambda s: entered.append((threading.get_ident(), s)) or
                        contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Current(("current", stream[0])))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    empty, limit, tried = torch.empty, [None], []  # (the most bytes a shared workspace can have; sizes refused)

    def replay(args, plan=plan):
        """(the launches, the workspaces allocated, on any thread)"""
        before, made, caller = len(launched), [], threading.get_ident()

        def allocate(*a, **kw):
            if limit[0] is not None and threading.get_ident() != caller and a[0] > limit[0]:
                tried.append(a[0])
                raise torch.OutOfMemoryError("no memory for a shared workspace")
            made.append(empty(*a, **kw))
            return made[-1]

        with monkeypatch.context() as m:
            m.setattr(torch, "empty", allocate)
            plan.run(list(experts._stacked_sources(args).values()), args[0])
        return launched[before:], [t for t in made if t.dtype == torch.uint8]

    def on(launch, ws):  # the launch's stream, and whether it takes ws's buffers (none other)
        inside = [v for v in launch[4 + len(FAKE_HEAD):] if type(v) is int and v > 1 << 20]
        base = ws.data_ptr()
        return launch[3], any(base <= v < base + ws.numel() for v in inside)

    def plain(args, plan=plan):  # every launch, on the current stream and a workspace of its own
        got, made = replay(args, plan)
        assert len(made) == 1 and {on(launch, made[0]) for launch in got} == {(stream[0], True)}
        return got

    def graphed(args, kept=None, capture=True, plan=plan, side=999):  # the first launch, then the graph
        first = len(entered)
        got, made = replay(args, plan)
        if kept is None:  # a shared workspace allocated now, on the call's stream by another thread
            (kept,) = made
            assert kept.numel() >= plan._layout.nbytes
            helper, on_stream = entered[first]
            assert helper != threading.get_ident() and on_stream == ("current", stream[0])
        else:
            assert made == []
        if capture:  # the later launches captured on the capture stream
            n = len(plan._steps) - 1
            captured, got = got[:n], got[n:]
            assert [on(launch, kept) for launch in captured] == [(side, True)] * n
        assert len(got) == 2 and got[1][::2] == ("graph", stream[0] if driver else "replay")
        assert on(got[0], kept) == (stream[0], True)
        assert args[0].data_ptr() in got[0] and args[1].data_ptr() in got[0]  # the call's hidden and ids
        return got[1][1], kept

    plain(args_of(10, layers[0]))
    graph_a, kept = graphed(args_of(11, layers[0]))
    assert graphed(args_of(12, layers[0]), kept, capture=False) == (graph_a, kept)
    plain(args_of(13, layers[1]))
    graph_b, _ = graphed(args_of(14, layers[1]), kept)  # the other layer: its own graph, the same workspace
    assert graph_b is not graph_a and graph_b.launches != graph_a.launches
    capturing[0] = True
    plain(args_of(15, layers[0]))
    capturing[0] = False
    stream[0] = 104
    plain(args_of(16, layers[0]))
    graph_c, kept_c = graphed(args_of(17, layers[0]))
    assert graph_c is not graph_a and kept_c.data_ptr() != kept.data_ptr()
    stream[0] = 103
    errors = []

    def in_a_thread():
        try:
            plain(args_of(18, layers[0]))
            graphed(args_of(19, layers[0]))
        except BaseException as e:  # (re-raised below)
            errors.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert errors == [] and plan.graphs == 4 and len(plans._ARENAS) == 3
    assert graphed(args_of(20, layers[0]), kept, capture=False) == (graph_a, kept)
    # the larger plan: a shared workspace twice as large, on which the first plan's graph is captured again
    plain(args_of(21, layers[0], larger), plan=recorded["larger"])
    _, grown = graphed(args_of(22, layers[0], larger), plan=recorded["larger"])
    assert grown.numel() == max(2 * kept.numel(), recorded["larger"]._layout.nbytes)
    graph_a2, _ = graphed(args_of(23, layers[0]), grown)
    assert graph_a2 is not graph_a and plan.graphs == 4
    assert graphed(args_of(24, layers[0]), grown, capture=False) == (graph_a2, grown)
    # a new stream's shared workspace: the ended thread's is freed first; past the limit,
    # with every thread alive, a new stream launches every kernel
    stream[0] = 105
    plain(args_of(25, layers[0]))
    graphed(args_of(26, layers[0]))
    assert len(plans._ARENAS) == 3 and {k[1] for k in plans._ARENAS} == {103, 104, 105}
    monkeypatch.setattr(plans, "_MAX_ARENAS", 3)
    stream[0] = 106
    for seed in (27, 28, 29):
        plain(args_of(seed, layers[0]))
    assert len(plans._ARENAS) == 3
    # out of memory for a shared workspace: every launch, and no second try until released
    stream[0] = 103
    plans.release_graph_workspaces()
    limit[0] = 0
    plain(args_of(30, layers[0]))
    plain(args_of(31, layers[0]))
    assert len(tried) == 1
    limit[0] = None
    plain(args_of(32, layers[0]))
    plans.release_graph_workspaces()
    graph_e, kept_e = graphed(args_of(33, layers[0]))
    assert graph_e is not graph_a2  # captured again, on a new shared workspace
    # a stream of a higher priority: captured on a capture stream of that priority
    stream[0], priority[0] = 107, -1
    plain(args_of(39, layers[0]))
    graphed(args_of(40, layers[0]), side=998)
    how = "driver" if driver else "pool"
    assert made_streams[0] == (how, 3, 0) and made_streams[-1] == (how, 3, -1)
    assert set(made_streams) == {(how, 3, 0), (how, 3, -1)}
    assert (len(made_streams) == 2) == driver  # the driver's kept; torch's pool asked per capture
    # the thread's context another device's: a stream of torch's pool, the driver asked again next time
    context[0], stream[0], priority[0] = 2, 108, -2
    plain(args_of(41, layers[0]))
    graphed(args_of(42, layers[0]), side=997)
    assert made_streams[-1] == ("pool", 3, -2) and (3, -2) not in plans._CAPTURE_STREAMS
    context[0], stream[0], priority[0] = 3, 103, 0
    # growing it where twice its size cannot be had: the size the larger plan needs
    monkeypatch.setattr(plans, "_MAX_ARENAS", 16)
    monkeypatch.setattr(plans, "_ARENA_STEP", 9000)
    least = -(-recorded["larger"]._layout.nbytes // 9000) * 9000
    for seed, on_stream in ((43, 109), (46, 110)):
        stream[0] = on_stream
        plain(args_of(seed, layers[0]))
        graph_f, kept_f = graphed(args_of(seed + 1, layers[0]))
        assert 2 * kept_f.numel() > least  # (the test's premise)
        plain(args_of(seed + 2, layers[0], larger), plan=recorded["larger"])
    del tried[:]
    stream[0], limit[0] = 109, least
    _, grown = graphed(args_of(49, layers[0], larger), plan=recorded["larger"])
    assert tried == [2 * kept_f.numel()] and grown.numel() == least
    # out of memory growing it: the larger plan launches every kernel (and does not try
    # again), the workspace it would have replaced stays for the graphs on it
    stream[0], limit[0] = 110, 0
    del tried[:]
    for seed in (50, 51):
        plain(args_of(seed, layers[0], larger), plan=recorded["larger"])
    assert tried == [2 * kept_f.numel(), least]
    assert graphed(args_of(52, layers[0]), kept_f, capture=False) == (graph_f, kept_f)
    # a failed capture: that call launches every kernel (on the shared workspace, allocated
    # for the capture), the next 7 on a workspace of their own, the 8th tries again (here
    # captured); a key whose captures keep failing tries again on the 64th call after the
    # second failure, the 512th after the third, and never after the fourth
    n = len(plan._steps) - 1

    def failed(args, first):
        got, made = replay(args)
        assert len(made) == first  # (the shared workspace, allocated for the first try)
        shared = plans._ARENAS[(3, stream[0], threading.get_ident())][0]
        assert [on(launch, shared) for launch in got] == [(999, True)] * n + [(stream[0], True)] * (n + 1)
        return shared

    stream[0], limit[0] = 111, None
    plain(args_of(53, layers[0]))
    _FakeGraph.failures[0] = 1
    shared = failed(args_of(54, layers[0]), 1)
    args = args_of(55, layers[0])
    for _ in range(7):
        plain(args)
    graph_g, _ = graphed(args_of(56, layers[0]), shared)
    assert graphed(args_of(57, layers[0]), shared, capture=False) == (graph_g, shared)
    stream[0] = 114
    plain(args)
    _FakeGraph.failures[0] = 4
    for tries, wait in enumerate((8, 64, 512, 1000)):
        failed(args, tries == 0)
        for _ in range(wait - 1):
            plain(args)
    assert _FakeGraph.failures[0] == 0 and plans._FAILED in plan._graphs.values()
    # a thread that Python did not start (``_thread``) counts as alive: a new stream's
    # workspace does not free its one
    import _thread
    captured, resume, foreign = threading.Event(), threading.Event(), []

    def not_pythons():
        try:
            foreign.append(threading.get_ident())
            plain(args_of(80, layers[0]))
            graphed(args_of(81, layers[0]))
        except BaseException as e:  # (re-raised below)
            errors.append(e)
        captured.set()
        resume.wait()

    stream[0] = 112
    _thread.start_new_thread(not_pythons, ())
    captured.wait()
    stream[0] = 113
    plain(args_of(82, layers[0]))
    graphed(args_of(83, layers[0]))
    resume.set()
    assert errors == [] and (3, 112, foreign[0]) in plans._ARENAS and (3, 113, threading.get_ident()) in plans._ARENAS
    stream[0] = 103
    if driver:  # a failed cuGraphLaunch raises, naming it
        driver_error[0] = 400
        with pytest.raises(RuntimeError, match="cuGraphLaunch .* CUDA driver error 400"):
            replay(args_of(38, layers[0]))


def _gemm_args(name, static, seed, scale_dtype=torch.float32):
    """One call's arguments of GEMM op ``name`` (all seven or six, schema order): 13 rows
    of K = 40 over 3 experts (``linear``: the first), [16, 16] blocks, N = 24, float32
    out; routing with an empty expert and a sentinel row."""
    gen = torch.Generator().manual_seed(seed)
    w, ws = _weights(gen, 3, 24, 40, [16, 16], scale_dtype)
    x = torch.randn(13, 40, generator=gen).to(torch.bfloat16)
    a = torch.rand(1 if name == "linear" else 3, generator=gen) * 0.01 + 0.002 if static else None
    if name == "linear":
        return (x, w[0], ws[0], [16, 16], a, torch.float32)
    if name == "grouped_mm":
        return (x, w, ws, _counts_to_offsets([5, 0, 7]), [16, 16], a, torch.float32)
    ids = torch.randint(0, 3, (13,), generator=gen)
    ids[4] = 3  # a sentinel: a zero row
    return (x, w, ws, ids, [16, 16], a, torch.float32)


@pytest.mark.parametrize("name", ["linear", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32", "ue8m0"])
def test_gemm_op_records_a_plan_on_its_second_call_and_replays_it_bitwise(name, static, scale_dtype):
    # the GEMM ops' CUDA kernel (kernels.GemmPlans), driven with CPU tensors and the
    # interpreted kernels: checks + forward, then record, then replays of other values
    from fp8_moe_ops import ops
    from fp8_moe_ops.kernels.plans import LaunchPlan

    checked = []
    check = getattr(ops, f"check_{name}")
    plans = kernels.GemmPlans(name, lambda *args: checked.append(True) or check(*args))
    calls = [_gemm_args(name, static, seed, scale_dtype) for seed in (1, 2, 3, 4)]
    states = []
    with mock.patch.object(LaunchPlan, "run", autospec=True, side_effect=LaunchPlan.run) as run:
        for args in calls:
            want = getattr(kernels, name)(*args)
            got = plans(args)
            assert got.shape == (13, 24) and got.dtype == torch.float32 and torch.equal(got, want)
            states.append(type(next(iter(plans.states.values()))))
    assert states == [type(None), LaunchPlan, LaunchPlan, LaunchPlan]
    assert run.call_count == 2  # the third and fourth calls replayed
    assert len(plans.states) == 1 and len(checked) == 1
    assert not torch.equal(plans(calls[3]), plans(calls[2]))
    _ulp_close(plans(calls[3]), getattr(reference, name)(*calls[3]))
    bad = list(calls[0])
    bad[0] = bad[0][:, :32]  # x of another K: a new key, checked, rejected
    with pytest.raises(ValueError, match=r"^x: expected last dim K = "):
        plans(tuple(bad))
    assert len(plans.states) == 1


@pytest.mark.parametrize("name", ["grouped_mm", "batched_mm"])
def test_gemm_op_replays_behind_its_metadata_guard(name):
    # once a key has a plan, a call with the same metadata skips the Python key; another
    # dtype of x is refused by the guard and rejected by the checks
    from fp8_moe_ops import ops
    from fp8_moe_ops._checks import meta_key

    if ops.metadata_guard([torch.zeros(1)]) is None:
        pytest.skip("this torch has no C++ tensor-metadata guard")
    plans = kernels.GemmPlans(name, getattr(ops, f"check_{name}"))
    calls = [_gemm_args(name, True, seed) for seed in (5, 6, 7)]
    for args in calls[:2]:
        plans(args)
    with mock.patch("fp8_moe_ops.kernels.plans.meta_key", wraps=meta_key) as keyed:
        assert torch.equal(plans(calls[2]), getattr(kernels, name)(*calls[2]))
        assert keyed.call_count == 0
        bad = list(calls[2])
        bad[0] = bad[0].double()
        with pytest.raises(TypeError, match=r"^x: expected dtype"):
            plans(tuple(bad))
        assert keyed.call_count == 1


@pytest.mark.parametrize("name", ["linear", "grouped_mm", "batched_mm"])
def test_gemm_op_plans_of_zero_rows_launch_nothing(name):
    # no row: an empty output of the recorded dtype on every call, no plan to record
    from fp8_moe_ops import ops

    args = list(_gemm_args(name, False, 10))
    args[0] = args[0][:0]
    if name == "batched_mm":
        args[3] = args[3][:0]
    plans = kernels.GemmPlans(name, getattr(ops, f"check_{name}"))
    for _ in range(3):
        out = plans(tuple(args))
        assert out.shape == (0, 24) and out.dtype == torch.float32
    assert list(plans.states.values()) == [False]


def _bad_gemm_cases():
    """Bad inputs of the GEMM ops' CPU tests (tests/test_bad_input.py) but the value checks
    (finite positive scales, monotonic offsets: CPU only)."""
    from test_bad_input import GROUPED_BAD, LINEAR_BAD

    return [("linear", *c) for c in LINEAR_BAD if "finite positive" not in c[2]] + [
        ("grouped_mm", *c) for c in GROUPED_BAD if "non-decreasing" not in c[2] and "<=" not in c[2]]


@pytest.mark.parametrize("name,change,exc,match", _bad_gemm_cases())
def test_gemm_op_plans_reject_bad_input_after_good_calls(name, change, exc, match):
    # the checks run once per metadata, then a plan replays (behind a guard where the
    # sources are the arguments): a bad call after good ones still meets every check
    from fp8_moe_ops import ops
    from test_bad_input import _grouped_args, _linear_args

    args_of = _linear_args if name == "linear" else _grouped_args
    plans = kernels.GemmPlans(name, getattr(ops, f"check_{name}"))
    names = plans.ARG_NAMES
    assert names[:3] == ("x", "w", "w_scale_inv") and names[-3:] == ("block_size", "act_scale", "out_dtype")
    for _ in range(3):
        plans(tuple(args_of().get(n) for n in names))
    assert len(plans.states) == 1
    with pytest.raises(exc, match=match):
        plans(tuple((args_of() | change).get(n) for n in names))


def test_a_compiled_gemm_plan_allocates_the_recorded_output(monkeypatch):
    # a GEMM op's output is not like its input rows ((M, N) in out_dtype against x's
    # (M, K)): a replay allocates the recorded shape and dtype, and hands the launchers
    # the new call's addresses (linear's weight and scales read as one expert's: views
    # at the arguments' addresses)
    first, second = _gemm_args("linear", False, 8), _gemm_args("linear", False, 9)
    sources = gemms._sources("linear", first)
    _, env, layout, calls = gemms.gemm_forward("linear", sources, first[3], first[5])
    plan, got = record_with_fake_launchers(monkeypatch, sources, env, layout, calls, device=3)
    assert plan.device == 3 and len(calls) == 2  # the quantisation, the GEMM
    new = gemms._sources("linear", second)
    out, ws = replay_keeping_workspace(monkeypatch, plan, list(new.values()), second[0])
    assert out.shape == (13, 24) and out.dtype == torch.float32 and ws.numel() == layout.nbytes
    addresses = {v for args in got for v in args if isinstance(v, int)}
    assert {second[0].data_ptr(), second[1].data_ptr(), second[2].data_ptr(), out.data_ptr()} <= addresses
    assert first[0].data_ptr() not in addresses


@pytest.mark.parametrize("shared,other", [("down_act_scale", "gate_up_act_scale"),
                                          ("down_scale_inv", "gate_up_scale_inv")])
def test_plan_recorded_from_one_tensor_passed_twice(shared, other):
    # one tensor for both projections' act scales, or per-tensor weight scales, when
    # recorded; two tensors later: each argument is read from its own tensor
    args, kw = _experts_args("T1", torch.bfloat16, torch.float32, static=True, per_tensor=True)
    given = dict(zip(_arg_names(), _positional(args, kw)))
    states, _ = _recorded(tuple({**given, shared: given[other]}.values()))
    assert not torch.equal(given[shared], given[other])
    assert torch.equal(kernels.planned_experts(states, "sig", tuple(given.values())),
                       kernels.grouped_experts(*given.values()))
