"""The launches the GEMM ops (:mod:`.gemms`) and the whole-experts forward
(:mod:`.experts`) share: the activation quantisation, the grouped GEMM (or the Gluon
kernel's launch where the launch table takes it) and the three-launch sort.

Each ``_*_call`` builds one kernel's launch as a :class:`~.launch.KernelCall` over
tensors it is given (it allocates nothing); :func:`_quantize` allocates and launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..functional import cdiv, next_power_of_2
from . import ws_gemm
from .activation import ACT_IDS
from .combine import slots_block
from .config import block_k, gemm_config
from .grouped_gemm import WeightTable, _grouped_gemm_kernel, max_row_tiles
from .launch import KernelCall, launch
from .quant import _quant_kernel, groups_per_program, quant_launch_shape, scale_grid_strides
from .sort import _sort_hist_kernel, _sort_scan_kernel, _sort_scatter_kernel, large_sort_launch_shape


def _block(block_size: Sequence[int]) -> tuple[int, int]:
    bn, bk = int(block_size[0]), int(block_size[1])
    if block_k(bk) < 16:
        raise ValueError(
            f"block_size: expected bk divisible by 16 for the Triton kernels (the fp8 dot's smallest K), "
            f"got {[bn, bk]}")
    return bn, bk


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    # the kernels index act scales and offsets as dense 1-D arrays (tiny; copied only
    # when a caller passes a strided view); one already is itself (a plan's source that
    # is its argument: a guard can find its plan under the interpreter too)
    if t is None or (t.dim() == 1 and t.is_contiguous()):
        return t
    return t.reshape(-1).contiguous()


def activation_source(x: torch.Tensor) -> torch.Tensor:
    """x as the quantisation reads it: itself, or a dense copy where its column offsets
    (``(K - 1) * stride(1)``, 32-bit in the kernel: 64-bit offsets cost its launches up to
    4.5 % more instructions, docs/benchmarks.md) would pass 2^31, as a column-major x of
    300k rows at K = 7168."""
    if (x.shape[1] - 1) * x.stride(1) < 2**31:
        return x
    return x.contiguous()


def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
    # UE8M0 grids reach the GEMM as their bytes (the kernel expands them)
    return s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s


def _ep(E: int) -> int:
    return max(2, next_power_of_2(E))


def large_sort_hist_shape(S: int, E: int) -> tuple[int, int]:
    """The (blocks + 1, bins) int32 histograms, then prefix sums, of the three-launch
    sort of S > ``MAX_SLOTS`` slots."""
    blocks, _, bins, _, _ = large_sort_launch_shape(S, E)
    return blocks + 1, bins


def _large_sort_calls(ids, perm, offsets, hist, slot_rows, E: int) -> list[KernelCall]:
    """The three launches of the sort of the contiguous ``ids``' S > ``MAX_SLOTS`` slots
    (:mod:`.sort`): the blocks' histograms into ``hist``, their prefix sums, then
    ``perm``, ``offsets`` and, given ``slot_rows`` (S,), each slot's sorted position (the
    inverse of ``perm``)."""
    S = ids.numel()
    blocks, block, bins, cb, rb = large_sort_launch_shape(S, E)
    rows = perm if slot_rows is None else slot_rows
    return [KernelCall(_sort_hist_kernel, (blocks,), (ids, hist, S, E), dict(BLOCK=block, NB=bins), {}),
            KernelCall(_sort_scan_kernel, (bins // cb,), (hist, blocks), dict(NB=bins, CB=cb, RB=rb), {}),
            KernelCall(_sort_scatter_kernel, (blocks,), (ids, hist, perm, offsets, rows, S, E, blocks),
                       dict(BLOCK=block, NB=bins, SLOT_ROWS=slot_rows is not None), {})]


def _quant_call(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, rows: int, bk: int, *, perm=None, offsets=None,
                static: bool = False, topk: int = 1, ids=None, num_experts: int = 0, dest=None) -> KernelCall | None:
    """Dynamic: x's ``rows`` rows -> q (rows, K) and their scales s (rows, G).  Static,
    with each row's expert's scale ``s`` (E,): the ``rows`` sorted rows (source row
    ``perm[i] // topk`` when ``perm`` is given; without ``offsets``, every row with
    ``s[0]``: one matrix's rows), or with ``ids`` (the contiguous
    (T, topk) expert ids of ``num_experts``) x's ``rows`` = T rows into their T * topk
    slots in slot order (slot ``t * topk + j``) -> q.  With ``ids`` and ``dest`` (the
    (T * topk,) row of q for each slot), either scheme: slot ``i`` into row
    ``dest[i]`` of q (dynamic: and of s).  Slots of no expert are skipped.  None when
    there is nothing to launch."""
    if rows == 0:
        return None
    K = x.shape[1]
    slots = ids is not None
    (row_blocks, groups), block_r, block_g = quant_launch_shape(rows, K, bk, topk if slots else 1)
    gpp = groups_per_program(row_blocks, groups) if static else 1
    E = num_experts if slots else offsets.shape[0] if offsets is not None else 1
    # a static call without offsets searches none: its rows are all expert 0's
    search = E.bit_length() if slots or offsets is not None or not static else 0
    index = ids if slots else perm if perm is not None else q
    return KernelCall(_quant_kernel, (row_blocks, cdiv(groups, gpp)), (
        x, x.stride(0), x.stride(1), q, s, *scale_grid_strides(s, static),
        index, offsets if offsets is not None else q, s, dest if dest is not None else q,
        rows, K, E,
    ), dict(TOPK=topk, KP=next_power_of_2(topk), GROUP=bk, BLOCK_R=block_r, BLOCK_G=block_g,
            SEARCH_STEPS=search, STATIC=static, GATHER=perm is not None, SLOTS=slots, DEST=dest is not None,
            GPP=gpp),
        {})


def _quantize(x, bk: int, rows: int, *, offsets=None, act_scale=None):
    """:func:`_quant_call` into new tensors (the quantisation on its own, as the tests and
    benchmarks check and time it): dynamic -> (q, scale (rows, G)); static
    (``act_scale`` (E,), ``offsets`` its experts' rows) -> (q, act_scale)."""
    static = act_scale is not None
    q = torch.empty((rows, x.shape[1]), dtype=torch.float8_e4m3fn, device=x.device)
    s = act_scale if static else torch.empty((rows, cdiv(x.shape[1], bk)), dtype=torch.float32, device=x.device)
    launch(_quant_call(x, q, s, rows, bk, offsets=offsets, static=static))
    return q, s


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    # a size-1 grid dim is either a one-block matrix or one scale per matrix: stride
    # 0 serves both without expanding the grid
    se, sn, sk = scale.stride()
    return se, (0 if scale.shape[1] == 1 else sn), (0 if scale.shape[2] == 1 else sk)


class Combine(NamedTuple):
    """The weighted combine in the down GEMM's launch (``COMBINE`` in :mod:`.grouped_gemm`)."""

    top_k_index: torch.Tensor  # (T, k)
    top_k_weights: torch.Tensor  # (T, k)
    final: torch.Tensor  # (T, N): the layer's output
    counters: torch.Tensor  # int32, at least one per column tile (cdiv(N, 16) always is), zeroed before
    partials: torch.Tensor | None  # float32 (S, down_split, N) where that is above 1, else None
    addresses: torch.Tensor | None = None  # int64 (3,): where the launch reads the first three's addresses (ADDRS)


class Gated(NamedTuple):
    """The gated activation and its quantisation in the gate_up GEMM's launch (``GATED``)."""

    a_q: torch.Tensor  # (S, I) e4m3 out
    a_scale: torch.Tensor  # dynamic: (S, cdiv(I, bk)) float32 out; static: the (E,) input
    counters: torch.Tensor  # int32, cdiv(I, bk) of them from `offset` on, zeroed before
    activation: str
    swiglu_limit: float | None
    static: bool
    offset: int


class TileMap(NamedTuple):
    """The sort's map of the grouped GEMMs' row tiles (:func:`.sort.write_tile_map`)."""

    tiles: torch.Tensor  # int32, sort.tile_map_size(max_row_tiles(S, E, bm, True), bm) entries
    bm: int  # the tiles' rows: a GEMM of another BM scans the offsets instead


def _gemm_call(q, q_scale, w, w_scale, block, out, *, offsets=None, perm=None, gather_a=False, scatter_out=False,
               static=False, topk=1, combine: Combine | None = None, gated: Gated | None = None,
               tile_map: TileMap | None = None) -> KernelCall | None:
    """The launch of ``out[rows] = q[rows] @ dequant(w[expert])^T`` over the
    expert-sorted rows (None when there are none).

    ``tile_map`` (with ``offsets`` and ``perm``): the sort's map of the row tiles, which
    the launch reads instead of scanning ``offsets`` and loading ``perm`` where its
    tiles have the map's height and its K is not split.

    ``combine`` also combines ``out`` (the slot-order (T*k, N) y of the experts forward,
    contiguous) into ``combine.final`` in the same launch.  ``gated`` also runs the
    gated activation of ``out`` (the sorted (S, 2I) h of the experts forward) and its
    quantisation into ``gated.a_q`` in the same launch.

    ``w`` is the stacked (E, N, K) tensor with its grid ``w_scale`` (float32, or UE8M0
    as ``float8_e8m0fnu`` or its ``uint8`` bytes), or a :class:`WeightTable`
    (``w_scale`` None).  A split table (gate and up, N rows each) launches as the fused
    (2N, K) matrix would: same config, same tiles per row block."""
    S = out.shape[0]
    E, N, K = w.shape
    if S == 0:
        return None
    bn, bk = block
    table = isinstance(w, WeightTable)
    split = table and w.split
    cfg = gemm_config(S, E, 2 * N if split else N, K, combine is not None,
                      ws_gemm.programs(out.device) if out.is_cuda else None)
    align = w.align if table else 16
    if table:
        ws_strides, one_scale_row, e8m0 = (0, *w.scale_strides), w.scale_rows == 1, w.scale_e8m0
        w, ws = w.w, w.scale
    else:
        e8m0 = w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
        ws = w_scale.view(torch.uint8) if w_scale.dtype == torch.float8_e8m0fnu else w_scale
        ws_strides, one_scale_row = _scale_strides(w_scale), w_scale.shape[1] == 1
    if not table and combine is None and gated is None and not gather_a and offsets is not None \
            and ws_gemm.usable(out.device, w, w_scale, block, cfg) and ws_gemm.tma_ready(q) \
            and (static or ws_gemm.scales_readable(q_scale)):
        return ws_gemm.ws_gemm_call(q, q_scale, w, ws, ws_strides, block, out, offsets=offsets, perm=perm,
                                    scatter_out=scatter_out, static=static, e8m0=e8m0,
                                    num_pid_m=max_row_tiles(S, E, ws_gemm.TILE, True),
                                    group_m=cfg["GROUP_M"], max_programs=ws_gemm.programs(out.device))
    # the grouped Triton kernel, on the entry's tiles
    k_split = cfg.get("SPLIT", 1)
    BM, BN = cfg["BM"], cfg["BN"]
    num_pid_m = max_row_tiles(S, E, BM, offsets is not None)
    # a split-K launch (mixtral_8x7b's down GEMM at T=1) scans: with the map its static
    # form ran about 3.6 us slower on an H100, its dynamic one no faster (docs/benchmarks.md)
    mapped = tile_map is not None and tile_map.bm == BM and offsets is not None and k_split == 1
    grid = (num_pid_m * cdiv(N, BN) * (2 if split else 1) * k_split,)
    dummy = out
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if "maxnreg" in cfg:
        options["maxnreg"] = cfg["maxnreg"]
    # the combine's and the activation's arguments; `counters` serves both
    ids = weights = final = partials = counters = addresses = dummy
    T, tb, kp = 0, 1, 2
    fed = combine is not None and combine.addresses is not None
    if combine is not None:
        ids, weights, final, counters, partials = combine[:5]
        addresses = combine.addresses if fed else dummy
        if (partials is None) != (k_split == 1):
            raise RuntimeError(f"split-K partials: expected a buffer for {k_split} K ranges, got {partials}")
        partials = dummy if partials is None else partials
        T, topk = ids.shape  # the down GEMM gathers nothing: TOPK is the combine's k
        tb, kp = next_power_of_2(T), slots_block(topk)
        options["enable_fp_fusion"] = False  # the combine rounds each product, as the reference
    act, act_meta = (dummy, dummy, 0.0), dict(GATED=False, ACT=0, HAS_LIMIT=False, ACT_STATIC=False, NG=1, CNT_OFF=0,
                                                ROWS=1, RB=1, BLOCK_G=1)
    if gated is not None:
        counters, limit = gated.counters, gated.swiglu_limit
        act = (gated.a_q, gated.a_scale, float(limit) if limit is not None else 0.0)
        rows = next_power_of_2(S)
        act_meta = dict(GATED=True, ACT=ACT_IDS[gated.activation], HAS_LIMIT=limit is not None,
                        ACT_STATIC=gated.static, NG=cdiv(BN - 1, bk) + 1, CNT_OFF=gated.offset, ROWS=rows,
                        RB=min(rows, 16), BLOCK_G=next_power_of_2(bk))
        options["enable_fp_fusion"] = False  # as the activation kernel: the reference's roundings
    bk_step = block_k(bk)
    return KernelCall(_grouped_gemm_kernel, grid, (
        q, q.stride(0), q_scale, *scale_grid_strides(q_scale, static),
        w, ws, *ws_strides,
        out, out.stride(0),
        perm if perm is not None else dummy, offsets if offsets is not None else dummy,
        tile_map.tiles if mapped else dummy,
        ids, weights, final, counters, T, addresses, partials, *act,
        S, N, E, num_pid_m,
    ), dict(K=K, TOPK=topk, BN_SCALE=bn, BK_SCALE=bk,
            GATHER_A=gather_a, SCATTER_OUT=scatter_out, STATIC=static,
            SCALE_E8M0=e8m0, HAS_OFFSETS=offsets is not None, TILE_MAP=mapped,
            W_SCALE_PER_TILE=bn % BN == 0 or one_scale_row, W_TABLE=table, W_ALIGN=align, W_SPLIT=split,
            COMBINE=combine is not None, TB=tb, KP=kp, ADDRS=fed, SPLIT=k_split, KS=cdiv(cdiv(K, bk_step), k_split) * bk_step,
            **act_meta, BM=BM, BN=BN, BK=bk_step, EP=_ep(E), GROUP_M=cfg["GROUP_M"]), options)


def down_split(S: int, E: int, N: int, K: int) -> int:
    """K ranges of the down GEMM with the combine in its launch (its ``partials``)."""
    return gemm_config(S, E, N, K, True).get("SPLIT", 1)
