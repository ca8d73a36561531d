"""Bad input gets a clear error naming the argument (one row of docs/ops.md each): the
ops, then the public Python API (modules, quantisation, calibration, conversion)."""

import pytest
import torch
from torch import nn

import fp8_moe_ops
from fp8_moe_ops.functional import gated_activation
from helpers import make_expert_weights, make_experts_inputs

OPS = torch.ops.fp8_moe


def _linear_args():
    w, ws = make_expert_weights(1, 64, 96, [32, 32])
    return dict(x=torch.randn(4, 96, dtype=torch.bfloat16), w=w[0], w_scale_inv=ws[0], block_size=[32, 32])


LINEAR_BAD = [
    # (change, exception, message fragment)
    (dict(x=torch.zeros(4, 96, dtype=torch.int64)), TypeError, "x: expected dtype bfloat16"),        # integer activations
    (dict(x=torch.zeros(2, 4, 96)), ValueError, "x: expected a 2-D"),                      # not 2-D
    (dict(x=torch.zeros(4, 95)), ValueError, "x: expected last dim K = 96"),               # K mismatch
    (dict(w=torch.zeros(64, 96)), TypeError, "w: expected dtype torch.float8_e4m3fn"),     # weights not e4m3
    (dict(w_scale_inv=torch.ones(2, 3, dtype=torch.float16)), TypeError, "w_scale_inv: expected dtype"),
    (dict(w_scale_inv=torch.ones(2, 2)), ValueError, r"w_scale_inv: expected shape \(2, 3\)"),  # grid mismatch
    (dict(block_size=[64, 32]), ValueError, r"w_scale_inv: expected shape \(1, 3\)"),     # block vs grid
    # a one-block grid is the per-matrix one: named once
    (dict(block_size=[64, 96]), ValueError, r"w_scale_inv: expected shape \(1, 1\) \(ceil .* \[64, 96\]\), got"),
    (dict(block_size=[32]), ValueError, r"block_size: expected a pair \(bn, bk\) of positive ints, got \[32\]"),
    (dict(block_size=[0, 32]), ValueError, r"block_size: expected a pair \(bn, bk\) of positive ints, got \[0, 32\]"),
    (dict(act_scale=torch.ones(2)), ValueError, "act_scale: expected one element"),
    (dict(act_scale=torch.ones(1, dtype=torch.float64)), TypeError, "act_scale: expected dtype torch.float32"),
    (dict(act_scale=torch.tensor([-1.0])), ValueError, "act_scale: expected finite positive"),   # negative scale
    (dict(act_scale=torch.tensor([float("nan")])), ValueError, "act_scale: expected finite positive"),
    (dict(w_scale_inv=torch.full((2, 3), float("inf"))), ValueError, "w_scale_inv: expected finite positive"),
    (dict(out_dtype=torch.int8), TypeError, "out_dtype"),
    (dict(x=torch.zeros(4, 96, device="meta")), ValueError, "expected a tensor on"),   # different devices
]


def test_an_int_block_size_stops_at_the_dispatcher():
    # which parses the schema's SymInt[2] before any check of the op's
    with pytest.raises(RuntimeError, match=r"fp8_moe::linear\(\) Expected a value of type 'List\[int\]'"):
        torch.ops.fp8_moe.linear(**(_linear_args() | dict(block_size=32)))


@pytest.mark.parametrize("change,exc,match", LINEAR_BAD)
def test_linear_bad_input(change, exc, match):
    kwargs = _linear_args() | change
    with pytest.raises(exc, match=match):
        OPS.linear(**kwargs)


def test_non_contiguous_weights_rejected_and_strided_activations_accepted():
    a = _linear_args()
    wt = a["w"].t().contiguous().t()  # same values, transposed strides
    with pytest.raises(ValueError, match="w: expected a contiguous tensor"):
        OPS.linear(**(a | dict(w=wt)))
    x = torch.randn(96, 4, dtype=torch.bfloat16).t()  # non-contiguous activations are fine
    assert torch.equal(OPS.linear(**(a | dict(x=x))), OPS.linear(**(a | dict(x=x.contiguous()))))


def _grouped_args():
    w, ws = make_expert_weights(3, 64, 96, [32, 32])
    return dict(x=torch.randn(6, 96), w=w, w_scale_inv=ws, offsets=torch.tensor([2, 2, 5], dtype=torch.int32),
                block_size=[32, 32])


GROUPED_BAD = [
    (dict(offsets=torch.tensor([2, 2, 5])), TypeError, "offsets: expected dtype torch.int32"),
    (dict(offsets=torch.tensor([2, 5], dtype=torch.int32)), ValueError, r"offsets: expected shape \(3,\)"),
    (dict(offsets=torch.tensor([3, 2, 5], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(offsets=torch.tensor([2, 2, 7], dtype=torch.int32)), ValueError, r"offsets\[-1\] <= 6"),
    (dict(act_scale=torch.ones(2)), ValueError, r"act_scale: expected shape \(3,\)"),
    (dict(w_scale_inv=torch.ones(3, 2, 2)), ValueError, "w_scale_inv: expected shape"),
]


@pytest.mark.parametrize("change,exc,match", GROUPED_BAD)
def test_grouped_mm_bad_input(change, exc, match):
    with pytest.raises(exc, match=match):
        OPS.grouped_mm(**(_grouped_args() | change))


def test_batched_mm_bad_input():
    a = _grouped_args()
    del a["offsets"]
    with pytest.raises(ValueError, match=r"expert_ids: expected shape \(6,\)"):
        OPS.batched_mm(**a, expert_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="expert_ids: expected dtype"):
        OPS.batched_mm(**a, expert_ids=torch.zeros(6))


def test_a_one_expert_act_scale_of_shape_empty_is_refused():
    # per-expert scales are (E,): a 0-d scale of E = 1's one element passed the element
    # count, then the CPU reference failed to index it (IndexError) while CUDA ran it
    w, ws = make_expert_weights(1, 64, 96, [32, 32])
    x, scalar = torch.randn(5, 96), torch.tensor(0.01)
    args = dict(x=x, w=w, w_scale_inv=ws, block_size=[32, 32], act_scale=scalar)
    with pytest.raises(ValueError, match=r"act_scale: expected shape \(1,\) \(one scale per expert\), got shape \(\)"):
        OPS.grouped_mm(**args, offsets=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"act_scale: expected shape \(1,\)"):
        OPS.batched_mm(**args, expert_ids=torch.zeros(5, dtype=torch.long))
    a = make_experts_inputs(4, 1, 64, 16, 1, [32, 32])
    for name in ("gate_up_act_scale", "down_act_scale"):
        with pytest.raises(ValueError, match=rf"{name}: expected shape \(1,\)"):
            OPS.grouped_experts(**(a | {name: scalar}))
    # a single matrix's scale may be () or (1,)
    la = _linear_args()
    assert torch.equal(OPS.linear(**la, act_scale=scalar), OPS.linear(**la, act_scale=scalar.reshape(1)))


EXPERTS_BAD = [
    (dict(hidden=torch.zeros(4, 2, 64)), ValueError, "hidden: expected a 2-D"),
    (dict(top_k_index=torch.zeros(4, 0, dtype=torch.long)), ValueError, "top_k >= 1"),          # top_k = 0
    (dict(top_k_index=torch.zeros(3, 2, dtype=torch.long)), ValueError, r"top_k_index: expected shape \(4, top_k\)"),
    (dict(top_k_index=torch.zeros(4, 2)), TypeError, "top_k_index: expected dtype"),
    (dict(top_k_weights=torch.ones(4, 3)), ValueError, "top_k_weights: expected shape"),
    (dict(top_k_weights=torch.ones(4, 2, dtype=torch.int64)), TypeError, "top_k_weights: expected dtype"),
    (dict(activation="swish"), ValueError, "activation: expected one of"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit"),
    (dict(gate_up_act_scale=torch.ones(4)), ValueError, r"gate_up_act_scale: expected shape \(3,\)"),
    (dict(down_act_scale=torch.zeros(3)), ValueError, "down_act_scale: expected finite positive"),
    (dict(down_proj=torch.zeros(3, 64, 8, dtype=torch.float8_e4m3fn)), ValueError, "down_proj: expected shape"),
    (dict(gate_up_proj=torch.zeros(3, 33, 64, dtype=torch.float8_e4m3fn), gate_up_scale_inv=torch.ones(3, 2, 2)),
     ValueError, "gate_up_proj: expected an even"),
    # H disagrees: the message shows hidden's shape beside the weight's, either may be the wrong one
    (dict(hidden=torch.zeros(4, 48)), ValueError,
     r"gate_up_proj: expected shape \(E, 2I, 48\) \(H from hidden, of shape \(4, 48\)\), got shape \(3, 32, 64\)"),
]


@pytest.mark.parametrize("change,exc,match", EXPERTS_BAD)
@pytest.mark.parametrize("op", ["grouped_experts", "batched_experts"])
def test_experts_bad_input(change, exc, match, op):
    a = make_experts_inputs(4, 3, 64, 16, 2, [32, 32])
    with pytest.raises(exc, match=match):
        getattr(OPS, op)(**(a | change))


def test_errors_also_raise_under_fake_tensors():
    # Metadata checks run in the fake kernel too: torch.compile fails at trace time (under
    # compile, a fake kernel that checked nothing let the real CPU kernel raise at run time)
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = _linear_args() | dict(x=torch.zeros(4, 95))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
        with pytest.raises(ValueError, match=r"^x: expected last dim K = 96"):
            OPS.linear(**fake)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="x: expected last dim K = 96"):
        torch.compile(lambda **kw: OPS.linear(**kw), fullgraph=True, backend="eager")(**a)


def test_overlapping_activations_accepted():
    # an expanded (stride-0, overlapping) x is read as the values it shows
    a = _linear_args()
    row = torch.randn(1, 96, dtype=torch.bfloat16)
    x = row.expand(4, 96)
    out = OPS.linear(**(a | dict(x=x)))
    assert torch.equal(out, OPS.linear(**(a | dict(x=x.contiguous()))))
    assert torch.equal(out[0], out[3])


def test_inf_activation_saturates_under_static_scales_only_in_its_row():
    a = make_experts_inputs(6, 3, 64, 32, 2, [32, 32], static=True)
    clean = OPS.grouped_experts(**a)
    a["hidden"][2, 5] = float("inf")
    out = OPS.grouped_experts(**a)
    assert torch.isfinite(out).all()  # +-448 after the static clamp, never NaN
    rows = [0, 1, 3, 4, 5]
    assert torch.equal(out[rows], clean[rows])  # no other token's row changes
    assert not torch.equal(out[2], clean[2])


# --------------------------------------------------------------------------- public Python API


def _experts(dispatch="eager", **kw):
    g = torch.Generator().manual_seed(0)
    return fp8_moe_ops.FP8Experts.from_float(torch.randn(3, 32, 64, generator=g), torch.randn(3, 64, 16, generator=g),
                                             block_size=(32, 32), dispatch=dispatch, **kw)


def _routing(T=4, k=2):
    g = torch.Generator().manual_seed(1)
    w, idx = torch.topk(torch.rand(T, 3, generator=g), k)
    return torch.randn(T, 64, generator=g).to(torch.bfloat16), idx, w


def _swap_index_and_weights(m, h, i, w):
    return m(h, w, i)


MODULE_CALL_BAD = [
    # (forward(hidden, index, weights) -> a bad call, exception, message fragment)
    (_swap_index_and_weights, TypeError, "top_k_index: expected dtype torch.int32 or torch.int64"),  # args swapped
    (lambda m, h, i, w: m(h, i.to(torch.int16), w), TypeError, "top_k_index: expected dtype"),
    (lambda m, h, i, w: m(h, i, w.double()), TypeError, "top_k_weights: expected dtype bfloat16"),
    (lambda m, h, i, w: m(h, i, w[:, :1]), ValueError, r"top_k_weights: expected shape \(4, 2\)"),
    (lambda m, h, i, w: m(h, i[:3], w[:3]), ValueError, r"top_k_index: expected shape \(4, 'top_k'\)"),
    (lambda m, h, i, w: m(h[:, :60], i, w), ValueError, r"hidden_states: expected shape \(..., 64\)"),
    (lambda m, h, i, w: m(h.long(), i, w), TypeError, "hidden_states: expected dtype"),
    (lambda m, h, i, w: m(h, i[:, :0], w[:, :0]), ValueError, "top_k >= 1"),
    (lambda m, h, i, w: m(h[None], i, w), ValueError, r"top_k_index: expected shape \(1, 4, 'top_k'\)"),
    (lambda m, h, i, w: m(h.to("meta"), i, w), ValueError, "hidden_states: expected a tensor on cpu"),
]


@pytest.mark.parametrize("dispatch", ["eager", "grouped", "batched"])
@pytest.mark.parametrize("call,exc,match", MODULE_CALL_BAD)
def test_experts_forward_bad_input_names_the_module_argument(call, exc, match, dispatch):
    with pytest.raises(exc, match=match):
        call(_experts(dispatch), *_routing())


BLOCK_SIZE_MSG = r"block_size: expected a pair \(bn, bk\) of positive ints"
BUILDERS = {
    "FP8Experts.from_float": lambda bs: fp8_moe_ops.FP8Experts.from_float(
        torch.randn(2, 8, 16), torch.randn(2, 16, 4), block_size=bs),
    "FP8Experts": lambda bs: fp8_moe_ops.FP8Experts(2, 16, 4, block_size=bs),
    "FP8Linear": lambda bs: fp8_moe_ops.FP8Linear(16, 8, block_size=bs),
    "FP8Linear.from_float": lambda bs: fp8_moe_ops.FP8Linear.from_float(nn.Linear(16, 8), block_size=bs),
    "quantize_weight": lambda bs: fp8_moe_ops.quantize_weight(torch.randn(8, 16), bs),
    "convert_linears": lambda bs: fp8_moe_ops.convert_linears(nn.Sequential(nn.Linear(16, 8)), block_size=bs),
}


@pytest.mark.parametrize("builder", BUILDERS.values(), ids=BUILDERS.keys())
@pytest.mark.parametrize("block_size,exc", [
    (128, TypeError),            # an int, not a pair
    ("32", TypeError),           # a string
    ((32.0, 32), TypeError),     # not ints
    ((32,), ValueError),         # one value
    ((32, 32, 32), ValueError),  # three values
    ((0, 32), ValueError),       # not positive
])
def test_block_size_is_always_a_pair_of_positive_ints(builder, block_size, exc):
    with pytest.raises(exc, match=BLOCK_SIZE_MSG):
        builder(block_size)


CONSTRUCT_BAD = [
    (lambda: fp8_moe_ops.FP8Experts(0, 16, 4), ValueError, "num_experts: expected a positive int, got 0"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16.0, 4), TypeError, "hidden_size: expected a positive int"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16, 4, dispatch="group"), ValueError, "dispatch: expected one of"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16, 4, activation="swish"), ValueError, "activation: expected one of"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16, 4, activation_scheme="statik"), ValueError, "activation_scheme"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16, 4, scale_dtype=torch.float16), TypeError, "scale_dtype: expected"),
    (lambda: fp8_moe_ops.FP8Experts(2, 16, 4, swiglu_limit=-1.0), ValueError, "swiglu_limit: expected"),
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.randn(2, 7, 16), torch.randn(2, 16, 3)), ValueError,
     r"gate_up_proj: expected shape \(E, 2I, H\)"),
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.randn(2, 8, 16), torch.randn(2, 16, 5)), ValueError,
     r"down_proj: expected shape \(2, 16, 4\)"),
    (lambda: fp8_moe_ops.FP8Linear(0, 8), ValueError, "in_features: expected a positive int"),
    (lambda: fp8_moe_ops.FP8Linear(16, 8, bias=1), TypeError, "bias: expected a bool"),
    (lambda: fp8_moe_ops.FP8Linear.from_float(nn.Conv1d(2, 2, 1)), TypeError, "linear: expected an nn.Linear"),
    (lambda: fp8_moe_ops.FP8Linear(16, 8)(torch.randn(3, 15)), ValueError, r"x: expected shape \(..., 16\)"),
    (lambda: fp8_moe_ops.FP8Linear(16, 8)(torch.randn(3, 16, device="meta")), ValueError,
     "x: expected a tensor on cpu \\(the device of the weights\\), got meta"),
    # from_float names the weight at fault, not quantize_weight's w
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.randn(2, 8, 16), torch.full((2, 16, 4), float("nan"))),
     ValueError, "down_proj: expected finite values, got NaN or Inf"),
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.ones(2, 8, 16, dtype=torch.int64), torch.randn(2, 16, 4)),
     TypeError, "gate_up_proj: expected a float32/bfloat16/float16 tensor, got torch.int64"),
    (lambda: fp8_moe_ops.FP8Linear.from_float(nn.Linear(16, 8, device="meta")), ValueError,
     "linear.weight: expected a tensor with values to quantise, got a tensor on the meta device"),
    (lambda: fp8_moe_ops.quantize_weight(torch.randn(8, 16), scale_dtype=torch.bfloat16), TypeError, "scale_dtype"),
    (lambda: fp8_moe_ops.calibrate_static_scales("model", []), TypeError, "model: expected an nn.Module"),
    # a zero size named the constructor's num_experts / hidden_size / intermediate_size, which from_float has not
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.randn(0, 64, 32), torch.randn(0, 32, 32)), ValueError,
     r"^gate_up_proj: expected shape \(E, 2I, H\) with E, I, H >= 1, got shape \(0, 64, 32\)"),
    (lambda: fp8_moe_ops.FP8Experts.from_float(torch.randn(2, 64, 0), torch.randn(2, 0, 32)), ValueError,
     r"^gate_up_proj: expected shape \(E, 2I, H\) with E, I, H >= 1"),
    (lambda: gated_activation(torch.randn(2, 3), "silu"), ValueError, r"h: expected shape \(\.\.\., 2I\)"),
    (lambda: gated_activation(torch.ones(2, 4, dtype=torch.int64), "silu"), TypeError,
     "h: expected a float16/bfloat16/float32/float64 tensor"),
    (lambda: gated_activation(torch.ones(2, 4).to(torch.float8_e4m3fn), "silu"), TypeError,
     "h: expected a float16/bfloat16/float32/float64 tensor .*, got torch.float8_e4m3fn"),
    (lambda: gated_activation(torch.randn(2, 4), ["silu"]), ValueError, r"activation: expected one of .*, got \['silu'\]"),
    (lambda: gated_activation(torch.randn(2, 4), "silu", -1.0), ValueError, "swiglu_limit: expected None or a positive"),
    (lambda: fp8_moe_ops.calibrate_static_scales(_experts(), []), ValueError, "calibration_batches"),
    # one batch alone: iterating it would run its rows, or its keys, as batches
    (lambda: fp8_moe_ops.calibrate_static_scales(_experts(), torch.zeros(4, 64)), TypeError,
     r"calibration_batches: expected an iterable of batches \(wrap a single batch in a list: .*\), got Tensor"),
    (lambda: fp8_moe_ops.calibrate_static_scales(_experts(), {"hidden": torch.zeros(4, 64)}), TypeError,
     r"calibration_batches: expected an iterable of batches .*, got dict"),
    (lambda: fp8_moe_ops.convert_linears([nn.Linear(2, 2)]), TypeError, "model: expected an nn.Module"),
]


def test_calibration_of_one_experts_batch_not_in_a_list_says_so_and_leaves_the_module_dynamic():
    # (hidden, top_k_index, top_k_weights) passed alone: each tensor would be a batch of its own; a
    # tuple is refused before any runs (a language model would take (input_ids, attention_mask)'s
    # mask as token ids, silently), a list once FP8Experts refuses one tensor; each error names
    # the argument and the fix
    m = _experts()
    batch = _routing()
    with pytest.raises(TypeError, match=r"calibration_batches: expected an iterable of batches, not a tuple of "
                                        r"tensors, .*wrap it in a list: .*, got a tuple of 3 tensors"):
        fp8_moe_ops.calibrate_static_scales(m, batch)
    with pytest.raises(TypeError, match=r"calibration_batches: expected an iterable of batches, got a list of 3 "
                                        r"tensors, each run as a batch alone \(model\(tensor\) raised: .*\); .*wrap it "
                                        r"in a list"):
        fp8_moe_ops.calibrate_static_scales(m, list(batch))
    assert m.activation_scheme == "dynamic"
    # the same batch in a list calibrates
    fp8_moe_ops.calibrate_static_scales(m, [batch])
    assert m.activation_scheme == "static"


def test_calibration_runs_mapping_batches_as_keywords_and_blames_no_good_list():
    # a mapping in a list (a tokenizer's BatchEncoding) ran as model(mapping), failing
    # deep inside; and a list of tensors for a one-input model is the right form: a
    # TypeError of its batches is the model's, not "one batch passed alone"
    class Keyworded(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = fp8_moe_ops.FP8Linear.from_float(nn.Linear(64, 32), (32, 32))

        def forward(self, x, shift=None):
            return self.lin(x if shift is None else x + shift)

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    by_name, by_place = Keyworded(), Keyworded()
    by_place.load_state_dict(by_name.state_dict())
    fp8_moe_ops.calibrate_static_scales(by_name, [{"x": x, "shift": torch.ones(64)}])
    fp8_moe_ops.calibrate_static_scales(by_place, [(x, torch.ones(64))])
    assert by_name.lin.activation_scheme == "static"
    assert torch.equal(by_name.lin.activation_scale, by_place.lin.activation_scale)
    lin = fp8_moe_ops.FP8Linear.from_float(nn.Linear(64, 32), (32, 32))
    with pytest.raises(TypeError, match="^x: expected dtype"):
        fp8_moe_ops.calibrate_static_scales(lin, [x.double(), x.double()])
    assert lin.activation_scheme == "dynamic"


@pytest.mark.parametrize("build,exc,match", CONSTRUCT_BAD)
def test_public_api_bad_input(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


@pytest.mark.parametrize("name,value,exc,match", [
    ("dispatch", "group", ValueError, r"dispatch: expected one of \('eager', 'grouped', 'batched'\), got 'group'"),
    ("activation", "gelu_erf", ValueError, "activation: expected one of"),
    ("activation_scheme", "statik", ValueError, "activation_scheme: expected one of"),
    # static needs calibrated scales first: calibrate_static_scales sets them
    ("activation_scheme", "static", ValueError, "activation_scheme: expected 'dynamic' until the static scales"),
    # the eager loop used to run with these (a negative limit clamped every gate)
    ("swiglu_limit", -5.0, ValueError, "swiglu_limit: expected None or a positive float, got -5.0"),
    ("swiglu_limit", "7", TypeError, "swiglu_limit: expected None or a positive float, got '7'"),
    # what shapes the weights is fixed (the eager loop ran over the first 3 experts of 4)
    ("num_experts", 2, AttributeError, r"num_experts: expected 3 \(fixed at construction by the weights' layout; "
     r"build a new FP8Experts for another\), got 2"),
    ("hidden_size", 32, AttributeError, "hidden_size: expected 64 .*, got 32"),
    ("intermediate_size", 8, AttributeError, "intermediate_size: expected 16 .*, got 8"),
    ("block_size", [16, 16], AttributeError, r"block_size: expected \[32, 32\] .*, got \[16, 16\]"),
])
def test_setting_an_unknown_value_raises_at_once(name, value, exc, match):
    m = _experts("grouped")
    before = getattr(m, name)
    with pytest.raises(exc, match=match):
        setattr(m, name, value)
    assert getattr(m, name) == before


def test_a_weight_set_to_none_is_refused():
    # accepted before: the next forward failed with "'NoneType' object has no attribute" naming nothing
    m, lin = _experts("grouped"), fp8_moe_ops.FP8Linear(16, 8, bias=True)
    for module, name in ((m, "gate_up_proj"), (m, "down_proj_scale_inv"), (lin, "weight"),
                         (lin, "weight_scale_inv")):
        before = getattr(module, name)
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor .*, got None"):
            setattr(module, name, None)
        assert getattr(module, name) is before
    lin.bias = None  # optional parameters may go
    assert lin.bias is None


def test_fixed_sizes_of_a_linear_and_block_size_copies():
    lin = fp8_moe_ops.FP8Linear(16, 8, block_size=(8, 8))
    for name in ("in_features", "out_features", "block_size"):
        with pytest.raises(AttributeError, match=f"{name}: expected .* build a new FP8Linear for another\\), got 4"):
            setattr(lin, name, 4)
    lin.block_size[0] = 4  # a copy: the module keeps its own
    assert lin.block_size == [8, 8]
    lin.block_size, lin.in_features = (8, 8), 16  # the values it has: accepted (code that syncs sizes)
    assert (lin.block_size, lin.in_features) == ([8, 8], 16)
    assert not hasattr(fp8_moe_ops.FP8Linear.__new__(fp8_moe_ops.FP8Linear), "in_features")  # unset: AttributeError


def test_expert_weights_hands_out_a_copy_of_the_block_size():
    # the list handed out was the module's own: changed there, every later forward ran
    # with another block size (wrong results where the scale grid kept its shape)
    m = _experts("grouped")
    m.expert_weights().block_size[0] = 16
    assert m.block_size == [32, 32] and m.expert_weights().block_size == [32, 32]


def test_linear_scheme_needs_its_scale():
    lin = fp8_moe_ops.FP8Linear(16, 8)
    with pytest.raises(ValueError, match="static scales \\['activation_scale'\\]"):
        lin.activation_scheme = "static"


@pytest.mark.parametrize("key,value,exc,match", [
    ("gate_up_proj", lambda t: t.float(), TypeError,                   # would be cast to fp8 silently
     "gate_up_proj: expected dtype torch.float8_e4m3fn .*, got torch.float32"),
    ("gate_up_proj_scale_inv", lambda t: t.to(torch.float8_e8m0fnu), TypeError, "gate_up_proj_scale_inv: expected dtype"),
    ("down_proj", lambda t: t[:, :, :8], ValueError, r"down_proj: expected shape \(3, 64, 16\)"),
    # scales a forward on CUDA would use unchecked (it checks no values)
    ("down_proj_scale_inv", lambda t: -t, ValueError, "down_proj_scale_inv: expected finite positive scales"),
    ("gate_up_proj_scale_inv", lambda t: t.index_fill(0, torch.tensor([1]), float("nan")), ValueError,
     "gate_up_proj_scale_inv: expected finite positive scales, got min nan"),
])
def test_load_state_dict_rejects_wrong_dtype_or_shape_naming_the_key(key, value, exc, match):
    m = _experts()
    sd = m.state_dict()
    sd[key] = value(sd[key])
    with pytest.raises(exc, match=match):
        m.load_state_dict(sd)


def _param(t):
    return nn.Parameter(t, requires_grad=False)


@pytest.mark.parametrize("name,value,exc,match", [
    ("gate_up_proj", lambda t: _param(t.float()), TypeError,  # the eager loop named the inner op's w
     "gate_up_proj: expected dtype torch.float8_e4m3fn \\(that of FP8Experts.gate_up_proj\\), got torch.float32"),
    ("down_proj", lambda t: _param(t[:2]), ValueError, r"down_proj: expected shape \(3, 64, 16\)"),
    ("down_proj_scale_inv", lambda t: _param(-t), ValueError, "down_proj_scale_inv: expected finite positive scales"),
    ("gate_up_proj_scale_inv", lambda t: "scales", TypeError, "gate_up_proj_scale_inv: expected a Tensor, got str"),
])
def test_replacing_a_parameter_is_checked_as_loading_it(name, value, exc, match):
    m = _experts()
    before = getattr(m, name)
    with pytest.raises(exc, match=match):
        setattr(m, name, value(before))
    assert getattr(m, name) is before
    setattr(m, name, _param(before.clone()))  # the same dtype and shape: accepted
    assert torch.equal(getattr(m, name), before)


@pytest.mark.parametrize("name,value,exc,match", [
    # unset under the dynamic scheme: checked against what the static scheme would hold
    ("gate_up_proj_activation_scale", torch.ones(6), ValueError,
     r"gate_up_proj_activation_scale: expected shape \(3,\) \(that of FP8Experts.gate_up_proj_activation_scale\), "
     r"got shape \(6,\)"),
    ("down_proj_activation_scale", -torch.ones(3), ValueError, "down_proj_activation_scale: expected finite positive"),
    ("down_proj_activation_scale", torch.ones(3, dtype=torch.bfloat16), TypeError,
     "down_proj_activation_scale: expected dtype torch.float32"),
    # a weight the kernels would read with the wrong strides
    ("gate_up_proj", _param(torch.zeros(3, 64, 32, dtype=torch.float8_e4m3fn).transpose(1, 2)), ValueError,
     r"gate_up_proj: expected a contiguous tensor \(weights are never copied per call\), got strides"),
])
def test_a_first_assignment_and_a_strided_weight_are_checked(name, value, exc, match):
    m = _experts()
    with pytest.raises(exc, match=match):
        setattr(m, name, _param(value) if not isinstance(value, nn.Parameter) else value)
    assert m.activation_scheme == "dynamic" and m.gate_up_proj.is_contiguous()
    assert name.endswith("proj") or getattr(m, name) is None


def test_a_static_scale_cannot_be_unset_while_static():
    m = _experts()
    m.gate_up_proj_activation_scale = _param(torch.full((3,), 0.01))
    m.down_proj_activation_scale = _param(torch.full((3,), 0.01))
    m.activation_scheme = "static"
    with pytest.raises(ValueError, match="gate_up_proj_activation_scale: expected a tensor while activation_scheme "
                                         "is 'static' .*, got None"):
        m.gate_up_proj_activation_scale = None  # the forward would have run dynamic, the scheme still 'static'
    m.activation_scheme = "dynamic"
    m.gate_up_proj_activation_scale = None
    lin = fp8_moe_ops.FP8Linear(16, 8, activation_scheme="static")
    with pytest.raises(ValueError, match="activation_scale: expected a tensor while activation_scheme is 'static'"):
        lin.activation_scale = None
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\) \(that of FP8Linear.bias\), got shape \(1,\)"):
        lin.bias = _param(torch.ones(1))  # would broadcast over every output
    lin.bias = _param(torch.ones(8, dtype=torch.bfloat16))  # any float dtype: added in the activations' dtype


def test_a_strided_weight_loads_by_copy_not_by_assignment():
    m = _experts()
    sd = m.state_dict()
    sd["gate_up_proj"] = sd["gate_up_proj"].transpose(1, 2).contiguous().transpose(1, 2)
    m.load_state_dict(sd)  # copied into the contiguous parameter
    with pytest.raises(ValueError, match="gate_up_proj: expected a contiguous tensor"):
        m.load_state_dict(sd, assign=True)


def test_load_state_dict_checks_a_static_scale():
    model = nn.Sequential(fp8_moe_ops.FP8Linear(16, 8, activation_scheme="static"))
    sd = model.state_dict()
    sd["0.activation_scale"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"0\.activation_scale: expected finite positive scales, got min 0.0"):
        model.load_state_dict(sd)
    model.load_state_dict({**sd, "0.activation_scale": torch.full((1,), 0.5)})
    assert model[0].activation_scale.item() == 0.5


def test_load_state_dict_names_the_prefixed_key():
    model = nn.Sequential(fp8_moe_ops.FP8Linear(16, 8))
    sd = model.state_dict()
    sd["0.weight"] = sd["0.weight"].float()
    with pytest.raises(TypeError, match=r"0\.weight: expected dtype torch.float8_e4m3fn"):
        model.load_state_dict(sd)
