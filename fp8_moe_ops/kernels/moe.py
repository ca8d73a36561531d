"""Entry points of the Triton implementation: one function per ``fp8_moe`` op.

Each takes exactly the op's arguments (already checked by :mod:`fp8_moe_ops.ops`)
and returns its output.  They run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (tests).  Layout of the whole-experts forward (S = T * k
slots, slot ``t*k + j`` is token t's j-th choice):

1. ``perm`` (S,) sorted position -> slot, ``offsets`` (E,): :mod:`.sort` (one launch)
   for S <= 2048, else :mod:`fp8_moe_ops.routing` (torch.sort);
2. activations quantised once: dynamic, (T, H) per token before any gather (scales
   do not depend on the expert); static, the sorted rows with their expert's scale;
3. gate_up GEMM, A rows gathered by ``perm // k`` -> h (S, 2I) in sorted order;
4. gated activation + quantisation -> (S, I) fp8;
5. down GEMM, output rows scattered by ``perm`` -> y (S, H) in slot order;
6. combine: per token, in ascending expert id, float32 -> (T, H).

Sentinel slots (ids outside [0, E)) are sorted last, never computed, and skipped by
the combine.  Batched variants sort internally and share this path, so grouped and
batched agree bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import routing
from ..functional import cdiv, next_power_of_2
from .activation import ACT_IDS, _gated_act_quant_kernel
from .combine import combine
from .config import block_k, gemm_config
from .grouped_gemm import WeightTable, _grouped_gemm_kernel, max_row_tiles
from .launch import launch
from .quant import _quant_kernel, quant_launch_shape
from .sort import MAX_SLOTS, _sort_kernel, sort_launch_shape

__all__ = ["linear", "grouped_mm", "batched_mm", "grouped_experts", "batched_experts"]


def _block(block_size: Sequence[int]) -> tuple[int, int]:
    bn, bk = int(block_size[0]), int(block_size[1])
    if block_k(bk) < 16:
        raise ValueError(
            f"block_size: expected bk divisible by 16 for the Triton kernels (the fp8 dot's smallest K), "
            f"got {[bn, bk]}")
    return bn, bk


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    # the kernels index act scales and offsets as dense 1-D arrays (tiny; copied only
    # when a caller passes a strided view)
    return None if t is None else t.reshape(-1).contiguous()


def _ep(E: int) -> int:
    return max(2, next_power_of_2(E))


def _sort_slots(expert_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm (S,) sorted position -> slot, offsets (E,) int32): one launch for small S,
    torch's sort beyond (same result: the stable order is unique)."""
    S = expert_ids.numel()
    if S > MAX_SLOTS:
        return routing.sort_slots(expert_ids, E)
    ids = expert_ids.reshape(-1)
    perm = torch.empty(S, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(E, dtype=torch.int32, device=ids.device)
    if S == 0:  # an empty grid would leave offsets unwritten
        return perm, offsets.zero_()
    grid, block, bins, nb = sort_launch_shape(S, E)
    launch(_sort_kernel, grid, (ids, perm, offsets, S, E), dict(BLOCK=block, NB=bins, NUM_BLOCKS=nb))
    return perm, offsets


def _quantize(x: torch.Tensor, bk: int, rows: int, *, perm=None, offsets=None, act_scale=None, topk: int = 1):
    """Dynamic: x (rows, K) -> (q, scale (rows, G)).  Static: the ``rows`` sorted rows
    (source row ``perm[i] // topk`` when ``perm`` is given) with their expert's scale
    -> (q, act_scale)."""
    K = x.shape[1]
    static = act_scale is not None
    q = torch.empty((rows, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = act_scale if static else torch.empty((rows, cdiv(K, bk)), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, s
    grid, block_r, block_g = quant_launch_shape(rows, K, bk)
    E = offsets.shape[0] if offsets is not None else 1
    launch(_quant_kernel, grid, (
        x, x.stride(0), x.stride(1), q, s,
        perm if perm is not None else q, offsets if offsets is not None else q, s,
        rows, K, E,
    ), dict(TOPK=topk, GROUP=bk, BLOCK_R=block_r, BLOCK_G=block_g, SEARCH_STEPS=E.bit_length(),
            STATIC=static, GATHER=perm is not None))
    return q, s


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    # a size-1 grid dim is either a one-block matrix or one scale per matrix: stride
    # 0 serves both without expanding the grid
    se, sn, sk = scale.stride()
    return se, (0 if scale.shape[1] == 1 else sn), (0 if scale.shape[2] == 1 else sk)


def _gemm(q, q_scale, w, w_scale, block, out, *, offsets=None, perm=None, gather_a=False,
          scatter_out=False, static=False, topk=1, config_n=None):
    """out[rows] = q[rows] @ dequant(w[expert])^T over the expert-sorted rows.

    ``w`` is the stacked (E, N, K) tensor with its grid ``w_scale``, or a
    :class:`WeightTable` (``w_scale`` None); ``config_n`` picks the launch config as
    for that N (a split gate/up pair launches as the fused matrix would)."""
    S = out.shape[0]
    E, N, K = w.shape
    if S == 0:
        return out
    bn, bk = block
    cfg = gemm_config(S, E, config_n or N, K)
    BM, BN = cfg["BM"], cfg["BN"]
    num_pid_m = max_row_tiles(S, E, BM, offsets is not None)
    grid = (num_pid_m * cdiv(N, BN),)
    table = isinstance(w, WeightTable)
    align = w.align if table else 16
    if table:
        ws_strides, one_scale_row, e8m0 = (0, *w.scale_strides), w.scale_rows == 1, w.scale_e8m0
        w, ws = w.w, w.scale
    else:
        e8m0 = w_scale.dtype == torch.float8_e8m0fnu
        ws = w_scale.view(torch.uint8) if e8m0 else w_scale
        ws_strides, one_scale_row = _scale_strides(w_scale), w_scale.shape[1] == 1
    dummy = out
    launch(_grouped_gemm_kernel, grid, (
        q, q.stride(0), q_scale, q_scale.stride(0) if not static else 0,
        w, ws, *ws_strides,
        out, out.stride(0),
        perm if perm is not None else dummy, offsets if offsets is not None else dummy,
        S, N, E, num_pid_m,
    ), dict(K=K, TOPK=topk, BN_SCALE=bn, BK_SCALE=bk,
            GATHER_A=gather_a, SCATTER_OUT=scatter_out, STATIC=static,
            SCALE_E8M0=e8m0, HAS_OFFSETS=offsets is not None,
            W_SCALE_PER_TILE=bn % BN == 0 or one_scale_row, W_TABLE=table, W_ALIGN=align,
            BM=BM, BN=BN, BK=block_k(bk), EP=_ep(E), GROUP_M=cfg["GROUP_M"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def linear(x, w, w_scale_inv, block_size, act_scale=None, out_dtype=None):
    """x (M, K) @ dequant(w (N, K))^T -> (M, N); ``act_scale`` one element (static)."""
    block = _block(block_size)
    M = x.shape[0]
    out = torch.empty((M, w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    w3, s3 = w.unsqueeze(0), w_scale_inv.unsqueeze(0)
    if act_scale is None:
        q, qs = _quantize(x, block[1], M)
        return _gemm(q, qs, w3, s3, block, out)
    a_s = _flat(act_scale)
    # static with one expert: the rows' expert comes from offsets = [M]
    offsets = torch.full((1,), M, dtype=torch.int32, device=x.device)
    q, _ = _quantize(x, block[1], M, offsets=offsets, act_scale=a_s)
    return _gemm(q, a_s, w3, s3, block, out, static=True)


def grouped_mm(x, w, w_scale_inv, offsets, block_size, act_scale=None, out_dtype=None):
    """x (S, K) sorted by expert, offsets (E,) int32 -> (S, N); rows past offsets[-1] zero."""
    block = _block(block_size)
    S = x.shape[0]
    out = torch.empty((S, w.shape[1]), dtype=out_dtype or x.dtype, device=x.device)
    if S == 0:
        return out
    offsets, act_scale = _flat(offsets), _flat(act_scale)
    if act_scale is None:
        q, qs = _quantize(x, block[1], S)
    else:
        q, qs = _quantize(x, block[1], S, offsets=offsets, act_scale=act_scale)
    return _gemm(q, qs, w, w_scale_inv, block, out, offsets=offsets, static=act_scale is not None)


def batched_mm(x, w, w_scale_inv, expert_ids, block_size, act_scale=None, out_dtype=None):
    """x (S, K), expert_ids (S,) -> (S, N); ids outside [0, E) give zero rows.

    Sorts the rows by expert on the device and runs the grouped kernel, gathering
    A rows and scattering output rows through the permutation."""
    block = _block(block_size)
    S = x.shape[0]
    out = torch.empty((S, w.shape[1]), dtype=out_dtype or x.dtype, device=x.device)
    if S == 0:
        return out
    perm, offsets = _sort_slots(expert_ids, w.shape[0])
    act_scale = _flat(act_scale)
    if act_scale is None:
        q, qs = _quantize(x, block[1], S)
        return _gemm(q, qs, w, w_scale_inv, block, out, offsets=offsets, perm=perm, gather_a=True,
                     scatter_out=True)
    q, qs = _quantize(x, block[1], S, perm=perm, offsets=offsets, act_scale=act_scale)
    return _gemm(q, qs, w, w_scale_inv, block, out, offsets=offsets, perm=perm, scatter_out=True, static=True)


def grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                    down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                    down_act_scale=None, swiglu_limit=None):
    """Whole expert forward: hidden (T, H), top_k_index / top_k_weights (T, k) -> (T, H)."""
    block = _block(block_size)
    E, two_i, _ = gate_up_proj.shape
    return experts_forward(
        hidden, top_k_index, top_k_weights, E, two_i // 2, block,
        lambda q, qs, h, **kw: _gemm(q, qs, gate_up_proj, gate_up_scale_inv, block, h, **kw),
        lambda a, a_s, y, **kw: _gemm(a, a_s, down_proj, down_scale_inv, block, y, **kw),
        activation, gate_up_act_scale, down_act_scale, swiglu_limit)


def experts_forward(hidden, top_k_index, top_k_weights, E, I, block, gate_up_gemm, down_gemm,
                    activation, gate_up_act_scale, down_act_scale, swiglu_limit):
    """The expert forward around its two grouped GEMMs, whatever holds the weights:
    ``gate_up_gemm(q, q_scale, h, **launch)`` and ``down_gemm(a, a_scale, y, **launch)``
    run :func:`_gemm` over E experts into ``h`` (S, 2I) and ``y`` (S, H)."""
    bk = block[1]
    T, H = hidden.shape
    k = top_k_index.shape[1]
    two_i = 2 * I
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    S = T * k
    dev = hidden.device
    perm, offsets = _sort_slots(top_k_index, E)
    gate_up_act_scale, down_act_scale = _flat(gate_up_act_scale), _flat(down_act_scale)

    # gate_up: h (S, 2I) in sorted order
    h = torch.empty((S, two_i), dtype=hidden.dtype, device=dev)
    if gate_up_act_scale is None:
        q, qs = _quantize(hidden, bk, T)
        gate_up_gemm(q, qs, h, offsets=offsets, perm=perm, gather_a=True, topk=k)
    else:
        q, qs = _quantize(hidden, bk, S, perm=perm, offsets=offsets, act_scale=gate_up_act_scale, topk=k)
        gate_up_gemm(q, qs, h, offsets=offsets, static=True)

    # act(gate) * up, rounded, quantised for the down projection
    static_down = down_act_scale is not None
    a_q = torch.empty((S, I), dtype=torch.float8_e4m3fn, device=dev)
    a_s = down_act_scale if static_down else torch.empty((S, cdiv(I, bk)), dtype=torch.float32, device=dev)
    grid, block_r, block_g = quant_launch_shape(S, I, bk)
    launch(_gated_act_quant_kernel, grid, (
        h, h.stride(0), a_q, a_s, offsets, a_s, S, I, E,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
    ), dict(ACT=ACT_IDS[activation], HAS_LIMIT=swiglu_limit is not None, STATIC=static_down,
            GROUP=bk, BLOCK_R=block_r, BLOCK_G=block_g, SEARCH_STEPS=E.bit_length()),
        enable_fp_fusion=False)

    # down: y (S, H) back in slot order; sentinel slots' rows are left unwritten
    y = torch.empty((S, H), dtype=hidden.dtype, device=dev)
    down_gemm(a_q, a_s, y, offsets=offsets, perm=perm, scatter_out=True, static=static_down)

    return combine(y, top_k_index, top_k_weights, E, out)


def batched_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                    down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                    down_act_scale=None, swiglu_limit=None):
    """Same contract as :func:`grouped_experts`; the slots are sorted internally, so
    the two agree bitwise."""
    return grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                           down_scale_inv, block_size, activation, gate_up_act_scale, down_act_scale,
                           swiglu_limit)
