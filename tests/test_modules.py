"""FP8Linear, FP8Experts, calibration, torch.export + AOTInductor."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fp8_moe_ops
from fp8_moe_ops import FP8Experts, FP8Linear

from helpers import OpsSeen, assert_agree, rel_err


def _float_experts(E=6, H=96, I=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


def _routing(T, E, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k)
    return idx, w


def test_fp8_linear_from_float_and_shapes():
    lin = nn.Linear(200, 72, bias=True)
    q = FP8Linear.from_float(lin, block_size=(64, 64), scale_dtype=torch.float8_e8m0fnu)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == (72, 200)
    assert q.weight_scale_inv.shape == (2, 4) and q.weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert q.activation_scale is None
    # a float32 bias, as the constructor's: either's state dict loads into the other
    assert q.bias.dtype == torch.float32
    assert FP8Linear.from_float(nn.Linear(200, 72, bias=True, dtype=torch.bfloat16)).bias.dtype == torch.float32
    x = torch.randn(2, 3, 200)
    y = q(x)
    assert y.shape == (2, 3, 72)
    assert rel_err(y, lin(x).detach()) < 0.08


def test_fp8_linear_static_calibration():
    lin = FP8Linear.from_float(nn.Linear(64, 32, bias=False), block_size=(32, 32))
    x = torch.randn(10, 64)
    fp8_moe_ops.calibrate_static_scales(lin, [x])
    assert lin.activation_scheme == "static" and lin.activation_scale.shape == (1,)
    torch.testing.assert_close(lin.activation_scale, x.abs().amax().reshape(1) / 448)
    assert rel_err(lin(x), x @ fp8_moe_ops.reference.dequantize_weight(lin.weight, lin.weight_scale_inv, [32, 32]).t()) < 0.08


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fp8_experts_close_to_float_moe(activation):
    gu, dp = _float_experts()
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), activation=activation)
    hidden = torch.randn(12, 96)
    idx, w = _routing(12, 6, 2)
    out = m(hidden, idx, w)
    # float MoE on the unquantised weights
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[activation]
    ref = torch.zeros(12, 96)
    for t in range(12):
        for j in range(2):
            e = idx[t, j]
            gate, up = (gu[e] @ hidden[t]).chunk(2)
            ref[t] += w[t, j] * (dp[e] @ (act(gate) * up))
    assert rel_err(out, ref) < 0.1


def test_fp8_experts_static_calibration_and_dispatches():
    gu, dp = _float_experts()
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32))
    hidden = torch.randn(20, 96)
    idx, w = _routing(20, 6, 2)
    dynamic = m(hidden, idx, w)
    fp8_moe_ops.calibrate_static_scales(m, [(hidden, idx, w)])
    assert m.activation_scheme == "static"
    assert m.gate_up_proj_activation_scale.shape == (6,) and m.down_proj_activation_scale.shape == (6,)
    outs = {}
    for d in ("eager", "grouped", "batched"):
        m.dispatch = d
        outs[d] = m(hidden, idx, w)
    assert_agree(outs["eager"], outs["grouped"])
    assert_agree(outs["grouped"], outs["batched"])
    assert rel_err(outs["grouped"], dynamic) < 0.1  # calibrated static close to dynamic


def test_calibration_expert_without_tokens_takes_layer_max():
    gu, dp = _float_experts(E=4)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32))
    idx = torch.tensor([[0, 1], [1, 2]])  # expert 3 never routed
    fp8_moe_ops.calibrate_static_scales(m, [(torch.randn(2, 96), idx, torch.ones(2, 2))])
    s = m.gate_up_proj_activation_scale
    assert s[3] == s[:3].max() and (s > 0).all()
    d = m.down_proj_activation_scale  # the fallback is per projection, not across both
    assert d[3] == d[:3].max()


def test_calibration_leaves_a_module_without_input_dynamic_and_says_so():
    # it became static with the arbitrary scale 1/448 (inputs past 1 clamped), silently
    model = nn.ModuleDict({"a": FP8Linear.from_float(nn.Linear(16, 16), block_size=(8, 8)),
                           "b": FP8Linear.from_float(nn.Linear(16, 16), block_size=(8, 8))})
    model.forward = lambda x: model["a"](x)  # b is never called
    with pytest.warns(UserWarning, match=r"no nonzero input reached model\.b in the calibration batches; left dynamic"):
        fp8_moe_ops.calibrate_static_scales(model, [torch.randn(2, 16)])
    assert model["a"].activation_scheme == "static" and model["b"].activation_scheme == "dynamic"
    assert model["b"]._observer is None


def test_calibration_skips_empty_batches_and_keeps_tiny_scales_positive():
    lin = FP8Linear.from_float(nn.Linear(16, 8), block_size=(8, 8))
    x = torch.randn(3, 16)
    # a batch of no tokens raised torch's amax error; an input of 1e-44 made the scale 0
    fp8_moe_ops.calibrate_static_scales(lin, [torch.randn(0, 16), torch.randn(2, 0, 16), x])
    assert lin.activation_scale.item() == (x.abs().max() / 448).item()
    tiny = FP8Linear.from_float(nn.Linear(16, 8), block_size=(8, 8))
    fp8_moe_ops.calibrate_static_scales(tiny, [torch.full((2, 16), 1e-44)])
    assert tiny.activation_scale.item() == 2.0 ** -149
    assert torch.isfinite(tiny(torch.full((2, 16), 1e-44))).all()


def test_calibration_refuses_nan_or_inf_and_leaves_the_model_dynamic():
    # one NaN token would have given its experts the fallback scale 1/448 (no error);
    # an Inf, an infinite scale that only the next forward refused
    gu, dp = _float_experts(E=4)
    model = nn.Sequential(FP8Linear.from_float(nn.Linear(96, 96, bias=False), block_size=(32, 32)))
    model.append(FP8Experts.from_float(gu, dp, block_size=(32, 32)))
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])

    def forward(x):
        return model[1](model[0](x), idx, torch.full((3, 2), 0.5))

    model.forward = forward
    x = torch.randn(3, 96)
    bad = x.clone()
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf in model\.0 \(FP8Linear\): its input"):
        fp8_moe_ops.calibrate_static_scales(model, [x, bad])
    for m in model:
        assert m.activation_scheme == "dynamic" and m._observer is None
    assert model[1].gate_up_proj_activation_scale is None
    # finite inputs whose expert 1 overflows its gate_up output: its down input is infinite
    model[1].gate_up_proj_scale_inv.data[1].fill_(1e38)
    with pytest.raises(ValueError, match=r"model\.1 \(FP8Experts\): the down input of expert 1;"):
        fp8_moe_ops.calibrate_static_scales(model, [x])
    assert model[1].activation_scheme == "dynamic" and model[0].activation_scale is None


def test_module_pickled_before_its_settings_became_properties_loads():
    # torch.save(module) of an earlier version stored the sizes, block_size and
    # swiglu_limit under their own names
    gu, dp = _float_experts(E=4, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), swiglu_limit=7.0)
    state = dict(m.__dict__)
    for name in ("num_experts", "hidden_size", "intermediate_size", "block_size", "swiglu_limit"):
        state[name] = state.pop("_" + name)
    old = FP8Experts.__new__(FP8Experts)
    old.__setstate__(state)
    assert (old.num_experts, old.block_size, old.swiglu_limit) == (4, [32, 32], 7.0)
    hidden = torch.randn(3, 64)
    idx, w = _routing(3, 4, 2)
    assert torch.equal(old(hidden, idx, w), m(hidden, idx, w))


def test_casting_a_model_keeps_fp8_weights_and_scales():
    # model.half() / .to(bf16) cast every floating parameter; the fp8 modules keep theirs
    gu, dp = _float_experts(E=4, H=64, I=32)
    model = nn.ModuleDict({"experts": FP8Experts.from_float(gu, dp, block_size=(32, 32)),
                           "linear": FP8Linear.from_float(nn.Linear(64, 64), block_size=(32, 32)), "norm": nn.LayerNorm(64)})
    dtypes = {n: p.dtype for n, p in model.named_parameters() if not n.startswith("norm")}
    hidden = torch.randn(3, 64, dtype=torch.float16)
    idx, w = _routing(3, 4, 2)
    want = model["experts"](hidden, idx, w), model["linear"](hidden)
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float16)):
        cast(model)
        assert {n: p.dtype for n, p in model.named_parameters() if not n.startswith("norm")} == dtypes
        assert torch.equal(model["experts"](hidden, idx, w), want[0])
        assert torch.equal(model["linear"](hidden), want[1])
    assert model["norm"].weight.dtype == torch.float16  # other modules cast as asked


def test_casting_a_model_makes_no_copy_of_its_fp8_weights():
    # the cast used to run on every weight and be dropped afterwards: a 16-bit copy of
    # each fp8 weight (twice its bytes; a DeepSeek-V3 layer's 7.5 GB gate_up as 15 GB)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.numels.append(out.numel())
            return out

    gu, dp = _float_experts(E=4, H=64, I=32)
    model = nn.ModuleDict({"experts": FP8Experts.from_float(gu, dp, block_size=(32, 32)),
                           "linear": FP8Linear.from_float(nn.Linear(64, 48), block_size=(32, 32))})
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float16)):
        with Made() as made:
            cast(model)
        assert max(made.numels, default=0) < 48  # no tensor the size of a weight or a bias made


def test_calibration_refusing_a_static_module_leaves_no_module_observing():
    # a refusal used to leave the modules before the static one observing: their forward
    # then ran the eager loop and kept recording
    gu, dp = _float_experts(E=4, H=64, I=32)
    first = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    static = FP8Experts.from_float(gu, dp, block_size=(32, 32))
    fp8_moe_ops.calibrate_static_scales(static, [(torch.randn(3, 64), *_routing(3, 4, 2))])
    model = nn.ModuleDict({"first": first, "static": static})
    with pytest.raises(ValueError, match="expected dynamic-scheme modules to calibrate"):
        fp8_moe_ops.calibrate_static_scales(model, [torch.randn(2, 64)])
    assert first._observer is None and static._observer is None


def test_convert_linears_keeps_tied_linears_tied():
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared, nn.Linear(64, 32), shared)})
    fp8_moe_ops.convert_linears(model, block_size=(32, 32))
    assert isinstance(model["a"], FP8Linear) and model["a"] is model["b"][0]
    assert model["b"][2] is model["a"]  # twice in one parent: its second place was left a Linear
    assert isinstance(model["b"][1], FP8Linear) and len(list(model.modules())) == 4


class _StackedExperts(nn.Module):
    """transformers 5.x's fused experts: stacked 3-D weights, no linear layer."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 16, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(4, 16, 16, dtype=dtype))


def test_convert_linears_warns_about_stacked_expert_weights_it_leaves():
    model = nn.ModuleDict({"attn": nn.Linear(16, 16), "layers": nn.ModuleList(
        nn.ModuleDict({"experts": _StackedExperts()}) for _ in range(2))})
    with pytest.warns(UserWarning, match=r"2 module\(s\) hold expert weights stacked .* layers\.0\.experts "
                                         r"\(_StackedExperts\): gate_up_proj, down_proj.*quantize_experts"):
        fp8_moe_ops.convert_linears(model, block_size=(16, 16))
    assert isinstance(model["attn"], FP8Linear)
    assert model["layers"][0]["experts"].down_proj.dtype == torch.bfloat16
    # none to leave: no warning (fp8 stacks, a skipped module's stacks, 2-D weights only)
    quiet = nn.ModuleDict({"experts": FP8Experts.from_float(*_float_experts(E=4, H=64, I=32), block_size=(32, 32)),
                           "router": nn.ModuleDict({"x": _StackedExperts()}), "mlp": nn.Linear(16, 16),
                           "conv": nn.Conv1d(4, 4, 3), "embed": nn.ParameterDict({"pos": nn.Parameter(torch.zeros(1, 8, 16))})})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8_moe_ops.convert_linears(quiet, block_size=(16, 16))


def test_convert_linears_names_the_layer_it_cannot_convert_and_changes_nothing():
    first = nn.Linear(16, 8)
    model = nn.Sequential(first, nn.Sequential(nn.Linear(8, 8, device="meta")))
    with pytest.raises(ValueError, match=r"convert_linears: 1\.0 \(Linear\): linear\.weight: .*meta device"):
        fp8_moe_ops.convert_linears(model, block_size=(8, 8))
    assert model[0] is first  # converted only once every layer could be


def test_module_argument_errors():
    with pytest.raises(ValueError, match="dispatch: expected one of"):
        FP8Experts(4, 64, 32, dispatch="loop")
    with pytest.raises(ValueError, match="activation_scheme: expected one of"):
        FP8Linear(64, 32, activation_scheme="tensor")
    with pytest.raises(ValueError, match="no FP8Linear or FP8Experts|found none"):
        fp8_moe_ops.calibrate_static_scales(nn.Linear(2, 2), [torch.randn(1, 2)])


def test_experts_input_checks_skipped_only_for_checked_metadata():
    # a call whose inputs (and weights) have a checked call's metadata skips the Python
    # checks; anything else is checked as ever, and errors still name the argument
    from unittest import mock

    gu, dp = _float_experts(E=4, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    idx, w = _routing(3, 4, 2)
    want = m(hidden, idx, w)
    with mock.patch.object(FP8Experts, "_check_inputs", autospec=True,
                           side_effect=FP8Experts._check_inputs) as checks:
        assert torch.equal(m(hidden.clone(), idx.clone(), w.clone()), want)
        assert checks.call_count == 0
        with pytest.raises(TypeError, match="top_k_index: expected dtype"):
            m(hidden, idx.float(), w)
        with pytest.raises(ValueError, match="top_k_weights: expected a tensor on meta"):
            m.to("meta")(hidden.to("meta"), idx.to("meta"), w)  # the weights moved: checked again
        assert checks.call_count == 2


class _Functions(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


def _direct_calls(monkeypatch):
    """Counts the grouped experts op's CPU kernel calls made by ops.call_experts itself."""
    from fp8_moe_ops import ops

    kernel = ops._KERNELS["grouped_experts"]["cpu"]
    calls = []
    monkeypatch.setitem(ops._KERNELS["grouped_experts"], "cpu", lambda *a: calls.append(1) or kernel(*a))
    return calls


def test_experts_call_the_kernel_directly_only_where_nothing_would_dispatch(monkeypatch):
    # FP8Experts (as the transformers plug-in) skips the dispatcher in plain eager calls;
    # with grad to record, a mode, a subclass, the profiler or under compile it dispatches
    gu, dp = _float_experts(E=4, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    idx, w = _routing(3, 4, 2)
    want = torch.ops.fp8_moe.grouped_experts(hidden, idx, w, *m.expert_weights())
    calls = _direct_calls(monkeypatch)
    assert torch.equal(m(hidden, idx, w), want) and len(calls) == 1
    x = hidden.clone().requires_grad_()
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), want) and len(calls) == 2
    with torch.inference_mode():
        assert torch.equal(m(hidden, idx, w), want) and len(calls) == 3

    out = m(x, idx, w)  # grad to record: through the op's autograd kernel, which refuses backward
    assert len(calls) == 3 and out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(RuntimeError, match="fp8_moe::grouped_experts"):
        out.float().sum().backward()
    with OpsSeen() as mode:
        assert torch.equal(m(hidden, idx, w), want)
    assert "fp8_moe.grouped_experts.default" in mode.seen and len(calls) == 3
    with _Functions():
        assert torch.equal(m(hidden, idx, w), want) and len(calls) == 3
    assert torch.equal(m(hidden.as_subclass(_Sub), idx, w), want) and len(calls) == 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(m(hidden, idx, w), want)
    assert len(calls) == 3 and "fp8_moe::grouped_experts" in {e.name for e in prof.events()}
    assert torch.equal(torch.compile(m, fullgraph=True, backend="eager")(hidden, idx, w), want)
    assert len(calls) == 3


def test_fp8_linear_calls_the_kernel_directly_only_where_nothing_would_dispatch(monkeypatch):
    # as FP8Experts: plain eager calls skip the dispatcher (ops.call_linear); grad to record,
    # a mode, a subclass or compile dispatch (the pass reads fp8_moe::linear in the graph)
    from fp8_moe_ops import ops

    torch.manual_seed(0)
    lin = FP8Linear.from_float(nn.Linear(64, 32), block_size=(32, 32))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    kernel, calls = ops._KERNELS["linear"]["cpu"], []
    monkeypatch.setitem(ops._KERNELS["linear"], "cpu", lambda *a: calls.append(1) or kernel(*a))
    want = torch.ops.fp8_moe.linear(x, lin.weight, lin.weight_scale_inv, [32, 32]) + lin.bias.to(torch.bfloat16)
    assert torch.equal(lin(x), want) and len(calls) == 1
    xg = x.clone().requires_grad_()
    out = lin(xg)  # grad to record: the op's autograd kernel, which refuses backward
    assert len(calls) == 1 and out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(RuntimeError, match="fp8_moe::linear"):
        out.float().sum().backward()
    with OpsSeen() as mode:
        assert torch.equal(lin(x), want)
    assert "fp8_moe.linear.default" in mode.seen and len(calls) == 1
    with _Functions():
        assert torch.equal(lin(x), want) and len(calls) == 1
    assert torch.equal(lin(x.as_subclass(_Sub)), want) and len(calls) == 1
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, fullgraph=True, backend="eager")(x), want)
        assert len(calls) == 1
        assert torch.equal(lin(xg), want) and len(calls) == 2
    with pytest.raises(TypeError, match="x: expected dtype") as direct:
        ops.call_linear(x.int(), lin.weight, lin.weight_scale_inv, [32, 32])
    with pytest.raises(TypeError, match="x: expected dtype") as dispatched:
        torch.ops.fp8_moe.linear(x.int(), lin.weight, lin.weight_scale_inv, [32, 32])
    assert str(direct.value) == str(dispatched.value) and len(calls) == 3


def test_call_experts_rejects_bad_input_as_the_op_does(monkeypatch):
    from fp8_moe_ops import ops

    gu, dp = _float_experts(E=4, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    idx, w = _routing(3, 4, 2)
    calls = _direct_calls(monkeypatch)
    for bad, exc, error in (((hidden, idx.float(), w), TypeError, "top_k_index: expected dtype"),
                            ((hidden, idx, w[:, :1]), ValueError, "top_k_weights: expected shape"),
                            ((hidden, idx, w), ValueError, "gate_up_scale_inv: expected finite positive scales")):
        weights = m.expert_weights()
        if error.startswith("gate_up_scale_inv"):
            weights = weights._replace(gate_up_scale_inv=-weights.gate_up_scale_inv)
        args = (*bad, *weights)
        with pytest.raises(exc, match=error) as direct:
            ops.call_experts("grouped_experts", args)
        with pytest.raises(exc, match=error) as dispatched:
            torch.ops.fp8_moe.grouped_experts(*args)
        assert str(direct.value) == str(dispatched.value)
    assert len(calls) == 3
    # what the dispatcher's parsing refuses (a str limit) the direct path's checks refuse, naming it
    args = (hidden, idx, w, *m.expert_weights()._replace(swiglu_limit="7"))
    with pytest.raises(TypeError, match="swiglu_limit: expected None or a positive float"):
        ops.call_experts("grouped_experts", args)
    with pytest.raises(RuntimeError, match="swiglu_limit"):
        torch.ops.fp8_moe.grouped_experts(*args)
    # numpy's reals are limits as Python's floats are
    limited = [ops.call_experts("grouped_experts", (hidden, idx, w, *m.expert_weights()._replace(swiglu_limit=v)))
               for v in (0.5, np.float32(0.5), np.float64(0.5))]
    assert torch.equal(limited[0], limited[1]) and torch.equal(limited[0], limited[2])


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_export_aoti_package_matches_eager(tmp_path, static):
    torch.manual_seed(0)
    gu, dp = _float_experts(E=5, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    hidden = torch.randn(7, 64, dtype=torch.bfloat16)
    idx, w = _routing(7, 5, 2)
    if static:
        fp8_moe_ops.calibrate_static_scales(m, [(hidden, idx, w)])
    ep = torch.export.export(m, (hidden, idx, w))
    assert "fp8_moe.grouped_experts" in str(ep.graph)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "experts.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    assert torch.equal(loaded(hidden, idx, w), m(hidden, idx, w))


@pytest.mark.parametrize("dispatch", ["eager", "grouped", "batched"])
def test_experts_accept_leading_dims(dispatch):
    gu, dp = _float_experts(E=5, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch=dispatch)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)  # (batch, sequence, H)
    idx, w = _routing(6, 5, 2)
    out = m(hidden, idx.view(2, 3, 2), w.view(2, 3, 2))
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, m(hidden.view(6, 64), idx, w).view(2, 3, 64))


def test_experts_read_replaced_and_parametrised_weights():
    # the forward reads the module's tensors as they are now: a parametrised scale grid
    # (doubled: the output doubles exactly), a replaced parameter, and under compile
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, s):
            return 2 * s

    gu, dp = _float_experts(E=4, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="grouped")
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    idx, w = _routing(5, 4, 2)
    before = m(hidden, idx, w)
    assert before.abs().max() > 0
    parametrize.register_parametrization(m, "down_proj_scale_inv", Doubled())
    assert torch.equal(m.expert_weights().down_scale_inv, 2 * m.parametrizations.down_proj_scale_inv.original)
    assert torch.equal(m(hidden, idx, w), 2 * before)
    assert torch.equal(torch.compile(m, fullgraph=True, backend="aot_eager")(hidden, idx, w), 2 * before)
    m.gate_up_proj = nn.Parameter(torch.zeros_like(m.gate_up_proj), requires_grad=False)  # every h is 0
    assert torch.equal(m(hidden, idx, w), torch.zeros_like(before))


@pytest.mark.slow
def test_experts_leading_dims_under_compile_with_the_pass():
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    import fp8_moe_ops.passes as passes

    gu, dp = _float_experts(E=5, H=64, I=32)
    m = FP8Experts.from_float(gu, dp, block_size=(32, 32), dispatch="eager")
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    idx, w = _routing(6, 5, 2)
    idx, w = idx.view(2, 3, 2), w.view(2, 3, 2)
    torch._dynamo.reset()
    counters["fp8_moe"].clear()
    with passes.enabled(), inductor_config.patch(force_disable_caches=True):
        out = torch.compile(m, fullgraph=True)(hidden, idx, w)
    assert counters["fp8_moe"]["loops_rewritten"] == 1
    assert out.shape == (2, 3, 64)
    assert_agree(out, m(hidden, idx, w))
