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
* a CUDA graph captures the table's address.  A table is never built during capture
  (the host-to-device copy cannot be captured): run one eager call before capturing,
  as one does anyway to warm up Triton; a replaced parameter needs a re-capture, as
  with any captured graph.

Tables do not pile up as parameters are replaced again and again (a reload per step,
FSDP-style re-allocation): each holds weak references to its tensors' storages and
their addresses, and building a table, once the cache has doubled since the last look,
drops every table one of whose storages has been freed or has moved (freed in place
and allocated again, ``untyped_storage().resize_``).  Past ``MAX_TABLES`` tables of live
storages (expert weights moved between the slots of a buffer pool make a new set of
addresses per arrangement), it also drops the least recently used until half that many
are left (each kept until the next sweep: a thread may have looked it up just before).  A
table a CUDA graph has captured is kept (the graph replays against it), and the GPU is
synchronised before a CUDA table is freed (a kernel on another stream may still read
it).  So the cache holds the live sets of tensors, the captured ones, and at
most as many again, and never more than ``MAX_TABLES`` uncaptured ones.

Gate and up as separate lists (2E matrices: every gate, then every up) are one
gate_up launch over a split table (``W_SPLIT``): each column tile reads a gate or an up
matrix and writes its half of the (S, 2I) output, with the launch config and tiles of
the fused (2I, H) matrix.  Each output element is computed exactly as with the stacked
weights, so the op equals ``grouped_experts`` on the stacked tensors bitwise.
"""

from __future__ import annotations

import itertools
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .grouped_gemm import WeightTable
from .._checks import meta_key
from .experts import FED, experts_forward, routing_sources
from .moe import _block
from .plans import planned

__all__ = ["grouped_experts_list"]


class Table:
    """A cached address table: the int64 device tensor, whether every weight address is
    a multiple of 16 bytes, its views over the four lists (kept, not sliced per call),
    weak references to the tensors' storages, whether a CUDA graph captured it, and
    when it was last looked up (a tick of ``_USES``)."""

    __slots__ = ("table", "aligned", "parts", "storages", "captured", "used")

    def __init__(self, table: torch.Tensor, aligned: bool, tensors: list[torch.Tensor], lengths: tuple):
        self.table, self.aligned, self.parts = table, aligned, tuple(table.split(lengths))
        self.storages = [(StorageWeakRef(s), s.data_ptr()) for s in (t.untyped_storage() for t in tensors)]
        self.captured = False
        self.used = next(_USES)

    def freed(self) -> bool:
        """Whether the storage of one of the tensors has been freed, or has moved (freed
        in place and allocated again: its tensors' addresses are not the table's)."""
        for ref, base in self.storages:
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # None once freed (by any thread)
            if storage is None or storage.data_ptr() != base:
                return True
        return False


# (device, list lengths, every tensor's address) -> its Table
_TABLES: dict[tuple, Table] = {}
_LOCK = threading.Lock()  # builds and drops tables; lookups go without it
MIN_SWEEP = 64  # tables cached before the first look for freed ones
MAX_TABLES = 1024  # uncaptured tables of live storages kept at most (a model has one or two per layer)
_sweep_at = MIN_SWEEP  # a build looks for freed tables once this many are cached
_USES = itertools.count()  # ticks of the lookups: eviction takes the least recently used
# (device, Table) of live tables dropped past MAX_TABLES: a thread may have looked one up
# just before, so each is kept until the next sweep has synchronised its device
_RETIRED: list[tuple] = []

_data_ptr = torch.Tensor.data_ptr


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _sweep() -> None:
    """Drops the tables whose storages are not all alive and in place any more, then,
    while ``MAX_TABLES`` or more are left, the least recently used (retired: freed at the
    next sweep), but never a captured one (under ``_LOCK``)."""
    global _sweep_at
    uncaptured = [key for key, entry in _TABLES.items() if not entry.captured]
    stale = {key for key in uncaptured if _TABLES[key].freed()}
    live = sorted((key for key in uncaptured if key not in stale), key=lambda key: _TABLES[key].used)
    evicted = live[:len(live) - MAX_TABLES // 2] if len(live) >= MAX_TABLES else []  # ever new addresses
    devices = {key[0] for key in (*stale, *evicted)} | {device for device, _ in _RETIRED}
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)  # no kernel on any stream reads them any more
    _RETIRED.clear()
    for key in stale:
        del _TABLES[key]
    _RETIRED.extend((key[0], _TABLES.pop(key)) for key in evicted)
    _sweep_at = min(max(MIN_SWEEP, 2 * len(_TABLES)), MAX_TABLES)


def _layout(w: torch.Tensor, s: torch.Tensor) -> tuple:
    return tuple(w.shape), tuple(s.shape), s.stride(), s.dtype


def address_table(lists: tuple, device: torch.device) -> Table:
    """The cached :class:`Table` of the tensors of ``lists``: their addresses in a (sum
    of list lengths,) int64 tensor on ``device``, whether the weights' (lists 0 and 2)
    addresses are all 16-byte aligned (separate allocations always are; views into one
    tensor may not be), and the table's view over each list.

    Raises RuntimeError when the table does not exist yet and the current CUDA stream
    is capturing a graph."""
    lengths = tuple(map(len, lists))
    tensors = [t for ts in lists for t in ts]
    ptrs = tuple(map(_data_ptr, tensors))
    key = (device, lengths, ptrs)
    entry = _TABLES.get(key)
    if entry is not None:
        entry.used = next(_USES)
        if not entry.captured and _capturing(device):
            with _LOCK:  # a graph replays against it: never dropped (back in the cache if just evicted)
                entry.captured = True
                _TABLES[key] = entry
        return entry
    if _capturing(device):
        raise RuntimeError(
            "fp8_moe::grouped_experts_list: no address table for these expert tensors yet, and one cannot "
            "be built while a CUDA graph is being captured; run one eager call with the same weights "
            "before capturing (a replaced parameter needs one more eager call and a re-capture)")
    with _LOCK:
        entry = _TABLES.get(key)  # another thread may have just built it
        if entry is None:
            if len(_TABLES) >= _sweep_at:
                _sweep()
            table = torch.tensor(ptrs, dtype=torch.int64, device=device)
            g, gs, e = lengths[:3]
            aligned = all(p % 16 == 0 for p in ptrs[:g] + ptrs[g + gs:g + gs + e])
            entry = _TABLES[key] = Table(table, aligned, tensors, lengths)
    return entry


def _weights(w: torch.Tensor, s: torch.Tensor, E: int, w0: torch.Tensor, s0: torch.Tensor, aligned: bool,
             split: bool) -> WeightTable:
    gn, gk = s0.shape
    sn, sk = s0.stride()
    return WeightTable(w, s, (E, *w0.shape), gn, (0 if gn == 1 else sn, 0 if gk == 1 else sk),
                       s0.dtype == torch.float8_e8m0fnu, 16 if aligned else 1, split)


_PLANS: dict = {}  # signature -> plan state (plans.planned)


def grouped_experts_list(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                         down_scale_inv, block_size, activation="silu", gate_up_act_scale=None,
                         down_act_scale=None, swiglu_limit=None):
    """Whole expert forward on per-expert lists: hidden (T, H), top_k_index /
    top_k_weights (T, k) -> (T, H).  ``down_proj``: E (H, I) matrices;
    ``gate_up_proj``: E fused (2I, H) matrices, or 2E (I, H) (every gate, then every up);
    each with its scale grid in the matching ``*_scale_inv`` list.

    The launches are recorded as a plan (:mod:`.experts`) on the second call of a
    signature (:func:`.plans.planned`, as for the stacked ops): the metadata of
    the routing tensors and act scales, the other arguments' values, the list lengths,
    the first weight and scale grid of each list (the op's checks hold every expert to
    them) and whether the weights are 16-byte aligned; the address table is an input of
    the plan like any tensor.  At decode a replay is the first launch and a CUDA graph
    of the others, one per address table (layer), stream and thread (:mod:`.plans`)."""
    block = _block(block_size)
    E, G = len(down_proj), len(gate_up_proj)
    I = down_proj[0].shape[1]
    entry = address_table((gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv), hidden.device)
    aligned, parts = entry.aligned, entry.parts
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

    return planned(_PLANS, key, sources, hidden, forward, FED)
