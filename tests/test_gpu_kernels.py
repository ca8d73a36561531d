"""The CUDA (Triton) implementation of every fp8_moe op against the CPU reference.

Marked ``gpu``; skipped without a CUDA device.  On the H200:
``python -m pytest -m gpu tests/test_gpu_kernels.py -q`` (a few minutes).  Every input
comes from a seeded generator, so a failure reproduces.  What is checked:

* activation quantisation (dynamic and static): bytes and scales bitwise equal to the
  reference's, on random data and on every e4m3 rounding case, at static scales inside
  and outside the fast division's bounds and dynamic groups of extreme magnitudes;
  the fast division (reciprocal once, two fma steps) bitwise equal to torch's IEEE
  division on adversarial pairs, and the fma instruction rounding once; NaN where the
  reference's is NaN for NaN and infinite inputs, and a NaN token's output row NaN;
* linear / grouped_mm / batched_mm / grouped_experts / batched_experts through
  ``torch.ops.fp8_moe`` on CUDA vs the same op on CPU, at adversarial shapes, static
  and dynamic, float32 and UE8M0 scales, per-tensor scales, bf16 / fp16 / fp32;
* every output element written: the caching allocator's free blocks are filled with
  NaN before each call, so an unwritten element reads back as NaN; rows of sentinel
  slots only (and grouped_mm rows past ``offsets[-1]``) must be exactly zero;
* grouped == batched experts bitwise, and run to run;
* at decode, the activation and the combine in the GEMMs' launches give the same bytes
  as their own kernels;
* a launch plan (recorded by an op's first call of an argument signature, replayed by
  later calls) equals the forward itself bitwise on new inputs of that signature;
* ``grouped_experts`` captured in a CUDA graph and replayed with new routing equals an
  eager call on that routing, bitwise (no host sync, routing-independent grid);
* every launch config of the shipped table, at the benchmark layers' shapes, agrees
  with the BM = 16 config that the small shapes compare with the reference.
"""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch

from fp8_moe_ops import reference, routing
from fp8_moe_ops import kernels
from fp8_moe_ops.kernels import experts, gemms, moe, plans, ws_gemm
from fp8_moe_ops.kernels.experts import ARG_NAMES
from fp8_moe_ops.kernels.plans import LaunchPlan

from helpers import (EXPERTS_BOUND, GEMM_BOUND, LARGE_WEIGHTS, MODELS, division_cases, division_matches,
                     fma_cases, fresh_graph_workspaces, make_expert_weights, make_experts_inputs, make_routing,
                     poison_free_memory, random_fp8_weights, rel_err, row_experts, run_elementwise, static_scale_cases, static_slot_ids,
                     uneven_offsets, with_split_k)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPS = torch.ops.fp8_moe
E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn


def _cuda(t):
    return t.cuda() if isinstance(t, torch.Tensor) else t


def _assert_written(out: torch.Tensor, ref: torch.Tensor) -> None:
    unwritten = (out.isnan().cpu() & ~ref.isnan()).sum().item()
    assert unwritten == 0, f"{unwritten} unwritten (NaN) elements"


# --------------------------------------------------------------------------- quantisation


def _e4m3_rounding_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours, the floats just above
    and below each midpoint, signed zeros, values past the range and infinities."""
    grid = torch.arange(0, 256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9)),
                      torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-3, 126.24, 17.0, float("inf"), float("-inf")])])


def test_static_quantisation_every_rounding_case_bitwise():
    x = _e4m3_rounding_cases()[:, None].expand(-1, 128).contiguous()
    one = torch.ones(1)
    q, _ = moe._quantize(x.cuda(), 128, x.shape[0], offsets=torch.tensor([x.shape[0]], dtype=torch.int32).cuda(),
                         act_scale=one.cuda())
    assert torch.equal(q.cpu().view(torch.uint8), reference.quantize_act_static(x, one).view(torch.uint8))


def test_fma_rounds_once_and_division_by_reciprocal_is_ieee_bitwise():
    a, b, c, want = fma_cases()
    assert torch.equal(run_elementwise(a.cuda(), b.cuda(), c.cuda()).cpu().view(torch.int32), want.view(torch.int32))
    x, d = division_cases(200000)
    assert division_matches(run_elementwise(x.cuda(), d.cuda()).cpu(), x, d)


def test_static_quantisation_at_any_scale_bitwise():
    x, offsets, scales = static_scale_cases(128)
    q, _ = moe._quantize(x.cuda(), 128, x.shape[0], offsets=offsets.cuda(), act_scale=scales.cuda())
    ref = reference.quantize_act_static(x, scales[row_experts(offsets)][:, None])
    assert torch.equal(q.cpu().view(torch.uint8), ref.view(torch.uint8))
    # each token into its slots (the prefill path), slot 1 with another expert's scale
    T, E = x.shape[0], scales.numel()
    ids = static_slot_ids(offsets)
    q = torch.zeros(T * 3, 128, dtype=FP8, device="cuda")
    moe.launch(moe._quant_call(x.cuda(), q, scales.cuda(), T, 128, static=True, topk=3, ids=ids.cuda(),
                               num_experts=E))
    q = q.cpu().view(T, 3, 128)
    for j in range(2):
        ref = reference.quantize_act_static(x, scales[ids[:, j].long()][:, None])
        assert torch.equal(q[:, j].view(torch.uint8), ref.view(torch.uint8)), j


def test_static_slot_quantisation_looping_over_k_groups_bitwise():
    # a prefill-sized launch (2048 tokens x 8 slots, 16 K groups of 128): its programs take
    # 2 groups each (quant.groups_per_program), stored at each slot's sorted row; scales
    # in the reciprocal's bounds, one expert's past them
    gen = torch.Generator().manual_seed(11)
    T, k, E, K = 2048, 8, 128, 2048
    x = (torch.randn(T, K, generator=gen) * torch.logspace(-4, 2, K)).to(torch.bfloat16)
    scales = torch.rand(E, generator=gen) * 0.01 + 0.01
    scales[7] = 2.0 ** 41
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    dest = torch.randperm(T * k, generator=gen).to(torch.int32)
    q = torch.zeros(T * k, K, dtype=FP8, device="cuda")
    call = moe._quant_call(x.cuda(), q, scales.cuda(), T, 128, static=True, topk=k, ids=ids.cuda(), num_experts=E,
                           dest=dest.cuda())
    assert call.constexprs["GPP"] == 2
    moe.launch(call)
    q = q.cpu()[dest.long()].view(T, k, K)
    for j in range(k):
        ref = reference.quantize_act_static(x, scales[ids[:, j].long()][:, None])
        assert torch.equal(q[:, j].view(torch.uint8), ref.view(torch.uint8)), j


def test_dynamic_quantisation_of_extreme_magnitudes_bitwise():
    gen = torch.Generator().manual_seed(5)
    mags = torch.tensor([2.0 ** -70, 2.0 ** -52, 1e-30, 1.0, 2.0 ** 51, 1e30, 2.0 ** 70, 3e36])
    x = (torch.randn(64, 512, generator=gen) * mags.repeat(8)[:, None])
    x[:, 128:256] *= 2.0 ** -20
    q, s = moe._quantize(x.cuda(), 128, 64)
    rq, rs = reference.quantize_act_dynamic(x, 128)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("T,K,group", [
    (1, 128, 128),    # T=1
    (333, 7168, 128),  # deepseek_v3's H, T not a multiple of any block
    (64, 400, 128),   # K not a multiple of the group
    (50, 96, 32),     # small group
])
def test_dynamic_quantisation_bitwise(dtype, T, K, group):
    gen = torch.Generator().manual_seed(T * K + group)
    # magnitudes over seven decades across K; one all-zero group (scale of a zero group)
    x = (torch.randn(T, K, generator=gen) * torch.logspace(-4, 3, K)).to(dtype)
    x[0, :group] = 0
    poison_free_memory()
    q, s = moe._quantize(x.cuda(), group, T)
    rq, rs = reference.quantize_act_dynamic(x, group)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


def _assert_same_nan_then_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    """NaN exactly where ``want`` is NaN (a NaN byte's sign bit is the cast instruction's
    choice), every other byte equal."""
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


def test_nan_and_inf_inputs_quantise_as_the_reference():
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(3))
    x[1, 5] = float("nan")  # dynamic: the whole group's scale and bytes NaN, as torch's amax
    x[2, 200] = -float("nan")
    x[3, :] = float("nan")
    x[4, 130] = float("inf")  # dynamic: scale inf, the inf itself NaN (inf / inf), the rest 0
    q, s = moe._quantize(x.cuda(), 128, x.shape[0])
    rq, rs = reference.quantize_act_dynamic(x, 128)
    _assert_same_nan_then_bitwise(s.cpu(), rs)
    _assert_same_nan_then_bitwise(q.cpu(), rq)
    one = torch.ones(1)
    q, _ = moe._quantize(x.cuda(), 128, x.shape[0], offsets=torch.tensor([x.shape[0]], dtype=torch.int32).cuda(),
                         act_scale=one.cuda())
    _assert_same_nan_then_bitwise(q.cpu(), reference.quantize_act_static(x, one))


@pytest.mark.parametrize("limit", [None, 7.0], ids=["no limit", "swiglu_limit"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("T", [1, 6])
def test_a_nan_or_inf_in_a_token_reaches_its_row_alone(T, poison, static, limit):
    # T=1: the activation and the combine in the GEMMs' launches; T=6: their own kernels.
    # NaN makes its token's row NaN; Inf does too under dynamic scales (its group's scale
    # is Inf, Inf / Inf is NaN) and saturates to +-448 under static ones (a finite row).
    # A swiglu_limit keeps a NaN (the GPU's plain min / max had clamped it to the limit).
    args = make_experts_inputs(T, 4, 256, 128, 2, [128, 128], static=static, seed=3)
    args["hidden"][T // 2, 7] = float(poison)
    args["swiglu_limit"] = limit
    out = OPS.grouped_experts(**{key: _cuda(v) for key, v in args.items()}).cpu()
    ref = OPS.grouped_experts(**args)
    row_is_nan = poison == "nan" or not static
    others = torch.arange(T) != T // 2
    assert bool(ref[T // 2].isnan().all()) == row_is_nan and not ref[others].isnan().any() and not ref.isinf().any()
    assert torch.equal(out.isnan(), ref.isnan()) and not out.isinf().any()
    assert rel_err(out[~ref.isnan()], ref[~ref.isnan()]) < EXPERTS_BOUND


# --------------------------------------------------------------------------- GEMMs

GEMM_CASES = {  # S rows, E experts, N, K, block
    "T=1": (1, 3, 256, 384, [128, 128]),
    "T<block, prime E, N/K not multiples": (45, 7, 200, 400, [128, 128]),
    "block 32": (300, 5, 96, 160, [32, 32]),
    "bn!=bk, bk=96": (130, 4, 150, 288, [64, 96]),
    "large": (2048, 8, 1024, 2048, [128, 128]),
}
# and a shape of the launch plans' test: more rows than the one-launch sort takes
GEMM_SHAPES = {**GEMM_CASES, "past the one-launch sort": (4096, 8, 512, 2048, [128, 128])}
DTYPES = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None), "bf16->fp32": (torch.bfloat16, torch.float32)}


def _gemm_inputs(case, static, scale_dtype, dtype, seed):
    S, E, N, K, block = GEMM_SHAPES[case]
    gen = torch.Generator().manual_seed(seed)
    # per-tensor weight scales (E, 1, 1) on one case
    w, ws = make_expert_weights(E, N, K, block, scale_dtype, per_tensor=(S == 45 and scale_dtype == E8M0), std=0.05,
                                gen=gen)
    x = torch.randn(S, K, generator=gen).to(dtype)
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    return gen, x, w, ws, a, block


gemm_params = pytest.mark.parametrize("case", list(GEMM_CASES))
gemm_combos = [pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"]),
               pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["f32scale", "e8m0scale"]),
               pytest.mark.parametrize("dtypes", list(DTYPES))]


def _gemm_test(fn):
    for mark in (gemm_params, *gemm_combos):
        fn = mark(fn)
    return fn


@_gemm_test
def test_linear_matches_cpu(case, static, scale_dtype, dtypes):
    dtype, out_dtype = DTYPES[dtypes]
    _, x, w, ws, a, block = _gemm_inputs(case, static, scale_dtype, dtype, seed=1)
    a0 = None if a is None else a[:1]
    poison_free_memory()
    out = OPS.linear(x.cuda(), w[0].cuda(), ws[0].cuda(), block, _cuda(a0), out_dtype)
    ref = OPS.linear(x, w[0], ws[0], block, a0, out_dtype)
    _assert_written(out, ref)
    assert rel_err(out.cpu(), ref) < GEMM_BOUND[out_dtype or dtype]


@_gemm_test
def test_grouped_mm_matches_cpu(case, static, scale_dtype, dtypes):
    dtype, out_dtype = DTYPES[dtypes]
    gen, x, w, ws, a, block = _gemm_inputs(case, static, scale_dtype, dtype, seed=2)
    S, E = x.shape[0], w.shape[0]
    offsets = uneven_offsets(S, E, gen, unrouted=S // 5)  # expert 1 empty, a fifth of the rows past the end
    poison_free_memory()
    out = OPS.grouped_mm(x.cuda(), w.cuda(), ws.cuda(), offsets.cuda(), block, _cuda(a), out_dtype)
    ref = OPS.grouped_mm(x, w, ws, offsets, block, a, out_dtype)
    _assert_written(out, ref)
    assert (out[int(offsets[-1]):] == 0).all()
    assert rel_err(out.cpu(), ref) < GEMM_BOUND[out_dtype or dtype]


@_gemm_test
def test_batched_mm_matches_cpu(case, static, scale_dtype, dtypes):
    dtype, out_dtype = DTYPES[dtypes]
    gen, x, w, ws, a, block = _gemm_inputs(case, static, scale_dtype, dtype, seed=3)
    E = w.shape[0]
    ids = torch.randint(-1, E + 1, (x.shape[0],), generator=gen)  # sentinels -1 and E among the rows
    poison_free_memory()
    out = OPS.batched_mm(x.cuda(), w.cuda(), ws.cuda(), ids.cuda(), block, _cuda(a), out_dtype)
    ref = OPS.batched_mm(x, w, ws, ids, block, a, out_dtype)
    _assert_written(out, ref)
    assert (out[((ids < 0) | (ids >= E)).cuda()] == 0).all()
    assert rel_err(out.cpu(), ref) < GEMM_BOUND[out_dtype or dtype]


@pytest.mark.parametrize("name", ["linear", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", ["T=1", "T<block, prime E, N/K not multiples", "large", "past the one-launch sort"])
def test_gemm_op_plans_replay_new_inputs_bitwise(name, static, case):
    # a GEMM op's second call of a signature records its launches (the Gluon kernel's
    # too, where it runs), later calls replay them behind the guard: bitwise the
    # forward's output on new values, and the CPU reference's to the GEMMs' bound
    def inputs(seed):
        gen, x, w, ws, a, block = _gemm_inputs(case, static, torch.float32, torch.bfloat16, seed)
        S, E = x.shape[0], w.shape[0]
        if name == "linear":
            return (x, w[0], ws[0], block, None if a is None else a[:1], None)
        if name == "grouped_mm":
            return (x, w, ws, uneven_offsets(S, E, gen, unrouted=S // 5), block, a, None)
        return (x, w, ws, torch.randint(-1, E + 1, (S,), generator=gen), block, a, None)

    op = getattr(OPS, name)
    first, second = inputs(1), inputs(2)
    first_gpu, second_gpu = [tuple(_cuda(t) for t in args) for args in (first, second)]
    for _ in range(3):
        out = op(*first_gpu)
    poison_free_memory()
    with mock.patch.object(LaunchPlan, "run", autospec=True, side_effect=LaunchPlan.run) as run:
        got = op(*second_gpu)
    assert run.call_count == 1  # replayed
    want = getattr(kernels, name)(*second_gpu)
    assert torch.equal(got, want) and not torch.equal(got, out)
    assert rel_err(got.cpu(), op(*second)) < GEMM_BOUND[torch.bfloat16]


# --------------------------------------------------------------------------- experts

EXPERT_CASES = {  # T, E, H, I, top_k, block, routing (tests/helpers.make_routing kinds)
    "T=1": (1, 8, 256, 128, 2, [128, 128], "uniform"),
    "T<block prime E, H/I not multiples": (37, 13, 400, 200, 4, [128, 128], "uniform"),
    "expert with no tokens": (130, 6, 256, 256, 2, [128, 128], "empty"),
    "all tokens on one expert": (300, 5, 384, 256, 2, [128, 128], "one"),
    "sentinels": (257, 9, 512, 384, 3, [128, 128], "sentinel"),
    "block 32": (100, 4, 160, 96, 2, [32, 32], "sentinel"),
    "mid-size": (600, 16, 1024, 512, 4, [128, 128], "uniform"),
    # the combine's own kernel over column blocks of 2048, the last one partial
    "H past one combine block": (40, 5, 4224, 128, 2, [128, 128], "sentinel"),
    # decode (T * k <= 64): the combine in the down GEMM's launch, and the activation in
    # the gate_up GEMM's where T * k <= 16 (block 32: 6 slots; the others 12, 16 and 32)
    "decode, H/I not multiples": (3, 13, 400, 200, 4, [128, 128], "sentinel"),
    "decode, 16 slots, 6 groups of I": (2, 16, 512, 768, 8, [128, 128], "uniform"),
    "decode, block 32": (3, 4, 160, 96, 2, [32, 32], "empty"),
    "decode, 32 slots, activation on its own": (8, 8, 256, 256, 4, [128, 128], "uniform"),
}
EXPERT_COMBOS = {  # activation dtype, scale dtype, static, per-tensor weight scales, activation, swiglu_limit
    "bf16 dynamic silu": (torch.bfloat16, torch.float32, False, False, "silu", None),
    "bf16 static silu": (torch.bfloat16, torch.float32, True, False, "silu", None),
    "fp16 e8m0 dynamic gelu": (torch.float16, E8M0, False, False, "gelu", None),
    "bf16 e8m0 static per-tensor gelu_tanh limit": (torch.bfloat16, E8M0, True, True, "gelu_tanh", 2.0),
    "fp32 static relu": (torch.float32, torch.float32, True, False, "relu", None),
    "bf16 dynamic per-tensor silu limit": (torch.bfloat16, torch.float32, False, True, "silu", 0.7),
}


@pytest.mark.parametrize("combo", list(EXPERT_COMBOS))
@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_experts_match_cpu(case, combo):
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    dtype, scale_dtype, static, per_tensor, activation, limit = EXPERT_COMBOS[combo]
    args = make_experts_inputs(T, E, H, I, k, block, dtype, scale_dtype, static, routing, per_tensor, seed=T + E)
    if routing == "sentinel":  # one token with sentinel slots only: its row must be exactly zero
        args["top_k_index"][0, :] = E
    args.update(activation=activation, swiglu_limit=limit)
    cargs = {key: _cuda(v) for key, v in args.items()}
    poison_free_memory()
    out = OPS.grouped_experts(**cargs)
    ref = OPS.grouped_experts(**args)
    _assert_written(out, ref)
    idx = args["top_k_index"]
    no_expert = ((idx < 0) | (idx >= E)).all(dim=1)
    assert (out.cpu()[no_expert] == 0).all()
    assert rel_err(out.cpu(), ref) < EXPERTS_BOUND
    poison_free_memory()
    assert torch.equal(OPS.batched_experts(**cargs), out)
    assert torch.equal(OPS.grouped_experts(**cargs), out)  # run to run


@pytest.mark.parametrize("combo", ["bf16 dynamic silu", "bf16 e8m0 static per-tensor gelu_tanh limit",
                                   "fp32 static relu"])
@pytest.mark.parametrize("case", ["T=1", "decode, H/I not multiples", "decode, 16 slots, 6 groups of I",
                                  "decode, block 32", "decode, 32 slots, activation on its own"])
def test_fused_launches_equal_the_separate_kernels_bitwise(case, combo, monkeypatch):
    # The fused launches are compiled without FMA contraction (for the activation's and
    # the combine's roundings); the K loop's rescale must still be the FMA that the
    # separate GEMM launches compile to, or decode outputs move by a rounding step.
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    dtype, scale_dtype, static, per_tensor, activation, limit = EXPERT_COMBOS[combo]
    assert moe.down_split(T * k, E, H, I) == 1  # K ranges would sum in another order
    args = make_experts_inputs(T, E, H, I, k, block, dtype, scale_dtype, static, routing, per_tensor, seed=T + E)
    args.update(activation=activation, swiglu_limit=limit)
    cargs = {key: _cuda(v) for key, v in args.items()}
    fused = kernels.grouped_experts(**cargs)
    monkeypatch.setattr(experts, "ACT_SLOTS", 0)
    monkeypatch.setattr(experts, "COMBINE_SLOTS", 0)
    assert len(experts.shape_calls(T, k, E, H, I, tuple(block))) == 5
    assert torch.equal(kernels.grouped_experts(**cargs), fused)


@pytest.mark.parametrize("combo", ["bf16 dynamic silu", "bf16 static silu",
                                   "bf16 e8m0 static per-tensor gelu_tanh limit"])
@pytest.mark.parametrize("case", ["T=1", "T<block prime E, H/I not multiples", "expert with no tokens", "block 32",
                                  "decode, H/I not multiples", "decode, 16 slots, 6 groups of I",
                                  "decode, 32 slots, activation on its own"])
def test_gemms_reading_the_sorts_tile_map_equal_the_offsets_scan_bitwise(case, combo, monkeypatch):
    # up to 2048 slots the GEMMs take their tiles and rows from the sort's tile map; a map
    # of 8-row tiles (no GEMM's height) leaves them to scan the offsets and load perm
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    dtype, scale_dtype, static, per_tensor, activation, limit = EXPERT_COMBOS[combo]
    args = make_experts_inputs(T, E, H, I, k, block, dtype, scale_dtype, static, routing, per_tensor, seed=T + E)
    args.update(activation=activation, swiglu_limit=limit)
    cargs = {key: _cuda(v) for key, v in args.items()}
    poison_free_memory()
    mapped = kernels.grouped_experts(**cargs)
    monkeypatch.setattr(experts, "_map_bm", lambda *_: 8)
    poison_free_memory()
    assert torch.equal(kernels.grouped_experts(**cargs), mapped)


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("T,split", [(64, 1), (2, 1), (2, 2), (1024, 1)],
                         ids=["combine_kernel", "fused", "fused_split_k", "three_launch_sort"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cuda_graph_replay_with_new_routing_equals_eager(static, T, split, monkeypatch):
    # T=2 (8 slots): the activation and the combine run in the GEMMs' launches, their
    # counters zeroed by the sort on every replay; split: the down GEMM's K in two ranges;
    # T=1024 (4096 slots): the sort in three launches, its histograms in the workspace
    # (another H: the op's plan of a signature is recorded under the config of that call,
    # and must not be one recorded in another case)
    E, H, I, k = 16, 512 if split == 1 else 384, 256, 4
    if split > 1:
        monkeypatch.setattr(moe, "gemm_config", with_split_k(moe.gemm_config, split))
    args = {key: _cuda(v) for key, v in make_experts_inputs(T, E, H, I, k, [128, 128], static=static, seed=7).items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OPS.grouped_experts(**args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = OPS.grouped_experts(**args)
    gen = torch.Generator().manual_seed(8)
    for kind in ("uniform", "sentinel", "one", "empty"):
        idx, wts = make_routing(T, k, E, kind, gen=gen)
        args["top_k_index"].copy_(idx)
        args["top_k_weights"].copy_(wts)
        args["hidden"].copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
        g.replay()
        assert torch.equal(out, OPS.grouped_experts(**args)), kind


# --------------------------------------------------------------------------- shipped launch configs

SMALL_CONFIG = {"BM": 16, "BN": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


@pytest.fixture(scope="module", params=list(MODELS))
def layer_weights(request):
    """One model's random fp8 weights on the GPU (too large for the CPU reference)."""
    E, H, I, k = MODELS[request.param]
    gen = torch.Generator(device="cuda").manual_seed(11)
    gu = random_fp8_weights(E, 2 * I, H, gen, std=32)
    dp = random_fp8_weights(E, H, I, gen, std=32)
    gus = torch.rand(E, 2 * I // 128, H // 128, device="cuda", generator=gen) * 2e-4 + 1e-4
    dps = torch.rand(E, H // 128, I // 128, device="cuda", generator=gen) * 2e-4 + 1e-4
    yield request.param, (gu, gus, dp, dps)
    del gu, dp
    torch.cuda.empty_cache()


@LARGE_WEIGHTS
def test_column_major_x_past_2_to_the_31_elements_reads_in_bounds():
    # the quantisation's column offset times x's K stride was 32-bit: a column-major x of
    # 300k rows at K = 7168 ((K - 1) * S > 2^31) read outside x
    S, K, N = 300_000, 7168, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(K, S, device="cuda", dtype=torch.bfloat16, generator=gen).t()  # strides (1, S)
    w, ws = make_expert_weights(1, N, K, [128, 128], std=0.05, gen=torch.Generator().manual_seed(11))
    w, ws = w[0].cuda(), ws[0].cuda()
    got = OPS.linear(x, w, ws, [128, 128])
    want = OPS.linear(x.contiguous(), w, ws, [128, 128])
    del x
    assert torch.equal(got, want)


@LARGE_WEIGHTS
@pytest.mark.parametrize("T", [1, 64, 512, 4096, 16384])
def test_shipped_configs_agree_with_the_checked_small_config(layer_weights, T, monkeypatch):
    # Same K steps, so every config must agree with BM = 16 to rounding.
    name, (gu, gus, dp, dps) = layer_weights
    E, H, _, k = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = torch.topk(torch.rand(T, E, device="cuda", generator=gen), k, dim=1).indices
    wts = torch.rand(T, k, device="cuda", generator=gen)
    poison_free_memory()
    out = OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, [128, 128])
    monkeypatch.setattr(moe, "gemm_config", lambda *a: dict(SMALL_CONFIG))
    # the forward itself, not the op: a second op call would replay the first one's launch plan
    ref = kernels.grouped_experts(x, idx, wts, gu, gus, dp, dps, [128, 128])
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref.cpu()) < EXPERTS_BOUND


# --------------------------------------------------------------------------- cached launches


@pytest.mark.parametrize("T", [3, 300])
def test_cached_launch_follows_alignment(T):
    # After the first call, launches skip Triton's JIT and reuse the compiled kernel,
    # but only for arguments that specialise as the first call's did: a hidden state at
    # an odd address gets a kernel compiled without the 16-byte alignment assumption.
    args = {key: _cuda(v) for key, v in make_experts_inputs(T, 8, 256, 128, 2, [128, 128], seed=5).items()}
    first = OPS.grouped_experts(**args)
    assert torch.equal(OPS.grouped_experts(**args), first)
    hidden = args["hidden"]
    buf = torch.empty(hidden.numel() + 1, dtype=hidden.dtype, device="cuda")
    args["hidden"] = buf[1:].view_as(hidden).copy_(hidden)
    assert args["hidden"].data_ptr() % 16 != 0
    assert torch.equal(OPS.grouped_experts(**args), first)
    assert torch.equal(OPS.grouped_experts(**args), first)


# --------------------------------------------------------------------------- launch plans


@pytest.mark.parametrize("combo", ["bf16 dynamic silu", "bf16 e8m0 static per-tensor gelu_tanh limit",
                                   "fp32 static relu"])
@pytest.mark.parametrize("case", ["T=1", "T<block prime E, H/I not multiples", "expert with no tokens", "sentinels"])
def test_launch_plan_replays_new_inputs_bitwise(case, combo):
    # the op's third call of a signature replays the plan its second call recorded
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    dtype, scale_dtype, static, per_tensor, activation, limit = EXPERT_COMBOS[combo]

    def inputs(seed):
        args = make_experts_inputs(T, E, H, I, k, block, dtype, scale_dtype, static, routing, per_tensor, seed=seed)
        args.update(activation=activation, swiglu_limit=limit)
        return {key: _cuda(v) for key, v in args.items()}

    first, second = inputs(1), inputs(2)
    states = {}
    for _ in range(2):  # the second call records
        out = kernels.planned_experts(states, "sig", tuple(first.get(name) for name in ARG_NAMES))
    assert isinstance(states["sig"], LaunchPlan) and states["sig"].device is not None  # launchers called directly
    assert torch.equal(out, kernels.grouped_experts(**first))
    OPS.grouped_experts(**first)  # checks the signature
    OPS.grouped_experts(**first)  # records the op's plan for it
    poison_free_memory()
    got = OPS.grouped_experts(**second)
    want = kernels.grouped_experts(**second)
    assert not torch.equal(want, out)
    assert torch.equal(got, want)
    assert torch.equal(kernels.planned_experts(states, "sig", tuple(second.get(name) for name in ARG_NAMES)), want)


GRAPH_CASES = [case for case, (T, *_, k, _, _) in EXPERT_CASES.items() if T * k <= experts.FED_SLOTS]


def _graph_inputs(T, E, H, I, k, block, routing, combo, seed) -> tuple:
    dtype, scale_dtype, static, per_tensor, activation, limit = EXPERT_COMBOS[combo]
    args = make_experts_inputs(T, E, H, I, k, block, dtype, scale_dtype, static, routing, per_tensor, seed=seed)
    args.update(activation=activation, swiglu_limit=limit)
    return tuple(_cuda(args.get(name)) for name in ARG_NAMES)


@pytest.mark.parametrize("combo", list(EXPERT_COMBOS))
@pytest.mark.parametrize("case", GRAPH_CASES)
def test_plan_graphs_replay_new_inputs_and_layers_bitwise(case, combo, monkeypatch):
    # up to FED_SLOTS slots a plan replays its launches after the first as a CUDA graph,
    # one per layer (the weights' addresses), captured on the second replay of a layer;
    # every call has new hidden states and routing, and each output stays its own
    fresh_graph_workspaces(monkeypatch)
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    layers = [_graph_inputs(T, E, H, I, k, block, routing, combo, seed) for seed in (1, 2)]
    states, outs = {}, []
    for i in range(8):  # forward, forward + record, two first replays, four graph replays
        args = (*_graph_inputs(T, E, H, I, k, block, routing, combo, 10 + i)[:3], *layers[i % 2][3:])
        poison_free_memory()
        got = kernels.planned_experts(states, "sig", args)
        outs.append((got, kernels.grouped_experts(*args)))
    assert states["sig"].graphs == 2
    for i, (got, want) in enumerate(outs):
        assert torch.equal(got, want), i
    assert not torch.equal(outs[-1][1], outs[-3][1])  # the inputs differ


def _graph_calls(T, E, H, I, k, combo="bf16 dynamic silu", calls=8):
    """Eight calls of one plan (two layers alternating, new hidden states and routing on
    every call): (the plan, [(its output, the forward's)])."""
    layers = [_graph_inputs(T, E, H, I, k, [128, 128], "uniform", combo, seed) for seed in (1, 2)]
    states, outs = {}, []
    for i in range(calls):
        args = (*_graph_inputs(T, E, H, I, k, [128, 128], "uniform", combo, 10 + i)[:3], *layers[i % 2][3:])
        outs.append((kernels.planned_experts(states, "sig", args), kernels.grouped_experts(*args)))
    return states["sig"], outs


@pytest.mark.parametrize("launch", ["cuGraphLaunch", "replay()"])
@pytest.mark.parametrize("form", ["split K", "Gluon down GEMM"])
def test_plan_graphs_of_split_k_and_gluon_launches_bitwise(form, launch, monkeypatch):
    # the down GEMM's K in two ranges with the fused combine (mixtral_8x7b's T=1 form), and
    # the Gluon down GEMM (TMA descriptors on the graph's workspace: the launch table takes
    # it at mid sizes from 64 rows per expert, here made to); the graphs launched through
    # the driver's cuGraphLaunch (where torch gives their executables) or torch's replay()
    fresh_graph_workspaces(monkeypatch)
    monkeypatch.setattr(plans, "_DRIVER_LAUNCH", None if launch == "cuGraphLaunch" else False)
    if form == "split K":
        T, E, H, I, k = 2, 16, 384, 256, 4
        monkeypatch.setattr(moe, "gemm_config", with_split_k(moe.gemm_config, 2))
    else:
        T, E, H, I, k = 128, 4, 512, 256, 2
        table = moe.gemm_config

        def gluon_down(S, E, N, K, split_k=False, sms=None):
            return dict(table(S, E, N, K, split_k, sms), ws_min_k=16)

        monkeypatch.setattr(moe, "gemm_config", gluon_down)
        if not ws_gemm.AVAILABLE or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Gluon GEMM runs on sm_90")
    args = _graph_inputs(T, E, H, I, k, [128, 128], "uniform", "bf16 dynamic silu", 3)
    launched = [c.kernel for c in experts._stacked(args, experts._stacked_sources(args))[3]]
    assert (ws_gemm._ws_gemm_kernel in launched) == (form != "split K")
    plan, outs = _graph_calls(T, E, H, I, k)
    assert plan.graphs == 2
    given = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")  # (the executables, from torch 2.9)
    assert [g[2] is not None for g in plan._graphs.values() if type(g) is tuple] == [given] * 2
    assert bool(plans._DRIVER_LAUNCH) == (launch == "cuGraphLaunch")  # (looked up on the first replay)
    for i, (got, want) in enumerate(outs):
        assert torch.equal(got, want), i


def test_plan_graph_workspace_stays_out_of_a_private_pool(monkeypatch):
    # where this thread's allocations go to a private pool (torch.cuda.use_mem_pool, as
    # torch.compile's CUDA graph trees warm up), the workspace the graphs share comes from
    # the caching allocator's own pool: the private pool's owner would free a block it
    # does not know of under the graphs
    fresh_graph_workspaces(monkeypatch)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        plan, outs = _graph_calls(*EXPERT_CASES["T=1"][:5])
    assert plan.graphs == 2
    for i, (got, want) in enumerate(outs):
        assert torch.equal(got, want), i
    ((ws, _),) = plans._ARENAS.values()
    segments = [(seg["address"], seg["total_size"]) for seg in pool.snapshot()]
    assert segments and not [a for a, n in segments if a <= ws.data_ptr() < a + n]


def test_plan_graphs_per_stream_and_thread_and_under_a_callers_capture(monkeypatch):
    fresh_graph_workspaces(monkeypatch)
    T, E, H, I, k, block, routing = EXPERT_CASES["decode, 32 slots, activation on its own"]
    combo = "bf16 dynamic silu"
    layer = _graph_inputs(T, E, H, I, k, block, routing, combo, 1)
    states = {}

    def calls(seeds):
        got = []
        for seed in seeds:
            args = (*_graph_inputs(T, E, H, I, k, block, routing, combo, seed)[:3], *layer[3:])
            got.append((kernels.planned_experts(states, "sig", args), kernels.grouped_experts(*args)))
        return got

    results = calls(range(5))  # a graph on the current stream
    assert states["sig"].graphs == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        results += calls(range(5, 8))  # its own graph and workspace
    torch.cuda.current_stream().wait_stream(side)
    assert states["sig"].graphs == 2
    thread = threading.Thread(target=lambda: results.extend(calls(range(8, 11))))
    thread.start()
    thread.join()
    assert states["sig"].graphs == 3
    urgent = torch.cuda.Stream(priority=-1)  # captured on a capture stream of its priority, made by the driver
    urgent.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(urgent):
        results += calls(range(11, 14))
    torch.cuda.current_stream().wait_stream(urgent)
    assert states["sig"].graphs == 4
    device = torch.cuda.current_device()
    assert {key[1] for key in plans._CAPTURE_STREAMS if key[0] == device} >= {0, urgent.priority} != {0}
    assert all(isinstance(plans._CAPTURE_STREAMS[(device, p)], torch.cuda.ExternalStream) for p in (0, urgent.priority))
    for i, (got, want) in enumerate(results):
        assert torch.equal(got, want), i
    # captured by the caller on a stream that has a graph: every launch, in the capture
    args = (*_graph_inputs(T, E, H, I, k, block, routing, combo, 20)[:3], *layer[3:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = kernels.planned_experts(states, "sig", args)
    assert states["sig"].graphs == 4
    for seed in (21, 22):
        fresh = _graph_inputs(T, E, H, I, k, block, routing, combo, seed)
        for dst, src in zip(args[:3], fresh[:3]):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, kernels.grouped_experts(*args)), seed


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_launch_plan_past_the_one_launch_sort_replays_bitwise(static, monkeypatch):
    # more than 2048 slots: the three-launch sort; with the Triton GEMMs (no Gluon launch,
    # which the plans cannot replay) such a signature has a plan too
    monkeypatch.setenv("FP8_MOE_GLUON", "0")
    T, E, H, I, k, block, kind = EXPERT_CASES["mid-size"]
    assert T * k > 2048

    def inputs(seed):
        args = make_experts_inputs(T, E, H, I, k, block, static=static, routing=kind, seed=seed)
        args.update(activation="silu", swiglu_limit=None)
        return tuple(_cuda(args.get(name)) for name in ARG_NAMES)

    first, second = inputs(1), inputs(2)
    states = {}
    for _ in range(2):  # the second call records
        kernels.planned_experts(states, "sig", first)
    assert isinstance(states["sig"], LaunchPlan) and states["sig"].device is not None
    poison_free_memory()
    got = kernels.planned_experts(states, "sig", second)
    assert torch.equal(got, kernels.grouped_experts(*second))


@pytest.mark.parametrize("S,E,kind", [
    (2049, 8, "uniform"),      # a last block of one slot
    (4096, 1, "uniform"),      # one expert
    (65536, 256, "uniform"),   # deepseek_v3 T=8192
    (131072, 128, "uniform"),  # qwen3_30b_a3b T=16384
    (100003, 257, "uniform"),  # prime S, 258 bins
    (50000, 64, "sentinel"),   # ids outside [0, E) on both sides
    (30000, 16, "one"),        # every slot on one expert
    (262147, 256, "uniform"),  # 1025 blocks: the scan in five steps of 256 blocks
    (1000003, 128, "sentinel"),  # 3907 blocks
])
def test_three_launch_sort_equals_torch_sort(S, E, kind):
    gen = torch.Generator(device="cuda").manual_seed(S)
    ids = torch.randint(-1, E + 1, (S,), device="cuda", generator=gen)
    if kind == "uniform":
        ids = ids.clamp(0, E - 1)
    elif kind == "one":
        ids.fill_(E // 2)
    perm, offsets = gemms._sort_slots(ids, E)
    rperm, roffsets = routing.sort_slots(ids, E)
    assert perm.dtype == torch.int32 and torch.equal(perm.long(), rperm) and torch.equal(offsets, roffsets)
