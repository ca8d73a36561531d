"""The fp8_moe ops on CPU: numerics against float64, agreement of the dispatches,
sentinels and empty inputs, opcheck, torch.compile."""

import pytest
import torch

import fp8_moe_ops
from fp8_moe_ops import reference

from helpers import (REL_BOUND, OpsSeen, assert_agree, experts_float64, make_expert_weights, make_experts_inputs,
                     rel_err)

OPS = torch.ops.fp8_moe


def _gemm_float64(x, w, ws, block, act_scale):
    """x @ w^T in float64 on the dequantised operands (activation quantised as the op does)."""
    bk = block[1]
    if act_scale is None:
        q, s = reference.quantize_act_dynamic(x, bk)
        xd = reference.dequantize_act(q, s, bk)
    else:
        xd = reference.quantize_act_static(x, act_scale).float() * act_scale
    return xd.double() @ reference.dequantize_weight(w, ws, block).double().t()


# (M, N, K, block): what each probes
LINEAR_SHAPES = [
    (1, 128, 128, [128, 128]),   # T = 1, one block
    (5, 200, 300, [128, 128]),   # M < block, N and K not multiples of 128
    (64, 96, 72, [32, 32]),      # ragged K tail with small blocks
    (0, 64, 64, [128, 128]),     # T = 0
]


@pytest.mark.parametrize("M,N,K,block", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
@pytest.mark.parametrize("static", [False, True])
def test_linear_against_float64(M, N, K, block, dtype, scale_dtype, static):
    w, ws = make_expert_weights(1, N, K, block, scale_dtype)
    x = torch.randn(M, K).to(dtype)
    act = torch.tensor([0.01]) if static else None
    out = OPS.linear(x, w[0], ws[0], block, act)
    assert out.shape == (M, N) and out.dtype == dtype and out.is_contiguous()
    if M:
        ref = _gemm_float64(x, w[0], ws[0], block, act)
        assert rel_err(out, ref) < REL_BOUND[dtype]
        # and the fp8 recipe itself is close to the unquantised product
        exact = x.double() @ reference.dequantize_weight(w[0], ws[0], block).double().t()
        assert rel_err(out, exact) < 0.08


def test_linear_out_dtype_and_per_tensor_scale():
    w, ws = make_expert_weights(1, 200, 160, [128, 128], per_tensor=True)  # (1, 1) grid on a 2x2-block matrix
    x = torch.randn(3, 160, dtype=torch.bfloat16)
    out = OPS.linear(x, w[0], ws[0], [128, 128], None, torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, _gemm_float64(x, w[0], ws[0], [128, 128], None)) < REL_BOUND[torch.float32]


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts,S", [
    ([3, 0, 5, 1, 2, 0, 4], 15),   # prime E = 7, empty experts; the last 0 rows fill S exactly
    ([0, 0, 6], 9),                # rows past offsets[-1] belong to no expert: zeros
    ([0, 0, 0], 4),                # no row has an expert
    ([1], 1),                      # T = 1
    ([0, 0], 0),                   # S = 0
])
@pytest.mark.parametrize("static", [False, True])
def test_grouped_and_batched_mm(counts, S, static):
    E, N, K, block = len(counts), 72, 200, [128, 128]
    w, ws = make_expert_weights(E, N, K, block, torch.float8_e8m0fnu)
    x = torch.randn(S, K, dtype=torch.bfloat16)
    act = torch.rand(E) * 0.01 + 0.005 if static else None
    offsets = _offsets(counts)
    out = OPS.grouped_mm(x, w, ws, offsets, block, act)
    assert out.shape == (S, N) and out.dtype == x.dtype
    ids = torch.full((S,), E + 2, dtype=torch.long)  # sentinel for rows of no expert
    start = 0
    for e, end in enumerate(offsets.tolist()):
        ids[start:end] = e
        if end > start:
            ref = _gemm_float64(x[start:end], w[e], ws[e], block, None if act is None else act[e])
            assert rel_err(out[start:end], ref) < REL_BOUND[x.dtype]
        start = end
    assert torch.equal(out[start:], torch.zeros_like(out[start:]))
    # batched with the same rows in a shuffled order gives the same rows, up to the
    # last bit: the CPU GEMM's result for a row can depend on its position in the
    # matrix (vectorised body or scalar tail), and the shuffle moves rows
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(S))
    outb = OPS.batched_mm(x[perm], w, ws, ids[perm], block, act)
    assert_agree(outb, out[perm])


def test_batched_mm_negative_sentinel_rows_are_zero():
    w, ws = make_expert_weights(3, 64, 64, [32, 32])
    x = torch.randn(4, 64)
    out = OPS.batched_mm(x, w, ws, torch.tensor([-1, 1, 3, 1], dtype=torch.int32), [32, 32])
    assert torch.equal(out[[0, 2]], torch.zeros(2, 64)) and out[[1, 3]].abs().sum() > 0


# (T, E, H, I, k, block, routing): what each probes
EXPERT_CASES = [
    (1, 4, 128, 64, 2, [128, 128], "uniform"),       # T = 1 (decode)
    (0, 4, 64, 32, 2, [32, 32], "uniform"),          # T = 0
    (5, 7, 200, 72, 2, [128, 128], "uniform"),       # prime E, T < block, H and I not multiples of 128
    (9, 5, 96, 48, 1, [32, 32], "empty"),            # top_k = 1, experts with no tokens (the first one too)
    (6, 3, 64, 40, 2, [32, 32], "one"),              # all tokens on the last expert (both slots)
    (8, 11, 64, 32, 8, [32, 32], "sentinel"),        # top_k = 8, prime E, sentinel ids -1 and E + 3
    (4, 3, 64, 32, 5, [16, 32], "uniform"),          # top_k > E: expert parallelism, extra slots remote
]


@pytest.mark.parametrize("T,E,H,I,k,block,routing", EXPERT_CASES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_experts_dispatches_agree(T, E, H, I, k, block, routing, static, scale_dtype):
    args = make_experts_inputs(T, E, H, I, k, block, scale_dtype=scale_dtype, static=static, routing=routing)
    grouped = OPS.grouped_experts(**args)
    batched = OPS.batched_experts(**args)
    assert grouped.shape == (T, H) and grouped.dtype == args["hidden"].dtype
    mod = fp8_moe_ops.FP8Experts(E, H, I, block, activation_scheme="static" if static else "dynamic",
                                 scale_dtype=scale_dtype)
    mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data = args["gate_up_proj"], args["gate_up_scale_inv"]
    mod.down_proj.data, mod.down_proj_scale_inv.data = args["down_proj"], args["down_scale_inv"]
    if static:
        mod.gate_up_proj_activation_scale.data = args["gate_up_act_scale"]
        mod.down_proj_activation_scale.data = args["down_act_scale"]
    eager = mod(args["hidden"], args["top_k_index"], args["top_k_weights"])
    # The three share the per-expert GEMM and the combine order (see assert_agree).
    assert_agree(grouped, batched)
    assert_agree(grouped, eager)
    if T:
        assert not torch.isnan(grouped).any()
        assert rel_err(grouped, experts_float64(**args)) < REL_BOUND[torch.bfloat16]


@pytest.mark.parametrize("which", ["gate_up_act_scale", "down_act_scale"])
def test_experts_one_static_scale_quantises_its_own_gemm_only(which):
    # each GEMM's input follows its own scale: static where given, dynamic where None
    args = make_experts_inputs(9, 5, 96, 48, 2, [32, 32], static=True, routing="uniform")
    both = OPS.grouped_experts(**args)
    mixed = OPS.grouped_experts(**{**args, which: None})
    none = OPS.grouped_experts(**{**args, "gate_up_act_scale": None, "down_act_scale": None})
    assert rel_err(mixed, experts_float64(**{**args, which: None})) < REL_BOUND[torch.bfloat16]
    assert not torch.equal(mixed, both) and not torch.equal(mixed, none)
    assert OPS.batched_experts(**{**args, which: None}).equal(mixed)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("swiglu_limit", [None, 0.05])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_experts_activations(activation, swiglu_limit, dtype):
    args = make_experts_inputs(6, 4, 64, 32, 2, [32, 32], dtype=dtype)
    args.update(activation=activation, swiglu_limit=swiglu_limit)
    out = OPS.grouped_experts(**args)
    assert_agree(out, OPS.batched_experts(**args))
    assert rel_err(out, experts_float64(**args)) < REL_BOUND[dtype] * 2


def test_gelu_and_gelu_tanh_differ():
    # The pass must keep them apart; make sure the ops do too.
    args = make_experts_inputs(16, 4, 64, 32, 2, [32, 32], dtype=torch.float32)
    a = OPS.grouped_experts(**args, activation="gelu")
    b = OPS.grouped_experts(**args, activation="gelu_tanh")
    assert not torch.equal(a, b)


@pytest.mark.parametrize("limit", [0.05, 0.3])  # clamps most / some of gate and up
def test_swiglu_limit_clamps_gate_above_and_up_both_sides(limit):
    args = make_experts_inputs(8, 4, 64, 32, 2, [32, 32], dtype=torch.float32)
    out = OPS.grouped_experts(**args, swiglu_limit=limit)
    # the oracle clamps gate to max=limit and up to [-limit, limit]; any other clamp
    # (gate both sides, up one side, none) is off by far more than the bound
    assert rel_err(out, experts_float64(**args, swiglu_limit=limit)) < REL_BOUND[torch.float32]
    assert rel_err(out, OPS.grouped_experts(**args)) > 0.1


def test_zero_hidden_rows_and_nan_isolation():
    args = make_experts_inputs(6, 4, 64, 32, 2, [32, 32])
    args["hidden"][0] = 0  # all-zero groups: scale 0, output exactly 0
    args["hidden"][3, 7] = float("nan")
    out = OPS.grouped_experts(**args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isnan(out[3]).any()
    assert not torch.isnan(out[[0, 1, 2, 4, 5]]).any()


def _opcheck(op, args, kwargs=None):
    # test_schema needs allclose, which torch does not implement for float8 on CPU.
    torch.library.opcheck(op, args, kwargs or {},
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_opcheck_all_ops(static, T):
    a = make_experts_inputs(T, 5, 64, 48, 2, [32, 32], static=static, scale_dtype=torch.float8_e8m0fnu)
    gu, gus = a["gate_up_proj"], a["gate_up_scale_inv"]
    act = a.get("gate_up_act_scale")
    x = a["hidden"]
    _opcheck(OPS.linear.default, (x, gu[1], gus[1], [32, 32], None if act is None else act[1:2]))
    offsets = _offsets([T // 2, 0, T - T // 2, 0, 0])
    _opcheck(OPS.grouped_mm.default, (x, gu, gus, offsets, [32, 32], act))
    ids = torch.randint(-1, 6, (T,))
    _opcheck(OPS.batched_mm.default, (x, gu, gus, ids, [32, 32], act, torch.float32))
    exp_args = tuple(a[k] for k in ("hidden", "top_k_index", "top_k_weights", "gate_up_proj",
                                     "gate_up_scale_inv", "down_proj", "down_scale_inv", "block_size"))
    kwargs = {k: a[k] for k in ("gate_up_act_scale", "down_act_scale") if k in a}
    _opcheck(OPS.grouped_experts.default, exp_args, dict(kwargs, activation="gelu_tanh"))
    _opcheck(OPS.batched_experts.default, exp_args, dict(kwargs, swiglu_limit=7.0))


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_compile_fullgraph_each_op(static):
    torch._dynamo.reset()
    a = make_experts_inputs(6, 3, 64, 32, 2, [32, 32], static=static)
    act = a.get("gate_up_act_scale")
    offsets = _offsets([2, 0, 3])
    ids = torch.tensor([0, 2, 1, 5, 2, 0])

    def f(a):
        x, gu, gus = a["hidden"], a["gate_up_proj"], a["gate_up_scale_inv"]
        return (
            OPS.linear(x, gu[0], gus[0], [32, 32], None if act is None else act[0]),
            OPS.grouped_mm(x, gu, gus, offsets, [32, 32], act),
            OPS.batched_mm(x, gu, gus, ids, [32, 32], act),
            OPS.grouped_experts(**a),
            OPS.batched_experts(**a),
        )

    eager = f(a)
    compiled = torch.compile(f, fullgraph=True)(a)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.slow
def test_one_graph_for_every_token_count_marked_unbacked():
    # T marked unbacked: the shape checks compare it without a guard (a runtime assert),
    # so one graph serves T = 0, 1 and more (backed, Dynamo specialises 0 and 1)
    torch._dynamo.reset()
    a = make_experts_inputs(5, 4, 64, 32, 2, [32, 32])
    mod = fp8_moe_ops.FP8Experts(4, 64, 32, [32, 32], dispatch="batched")
    mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data = a["gate_up_proj"], a["gate_up_scale_inv"]
    mod.down_proj.data, mod.down_proj_scale_inv.data = a["down_proj"], a["down_scale_inv"]
    weights = {k: v for k, v in a.items() if k not in ("hidden", "top_k_index", "top_k_weights")}

    def f(hidden, top_k_index, top_k_weights):
        return OPS.grouped_experts(hidden, top_k_index, top_k_weights, **weights)

    compiled_op = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled_mod = torch.compile(mod, fullgraph=True, backend="aot_eager")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for T in (5, 0, 1, 9):
        b = make_experts_inputs(T, 4, 64, 32, 2, [32, 32], seed=T)
        routing = (b["hidden"], b["top_k_index"], b["top_k_weights"])
        for t in routing:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        assert torch.equal(compiled_op(*routing), f(*routing))
        assert torch.equal(compiled_mod(*routing), mod(*routing))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2
    # inputs that disagree on T fail Dynamo's guard on their sizes: nothing runs
    for T, Ti in ((6, 4), (4, 6)):
        b = make_experts_inputs(max(T, Ti), 4, 64, 32, 2, [32, 32], seed=T)
        routing = (b["hidden"][:T], b["top_k_index"][:Ti], b["top_k_weights"][:Ti])
        for t in routing:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        with pytest.raises(AssertionError, match=r"top_k_index\.size\(\)\[0\] == hidden\.size\(\)\[0\]"):
            compiled_op(*routing)
        with pytest.raises(AssertionError, match=r"top_k_index\.size\(\)\[0\] == hidden_states\.size\(\)\[0\]"):
            compiled_mod(*routing)


def _gemm_calls_of_grad_input() -> tuple[torch.Tensor, dict]:
    """(x requiring grad, name -> the GEMM op of that name on x as a function of x)."""
    gen = torch.Generator().manual_seed(3)
    w, ws = make_expert_weights(3, 32, 64, [32, 32], gen=gen)
    x = torch.randn(4, 64, generator=gen).requires_grad_()
    return x, {"linear": lambda x: OPS.linear(x, w[0], ws[0], [32, 32]),
               "grouped_mm": lambda x: OPS.grouped_mm(x, w, ws, torch.tensor([1, 3, 4], dtype=torch.int32), [32, 32]),
               "batched_mm": lambda x: OPS.batched_mm(x, w, ws, torch.tensor([0, 2, 1, 0]), [32, 32])}


def _op_calls() -> list:
    """(name, the op as a function of its first input, that input; no grad): the GEMM ops
    of :func:`_gemm_calls_of_grad_input` and ``grouped_experts`` on its hidden states."""
    x, calls = _gemm_calls_of_grad_input()
    args = make_experts_inputs(3, 4, 32, 16, 2, [16, 16])
    hidden = args.pop("hidden")
    return [(name, call, x.detach()) for name, call in calls.items()] + [
        ("grouped_experts", lambda h: OPS.grouped_experts(h, **args), hidden)]


def test_gemm_ops_backward_raises_naming_the_op():
    x, calls = _gemm_calls_of_grad_input()
    for name, call in calls.items():
        out = call(x)
        assert out.requires_grad  # the forward runs as usual
        with pytest.raises(RuntimeError, match=f"fp8_moe::{name} has no autograd formula \\(an inference op\\)"):
            out.sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear", "grouped_mm", "batched_mm", "grouped_experts", "batched_experts"])
def test_compiled_forward_of_inputs_requiring_grad_runs_and_its_backward_raises(name):
    # torch.compile traces a backward as it compiles a forward whose inputs require grad:
    # the refusal must happen where the backward runs, as in eager (it failed the compile)
    x, calls = _gemm_calls_of_grad_input()
    if name.endswith("experts"):
        args = make_experts_inputs(3, 4, 32, 16, 2, [16, 16])
        x = args.pop("hidden").float().requires_grad_()
        calls[name] = lambda x: getattr(OPS, name)(x, **args)
    torch._dynamo.reset()
    out = torch.compile(calls[name], backend="aot_eager", fullgraph=True)(x)
    assert out.requires_grad and torch.equal(out, calls[name](x))
    with pytest.raises(RuntimeError, match=f"fp8_moe::{name} has no autograd formula \\(an inference op\\)"):
        out.sum().backward()


def test_forward_mode_and_torch_func_differentiation_refused_naming_the_op():
    # a tangent used to pass straight through the CPU reference's quantisation (forward_ad)
    # or come back zero (torch.func.jvp); torch.func.grad failed with torch's own message
    import torch.autograd.forward_ad as fwAD

    x, calls = _gemm_calls_of_grad_input()
    x = x.detach()
    args = make_experts_inputs(3, 4, 32, 16, 2, [16, 16])
    weights = args.pop("top_k_weights").float()
    args["hidden"] = args["hidden"].float()
    calls["grouped_experts"] = lambda w: OPS.grouped_experts(top_k_weights=w, **args)
    inputs = {"grouped_experts": weights}
    for name, call in calls.items():
        v = inputs.get(name, x)
        refused = f"fp8_moe::{name} has no forward-mode AD formula \\(an inference op\\)"
        with fwAD.dual_level(), pytest.raises(RuntimeError, match=refused):
            call(fwAD.make_dual(v, torch.ones_like(v)))
        with pytest.raises(RuntimeError, match=refused):
            torch.func.jvp(call, (v,), (torch.ones_like(v),))
        with pytest.raises(RuntimeError, match=f"fp8_moe::{name} has no autograd formula \\(an inference op\\): "
                                               "torch.func transforms"):
            torch.func.grad(lambda v: call(v).sum())(v)
        with fwAD.dual_level():  # no tangent on any argument: the op runs
            assert torch.equal(call(v), call(v.clone()))
        assert torch.equal(torch.func.vmap(call)(torch.stack([v, v]))[1], call(v))  # no differentiation: runs
    # the modules' direct calls of the kernels (ops.call_linear / call_experts) too
    lin = fp8_moe_ops.FP8Linear.from_float(torch.nn.Linear(64, 32, bias=False), block_size=(32, 32))
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="fp8_moe::linear has no forward-mode AD formula"):
        lin(fwAD.make_dual(x, torch.ones_like(x)))


def test_direct_calls_hand_no_negated_view_to_a_kernel():
    # a negated view (torch._neg_view, the .imag of a conjugated tensor) holds its data
    # unnegated; the CUDA kernels read memory, and ops.call_experts / call_linear (which
    # FP8Experts, FP8Linear and the plug-in call) skip the dispatcher that resolves it:
    # they computed the layer of x for -x.  Such a call now dispatches.
    from unittest import mock

    from fp8_moe_ops import ops

    gen = torch.Generator().manual_seed(3)
    w, ws = make_expert_weights(1, 32, 64, [32, 32], gen=gen)
    x = torch.randn(4, 64, generator=gen)
    e = make_experts_inputs(3, 4, 32, 16, 2, [16, 16])
    rest = (e["top_k_index"], e["top_k_weights"], e["gate_up_proj"], e["gate_up_scale_inv"], e["down_proj"],
            e["down_scale_inv"], e["block_size"], "silu", None, None, None)
    cases = {"linear": (x, lambda v: ops.call_linear(v, w[0], ws[0], [32, 32])),
             "grouped_experts": (e["hidden"], lambda v: ops.call_experts("grouped_experts", (v, *rest)))}
    for name, (v, call) in cases.items():
        kernel, seen = ops._KERNELS[name]["cpu"], []
        with mock.patch.dict(ops._KERNELS[name], cpu=lambda *a: seen.append(a[0].is_neg()) or kernel(*a)):
            got = call(torch._neg_view(v))
            assert seen == []  # dispatched: the kernel called directly saw nothing
            call(-v)
            assert seen == [False]  # a plain tensor takes the direct path
        assert torch.equal(got, call(-v))


def test_cpu_ops_ignore_autocast():
    # the reference's float32 GEMMs are the ops' numerics; under CPU autocast they ran in
    # bf16 / fp16, and eager no longer matched compiled code (which runs the op without it)
    calls = _op_calls()
    for name, call, h in calls:
        want = call(h)
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                got = call(h)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, dtype)
    lin = fp8_moe_ops.FP8Linear.from_float(torch.nn.Linear(64, 32, bias=False), block_size=(32, 32))
    x = calls[0][2]  # linear's input
    with torch.no_grad():
        want = lin(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(lin(x), want)  # the module's direct call of the CPU kernel


def test_the_autograd_kernel_reaches_what_each_dispatch_key_set_calls_for_after_plain_calls():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # the autograd kernel remembers, per key set, the kernel below it: plain CPU calls
    # first, then a dispatch mode and fake tensors must each still reach their own
    # kernel, and plain calls the CPU kernel again
    for name, call, h in _op_calls():
        want = call(h)
        with OpsSeen() as mode:
            assert torch.equal(call(h), want)
        assert f"fp8_moe.{name}.default" in mode.seen
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = call(h)
        assert isinstance(fake, FakeTensor) and fake.shape == want.shape
        got = call(h)
        assert type(got) is torch.Tensor and torch.equal(got, want)


def test_experts_op_backward_raises_and_no_grad_output():
    args = make_experts_inputs(3, 4, 32, 16, 2, [16, 16])
    args["hidden"] = args["hidden"].float().requires_grad_()
    out = OPS.grouped_experts(**args)  # the forward runs as usual
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="fp8_moe::grouped_experts has no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        assert not OPS.grouped_experts(**args).requires_grad


def test_cuda_kernels_run_with_their_inputs_gpu_current(monkeypatch):
    # Triton launches on the current device, and the dispatcher sets none for a Python
    # kernel: each op's CUDA kernel makes its first argument's GPU current where another
    # one is (a model spread over GPUs in one process), and only there
    import contextlib
    from types import SimpleNamespace

    from fp8_moe_ops import ops

    entered, ran = [], []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # (CUDA builds only)
    monkeypatch.setattr(torch.cuda, "device", device)
    kernel = ops._on_its_device(lambda *args: ran.append((list(entered), args)) or "out")
    on_0, on_1 = SimpleNamespace(get_device=lambda: 0), SimpleNamespace(get_device=lambda: 1)
    assert kernel(on_0, 5) == "out" and ran[-1] == ([], (on_0, 5))
    assert kernel(on_1, 5) == "out" and ran[-1] == ([1], (on_1, 5))
    assert set(ops._KERNELS) >= {"linear", "grouped_mm", "batched_mm", "grouped_experts", "batched_experts",
                                 "grouped_experts_list"}
    for name, kernels in ops._KERNELS.items():
        assert kernels["cuda"].__qualname__ == kernel.__qualname__, name
