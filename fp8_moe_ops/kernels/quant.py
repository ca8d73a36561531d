"""Fp8 activation quantisation kernels (dynamic per-token groups, static per expert).

The numerics are :func:`fp8_moe_ops.reference.quantize_act_dynamic` /
:func:`~fp8_moe_ops.reference.quantize_act_static`, bitwise:

* the division is IEEE (``tl.math.div_rn``): Triton's ``/`` on float32 is approximate;
* the float32 -> e4m3 and float32 -> bf16 roundings (to nearest even) are the GPU's
  own cast instructions (``cvt.rn``), one per element or pair, as torch's casts round.
  The Triton interpreter's casts do not round that way (126.24 -> 64, ties away from
  zero, subnormals to 0, bf16 truncated: docs/notes.md), so under ``TRITON_INTERPRET=1``
  (``HW_CASTS`` false) :func:`round_to_e4m3` and :func:`round_to` round in float32
  arithmetic and cast only the already exact value; the CPU tests check those bytes
  bitwise against torch, and the GPU tests the casts' bytes against the same
  reference.

The ``@triton.jit`` helpers here are shared with the gated-activation kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import cdiv, next_power_of_2

FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
# the GPU's cast instructions round as torch does; the interpreter's do not (module docstring).
# Read when the kernels are decorated, as Triton itself decides interpretation.
HW_CASTS = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def round_to_e4m3(v):
    """float32 in [-448, 448] (or NaN) -> float8_e4m3fn, round to nearest even.

    On the GPU the cast instruction.  Under the interpreter: e4m3 has 3 mantissa bits
    and a smallest normal exponent of -6, so the grid step at |v| in [2^e, 2^(e+1)) is
    2^(max(e, -6) - 3) (subnormals share the step of the smallest binade).
    ``(y + 1.5 * 2^23) - 1.5 * 2^23`` rounds y (< 2^22) to an integer with the FPU's
    round-to-nearest-even; the scalings are by powers of two, hence exact."""
    if HW_CASTS:
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
    elif HW_CASTS:
        return x.to(dtype, fp_downcast_rounding="rtne")
    elif dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        r = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
        return r.to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def quantize_static(x, scale):
    """x float32 (..., C), scale float32 broadcasting -> e4m3(clamp(x / scale))."""
    v = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return round_to_e4m3(v)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_dynamic(x):
    """x float32 (R, C), one quantisation group per row (columns past the group must
    be 0) -> (q e4m3 (R, C), scale float32 (R,)), scale = amax / 448, 0 -> q = 0.
    A NaN in a group makes its amax, scale and every q NaN, as torch's ``amax``
    (``tl.max`` would skip it on the GPU)."""
    amax = tl.reduce(tl.abs(x), 1, _max_keeping_nan)
    s = tl.math.div_rn(amax, FP8_MAX)
    safe = tl.where(s == 0.0, 1.0, s)
    return quantize_static(x, safe[:, None]), s


@triton.jit
def quantize_and_store(x, rows, rmask, mask, cols, g, expert, q_ptr, s_ptr, stride_sm, stride_sk, act_scale_ptr, K,
                       GROUP: tl.constexpr, STATIC: tl.constexpr):
    """Quantise the float32 block ``x`` (BLOCK_R, BLOCK_G) = K group ``g`` of ``rows``
    (``mask``: its valid elements, 0 elsewhere) into q (R, K) and, dynamic, its scales
    into s (R, ceil(K/GROUP)) of strides (``stride_sm``, ``stride_sk``); static divides
    by the scale of each row's ``expert``."""
    if STATIC:
        scale = tl.load(act_scale_ptr + expert, mask=rmask, other=1.0)
        q = quantize_static(x, scale[:, None])
    else:
        q, s = quantize_dynamic(x)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sk, s, mask=rmask)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)


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
def quant_block(pid_r, g, x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk, perm_ptr, offsets_ptr,
                act_scale_ptr, dest_ptr, R, K, E, TOPK: tl.constexpr, KP: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, SEARCH_STEPS: tl.constexpr, STATIC: tl.constexpr,
                GATHER: tl.constexpr, SLOTS: tl.constexpr, DEST: tl.constexpr):
    """Row block ``pid_r``, K group ``g``: dynamic quantises x's rows in place order;
    static, with the scale of each row's expert, either the expert-sorted rows (source
    row perm[i] // TOPK when GATHER) or, with SLOTS, x's R = T rows (tokens) into their
    slots ``t * TOPK + j`` in slot order: each row is loaded once and quantised once per
    slot, with the scale of the slot's expert ``perm_ptr[slot]`` (the (T, TOPK) expert
    ids; slots of no expert are skipped).  With SLOTS and DEST, slot ``s`` goes to row
    ``dest_ptr[s]`` instead (its expert-sorted position), dynamic too: each row is
    quantised once, with its own scales, and stored once per slot, scales included."""
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cg = tl.arange(0, BLOCK_G)
    cols = g * GROUP + cg
    cmask = (cg < GROUP) & (cols < K)
    rmask = rows < R
    if SLOTS:
        # all TOPK slots of each row at once (KP: TOPK rounded up to a power of two), every
        # load before the stores
        js = tl.arange(0, KP)
        slots = rows[:, None] * TOPK + js[None, :]
        expert = tl.load(perm_ptr + slots, mask=rmask[:, None] & (js[None, :] < TOPK), other=-1)
        smask = (expert >= 0) & (expert < E)
        out_rows = tl.load(dest_ptr + slots, mask=smask, other=0) if DEST else slots
        out_rows = out_rows.to(tl.int64)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk,
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(act_scale_ptr + expert, mask=smask, other=1.0)
            q = quantize_static(x[:, None, :], scale[:, :, None])
        else:
            q1, s = quantize_dynamic(x)
            q = tl.broadcast_to(q1[:, None, :], (BLOCK_R, KP, BLOCK_G))
            tl.store(s_ptr + out_rows * stride_sm + g * stride_sk, tl.broadcast_to(s[:, None], (BLOCK_R, KP)),
                     mask=smask)
        tl.store(q_ptr + out_rows[:, :, None] * K + cols[None, None, :], q,
                 mask=smask[:, :, None] & cmask[None, None, :])
    else:
        src = rows
        expert = None  # dynamic scales do not depend on the expert
        if STATIC:
            expert = expert_of_rows(rows, offsets_ptr, E, SEARCH_STEPS)
            rmask = rmask & (expert < E)
            if GATHER:
                src = tl.load(perm_ptr + rows, mask=rmask, other=0) // TOPK
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        quantize_and_store(x.to(tl.float32), rows, rmask, mask, cols, g, expert, q_ptr, s_ptr, stride_sm, stride_sk,
                           act_scale_ptr, K, GROUP=GROUP, STATIC=STATIC)


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
):
    # program (row block, K group)
    quant_block(tl.program_id(0), tl.program_id(1), x_ptr, stride_xm, stride_xk, q_ptr, s_ptr, stride_sm, stride_sk,
                perm_ptr, offsets_ptr, act_scale_ptr, dest_ptr, R, K, E, TOPK, KP, GROUP, BLOCK_R, BLOCK_G,
                SEARCH_STEPS, STATIC, GATHER, SLOTS, DEST)


def scale_grid_strides(s, static: bool) -> tuple[int, int]:
    """The (row, K group) strides of a dynamic scheme's activation scales ``s``, as the
    kernels take them; (0, 0) for a static scheme's (E,) scales, which they index by
    expert."""
    return (0, 0) if static else (s.stride(0), s.stride(1))


def quant_launch_shape(rows: int, K: int, group: int, slots: int = 1) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_G) for quantising ``rows`` x ``K`` in groups of ``group``,
    each row into ``slots`` outputs (static slots: a row per slot of its token).  A
    program takes up to 16 rows and up to 4096 outputs (but always one row, whatever
    its outputs), and no more rows than there are (decode)."""
    block_g = next_power_of_2(group)
    block_r = max(1, min(16, 4096 // (block_g * next_power_of_2(slots)), next_power_of_2(rows)))
    return (cdiv(rows, block_r), cdiv(K, group)), block_r, block_g
