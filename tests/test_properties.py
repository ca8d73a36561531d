"""Property tests: grouped == batched == eager loop == float64 within the bound, on
inputs drawn by hypothesis (sizes not multiples of the block, sentinels, skew)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8_moe_ops

from helpers import REL_BOUND, assert_agree, experts_float64, make_experts_inputs, rel_err

OPS = torch.ops.fp8_moe


@st.composite
def moe_inputs(draw):
    E = draw(st.integers(1, 9))
    k = draw(st.integers(1, 4))
    T = draw(st.integers(0, 12))
    bn = draw(st.sampled_from([16, 32]))
    bk = draw(st.sampled_from([16, 32]))
    H = draw(st.integers(1, 5)) * 8 + draw(st.sampled_from([0, 3]))   # often not a block multiple
    I = draw(st.integers(1, 4)) * 8 + draw(st.sampled_from([0, 5]))
    routing = draw(st.sampled_from(["uniform", "one", "empty", "sentinel"]))
    if routing == "empty" and E == 1:
        routing = "uniform"
    return dict(
        T=T, E=E, H=H, I=I, k=k, block_size=[bn, bk],
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        scale_dtype=draw(st.sampled_from([torch.float32, torch.float8_e8m0fnu])),
        static=draw(st.booleans()), routing=routing, per_tensor=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# derandomize: CI runs the same examples every time (no flaky first-seen failures);
# widen the search locally with --hypothesis-seed or a larger max_examples.
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(moe_inputs(), st.sampled_from(["silu", "gelu", "gelu_tanh", "relu"]))
def test_dispatches_agree_with_each_other_and_float64(case, activation):
    args = make_experts_inputs(**case)
    args["activation"] = activation
    grouped = OPS.grouped_experts(**args)
    assert_agree(grouped, OPS.batched_experts(**args))
    E, H, I = case["E"], case["H"], case["I"]
    mod = fp8_moe_ops.FP8Experts(E, H, I, case["block_size"], activation,
                                 "static" if case["static"] else "dynamic", scale_dtype=case["scale_dtype"])
    for name, key in [("gate_up_proj", "gate_up_proj"), ("gate_up_proj_scale_inv", "gate_up_scale_inv"),
                      ("down_proj", "down_proj"), ("down_proj_scale_inv", "down_scale_inv"),
                      ("gate_up_proj_activation_scale", "gate_up_act_scale"),
                      ("down_proj_activation_scale", "down_act_scale")]:
        if key in args:
            getattr(mod, name).data = args[key]
    assert_agree(grouped, mod(args["hidden"], args["top_k_index"], args["top_k_weights"]))
    if case["T"]:
        assert not torch.isnan(grouped).any()
        # Two roundings to the activation dtype separate the op from the yardstick.
        assert rel_err(grouped, experts_float64(**args)) < 2 * REL_BOUND[case["dtype"]]
