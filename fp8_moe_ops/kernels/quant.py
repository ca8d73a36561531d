"""Fp8 activation quantisation kernels (dynamic per-token groups, static per expert).

The numerics are :func:`fp8_moe_ops.reference.quantize_act_dynamic` /
:func:`~fp8_moe_ops.reference.quantize_act_static`, bitwise:

* the division is IEEE, rounded to nearest even (Triton's ``/`` on float32 is
  approximate): where every divisor of a block lies in [2^-40, 2^40], by the divisor's
  reciprocal, taken once, and two fma correction steps per quotient
  (:func:`divide_by_reciprocal`); elsewhere ``tl.math.div_rn``, whose reciprocal,
  Newton step and range check come again with every element;
* the clamp to +-448 is the e4m3 cast's own saturation on the GPU (``cvt.rn.satfinite``:
  infinities saturate, NaN stays NaN), an explicit clamp under the interpreter;
* the float32 -> e4m3 and float32 -> bf16 roundings (to nearest even) are the GPU's
  own cast instructions (``cvt.rn``), one per element or pair, as torch's casts round.
  The Triton interpreter's casts do not round that way (126.24 -> 64, ties away from
  zero, subnormals to 0, bf16 truncated: docs/notes.md), so under ``TRITON_INTERPRET=1``
  (``NATIVE`` false) :func:`round_to_e4m3` and :func:`round_to` round in float32
  arithmetic and cast only the already exact value; the CPU tests check those bytes
  bitwise against torch, and the GPU tests the casts' bytes against the same
  reference.  The interpreter's ``tl.fma`` rounds twice; :func:`fma_rn` computes the
  fused result there.

The ``@triton.jit`` helpers here are shared with the gated-activation kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2

FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
# compiled for the GPU: its cast and fma instructions round as torch and IEEE do, and
# inline assembly exists; the interpreter has neither (module docstring).  Read when the
# kernels are decorated, as Triton itself decides interpretation.
NATIVE = tl.constexpr(not triton.knobs.runtime.interpret)
# divide_by_reciprocal's bounds: (positive) divisors in [_D_MIN, _D_MAX], dividends clamped to
# +-_X_MAX (448 * _D_MAX < _X_MAX: a quotient past the clamp saturates either way)
_D_MIN = tl.constexpr(2.0 ** -40)
_D_MAX = tl.constexpr(2.0 ** 40)
_X_MAX = tl.constexpr(2.0 ** 50)
# the fewest programs a quantisation launch narrows to by looping its programs over K
# groups (groups_per_program)
QUANT_MIN_PROGRAMS = 4096


@triton.jit
def round_to_e4m3(v):
    """float32 in [-448, 448] (or NaN) -> float8_e4m3fn, round to nearest even.

    On the GPU the cast instruction.  Under the interpreter: e4m3 has 3 mantissa bits
    and a smallest normal exponent of -6, so the grid step at |v| in [2^e, 2^(e+1)) is
    2^(max(e, -6) - 3) (subnormals share the step of the smallest binade).
    ``(y + 1.5 * 2^23) - 1.5 * 2^23`` rounds y (< 2^22) to an integer with the FPU's
    round-to-nearest-even; the scalings are by powers of two, hence exact."""
    if NATIVE:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31
    exp = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    step = ((127 + step_exp) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(v) * inv_step
    r = (y + 12582912.0) - 12582912.0
    res = ((r * step).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # the interpreter's cast turns NaN into a number: torch's NaN byte (0x7F, with v's sign)
    nan = ((bits >> 24) & 0x80 | 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return tl.where(v != v, nan, res.to(tl.float8e4nv))


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 -> ``dtype`` (bf16 / fp16 / fp32) rounding to nearest even.

    On the GPU the cast instruction.  Under the interpreter bf16 is rounded in integer
    arithmetic on the float32 bits (add 0x7FFF plus the lowest kept bit, clear the low
    half; NaN kept as is), then cast exactly."""
    if dtype == tl.float32:
        return x
    elif NATIVE:
        return x.to(dtype, fp_downcast_rounding="rtne")
    elif dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        r = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
        return r.to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def to_e4m3(v):
    """float32 -> e4m3 of clamp(v, -448, 448), rounded to nearest even.  On the GPU the
    cast alone: its ``satfinite`` form saturates (infinities too) and keeps NaN."""
    if NATIVE:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return round_to_e4m3(tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def fma_rn(a, b, c):
    """float32 ``a * b + c`` rounded once, to nearest even.  On the GPU the fma
    instruction.  The interpreter's ``tl.fma`` rounds the product and the sum apart, so
    there: the product exactly in float64 (24 + 24 bits), the sum and its rounding
    error (TwoSum), the sum made odd when it was inexact (round to odd), then rounded
    to float32; rounding to odd with 29 bits to spare cannot round twice."""
    if NATIVE:
        return tl.fma(a, b, c)
    p = a.to(tl.float64) * b.to(tl.float64)
    c64 = c.to(tl.float64)
    s = p + c64
    p_part = s - c64
    err = (p - p_part) + (c64 - (s - p_part))
    bits = s.to(tl.int64, bitcast=True)
    step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)  # away from zero when err has s's sign
    odd = tl.where((err != 0) & ((bits & 1) == 0), bits + step, bits)
    return odd.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def divide_by_reciprocal(x, d, r):
    """x / d (float32, broadcasting) rounded to nearest even, as IEEE division, given
    r = 1 / d so rounded, for d in [2^-40, 2^40] (positive) and |x| <= 2^50.

    q = x * r, then twice ``q -= (d * q - x) * r`` in fma (the residual is exact).  After
    the first step q is within one ulp of x / d; given that and r within half an ulp of
    1 / d, the second step's result is x / d correctly rounded (Markstein's theorem).  The
    bounds keep r, q and the residuals finite, and normal unless x is below about 2^-100,
    where x / d is below 2^-60 and so is the result, with x / d's sign: both quantise to
    the same signed zero.  Zeros keep their sign because d is positive and the step adds
    ``(d * q - x) * -r`` to q (negating the residual instead, as ``0 - v``, would turn
    a -0 quotient into +0; a negative d, +0 / d into +0)."""
    # exact sign flips the fma takes as operand modifiers (Triton's -v is an add, 0 - v)
    neg_r = r * -1.0
    neg_x = x * -1.0
    q = x * r
    q = fma_rn(fma_rn(d, q, neg_x), neg_r, q)
    return fma_rn(fma_rn(d, q, neg_x), neg_r, q)


@triton.jit
def reciprocals(scale, BY_RECIPROCAL: tl.constexpr):
    """(whether the block divides by ``scale``'s reciprocals, the reciprocals): with
    ``BY_RECIPROCAL``, where every scale of the block lies in [2^-40, 2^40]
    (:func:`divide_by_reciprocal`'s bounds); otherwise (a zero, negative, NaN, infinite or
    extreme scale) ``div_rn`` divides.  Without it, never: the kernels of a few rows
    (decode), where a thread holds a few quotients of each divisor and the second branch's
    code costs registers."""
    fast = False
    if BY_RECIPROCAL:
        fast = tl.min(((scale >= _D_MIN) & (scale <= _D_MAX)).to(tl.int32)) == 1
    return fast, tl.math.div_rn(1.0, scale)


@triton.jit
def store_quantized(x, scale, fast, r, q_ptrs, mask):
    """Stores e4m3(clamp(x / scale)) at ``q_ptrs`` (``mask``), the division IEEE: x
    float32 (..., C), scale float32 (..., 1) and its :func:`reciprocals` ``fast``, ``r``,
    broadcasting to the pointers' shape.  ``fast``: by the reciprocals (x clamped to
    +-2^50 first: the quotients that changes saturate either way), else ``div_rn``.  Each
    branch stores its own bytes (bytes handed out of a branch are repacked one by one
    where the branches join)."""
    if fast:
        xc = tl.clamp(x, -_X_MAX, _X_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptrs, to_e4m3(divide_by_reciprocal(xc, scale, r)), mask=mask)
    else:
        tl.store(q_ptrs, to_e4m3(tl.math.div_rn(x, scale)), mask=mask)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def dynamic_scales(x):
    """x float32 (R, C), one quantisation group per row (columns past the group must be
    0) -> (scale, divisor) (R,): scale = amax / 448 and the divisor of the quantisation
    (1 where the scale is 0, so that q = 0).  A NaN in a group makes its amax,
    scale and every q NaN, as torch's ``amax`` (``tl.max`` would skip it on the GPU)."""
    amax = tl.reduce(tl.abs(x), 1, _max_keeping_nan)
    s = tl.math.div_rn(amax, FP8_MAX)
    return s, tl.where(s == 0.0, 1.0, s)


@triton.jit
def quantize_and_store(x, rows, rmask, mask, cols, g, expert, q_ptr, s_ptr, stride_sm, stride_sk, act_scale_ptr, K,
                       GROUP: tl.constexpr, STATIC: tl.constexpr, BY_RECIPROCAL: tl.constexpr):
    """Quantise the float32 block ``x`` (BLOCK_R, BLOCK_G) = K group ``g`` of ``rows``
    (``mask``: its valid elements, 0 elsewhere) into q (R, K) and, dynamic, its scales
    into s (R, ceil(K/GROUP)) of strides (``stride_sm``, ``stride_sk``); static divides
    by the scale of each row's ``expert``; ``BY_RECIPROCAL`` as :func:`reciprocals`'."""
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if STATIC:
        scale = tl.load(act_scale_ptr + expert, mask=rmask, other=1.0)[:, None]
    else:
        s, divisor = dynamic_scales(x)
        scale = divisor[:, None]
    fast, r = reciprocals(scale, BY_RECIPROCAL)
    store_quantized(x, scale, fast, r, q_ptrs, mask)
    if not STATIC:
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sk, s, mask=rmask)


@triton.jit
def expert_of_rows(rows, offsets_ptr, E, SEARCH_STEPS: tl.constexpr):
    """Expert id of each sorted row: the number of inclusive offsets <= row (E when the
    row is past ``offsets[-1]``, i.e. belongs to no expert).  A binary search over the
    non-decreasing offsets, ``SEARCH_STEPS = E.bit_length()`` steps (enough for E + 1
    answers): a few cached loads per row instead of an (rows, E) compare matrix.  A
    loop, not ``tl.static_range``: unrolled, Triton 3.6's layout pass fails on sm_90
    ("mask type matches ptr type") when the result masks a later load."""
    lo = tl.zeros_like(rows)
    hi = lo + E
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        le = tl.load(offsets_ptr + mid, mask=active, other=0) <= rows
        lo = tl.where(active & le, mid + 1, lo)
        hi = tl.where(active & ~le, mid, hi)
    return lo


@triton.jit
def quant_block(pid_r, pid_g, x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, perm_ptr,
                offsets_ptr, act_scale_ptr, dest_ptr, R, K, E, TOPK: tl.constexpr, KP: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                STATIC: tl.constexpr, GATHER: tl.constexpr, SLOTS: tl.constexpr, DEST: tl.constexpr,
                BY_RECIPROCAL: tl.constexpr, GPP: tl.constexpr):
    """Row block ``pid_r``, K groups ``[pid_g * GPP, (pid_g + 1) * GPP)``, one after the
    other (the rows' indices, experts and scales loaded once; a loop of a constexpr count,
    as the interpreter cannot loop to a run-time bound): dynamic quantises x's rows
    in place order; static, with the scale of each row's expert, either the
    expert-sorted rows (source row perm[i] // TOPK when GATHER) or, with SLOTS, x's R = T
    rows (tokens) into their slots ``t * TOPK + j`` in slot order: each row is loaded
    once and quantised once per slot, with the scale of the slot's expert
    ``perm_ptr[slot]`` (the (T, TOPK) expert ids; slots of no expert are skipped).  With
    SLOTS and DEST, slot ``s`` goes to row ``dest_ptr[s]`` instead (its expert-sorted
    position), dynamic too: each row is quantised once, with its own scales, and stored
    once per slot, scales included.  ``BY_RECIPROCAL`` as :func:`reciprocals`'."""
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cg = tl.arange(0, BLOCK_G)
    rmask = rows < R
    G = tl.cdiv(K, GROUP)
    src = rows
    if SLOTS:
        # all TOPK slots of each row at once (KP: TOPK rounded up to a power of two), every
        # load before the stores
        js = tl.arange(0, KP)
        slots = rows[:, None] * TOPK + js[None, :]
        expert = tl.load(perm_ptr + slots, mask=rmask[:, None] & (js[None, :] < TOPK), other=-1)
        smask = (expert >= 0) & (expert < E)
        out_rows = tl.load(dest_ptr + slots, mask=smask, other=0) if DEST else slots
        out_rows = out_rows.to(tl.int64)
        if STATIC:
            scale = tl.load(act_scale_ptr + expert, mask=smask, other=1.0)[:, :, None]
            fast, r = reciprocals(scale, BY_RECIPROCAL)
    else:
        expert = None  # dynamic scales do not depend on the expert
        if STATIC:
            if SEARCH_STEPS > 0:
                expert = expert_of_rows(rows, offsets_ptr, E, SEARCH_STEPS)
                rmask = rmask & (expert < E)
            else:  # one matrix's rows (no offsets): all expert 0's
                expert = tl.zeros_like(rows)
            if GATHER:
                src = tl.load(perm_ptr + rows, mask=rmask, other=0) // TOPK
    for i in tl.range(GPP, loop_unroll_factor=1):
        g = pid_g * GPP + i
        if g < G:
            cols = g * GROUP + cg
            cmask = (cg < GROUP) & (cols < K)
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask,
                        other=0.0).to(tl.float32)
            if SLOTS:
                q_ptrs = q_ptr + out_rows[:, :, None] * K + cols[None, None, :]
                qmask = smask[:, :, None] & cmask[None, None, :]
                if STATIC:
                    store_quantized(x[:, None, :], scale, fast, r, q_ptrs, qmask)
                else:
                    s, divisor = dynamic_scales(x)
                    # each row quantised once, stored per slot: a thread holds a few quotients
                    # of each divisor, fewer than the reciprocal and its range check would save
                    q = to_e4m3(tl.math.div_rn(x, divisor[:, None]))
                    tl.store(q_ptrs, tl.broadcast_to(q[:, None, :], (BLOCK_R, KP, BLOCK_G)), mask=qmask)
                    tl.store(s_ptr + out_rows * stride_sm + g * stride_sk,
                             tl.broadcast_to(s[:, None], (BLOCK_R, KP)), mask=smask)
            else:
                quantize_and_store(x, rows, rmask, mask, cols, g, expert, q_ptr, s_ptr, stride_sm, stride_sk,
                                   act_scale_ptr, K, GROUP=GROUP, STATIC=STATIC, BY_RECIPROCAL=BY_RECIPROCAL)


@triton.jit
def _quant_kernel(
    x_ptr, stride_xm, stride_xk,  # x (rows of the source, K) float
    q_ptr,                         # q (R, K) e4m3 contiguous (SLOTS: (R * TOPK, K))
    s_ptr, stride_sm, stride_sk,   # dynamic: s (R, G) float32, either order (K-group major at prefill: ws_gemm)
    perm_ptr, offsets_ptr, act_scale_ptr,
    dest_ptr,                      # SLOTS with DEST: (R * TOPK,) each slot's row of q (and s)
    R, K, E,
    TOPK: tl.constexpr, KP: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, STATIC: tl.constexpr, GATHER: tl.constexpr, SLOTS: tl.constexpr, DEST: tl.constexpr,
    GPP: tl.constexpr,
):
    # program (row block, GPP K groups)
    quant_block(tl.program_id(0), tl.program_id(1), x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk,
                perm_ptr, offsets_ptr, act_scale_ptr, dest_ptr, R, K, E, TOPK, KP, GROUP, BLOCK_R, BLOCK_G,
                SEARCH_STEPS, STATIC, GATHER, SLOTS, DEST, BY_RECIPROCAL=True, GPP=GPP)


def scale_grid_strides(s, static: bool) -> tuple[int, int]:
    """The (row, K group) strides of a dynamic scheme's activation scales ``s``, as the
    kernels take them; (0, 0) for a static scheme's (E,) scales, which they index by
    expert."""
    return (0, 0) if static else (s.stride(0), s.stride(1))


def groups_per_program(row_blocks: int, groups: int) -> int:
    """K groups per program of a static :func:`_quant_kernel` launch over ``row_blocks`` x
    ``groups`` blocks: the largest power of two (a compile-time count) that leaves it
    ``QUANT_MIN_PROGRAMS`` programs, and no more than the groups rounded up to a power of
    two; at least one.  A program's rows' indices, experts, scales and reciprocals are loaded
    once for all its groups: on the H200 the static slot quantisation of prefill layers
    took 15-22 % less time so than with one group a program (18-38 % less than before the
    reciprocals too).  A dynamic launch keeps one group a program: looped, with less to
    load once and a scale reduction per group, it took 3-9 % more (docs/benchmarks.md)."""
    fit = max(1, row_blocks * groups // QUANT_MIN_PROGRAMS)
    return min(1 << (fit.bit_length() - 1), next_power_of_2(groups))


def quant_launch_shape(rows: int, K: int, group: int, slots: int = 1) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_G) for quantising ``rows`` x ``K`` in groups of ``group``,
    each row into ``slots`` outputs (static slots: a row per slot of its token).  A
    program takes up to 16 rows and up to 4096 outputs (but always one row, whatever
    its outputs), and no more rows than there are (decode)."""
    block_g = next_power_of_2(group)
    block_r = max(1, min(16, 4096 // (block_g * next_power_of_2(slots)), next_power_of_2(rows)))
    return (cdiv(rows, block_r), cdiv(K, group)), block_r, block_g
