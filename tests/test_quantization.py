"""Quantisation: compared bitwise with torch's own casts."""

import pytest
import torch

import fp8_moe_ops
from fp8_moe_ops import reference

E4M3 = torch.float8_e4m3fn


def _groups(x, bk):
    # (M, K) -> list of (M, <=bk) column groups
    return list(torch.split(x.float(), bk, dim=1))


@pytest.mark.parametrize("M,K,bk", [
    (1, 128, 128),   # one token, one group
    (5, 200, 128),   # K not a multiple of the group: tail group of 72
    (3, 7, 4),       # tiny groups, ragged tail
    (0, 64, 32),     # T = 0
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dynamic_quantisation_matches_torch_cast(M, K, bk, dtype):
    x = (torch.randn(M, K) * 3).to(dtype)
    q, s = reference.quantize_act_dynamic(x, bk)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert q.shape == (M, K) and s.shape == (M, -(-K // bk))
    for g, xg in enumerate(_groups(x, bk)):
        scale = xg.abs().amax(dim=1, keepdim=True) / 448.0 if M else torch.empty(0, 1)
        torch.testing.assert_close(s[:, g : g + 1], scale, rtol=0, atol=0)
        expected = (xg / scale).to(E4M3)  # torch's own (IEEE) division and cast
        lo = g * bk
        assert torch.equal(q[:, lo : lo + xg.shape[1]].view(torch.uint8), expected.view(torch.uint8))


def test_dynamic_quantisation_edge_values():
    x = torch.randn(4, 64)
    x[0, :32] = 0  # all-zero group: scale 0, zeros, no NaN
    x[1, 5] = float("nan")  # NaN stays in its own row and group
    x[2, 40] = 1e30  # huge value: its group saturates nothing (scale follows amax)
    q, s = reference.quantize_act_dynamic(x, 32)
    assert s[0, 0] == 0 and torch.equal(q[0, :32].float(), torch.zeros(32))
    assert torch.isnan(s[1, 0]) and torch.isnan(q[1, :32].float()).all()
    assert not torch.isnan(q[[0, 2, 3]].float()).any() and not torch.isnan(q[1, 32:].float()).any()
    assert q[2, 40].float() == 448
    deq = reference.dequantize_act(q, s, 32)
    assert torch.equal(deq[0, :32], torch.zeros(32))


def test_static_quantisation_saturates_inf_and_keeps_nan():
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan"), 1e6, 0.3]])
    q = reference.quantize_act_static(x, torch.tensor(0.5)).float()
    assert q[0, 0] == 2 and q[0, 1] == 448 and q[0, 2] == -448 and torch.isnan(q[0, 3]) and q[0, 4] == 448
    assert q[0, 5] == torch.tensor(0.6).to(E4M3).float()


@pytest.mark.parametrize("shape,block", [
    ((256, 384), (128, 128)),    # exact blocks
    ((200, 300), (128, 128)),    # N, K not multiples of 128
    ((3, 130, 70), (64, 32)),    # stacked experts, ragged both ways
])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_quantize_weight(shape, block, scale_dtype):
    w = torch.randn(shape) * 0.05
    w[..., :block[0], :block[1]] = 0  # an all-zero block
    q, s = fp8_moe_ops.quantize_weight(w, block, scale_dtype)
    grid = (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    assert q.dtype == E4M3 and q.shape == w.shape
    assert s.dtype == scale_dtype and s.shape == tuple(shape[:-2]) + grid
    sf = s.float()
    # each block's scale from w itself, as documented: amax / 448 (UE8M0: the power of two
    # at or above it), 1 for the all-zero block
    (N, K), (bn, bk) = shape[-2:], block
    padded = torch.nn.functional.pad(w.abs(), (0, grid[1] * bk - K, 0, grid[0] * bn - N))
    amax = padded.reshape(*shape[:-2], grid[0], bn, grid[1], bk).amax(dim=(-3, -1))
    want = amax / 448
    if scale_dtype == torch.float8_e8m0fnu:
        want = torch.exp2(torch.ceil(torch.log2(want)))
    assert torch.equal(sf, torch.where(amax == 0, 1.0, want))
    full = reference._expand_scale_grid(sf, shape[-2:], block)
    # bitwise: the stored fp8 is torch's cast of w / its block scale
    assert torch.equal(q.view(torch.uint8), (w / full).clamp(-448, 448).to(E4M3).view(torch.uint8))
    if scale_dtype == torch.float8_e8m0fnu:
        assert torch.equal(torch.log2(sf), torch.log2(sf).round())  # powers of two
        assert (q.float().abs() <= 448).all() and ((w / full).abs() <= 448).all()  # nothing saturates
    deq = reference.dequantize_weight(q, s, block)
    assert torch.equal(deq[..., :block[0], :block[1]], torch.zeros_like(deq[..., :block[0], :block[1]]))
    assert ((deq - w).norm() / w.norm()).item() < 0.05  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("bad,exc,match", [
    (dict(w=torch.zeros(4, 4, dtype=torch.int32)), TypeError, "w: expected a float32"),
    (dict(w=torch.zeros(4)), ValueError, "w: expected a 2-D"),
    (dict(block_size=(0, 128)), ValueError, "block_size"),
    (dict(scale_dtype=torch.float16), TypeError, "scale_dtype"),
    (dict(w=torch.full((4, 4), float("nan"))), ValueError, "finite"),
    # finite in float64 but not in float32, which the scales are: NaN weights, infinite scale before
    (dict(w=torch.tensor([[1e39, 1.0]], dtype=torch.float64)), ValueError,
     r"w: expected values within float32's range \(\|w\| <= 3\.403e\+38\), got max \|w\| 1e\+39"),
    # a UE8M0 block rounding to 256 * 2^120: dequantised to inf before
    (dict(w=torch.tensor([[3.2e38]]), scale_dtype=torch.float8_e8m0fnu), ValueError,
     r"w: expected \|w\| below 3\.19e\+38 for UE8M0 scales"),
])
def test_quantize_weight_rejects_bad_input(bad, exc, match):
    kwargs = dict(w=torch.randn(4, 4), block_size=(128, 128), scale_dtype=torch.float32) | bad
    with pytest.raises(exc, match=match):
        fp8_moe_ops.quantize_weight(**kwargs)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_quantize_weight_per_tensor(scale_dtype):
    w = torch.randn(3, 200, 72) * 0.05
    q, s = fp8_moe_ops.quantize_weight(w, None, scale_dtype)  # one scale per matrix
    assert s.shape == (3, 1, 1) and s.dtype == scale_dtype
    expected = w.abs().amax(dim=(1, 2), keepdim=True) / 448
    if scale_dtype == torch.float8_e8m0fnu:
        expected = torch.exp2(torch.ceil(torch.log2(expected)))
    assert torch.equal(s.float(), expected)
    assert torch.equal(q.view(torch.uint8), (w / expected).clamp(-448, 448).to(E4M3).view(torch.uint8))


@pytest.mark.parametrize("value", [1e-38, 1e-42, 1e-44])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_quantize_weight_of_tiny_blocks_keeps_a_positive_scale(value, scale_dtype):
    # amax / 448 below the scale dtype's range: the scale underflowed to 0 (float32), or
    # the stored UE8M0 scale (2^-127) was larger than the one divided by (263x weights)
    w = torch.full((4, 4), value)
    w[0, 0] = -value
    q, s = fp8_moe_ops.quantize_weight(w, (128, 128), scale_dtype)
    smallest = 2.0 ** -149 if scale_dtype == torch.float32 else 2.0 ** -127
    v = torch.tensor(value)  # float32, as w holds it
    want = (v / 448).clamp_min(smallest) if scale_dtype == torch.float32 else torch.tensor(smallest)
    if scale_dtype == torch.float32 and v / want > 448:  # rounded down below 2^-126: one ulp up
        want = torch.nextafter(want, v)
    assert s.float().item() == want.item()
    deq = reference.dequantize_weight(q, s, (128, 128))
    assert torch.isfinite(deq).all() and (deq.abs() <= 448 * s.float()).all()
    if value * 2.0 ** 127 >= 2.0 ** -9 or scale_dtype == torch.float32:  # representable with that scale
        torch.testing.assert_close(deq, w, rtol=0.07, atol=0.0)
    else:
        assert not deq.any()  # below UE8M0's smallest step: zeros, not garbage


@pytest.mark.parametrize("value", [2.0 ** -140, 2.0 ** -141, 3e-43])
def test_quantize_weight_of_subnormal_blocks_saturates_no_weight(value):
    # amax / 448 in float32's subnormal range rounds to few bits: rounded down, the block's
    # largest weight divided to more than 448 and saturated (12.5 % off at 2^-140)
    w = torch.tensor([[value, -value / 3]])
    q, s = fp8_moe_ops.quantize_weight(w, (1, 2))
    assert w[0, 0] / s <= 448 and s.item() >= value / 448
    deq = reference.dequantize_weight(q, s, (1, 2))
    assert abs(deq[0, 0].item() - value) <= value / 16  # within half an e4m3 step, not saturated


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3)])
def test_quantize_weight_per_tensor_of_an_empty_matrix(shape):
    # the per-tensor block of an empty matrix was (0, K): a division by zero
    q, s = fp8_moe_ops.quantize_weight(torch.randn(shape), None)
    assert q.shape == shape and s.shape == shape[:-2] + tuple(min(n, 1) for n in shape[-2:])


def test_quantize_weight_outputs_carry_no_autograd_history():
    q, s = fp8_moe_ops.quantize_weight(torch.randn(4, 4, requires_grad=True), (2, 2))
    assert not q.requires_grad and not s.requires_grad and s.grad_fn is None


def test_a_block_far_larger_than_the_matrix_costs_what_the_matrix_does():
    # one block of any size is legal (its grid is (1, 1)); the reference pads to the matrix,
    # not to the block (a (2^24, 2^24) block padded a 64 x 96 weight to petabytes)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen)
    huge = [2 ** 24, 2 ** 24]
    q, s = reference.quantize_weight_blockwise(w, huge, torch.float32)
    q_exact, s_exact = reference.quantize_weight_blockwise(w, [64, 96], torch.float32)
    assert s.shape == (1, 1) and torch.equal(s, s_exact) and torch.equal(q.view(torch.uint8), q_exact.view(torch.uint8))
    x = torch.randn(8, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(torch.ops.fp8_moe.linear(x, q, s, huge), torch.ops.fp8_moe.linear(x, q, s, [64, 96]))
    xq, xs = reference.quantize_act_dynamic(x, 2 ** 24)
    assert xs.shape == (8, 1) and torch.equal(reference.dequantize_act(xq, xs, 2 ** 24),
                                              reference.dequantize_act(*reference.quantize_act_dynamic(x, 96), 96))
