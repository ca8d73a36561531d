"""Entry point of ``fp8_moe::grouped_experts_list``: the grouped expert forward on
per-expert weight lists (``nn.ModuleList`` experts), reading every expert's weight and
scale tensors where they are.  No stacked copy exists, neither per call nor once.

The grouped GEMM (:mod:`.grouped_gemm`, ``W_TABLE``) takes the experts' addresses from
a device-side table: one int64 tensor holding the addresses of every tensor of the four
lists (gate_up weights, their scales, down weights, their scales).  A table is built
by one host-to-device copy the first time a set of tensors is seen and reused by every
later call with the same set (key: the tensors' addresses, the list lengths and the
device).  An address is all a table holds, so:

* a weight updated in place (``copy_``, an optimiser step) keeps its address: the
  table stays right;
* a replaced parameter (``module.weight = new``, ``.data = ...``, a reload) has a new
  address: the next call builds and caches a new table;
* a CUDA graph captures the table's address; tables are never freed (32 bytes per
  expert per set of tensors), so a graph replays against a live table.  A table is
  never built during capture (the host-to-device copy cannot be captured): run one
  eager call before capturing, as one does anyway to warm up Triton; a replaced
  parameter needs a re-capture, as with any captured graph.

Gate and up as separate lists (2E matrices: every gate, then every up) are one
gate_up launch over a split table (``W_SPLIT``): each column tile reads a gate or an up
matrix and writes its half of the (S, 2I) output, with the launch config and tiles of
the fused (2I, H) matrix.  Each output element is computed exactly as with the stacked
weights, so the op equals ``grouped_experts`` on the stacked tensors bitwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .grouped_gemm import WeightTable
from .._checks import meta_key
from .experts import experts_forward, planned, routing_sources
from .moe import _block

__all__ = ["grouped_experts_list"]


class Table(NamedTuple):
    """A cached address table: the int64 device tensor, whether every weight address is
    a multiple of 16 bytes, and its views over the four lists (kept, not sliced per call)."""

    table: torch.Tensor
    aligned: bool
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# (device, list lengths, every tensor's address) -> its Table
_TABLES: dict[tuple, Table] = {}

_data_ptr = torch.Tensor.data_ptr


def _layout(w: torch.Tensor, s: torch.Tensor) -> tuple:
    return tuple(w.shape), tuple(s.shape), s.stride(), s.dtype


def address_table(lists: tuple, device: torch.device) -> Table:
    """The cached (sum of list lengths,) int64 table of the tensors' addresses on
    ``device``, whether the weights' (lists 0 and 2) addresses are all 16-byte aligned
    (separate allocations always are; views into one tensor may not be), and the
    table's view over each list.

    Raises RuntimeError when the table does not exist yet and the current CUDA stream
    is capturing a graph."""
    lengths = tuple(map(len, lists))
    ptrs = tuple(map(_data_ptr, [t for ts in lists for t in ts]))
    key = (device, lengths, ptrs)
    entry = _TABLES.get(key)
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fp8_moe::grouped_experts_list: no address table for these expert tensors yet, and one cannot "
                "be built while a CUDA graph is being captured; run one eager call with the same weights "
                "before capturing (a replaced parameter needs one more eager call and a re-capture)")
        table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        g, gs, e = lengths[:3]
        aligned = all(p % 16 == 0 for p in ptrs[:g] + ptrs[g + gs:g + gs + e])
        # setdefault: a table another thread has just built and handed out stays the table
        entry = _TABLES.setdefault(key, Table(table, aligned, tuple(table.split(lengths))))
    return entry


def _weights(w: torch.Tensor, s: torch.Tensor, E: int, w0: torch.Tensor, s0: torch.Tensor, aligned: bool,
             split: bool) -> WeightTable:
    gn, gk = s0.shape
    sn, sk = s0.stride()
    return WeightTable(w, s, (E, *w0.shape), gn, (0 if gn == 1 else sn, 0 if gk == 1 else sk),
                       s0.dtype == torch.float8_e8m0fnu, 16 if aligned else 1, split)


_PLANS: dict = {}  # signature -> plan state (experts.planned)


def grouped_experts_list(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                         down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                         down_act_scale=None, swiglu_limit=None):
    """Whole expert forward on per-expert lists: hidden (T, H), top_k_index /
    top_k_weights (T, k) -> (T, H).  ``down_proj``: E (H, I) matrices;
    ``gate_up_proj``: E fused (2I, H) matrices, or 2E (I, H) (every gate, then every up);
    each with its scale grid in the matching ``*_scale_inv`` list.

    The launches are recorded as a plan (:mod:`.experts`) on the second call of a
    signature (:func:`.experts.planned`, as for the stacked ops): the metadata of
    the routing tensors and act scales, the other arguments' values, the list lengths,
    the first weight and scale grid of each list (the op's checks hold every expert to
    them) and whether the weights are 16-byte aligned; the address table is an input of
    the plan like any tensor."""
    block = _block(block_size)
    E, G = len(down_proj), len(gate_up_proj)
    I = down_proj[0].shape[1]
    _, aligned, parts = address_table((gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv), hidden.device)
    sources = routing_sources(hidden, top_k_index, top_k_weights, gate_up_act_scale, down_act_scale)
    sources.update(zip(("gate_up_w", "gate_up_s", "down_w", "down_s"), parts))
    key = (meta_key((hidden, top_k_index, top_k_weights, block_size, activation, gate_up_act_scale, down_act_scale,
                     swiglu_limit)), E, G, _layout(gate_up_proj[0], gate_up_scale_inv[0]),
           _layout(down_proj[0], down_scale_inv[0]), aligned)
    gu0, gus0 = gate_up_proj[0], gate_up_scale_inv[0]

    def forward():
        gate_up = (_weights(sources["gate_up_w"], sources["gate_up_s"], E, gu0, gus0, aligned, G != E), None)
        down = (_weights(sources["down_w"], sources["down_s"], E, down_proj[0], down_scale_inv[0], aligned, False), None)
        return experts_forward(sources, E, I, block, gate_up, down, activation, swiglu_limit)

    return planned(_PLANS, key, sources, hidden, forward)
