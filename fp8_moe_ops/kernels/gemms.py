"""The GEMM ops (``linear``, ``grouped_mm``, ``batched_mm``) on the GPU, and their launch
plans.

A forward quantises the activation rows (dynamic: per row and K group, into the
workspace's ``q`` and ``q_scale``; static: with the given scale, of the one matrix or
of each row's expert) and runs the grouped GEMM (:mod:`.grouped_gemm`, or the Gluon
kernel where the launch table takes it: :mod:`.ws_gemm`): two launches.
``batched_mm`` first sorts its rows by expert (``perm``, ``offsets``: one launch, three
past 2048 rows, :mod:`.sort`), then gathers its A rows (static: quantised in sorted
order with their expert's scale) and scatters its output rows through ``perm``.
``grouped_mm`` reads its rows in place; past 2048 rows its dynamic scales are laid out
K-group major, as the Hopper GEMM reads them fastest (the experts forward's rule).

The intermediate buffers are views of one workspace allocation, so a call's launches
are recorded and replayed as the experts ops' are (:mod:`.plans`):
:class:`GemmPlans` is the ops' CUDA kernel.  An eager decode-sized ``FP8Linear`` call
otherwise spends tens of microseconds of CPU building its two launches (the configs,
the grids, the launch cache's keys; 46 µs on the CPU machine).
"""

from __future__ import annotations

import torch

from ..functional import cdiv
from .launch import KernelCall, launch
from .moe import (_block, _flat, _gemm_call, _large_sort_calls, _quant_call, _scale_bytes, activation_source,
                  large_sort_hist_shape)
from .plans import Layout, Plans
from .sort import MAX_SLOTS, _sort_kernel, sort_launch_shape

__all__ = ["linear", "grouped_mm", "batched_mm", "GemmPlans"]


def _sources(name: str, args: tuple) -> dict:
    """The tensors the kernels read, named as the op's arguments: ``linear``'s matrix
    and scale grid as one expert's (views), a UE8M0 grid as its bytes, the act scale and
    the routing tensors dense."""
    x, w, w_scale_inv = args[:3]
    if name == "linear":
        w, w_scale_inv = w.unsqueeze(0), w_scale_inv.unsqueeze(0)
    sources = dict(x=activation_source(x), w=w, w_scale_inv=_scale_bytes(w_scale_inv))
    if name == "grouped_mm":
        sources["offsets"] = _flat(args[3])
    elif name == "batched_mm":
        sources["expert_ids"] = args[3].contiguous()
    sources["act_scale"] = _flat(args[-2])
    return sources


def _sort_calls(ids: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, hist, E: int) -> list[KernelCall]:
    """The sort of the S = ``ids.numel()`` > 0 rows by expert into ``perm`` (sorted
    position -> row) and ``offsets`` (E,): one launch, or three past ``MAX_SLOTS``
    (``hist``: their histograms).  The same result as
    :func:`fp8_moe_ops.routing.sort_slots` (the stable order is unique)."""
    S = ids.numel()
    if S > MAX_SLOTS:
        return _large_sort_calls(ids, perm, offsets, hist, None, E)
    grid, block, bins, nb = sort_launch_shape(S, E)
    return [KernelCall(_sort_kernel, grid, (ids, perm, offsets, offsets, 0, S, E),
                       dict(BLOCK=block, NB=bins, NUM_BLOCKS=nb, CNT_BLOCK=0), {})]  # no counters to zero


def _sort_slots(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sort_calls` into new tensors (the sort on its own, as the tests check it):
    (perm, offsets)."""
    S = ids.numel()
    perm = torch.empty(S, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(E, dtype=torch.int32, device=ids.device)
    if S == 0:  # an empty grid would leave offsets unwritten
        return perm, offsets.zero_()
    hist = torch.empty(large_sort_hist_shape(S, E), dtype=torch.int32, device=ids.device) if S > MAX_SLOTS else None
    for call in _sort_calls(ids.contiguous(), perm, offsets, hist, E):
        launch(call)
    return perm, offsets


def _layout(name: str, S: int, K: int, E: int, bk: int, static: bool) -> Layout:
    """The forward's buffers: the sort's (``batched_mm``), ``q`` and, dynamic,
    ``q_scale`` (K-group major past ``MAX_SLOTS`` rows read in place: ``grouped_mm``)."""
    bufs = []
    if name == "batched_mm":
        bufs += [("perm", torch.int32, (S,)), ("offsets", torch.int32, (E,))]
        if S > MAX_SLOTS:
            bufs.append(("hist", torch.int32, large_sort_hist_shape(S, E)))
    bufs.append(("q", torch.float8_e4m3fn, (S, K)))
    if not static:
        G = cdiv(K, bk)
        kmajor = name == "grouped_mm" and S > MAX_SLOTS
        bufs.append(("q_scale", torch.float32, (S, G), (1, S) if kmajor else (G, 1)))
    return Layout.of(bufs)


def _calls(name: str, env: dict, block: tuple[int, int]) -> list[KernelCall]:
    """The forward's launches over the tensors of ``env`` (the sources, ``out``, the
    buffers of :func:`_layout`)."""
    x, w, ws, a_s, out = env["x"], env["w"], env["w_scale_inv"], env["act_scale"], env["out"]
    S, bk = x.shape[0], block[1]
    static = a_s is not None
    q, q_scale = env["q"], a_s if static else env["q_scale"]
    if name == "linear":  # static: the one scale, no offsets
        return [_quant_call(x, q, q_scale, S, bk, static=static),
                _gemm_call(q, q_scale, w, ws, block, out, static=static)]
    if name == "grouped_mm":
        offsets = env["offsets"]
        return [_quant_call(x, q, q_scale, S, bk, offsets=offsets if static else None, static=static),
                _gemm_call(q, q_scale, w, ws, block, out, offsets=offsets, static=static)]
    perm, offsets = env["perm"], env["offsets"]
    calls = _sort_calls(env["expert_ids"], perm, offsets, env.get("hist"), w.shape[0])
    if static:  # quantised in sorted order, each row with its expert's scale
        calls.append(_quant_call(x, q, q_scale, S, bk, perm=perm, offsets=offsets, static=True))
        calls.append(_gemm_call(q, q_scale, w, ws, block, out, offsets=offsets, perm=perm, scatter_out=True,
                                static=True))
    else:  # quantised in place order, gathered by the GEMM
        calls.append(_quant_call(x, q, q_scale, S, bk))
        calls.append(_gemm_call(q, q_scale, w, ws, block, out, offsets=offsets, perm=perm, gather_a=True,
                                scatter_out=True))
    return calls


def gemm_forward(name: str, sources: dict, block_size, out_dtype) -> tuple:
    """Runs op ``name``'s forward on ``sources`` (:func:`_sources`).  Returns (out, the
    tensors by name, the workspace layout, the launches): what a plan is recorded from."""
    x, w = sources["x"], sources["w"]
    S, K = x.shape
    out = torch.empty((S, w.shape[1]), dtype=out_dtype or x.dtype, device=x.device)
    if S == 0:
        return out, {}, Layout([], 0), []
    block = _block(block_size)
    layout = _layout(name, S, K, w.shape[0], block[1], sources["act_scale"] is not None)
    ws = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    env = dict(sources, out=out)
    env.update(zip((n for n, *_ in layout.buffers), layout.views(ws)))
    calls = [c for c in _calls(name, env, block) if c is not None]
    for call in calls:
        launch(call)
    return out, env, layout, calls


def linear(x, w, w_scale_inv, block_size, act_scale=None, out_dtype=None):
    """x (M, K) @ dequant(w (N, K))^T -> (M, N); ``act_scale`` one element (static)."""
    args = (x, w, w_scale_inv, block_size, act_scale, out_dtype)
    return gemm_forward("linear", _sources("linear", args), block_size, out_dtype)[0]


def grouped_mm(x, w, w_scale_inv, offsets, block_size, act_scale=None, out_dtype=None):
    """x (S, K) sorted by expert, offsets (E,) int32 -> (S, N); rows past offsets[-1] zero."""
    args = (x, w, w_scale_inv, offsets, block_size, act_scale, out_dtype)
    return gemm_forward("grouped_mm", _sources("grouped_mm", args), block_size, out_dtype)[0]


def batched_mm(x, w, w_scale_inv, expert_ids, block_size, act_scale=None, out_dtype=None):
    """x (S, K), expert_ids (S,) -> (S, N); ids outside [0, E) give zero rows."""
    args = (x, w, w_scale_inv, expert_ids, block_size, act_scale, out_dtype)
    return gemm_forward("batched_mm", _sources("batched_mm", args), block_size, out_dtype)[0]


class GemmPlans(Plans):
    """The CUDA calls of GEMM op ``name`` through its launch plans (:class:`Plans`; the
    op's arguments in schema order, all of them: the dispatcher may leave trailing
    defaults out, the op fills them in; their names are the op's schema's).  The cheap
    key: x's shape, the block size, whether ``act_scale`` is given, ``out_dtype``, the
    setting."""

    def __init__(self, name: str, check):
        super().__init__(check)
        self.name = name
        self.ARG_NAMES = tuple(a.name for a in getattr(torch.ops.fp8_moe, name).default._schema.arguments)

    def cheap_key(self, args: tuple, gluon) -> tuple:
        block = args[-3]  # with its types, as StackedPlans' key
        return (args[0].shape, *block, args[-2] is None, args[-1], gluon, block.__class__, block[0].__class__,
                block[1].__class__)

    def sources(self, args: tuple) -> dict:
        return _sources(self.name, args)

    def forward(self, args: tuple, sources: dict) -> tuple:
        return gemm_forward(self.name, sources, args[-3], args[-1])
