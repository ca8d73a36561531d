"""The production routing and expert-forward pieces (``fp8_moe_ops.routing``,
``fp8_moe_ops.functional``) against the reference, an independent implementation."""

import pytest
import torch

from fp8_moe_ops import functional, reference, routing

from helpers import make_routing

ROUTING_CASES = [
    # (T, k, E, kind): what each probes
    (0, 2, 4, "uniform"),    # T = 0: no slot, offsets all zero
    (1, 1, 1, "uniform"),    # T = 1, E = 1
    (13, 3, 7, "uniform"),   # prime E
    (9, 2, 5, "empty"),      # experts without tokens, the first one included
    (6, 2, 3, "one"),        # every slot on the last expert
    (12, 3, 5, "sentinel"),  # ids outside [0, E) on both sides; a token with no valid expert
]


@pytest.mark.parametrize("T,k,E,kind", ROUTING_CASES)
def test_sort_slots_is_the_reference_sort(T, k, E, kind):
    idx, _ = make_routing(T, k, E, kind, gen=torch.Generator().manual_seed(T + E))
    perm, offsets = routing.sort_slots(idx, E)
    rperm, roffsets = reference.sort_by_expert(idx, E)
    assert perm.dtype == torch.int64 and offsets.dtype == torch.int32
    assert torch.equal(perm, rperm) and torch.equal(offsets, roffsets)
    pos = routing.sorted_positions(perm)  # the inverse permutation
    assert pos.dtype == torch.int64 and torch.equal(perm[pos], torch.arange(T * k))
    assert torch.equal(pos[perm], torch.arange(T * k))


@pytest.mark.parametrize("ids,E,match", [
    (torch.tensor([[0.9, 1.7]]), 2, "expert_ids: expected an integer tensor"),  # was truncated to 0, 1
    (torch.tensor([[True, False]]), 2, "expert_ids: expected an integer tensor"),
    (torch.tensor([[0, 1]]), 2.5, "num_experts: expected a non-negative int, got 2.5"),  # made 3 offsets
])
def test_sort_slots_rejects_what_is_not_ids(ids, E, match):
    with pytest.raises(TypeError, match=match):
        routing.sort_slots(ids, E)


def test_sort_slots_rejects_a_negative_expert_count_as_a_value():
    with pytest.raises(ValueError, match="num_experts: expected a non-negative int, got -1"):
        routing.sort_slots(torch.tensor([[0, 1]]), -1)


@pytest.mark.parametrize("T,k,E,kind", ROUTING_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_is_the_reference_combine(T, k, E, kind, dtype):
    gen = torch.Generator().manual_seed(T * 7 + E)
    idx, w = make_routing(T, k, E, kind, gen=gen)
    y = torch.randn(T * k, 16, generator=gen).to(dtype)
    valid = ((idx >= 0) & (idx < E)).reshape(-1)
    y[~valid] = float("nan")  # rows of sentinel slots are never read
    out = routing.combine(y, idx, w, E, dtype)
    assert torch.equal(out, reference.combine(y, idx, w, E, dtype))
    none = ~((idx >= 0) & (idx < E)).any(dim=1)
    assert torch.equal(out[none], torch.zeros_like(out[none]))


@pytest.mark.parametrize("activation", functional.ACTIVATIONS)
@pytest.mark.parametrize("limit", [None, 0.4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_activation_is_the_reference_one(activation, limit, dtype):
    h = (torch.randn(7, 2 * 24, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    out = functional.gated_activation(h, activation, limit)
    assert out.shape == (7, 24) and out.dtype == dtype
    assert torch.equal(out, reference.gated_activation(h, activation, limit))


def test_gated_activation_rejects_unknown_names():
    with pytest.raises(ValueError, match="activation: expected one of"):
        functional.gated_activation(torch.zeros(1, 4), "swish")


def test_constants_agree_with_the_reference():
    assert functional.ACTIVATIONS == reference.ACTIVATIONS and functional.FP8_MAX == reference.FP8_MAX
    assert [functional.cdiv(a, 4) for a in range(9)] == [reference.cdiv(a, 4) for a in range(9)]
