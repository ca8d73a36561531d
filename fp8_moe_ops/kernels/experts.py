"""The whole-experts forward on the GPU (``grouped_experts``, ``batched_experts``, and
``grouped_experts_list`` through :mod:`.moe_list`) and the launch plan that replays it.

Layout of the forward (S = T * k slots, slot ``t*k + j`` is token t's j-th choice):

1. ``perm`` (S,) sorted position -> slot, ``offsets`` (E,): :mod:`.sort`, one launch
   for S <= 2048, which also writes both GEMMs' ``tile_map`` (their row tiles, and the
   tiles' slots: :func:`.sort.write_tile_map`), else three (histograms, their prefix
   sums, the scatter; also where the gate_up GEMM reads its A in place, step 3);
2. activations quantised once, in the sort's launch where the sort is one: dynamic,
   (T, H) per token (scales do not depend on the expert); static, the (S, H) slots
   with their expert's scale, in slot order (that needs the ids, not the sort);
3. gate_up GEMM, A rows gathered by ``perm // k`` (static: ``perm``) -> h (S, 2I) in
   sorted order.  Where the Gluon kernel takes it (:func:`_sorted_a`: on Hopper from
   64 rows per expert), step 2 instead stores each token's quantised row at its slots'
   sorted rows (both schemes; ``slot_rows``, the inverse of ``perm``) and the GEMM reads
   A in place: the same bytes and scales, so the same output;
4. gated activation + quantisation -> (S, I) fp8; for S <= 16 (``ACT_SLOTS``: decode)
   in the gate_up GEMM's launch, by the last row tile to finish each quantisation
   group (:mod:`.grouped_gemm`), with counters the sort zeroes;
5. down GEMM, output rows scattered by ``perm`` -> y (S, H) in slot order (at decode
   with few experts in K ranges summed into float32 partials: :mod:`.config`);
6. combine: per token, in ascending expert id, float32 -> (T, H); for S <= 64
   (``COMBINE_SLOTS``: decode) in the down GEMM's launch, by the last row tile to
   finish each column tile (:mod:`.grouped_gemm`), with counters the sort zeroes.

Sentinel slots (ids outside [0, E)) are sorted last, never computed, and skipped by
the combine.  ``batched_experts`` sorts internally and shares this path, so grouped
and batched agree bitwise.  The intermediate buffers (perm, offsets, the quantised
activations and their scales, h, y) are views of one workspace allocation
(:func:`_layout`).

**Launch plans** (:mod:`.plans`).  A call of an argument signature (the second) runs
the forward as above and records its launches; later calls of the signature replay them
on their own tensors (the stacked ops' table, :class:`StackedPlans`, keys its plans on
every tensor's dtype, shape, strides, device and 16-byte alignment and every other
argument's value; :mod:`.moe_list` keys its own).  A replay makes its sources with
:func:`routing_sources` as the forward does (a strided ``top_k_index`` is copied dense on
every call).  A signature gets no plan (and runs the forward on every call) for T = 0.
"""

from __future__ import annotations

import torch

from ..functional import cdiv, next_power_of_2
from . import ws_gemm
from .activation import gated_act_quant_call
from .combine import combine_call
from .config import gemm_config
from .launch import KernelCall, launch
from .grouped_gemm import max_row_tiles
from .moe import (Combine, Gated, TileMap, _block, _flat, _gemm_call, _large_sort_calls, _quant_call, _scale_bytes,
                  activation_source, down_split, large_sort_hist_shape)
from .plans import Layout, Plans, planned
from .quant import quant_launch_shape, scale_grid_strides
from .sort import CNT_STEP, MAX_SLOTS, _sort_quant_kernel, sort_launch_shape, tile_map_size

__all__ = ["grouped_experts", "batched_experts", "experts_forward", "planned_experts", "StackedPlans"]

# at most this many slots (and <= MAX_SLOTS: the one-launch sort zeroes the counters): the
# combine runs in the down GEMM's launch (the last program of a column tile combines all T
# tokens' slots there, so its share grows with S: on the H200, 128 and 256 saved the
# combine's launch but slowed the down GEMM as much or more, docs/benchmarks.md)
COMBINE_SLOTS = 64
# at most this many slots (and <= COMBINE_SLOTS: the counters): the activation runs in the
# gate_up GEMM's launch.  On the H200 (with decode programs capped at 128 registers) that
# saved 4-6 us of a T=1 layer in a CUDA graph and 1-2.5 % at 16 slots; at 64 slots qwen3_30b_a3b
# T=8 lost 5-6 % and mixtral_8x7b T=32 2 % (docs/benchmarks.md)
ACT_SLOTS = 16
# at most MAX_SLOTS slots, the gate_up GEMM reads its rows in place (where the Gluon kernel
# takes it; the sort then takes three launches and the quantisation its own) only from this
# many rows per expert: on the H200 mixtral_8x7b's layer at T=256 (64 rows) was 3-5 % slower
# so, at T=288 to 448 (72 to 112 rows) 4-16 % faster, at T=512 and 1024 10-18 %
# (docs/benchmarks.md).  It implies more than COMBINE_SLOTS slots (up to there the one-launch
# sort zeroes the counters of the kernels fused into the GEMMs' launches).
SORTED_A_MIN_ROWS = 72

# at most this many slots (on the one-launch sort's path), the sort's launch writes the
# addresses of the routing tensors and the output to the workspace (``addresses``) and the
# later launches read them from there: only the first launch takes a call's own tensors,
# so a plan replays the others as a CUDA graph (:mod:`.plans`).  Decode, where a call's
# CPU time is its launches'; 512 slots is T=64 at k=8
FED_SLOTS = 512
# the sources a plan's first launch hands on through ``addresses`` (with the output)
FED = ("hidden", "top_k_index", "top_k_weights")

# the experts ops' arguments, in schema order
ARG_NAMES = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "gate_up_scale_inv", "down_proj",
             "down_scale_inv", "block_size", "activation", "gate_up_act_scale", "down_act_scale", "swiglu_limit")


def _layout(T: int, k: int, E: int, H: int, I: int, bk: int, dtype: torch.dtype, static_gate_up: bool,
            static_down: bool, sorted_a: bool = False) -> Layout:
    """The forward's intermediate buffers; ``hist`` where the sort takes three launches
    (S > 2048, or ``sorted_a``); ``sorted_a``: the gate_up GEMM's A stored per
    expert-sorted slot (:func:`_sorted_a`), at the rows ``slot_rows`` says; the dynamic
    scheme's activation scales (rows, K groups) in the order :func:`_kmajor_scales` says."""
    S = T * k
    bufs = [("perm", torch.int32, (S,)), ("offsets", torch.int32, (E,))]
    if S <= MAX_SLOTS and not sorted_a:
        bm = _map_bm(S, E, H, I)
        bufs.append(("tile_map", torch.int32, (tile_map_size(max_row_tiles(S, E, bm, True), bm),)))
        if S <= FED_SLOTS:
            bufs.append(("addresses", torch.int64, (3,)))
    else:
        bufs.append(("hist", torch.int32, large_sort_hist_shape(S, E)))
        if sorted_a:
            bufs.append(("slot_rows", torch.int32, (S,)))
    if S <= COMBINE_SLOTS:
        bufs.append(("counters", torch.int32, (_counters(S, H, I, bk)[0],)))
        split = down_split(S, E, H, I)
        if split > 1:
            bufs.append(("partials", torch.float32, (S, split, H)))
    q_rows = S if static_gate_up or sorted_a else T
    bufs.append(("q", torch.float8_e4m3fn, (q_rows, H)))
    if not static_gate_up:
        G = cdiv(H, bk)
        bufs.append(("q_scale", torch.float32, (q_rows, G), (1, q_rows) if _kmajor_scales(S) else (G, 1)))
    bufs += [("h", dtype, (S, 2 * I)), ("a_q", torch.float8_e4m3fn, (S, I))]
    if not static_down:
        bufs.append(("a_scale", torch.float32, (S, cdiv(I, bk))))
    bufs.append(("y", dtype, (S, H)))
    return Layout.of(bufs)


def _map_bm(S: int, E: int, H: int, I: int) -> int:
    """The row tiles of the one-launch sort's tile map: the gate_up GEMM's (the down
    GEMM's are the same at decode; a GEMM of other tiles scans the offsets)."""
    return gemm_config(S, E, 2 * I, H)["BM"]


def _kmajor_scales(S: int) -> bool:
    """Whether the gate_up GEMM's dynamic activation scales (of a forward of S slots) are
    laid out K-group major (strides (1, rows)) rather than row-major: at prefill (the
    three-launch sort's path, S > 2048), where the Hopper GEMM (:mod:`.ws_gemm`) then copies
    each K step's scales of a tile's rows (adjacent there) into shared memory beside its
    A tile, measured faster than its consumers' reads of row-major scales where it stores
    its rows in place (``grouped_mm``'s quantisation, ``gemms._layout``, follows the same
    rule).  The down GEMM, which scatters its rows, measured slower with them
    (docs/benchmarks.md): its scales, which the activation writes, stay row-major.  The
    grouped Triton kernel reads either; at decode the fused kernels' few rows read them
    row-major."""
    return S > MAX_SLOTS


def _counters(S: int, H: int, I: int, bk: int) -> tuple[int, int | None]:
    """The counters of a forward of S <= COMBINE_SLOTS slots: (how many, where the gate_up
    GEMM's start, None when the activation has its own launch).  The down GEMM's come
    first, one per column tile (BN >= 16), then one per quantisation group of I."""
    down = cdiv(H, 16)
    return (down + cdiv(I, bk), down) if S <= ACT_SLOTS else (down, None)


def routing_sources(hidden, top_k_index, top_k_weights, gate_up_act_scale, down_act_scale) -> dict:
    """The call's routing tensors and act scales as the kernels read them (dense; one
    tensor given as both act scales is two sources: a plan records one object once)."""
    gate_up_act_scale, down_act_scale = _flat(gate_up_act_scale), _flat(down_act_scale)
    if down_act_scale is not None and down_act_scale is gate_up_act_scale:
        down_act_scale = down_act_scale.view(down_act_scale.shape)
    return dict(hidden=activation_source(hidden), top_k_index=top_k_index.contiguous(),
                top_k_weights=top_k_weights.contiguous(),
                gate_up_act_scale=gate_up_act_scale, down_act_scale=down_act_scale)


def _sort_quant_call(ids, perm, offsets, counters, tile_map: TileMap, E: int, x, q, q_scale, bk: int,
                     static: bool, fed: tuple | None) -> KernelCall:
    """The one-launch sort of the slots (zeroing ``counters`` if given, writing the
    GEMMs' ``tile_map``) and the quantisation of x (T, H), together: dynamic, x's T rows
    with their scales into ``q_scale``; static, each row into its k slots (slot order)
    with their experts' scales ``q_scale``.  ``fed``: (routing weights, output, the
    ``addresses`` buffer), where the launch writes the ids', weights' and output's
    addresses."""
    S = ids.numel()
    (sort_programs,), block, bins, nb = sort_launch_shape(S, E)
    T, H = x.shape
    k = ids.shape[1]
    (row_blocks, groups), block_r, block_g = quant_launch_shape(T, H, bk, k if static else 1)
    n_cnt = 0 if counters is None else counters.numel()
    step = CNT_STEP.value
    cnt, cnt_block = (offsets if counters is None else counters, n_cnt), cdiv(n_cnt, step) * step
    return KernelCall(_sort_quant_kernel, (sort_programs + row_blocks * groups,), (
        ids, perm, offsets, *cnt, S, E, tile_map.tiles, max_row_tiles(S, E, tile_map.bm, True), sort_programs,
        x, x.stride(0), x.stride(1), q, q_scale, *scale_grid_strides(q_scale, static), T, H, groups,
        *(fed or (x, x, x)),
    ), dict(BLOCK=block, NB=bins, NUM_BLOCKS=nb, CNT_BLOCK=cnt_block, MAP_BM=tile_map.bm, TOPK=k,
            KP=next_power_of_2(k), STATIC=static, GROUP=bk, BLOCK_R=block_r, BLOCK_G=block_g,
            ADDRS=fed is not None), {})


def _sorted_a(device: torch.device, gate_up: tuple, S: int, E: int, I: int, H: int, block: tuple[int, int]) -> bool:
    """Whether the gate_up GEMM reads its A rows in place, stored per expert-sorted slot
    rather than gathered per token: where the TMA kernel (:mod:`.ws_gemm`, which cannot
    gather) runs it, where storing k rows per token costs a few percent of the GEMM it
    speeds up.  Past ``MAX_SLOTS`` slots, and from ``SORTED_A_MIN_ROWS`` rows per expert
    below (there the sort takes its three launches, as the one-launch sort quantises
    before it knows the sorted rows)."""
    w, w_scale = gate_up
    in_place = S > MAX_SLOTS or S >= SORTED_A_MIN_ROWS * min(E, S)
    return in_place and isinstance(w, torch.Tensor) and ws_gemm.usable(device, w, w_scale, block,
                                                                          gemm_config(S, E, 2 * I, H))


def _calls(env: dict, E: int, I: int, block: tuple[int, int], activation: str, swiglu_limit, gate_up: tuple,
           down: tuple, sorted_a: bool = False) -> list[KernelCall]:
    """The forward's launches over the tensors of ``env`` (the op's routing tensors and
    act scales, ``out``, and the buffers of :func:`_layout`).  ``gate_up`` / ``down``:
    the GEMMs' (w, w_scale), as :func:`.moe._gemm_call` takes them; ``sorted_a`` as
    the layout's."""
    bk = block[1]
    hidden, ids = env["hidden"], env["top_k_index"]
    T = hidden.shape[0]
    k = ids.shape[1]
    S = T * k
    perm, offsets, h, y = env["perm"], env["offsets"], env["h"], env["y"]
    counters = env.get("counters")  # the activation and the combine run in the GEMMs' launches
    gate_up_act_scale, down_act_scale = env["gate_up_act_scale"], env["down_act_scale"]
    # gate_up: h (S, 2I) in sorted order, its A rows gathered through perm from x
    # quantised per token (dynamic) or from the slots quantised with their expert's scale
    # (static), either in the sort's launch where the sort is one
    q = env["q"]
    static = gate_up_act_scale is not None
    q_scale = gate_up_act_scale if static else env["q_scale"]
    tile_map = None
    if "tile_map" in env:
        tile_map = TileMap(env["tile_map"], _map_bm(S, E, hidden.shape[1], I))
    gemm = dict(offsets=offsets, perm=perm, gather_a=True, topk=1 if static else k, static=static, tile_map=tile_map)
    weights, out, addresses = env["top_k_weights"], env["out"], env.get("addresses")
    if tile_map is not None:
        fed = None if addresses is None else (weights, out, addresses)
        calls = [_sort_quant_call(ids, perm, offsets, counters, tile_map, E, hidden, q, q_scale, bk, static, fed)]
    else:
        calls = _large_sort_calls(ids, perm, offsets, env["hist"], env.get("slot_rows"), E)
        if sorted_a:  # q (S, H) in sorted order, read in place: each token quantised once, stored per slot
            calls.append(_quant_call(hidden, q, q_scale, T, bk, static=static, topk=k, ids=ids, num_experts=E,
                                     dest=env["slot_rows"]))
            gemm.update(gather_a=False, topk=1)
        elif static:
            calls.append(_quant_call(hidden, q, q_scale, T, bk, static=True, topk=k, ids=ids, num_experts=E))
        else:
            calls.append(_quant_call(hidden, q, q_scale, T, bk))
    # then act(gate) * up, rounded, quantised for the down projection: in the same launch
    # for S <= ACT_SLOTS, else its own
    a_q = env["a_q"]
    a_s = env["a_scale"] if down_act_scale is None else down_act_scale
    static_down = down_act_scale is not None
    gated = None
    act_counters = None if counters is None else _counters(S, hidden.shape[1], I, bk)[1]
    if act_counters is not None:
        gated = Gated(a_q, a_s, counters, activation, swiglu_limit, static_down, act_counters)
    calls.append(_gemm_call(q, q_scale, *gate_up, block, h, **gemm, gated=gated))
    if gated is None:
        calls.append(gated_act_quant_call(h, a_q, a_s, offsets, E, bk, activation, swiglu_limit, static_down))

    # down: y (S, H) back in slot order (sentinel slots' rows are zero or unwritten, and
    # never read), then the combine, in the same launch where there are counters
    fused = Combine(ids, weights, out, counters, env.get("partials"), addresses) if counters is not None else None
    calls.append(_gemm_call(a_q, a_s, *down, block, y, offsets=offsets, perm=perm, scatter_out=True,
                            static=static_down, combine=fused, tile_map=tile_map))
    if fused is None:
        calls.append(combine_call(y, ids, weights, E, out, addresses))
    return [c for c in calls if c is not None]


def shape_calls(T: int, k: int, E: int, H: int, I: int, block: tuple[int, int], static: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> list[KernelCall]:
    """The launches of a forward of this shape (stacked weights with float32 scale
    grids; static: both act scales), built over meta-device placeholders and never run:
    for tools that inspect what a call launches (tests, ``bench/kernel_resources.py``)."""
    bn, bk = block

    def meta(*shape, dt=torch.float32):
        return torch.zeros((), dtype=dt, device="meta").expand(*shape)

    layout = _layout(T, k, E, H, I, bk, dtype, static, static)
    ws = torch.empty(layout.nbytes, dtype=torch.uint8, device="meta")
    env = dict(zip((name for name, *_ in layout.buffers), layout.views(ws)))
    env.update(hidden=meta(T, H, dt=dtype), top_k_index=meta(T, k, dt=torch.int64), top_k_weights=meta(T, k),
               out=meta(T, H, dt=dtype), gate_up_act_scale=meta(E) if static else None,
               down_act_scale=meta(E) if static else None)
    fp8 = torch.float8_e4m3fn
    gate_up = (meta(E, 2 * I, H, dt=fp8), meta(E, cdiv(2 * I, bn), cdiv(H, bk)))
    down = (meta(E, H, I, dt=fp8), meta(E, cdiv(H, bn), cdiv(I, bk)))
    return _calls(env, E, I, (bn, bk), "silu", None, gate_up, down)


def experts_forward(sources: dict, E: int, I: int, block: tuple[int, int], gate_up: tuple, down: tuple,
                    activation: str, swiglu_limit) -> tuple[torch.Tensor, dict, Layout, list[KernelCall]]:
    """Runs the forward whatever holds the weights.  ``sources`` (name -> tensor or None,
    one object per name: :func:`_distinct`): :func:`routing_sources` and the tensors the
    GEMMs read; ``gate_up`` / ``down``: the GEMMs over them as in :func:`_calls`.  Returns (out, the tensors by name, the workspace layout,
    the launches): what a plan is recorded from."""
    hidden, top_k_index = sources["hidden"], sources["top_k_index"]
    T, H = hidden.shape
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if T == 0 or H == 0:  # an empty output (the launch configs divide by H)
        return out, {}, Layout([], 0), []
    k = top_k_index.shape[1]
    sorted_a = _sorted_a(hidden.device, gate_up, T * k, E, I, H, block)
    layout = _layout(T, k, E, H, I, block[1], hidden.dtype, sources["gate_up_act_scale"] is not None,
                     sources["down_act_scale"] is not None, sorted_a)
    ws = torch.empty(layout.nbytes, dtype=torch.uint8, device=hidden.device)
    env = dict(sources, out=out)
    env.update(zip((name for name, *_ in layout.buffers), layout.views(ws)))
    calls = _calls(env, E, I, block, activation, swiglu_limit, gate_up, down, sorted_a)
    for call in calls:
        launch(call)
    return out, env, layout, calls


def _distinct(sources: dict) -> dict:
    """``sources`` with one tensor object per name: a tensor passed as two arguments (one
    per-tensor scale for both projections, say) gets an alias for the second, so each
    kernel argument names the argument it came from (what a plan records)."""
    seen, out = set(), {}
    for name, t in sources.items():
        if t is not None and id(t) in seen:
            t = t.view(t.shape)
        if t is not None:
            seen.add(id(t))
        out[name] = t
    return out


def _stacked_sources(args: tuple) -> dict:
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv = args[:7]
    return _distinct(dict(routing_sources(hidden, top_k_index, top_k_weights, args[9], args[10]),
                          gate_up_proj=gate_up_proj, gate_up_scale_inv=_scale_bytes(gate_up_scale_inv),
                          down_proj=down_proj, down_scale_inv=_scale_bytes(down_scale_inv)))


def _stacked(args: tuple, sources: dict) -> tuple:
    E, two_i, _ = args[3].shape
    return experts_forward(
        sources, E, two_i // 2, _block(args[7]),
        (sources["gate_up_proj"], sources["gate_up_scale_inv"]),
        (sources["down_proj"], sources["down_scale_inv"]), args[8], args[11])


def grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                    down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                    down_act_scale=None, swiglu_limit=None):
    """Whole expert forward: hidden (T, H), top_k_index / top_k_weights (T, k) -> (T, H)."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
            block_size, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
    return _stacked(args, _stacked_sources(args))[0]


def batched_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                    down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                    down_act_scale=None, swiglu_limit=None):
    """Same contract as :func:`grouped_experts`; the slots are sorted internally, so
    the two agree bitwise."""
    return grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                           down_scale_inv, block_size, activation, gate_up_act_scale, down_act_scale,
                           swiglu_limit)


def planned_experts(states: dict, key, args: tuple) -> torch.Tensor:
    """``grouped_experts(*args)`` (the twelve arguments in schema order) through
    :func:`.plans.planned`; ``key`` decides every tensor's dtype, shape, strides, device and
    16-byte alignment and every other argument's value (``fp8_moe_ops.ops`` keys on them)."""
    sources = _stacked_sources(args)
    return planned(states, key, sources, args[0], lambda: _stacked(args, sources), FED)


class StackedPlans(Plans):
    """The CUDA calls of one stacked experts op (``grouped_experts`` or
    ``batched_experts``) through its launch plans (:class:`Plans`; the twelve arguments
    in schema order).  The cheap key: hidden's shape, the block size, activation and
    limit, which act scales are given, the setting."""

    ARG_NAMES = ARG_NAMES
    FED = FED

    def cheap_key(self, args: tuple, gluon) -> tuple:
        # the values' types too (as attributes: a few tens of ns less than type()): 1, 1.0 and True
        # are equal keys, and the checks refuse some of them, as a dict whose keys are the block
        block, limit = args[7], args[11]
        return (args[0].shape, *block, args[8], limit, args[9] is None, args[10] is None, gluon, block.__class__,
                block[0].__class__, block[1].__class__, limit.__class__)

    def sources(self, args: tuple) -> dict:
        return _stacked_sources(args)

    def forward(self, args: tuple, sources: dict) -> tuple:
        return _stacked(args, sources)
