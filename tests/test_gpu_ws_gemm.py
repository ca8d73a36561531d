"""The Hopper prefill GEMM (``fp8_moe_ops/kernels/ws_gemm.py``, Gluon) on the GPU: its
output equals the grouped Triton kernel's bitwise (the same products, scales and
rounding), so every check of that kernel against the CPU reference holds for it too.

Marked ``gpu``; skipped without an sm_90 device.  On the H200:
``python -m pytest -m gpu tests/test_gpu_ws_gemm.py -q``.  Each test runs an op with
the kernel (``FP8_MOE_GLUON=1``: wherever it can run; asserted to launch) and with
``FP8_MOE_GLUON=0`` (the Triton kernel) on the same seeded inputs, with the caching
allocator's free memory filled with NaN before each call so that an output element
the kernel forgets to write cannot pass.  Shapes are prefill-sized (the launch table's
128 x 128 tiles) with prime E, N and K not multiples of 128 (an odd number of K steps:
the kernel takes them two at a time), empty experts, rows past
``offsets[-1]``, sentinel ids, static and dynamic activation scales, float32, UE8M0
and per-tensor weight scales, coarser blocks, and bf16 / fp16 / float32 outputs.
"""

from __future__ import annotations

import pytest
import torch

from fp8_moe_ops import reference
from fp8_moe_ops.kernels import experts, gemms, moe, plans, ws_gemm

from helpers import (EXPERTS_BOUND, GEMM_BOUND, make_expert_weights, make_experts_inputs, poison_free_memory, rel_err,
                     uneven_offsets)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 (Hopper) GPU")]

OPS = torch.ops.fp8_moe
E8M0 = torch.float8_e8m0fnu
GEMM_CASES = {  # S, E, N, K, block
    "prime E, N and K not multiples of 128": (3001, 7, 200, 1040, [128, 128]),  # 9 K steps: an odd last one
    "one expert": (1500, 1, 384, 1024, [128, 128]),
    "blocks 256": (2600, 3, 512, 768, [256, 256]),
    "many tiles": (8192, 8, 2048, 1792, [128, 128]),
    # two K steps: one trip of the two-step loop and no odd last step; wide tiles, two single steps
    "two K steps": (3000, 3, 384, 240, [128, 128]),
    "two K steps, wide tiles": (3000, 3, 512, 208, [128, 128]),
    # wide tiles over a long K (past WIDE_MAX_K, within WIDE_LONG_MAX_K at 733 rows per expert;
    # tests/test_ws_gemm.py checks the choice): 33 K steps, the ring wrapping many times
    "wide tiles, long K": (2200, 3, 512, 4160, [128, 128]),
}
SCALES = {"f32": (torch.float32, False), "e8m0": (E8M0, False), "per-tensor": (torch.float32, True)}
DTYPES = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None), "bf16->fp32": (torch.bfloat16, torch.float32)}


@pytest.fixture
def ws_launches(monkeypatch):
    """The Gluon kernel's launches in the test (``calls``: each one's KernelCall, in
    order); ``off()`` runs the Triton kernel."""
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    calls = []
    real = ws_gemm.ws_gemm_call

    def recorded(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(ws_gemm, "ws_gemm_call", recorded)

    class Launches:
        def __init__(self):
            self.calls = calls

        def __len__(self):
            return len(calls)

        def off(self, fn):
            with monkeypatch.context() as m:
                m.setenv("FP8_MOE_GLUON", "0")
                return fn()

    return Launches()


def _both(fn, launches):
    """(fn() with the Gluon kernel, fn() without), each on NaN-filled free memory."""
    poison_free_memory()
    before = len(launches)
    got = fn()
    assert len(launches) > before, "the Gluon kernel did not run"
    poison_free_memory()
    return got, launches.off(fn)


def _gemm_inputs(case, static, scales, dtype, seed):
    S, E, N, K, block = GEMM_CASES[case]
    scale_dtype, per_tensor = SCALES[scales]
    gen = torch.Generator().manual_seed(seed)
    w, ws = make_expert_weights(E, N, K, block, scale_dtype, per_tensor, std=0.05, gen=gen)
    x = torch.randn(S, K, generator=gen).to(dtype)
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    return gen, x, w, ws, a, block


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_grouped_mm_equals_the_triton_kernel_bitwise(case, static, scales, dtypes, ws_launches):
    dtype, out_dtype = DTYPES[dtypes]
    gen, x, w, ws, a, block = _gemm_inputs(case, static, scales, dtype, seed=5)
    S, E = x.shape[0], w.shape[0]
    offsets = uneven_offsets(S, E, gen, unrouted=S // 10)  # the second expert empty, a tenth past the end
    args = _cuda(x, w, ws, offsets)
    got, want = _both(lambda: OPS.grouped_mm(*args, block, *_cuda(a), out_dtype), ws_launches)
    assert torch.equal(got, want)
    assert not got.isnan().any() and (got[int(offsets[-1]):] == 0).all()
    if case != "many tiles":  # the CPU reference at the small shapes: the bound of test_gpu_kernels
        ref = OPS.grouped_mm(x, w, ws, offsets, block, a, out_dtype)
        assert rel_err(got.cpu(), ref) < GEMM_BOUND[out_dtype or dtype]


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_negative_offsets_are_clamped_into_the_rows(gluon, ws_launches):
    # grouped_mm on CUDA checks no offset values: a negative offset started row tiles
    # before row 0, stored outside out (canary rows around it here); clamped into [0, S],
    # its rows equal those of the clamped offsets
    gen, x, w, ws, _, block = _gemm_inputs("prime E, N and K not multiples of 128", False, "f32", torch.bfloat16, 13)
    S, N = x.shape[0], w.shape[1]
    given = torch.tensor([-700, -1, 1000, 1000, 2000, 2500, S], dtype=torch.int32)
    x, w, ws, given, clamped = _cuda(x, w, ws, given, given.clamp(0, S))

    def run():
        q, qs = moe._quantize(x, block[1], S)
        rows = torch.full((3 * S, N), 7.0, dtype=torch.bfloat16, device="cuda")
        moe.launch(moe._gemm_call(q, qs, w, ws, block, rows[S:2 * S], offsets=given))
        return rows

    before = len(ws_launches)
    rows = run() if gluon else ws_launches.off(run)
    assert (len(ws_launches) > before) == gluon
    assert (rows[:S] == 7).all() and (rows[2 * S:] == 7).all()
    assert torch.equal(rows[S:2 * S], OPS.grouped_mm(x, w, ws, clamped, block))


def test_no_experts_run_the_triton_kernel_and_give_zeros(ws_launches):
    # E = 0 (an expert-parallel rank without local experts) at a prefill shape: the Gluon
    # kernel's TMA descriptor of an empty weight raised; the Triton kernel stores zeros
    gen, x, w, ws, _, block = _gemm_inputs("prime E, N and K not multiples of 128", False, "f32", torch.bfloat16, 17)
    w, ws = w[:0], ws[:0]
    offsets = torch.zeros(0, dtype=torch.int32)
    got = OPS.grouped_mm(*_cuda(x, w, ws, offsets), block)
    args = make_experts_inputs(3001, 1, 1040, 256, 2, [128, 128], seed=17)  # its ids are sentinels once E = 0
    args.update({name: args[name][:0] for name in ("gate_up_proj", "gate_up_scale_inv", "down_proj", "down_scale_inv")})
    out = OPS.grouped_experts(**{name: _cuda(v)[0] for name, v in args.items()})
    assert len(ws_launches) == 0
    assert torch.equal(got.cpu(), OPS.grouped_mm(x, w, ws, offsets, block)) and not got.any()
    assert torch.equal(out.cpu(), OPS.grouped_experts(**args)) and not out.any()


# rows per expert: row tiles of wide tiles whose expert ends 1, 64, 65, 128 rows in,
# an empty expert, and one of 50 rows alone
WIDE_ROWS = [1, 64, 65, 0, 128, 129, 192, 193, 50]


@pytest.mark.parametrize("by_expert", [True, False], ids=["by expert", "row groups"])
@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("scales", ["f32", "e8m0"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_wide_tiles_whose_expert_ends_anywhere_in_them(static, scales, programs, by_expert, ws_launches,
                                                       monkeypatch):
    # 128 x 256 output tiles (9 K steps) whose rows end in the first half, at it, just
    # past it, at the tile's end; tail tiles; programs that take many tiles in turn: the
    # same bits as the Triton kernel's, and the rows past offsets[-1] zero
    if programs is not None:
        monkeypatch.setattr(ws_gemm, "programs", lambda device: programs)
    monkeypatch.setattr(ws_gemm, "BY_EXPERT", by_expert)  # both tile orders: each tile once
    E, N, K = len(WIDE_ROWS), 512, 1040
    scale_dtype, per_tensor = SCALES[scales]
    gen = torch.Generator().manual_seed(11)
    w, ws = make_expert_weights(E, N, K, [128, 128], scale_dtype, per_tensor, std=0.05, gen=gen)
    offsets = torch.tensor(WIDE_ROWS).cumsum(0).to(torch.int32)
    S = int(offsets[-1]) + 77  # rows past offsets[-1]: tail tiles
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
    args = _cuda(x, w, ws, offsets)
    # the forward itself: the op's launch plans do not key on the programs, so they would
    # replay an earlier parametrisation's launches
    got, want = _both(lambda: gemms.grouped_mm(*args, [128, 128], *_cuda(a)), ws_launches)
    assert ws_launches.calls
    assert all(c.constexprs["WN"] == 2 and c.constexprs["BY_EXPERT"] is by_expert for c in ws_launches.calls)
    assert torch.equal(got, want)
    assert not got.isnan().any() and (got[int(offsets[-1]):] == 0).all()
    ref = OPS.grouped_mm(x, w, ws, offsets, [128, 128], a)
    assert rel_err(got.cpu(), ref) < GEMM_BOUND[torch.bfloat16]


@pytest.mark.parametrize("by_expert", [True, False], ids=["by expert", "row groups"])
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_few_programs_take_every_tile_in_turn(case, static, programs, by_expert, ws_launches, monkeypatch):
    # a persistent launch of 1 or 5 programs: each runs many tiles (tail tiles and the
    # empty expert's among them) through one ring, its phases carried from tile to tile,
    # in either tile order
    monkeypatch.setattr(ws_gemm, "programs", lambda device: programs)
    monkeypatch.setattr(ws_gemm, "BY_EXPERT", by_expert)
    gen, x, w, ws, a, block = _gemm_inputs(case, static, "f32", torch.bfloat16, seed=7)
    S, E = x.shape[0], w.shape[0]
    args = _cuda(x, w, ws, uneven_offsets(S, E, gen, unrouted=S // 7))
    # the forward itself: the op's launch plans do not key on the programs, so through the
    # op a third call of one shape would replay the launch of an earlier test's programs
    got, want = _both(lambda: gemms.grouped_mm(*args, block, *_cuda(a)), ws_launches)
    assert torch.equal(got, want)
    assert not got.isnan().any()


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("case", list(GEMM_CASES)[:3])
def test_batched_mm_static_scatters_as_the_triton_kernel(case, scales, ws_launches):
    # static batched_mm reads A quantised in sorted order and scatters the output rows
    # (dynamic gathers A per row: the Triton kernel's case)
    gen, x, w, ws, a, block = _gemm_inputs(case, True, scales, torch.bfloat16, seed=6)
    E = w.shape[0]
    ids = torch.randint(-1, E + 1, (x.shape[0],), generator=gen)  # sentinels -1 and E among the rows
    args = _cuda(x, w, ws, ids, a)
    got, want = _both(lambda: OPS.batched_mm(*args[:4], block, args[4]), ws_launches)
    assert torch.equal(got, want)
    assert (got[((ids < 0) | (ids >= E)).cuda()] == 0).all()


EXPERT_CASES = {  # T, E, H, I, top_k, block, routing: T * k > 2048 (three-launch sort) and > 384 rows per expert
    "prime E, H and I not multiples of 128, sentinels": (1201, 7, 1040, 400, 3, [128, 128], "sentinel"),  # odd K steps
    "an expert with no tokens": (1100, 5, 1024, 768, 2, [128, 128], "empty"),
    "all tokens on one expert": (2100, 3, 512, 256, 2, [128, 128], "one"),
    # 1400 slots, 280 rows per expert (mixtral_8x7b's T <= 1024): the gate_up GEMM's rows in
    # place, sorted in three launches all the same
    "at most 2048 slots": (700, 5, 1024, 768, 2, [128, 128], "uniform"),
}


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_experts_equal_the_triton_kernels_bitwise(case, static, scales, ws_launches):
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    scale_dtype, per_tensor = SCALES[scales]
    args = make_experts_inputs(T, E, H, I, k, block, torch.bfloat16, scale_dtype, static, routing, per_tensor,
                               seed=T)
    if routing == "sentinel":  # a token with sentinel slots only: its row must be exactly zero
        args["top_k_index"][0, :] = E
    cuda = {name: _cuda(v)[0] for name, v in args.items()}
    got, want = _both(lambda: OPS.grouped_experts(**cuda), ws_launches)
    assert torch.equal(got, want)
    assert not got.isnan().any()
    if routing == "sentinel":
        assert (got[0] == 0).all()
    assert torch.equal(OPS.batched_experts(**cuda), got)
    assert rel_err(got.cpu(), reference.grouped_experts(**args)) < EXPERTS_BOUND


@pytest.mark.parametrize("case", [name for name, (T, _, _, _, k, *_) in EXPERT_CASES.items() if T * k > 2048])
def test_experts_scales_kmajor_equal_row_major_bitwise(case, ws_launches, monkeypatch):
    # at prefill the gate_up GEMM's dynamic activation scales are laid out K-group major (a
    # tile's rows side by side), which the quantisation kernel writes and the Gluon
    # kernel's producer copies into shared memory; the down GEMM's stay row-major, which
    # its consumers load.  All row-major, the same output, bitwise
    T, E, H, I, k, block, routing = EXPERT_CASES[case]
    args = make_experts_inputs(T, E, H, I, k, block, torch.bfloat16, torch.float32, False, routing, False, seed=T + 1)
    cuda = {name: _cuda(v)[0] for name, v in args.items()}

    def kmajor_flags():
        return [call.constexprs["KMAJOR"] for call in ws_launches.calls]

    assert experts._kmajor_scales(T * k)
    poison_free_memory()
    kmajor = experts.grouped_experts(**cuda)  # the forward itself: an op's plan of an earlier test would not build it
    assert kmajor_flags() == [True, False], "gate_up K-group major, down row-major"
    with monkeypatch.context() as m:
        m.setattr(experts, "_kmajor_scales", lambda S: False)
        poison_free_memory()
        row_major = experts.grouped_experts(**cuda)
    assert kmajor_flags()[2:] == [False, False] and len(ws_launches) == 4
    assert torch.equal(kmajor, row_major)
    assert not kmajor.isnan().any()


@pytest.mark.parametrize("scales", ["f32", "e8m0"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_launch_plan_replays_gluon_launches_on_new_inputs_bitwise(case, static, scales, ws_launches):
    # a signature's second call records its launches, the Gluon GEMMs' included (each TMA
    # descriptor kept as its base's source, shape and strides); its third, on new inputs
    # (routing, weights, addresses), replays them without building a launch and equals the
    # forward without a plan and the Triton kernels'.  The op, from its third call of a
    # signature (its plan, found through the guard), the same; captured in a CUDA graph
    # and replayed on new routing, the same as its eager call
    T, E, H, I, k, block, routing = EXPERT_CASES[case]

    def inputs(seed):
        args = make_experts_inputs(T, E, H, I, k, block, torch.bfloat16, SCALES[scales][0], static, routing,
                                   seed=seed)
        return dict(zip(args, _cuda(*args.values())))

    def positional(args):
        return tuple({**args, "activation": "silu"}.get(name) for name in experts.ARG_NAMES)

    first, second = inputs(T + 2), inputs(T + 3)
    states = {}
    for _ in range(2):
        experts.planned_experts(states, "sig", positional(first))
    assert isinstance(states["sig"], plans.LaunchPlan) and states["sig"].device is not None
    built = len(ws_launches)
    poison_free_memory()
    got = experts.planned_experts(states, "sig", positional(second))
    assert len(ws_launches) == built, "the replay built a Gluon launch"
    assert not got.isnan().any()
    poison_free_memory()
    assert torch.equal(experts.grouped_experts(*positional(second)), got)
    assert len(ws_launches) > built, "the Gluon kernel did not run"
    assert torch.equal(ws_launches.off(lambda: experts.grouped_experts(*positional(second))), got)

    for _ in range(3):
        poison_free_memory()
        assert torch.equal(OPS.grouped_experts(**second), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS.grouped_experts(**second)
    for name in ("hidden", "top_k_index", "top_k_weights"):
        second[name].copy_(first[name])
    graph.replay()
    assert torch.equal(out, OPS.grouped_experts(**second))
