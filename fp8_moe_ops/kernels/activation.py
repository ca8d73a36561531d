"""Fused gated activation + fp8 quantisation between the two expert GEMMs.

h (S, 2I) (gate columns then up columns, rounded to the activation dtype by the
gate_up GEMM) -> ``a = act(gate) * up`` in float32, rounded to the activation dtype
(as :func:`fp8_moe_ops.reference.gated_activation`), then quantised for the down
projection exactly as :mod:`.quant` does: the rounded ``a`` never goes to memory.
At decode (S <= ``ACT_SLOTS`` of :mod:`.experts`) :func:`gated_act_quant` runs in
the gate_up GEMM's launch instead (``GATED`` in :mod:`.grouped_gemm`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import KernelCall
from .quant import NATIVE, expert_of_rows, quant_launch_shape, quantize_and_store, round_to

ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@triton.jit
def _silu(g):
    """g / (1 + exp(-g)).  On the GPU five instructions: ``ex2.approx.ftz`` of
    ``-g * log2(e)`` (an exp as approximate as ``tl.exp``'s; the flush affects only
    terms below 2^-126, next to 1), ``rcp.approx.ftz`` of ``1 + that`` (1 ulp; the
    denominator is at least 1) and the product with g: within a few float32 ulps of an
    IEEE division of ``tl.exp``'s result, which took about 18 (the division's Newton
    steps and checks, the exp's range fix-ups).  The gated activation at prefill is bound
    by instructions issued, not bytes moved (docs/benchmarks.md).  The interpreter
    (``NATIVE`` false) has no inline assembly: there the division."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            """{
            .reg .f32 t;
            mul.f32 t, $1, 0fBFB8AA3B;
            ex2.approx.ftz.f32 t, t;
            add.f32 t, t, 0f3F800000;
            rcp.approx.ftz.f32 t, t;
            mul.f32 $0, $1, t;
            }""", "=r,r", [g], dtype=tl.float32, is_pure=True, pack=1)
    return tl.math.div_rn(g, 1.0 + tl.exp(-g))


@triton.jit
def _apply_activation(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return _silu(g)
    elif ACT == 1:  # gelu, erf form
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh form; tanh(u) = 1 - 2 / (exp(2u) + 1) (no tanh in tl core)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 - tl.math.div_rn(2.0, tl.exp(2.0 * u) + 1.0))
    else:  # relu
        return tl.where(g < 0.0, 0.0, g)  # NaN stays NaN, as F.relu


@triton.jit
def gated_act_quant(h_ptr, stride_hm, q_ptr, s_ptr, act_scale_ptr, rows, rmask, expert, g, I, limit,
                    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, STATIC: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_G: tl.constexpr, BY_RECIPROCAL: tl.constexpr):
    """Group ``g`` (columns ``[g * GROUP, (g + 1) * GROUP)`` of I) of the sorted ``rows``
    (``rmask``: rows of an expert; ``expert``: each row's, read when STATIC) -> q, and
    its scales into s (dynamic), dividing as :func:`.quant.reciprocals` says with
    ``BY_RECIPROCAL``.  h is read past L1 (``.cg``): in the gate_up GEMM's
    fused activation other programs wrote it in the same launch."""
    cg = tl.arange(0, BLOCK_G)
    cols = g * GROUP + cg
    cmask = (cg < GROUP) & (cols < I)
    mask = rmask[:, None] & cmask[None, :]
    base = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    up = tl.load(base + I, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_LIMIT:  # a NaN stays NaN, as in torch (the GPU's plain min / max return the other operand)
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    a = round_to(_apply_activation(gate, ACT) * up, h_ptr.dtype.element_ty).to(tl.float32)
    a = tl.where(mask, a, 0.0)
    # its scales row-major, (S, ceil(I/GROUP)) contiguous: the down GEMM's layout (experts._kmajor_scales)
    quantize_and_store(a, rows, rmask, mask, cols, g, expert, q_ptr, s_ptr, tl.cdiv(I, GROUP), 1, act_scale_ptr, I,
                       GROUP=GROUP, STATIC=STATIC, BY_RECIPROCAL=BY_RECIPROCAL)


@triton.jit
def _gated_act_quant_kernel(
    h_ptr, stride_hm,          # h (S, 2I) activation dtype, unit stride in columns
    q_ptr, s_ptr,              # q (S, I) e4m3; s (S, ceil(I/bk)) float32 (dynamic)
    offsets_ptr, act_scale_ptr,
    S, I, E, limit,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, STATIC: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    # rows past offsets[-1] are sentinel slots: nothing downstream reads them
    if STATIC:  # each row's expert, for its scale: a search of SEARCH_STEPS dependent loads
        expert = expert_of_rows(rows, offsets_ptr, E, SEARCH_STEPS)
        rmask = (rows < S) & (expert < E)
    else:  # only the rows with an expert: one load before the loads of h
        expert = rows  # (unread)
        rmask = rows < tl.minimum(tl.load(offsets_ptr + tl.maximum(E - 1, 0), mask=E > 0, other=0), S)
    gated_act_quant(h_ptr, stride_hm, q_ptr, s_ptr, act_scale_ptr, rows, rmask, expert, tl.program_id(1), I, limit,
                    ACT, HAS_LIMIT, STATIC, GROUP, BLOCK_G, BY_RECIPROCAL=True)


def gated_act_quant_call(h, a_q, a_s, offsets, num_experts: int, bk: int, activation: str, swiglu_limit,
                         static: bool) -> KernelCall:
    """The launch of :func:`_gated_act_quant_kernel` over the S sorted rows of h (S, 2I)
    -> a_q (S, I) and, dynamic, its scales a_s (S, ceil(I/bk)); static, a_s is the (E,)
    input.  ``offsets``: the (E,) inclusive row ends of the experts."""
    S, I = h.shape[0], h.shape[1] // 2
    grid, block_r, block_g = quant_launch_shape(S, I, bk)
    return KernelCall(_gated_act_quant_kernel, grid, (
        h, h.stride(0), a_q, a_s, offsets, a_s, S, I, num_experts,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
    ), dict(ACT=ACT_IDS[activation], HAS_LIMIT=swiglu_limit is not None, STATIC=static,
            GROUP=bk, BLOCK_R=block_r, BLOCK_G=block_g, SEARCH_STEPS=num_experts.bit_length()),
        dict(enable_fp_fusion=False))
