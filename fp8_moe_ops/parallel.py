"""Expert parallelism: each rank holds E/world experts; routed slots travel to them and back.

Data flow of :class:`ExpertParallel` on every rank (S = T_r * k slots; see docs/parallel.md):

1. The owner of expert ``e`` is rank ``e // E_local``.  Each token is sent once to each
   rank that owns at least one of its experts (not once per slot): a row of its k
   local expert ids on that rank as int32, -1 for the slots elsewhere, followed by its
   activations (as bytes: gloo has no bfloat16 or fp8 all-to-all).  Rows are
   ordered by destination rank, then token.  The receiver copies the ids of its rows out
   whole (the row stride, 4k + H * itemsize bytes, need not be a multiple of 4).
2. ``all_to_all_single`` of the (rows, slots) counts per rank; one host sync turns them
   into split sizes.  Then ``all_to_all_single`` of the rows.
3. The receiver expands the rows into its valid slots, in (source, token, choice)
   order, and runs ``torch.ops.fp8_moe.grouped_experts`` on them with top_k = 1 and
   weight 1.0: its output is each slot's down projection rounded to the activation
   dtype, exactly (a float32 product by 1.0 and one rounding of a value that is
   already in the activation dtype change nothing).
4. ``all_to_all_single`` sends the per-slot outputs back; the source puts them in slot
   order (they arrive by rank, token, choice: the stable sort of the slots by owner) and
   ``routing.combine`` weights and sums them in float32 in ascending expert id and
   rounds once: the single-process ``FP8Experts`` numerics (on CUDA with the
   single-GPU op's own combine kernel).

Under ``torch.compile`` the transport (steps 2-4: split sizes are data) runs as an
eager island (``torch.compiler.disable``); the packing before it and the combine after
it have shapes that depend on T_r, k and the world size only and compile.

Like the ops it calls, it is inference-only: with inputs that require grad its output
does too, and a backward through it raises (the bytes sent between ranks carry no
autograd graph, so a gradient would otherwise reach the routing weights alone, and on
CUDA, whose combine is a kernel, not even those).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import nn

from . import ops
from ._checks import ACT_DTYPES, fail
from .modules import FP8Experts
from .routing import combine

__all__ = ["ExpertParallel", "shard_experts"]

_PARAMS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv",
           "gate_up_proj_activation_scale", "down_proj_activation_scale")


def shard_experts(experts: FP8Experts, rank: int, world_size: int) -> FP8Experts:
    """The experts ``[rank * E/world_size, (rank + 1) * E/world_size)`` of ``experts``.

    Weights, weight scales and static activation scales are sliced along the expert
    dimension and copied (so the full module's storage can be freed); every other
    setting (block size, activation, scheme, dispatch, swiglu limit) is kept.

    The shard remembers its ``(rank, world_size)``: :class:`ExpertParallel` refuses it on
    another rank or in a group of another size.

    Raises:
        TypeError: ``experts`` is not an ``FP8Experts``, or ``rank`` / ``world_size`` not
            an integer (Python's or numpy's; not bool).
        ValueError: ``world_size`` < 1, ``rank`` outside [0, world_size), or E not a
            multiple of ``world_size``.
    """
    if not isinstance(experts, FP8Experts):
        raise TypeError(f"experts: expected an FP8Experts, got {type(experts).__name__}")
    world_size = _integer(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    rank = _integer(rank, "rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    E = experts.num_experts
    if E % world_size:
        raise ValueError(f"world_size: expected a divisor of num_experts={E}, got {world_size}")
    n = E // world_size
    lo = rank * n
    local = FP8Experts(n, experts.hidden_size, experts.intermediate_size, experts.block_size, experts.activation,
                       experts.activation_scheme, experts.dispatch, experts.gate_up_proj_scale_inv.dtype,
                       experts.swiglu_limit, device="meta")
    for name in _PARAMS:
        full = getattr(experts, name)
        if full is not None:
            setattr(local, name, nn.Parameter(full.detach()[lo:lo + n].clone(), requires_grad=False))
    local._shard = (rank, world_size)
    return local


def _integer(value, name: str) -> int:
    """``value`` as a Python int: an int or any other integer (numpy's), not a bool (nor
    a tensor, whose ``__index__`` takes a one-element bool tensor too)."""
    if not isinstance(value, (bool, torch.Tensor)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    fail(TypeError, name, "an int", f"{type(value).__name__} {value!r}")


class ExpertParallel(nn.Module):
    """Runs this rank's tokens through experts spread over the ranks of ``group``.

    Args:
        local_experts: this rank's ``FP8Experts`` (``shard_experts(full, rank, world)``),
            holding global experts ``[rank * E_local, (rank + 1) * E_local)``.
        num_experts: E, the global number of experts (``E_local * world_size``).
        group: the process group (``None``: the default group).  Every rank of the group
            must call ``forward`` the same number of times (it is collective), each with
            its own tokens; NCCL needs the tensors on the rank's current CUDA device.

    ``forward(hidden_states (T_r, H), top_k_index (T_r, k) global expert ids,
    top_k_weights (T_r, k)) -> (T_r, H)``, in the dtype of ``hidden_states``, equal to the
    full single-process ``FP8Experts`` on the same tokens up to float32 summation order.
    T_r may differ between ranks and be 0.  Ids outside [0, num_experts) are sentinels:
    they are not sent anywhere and contribute exactly 0.
    """

    def __init__(self, local_experts: FP8Experts, num_experts: int, group=None):
        super().__init__()
        if not isinstance(local_experts, FP8Experts):
            raise TypeError(f"local_experts: expected an FP8Experts, got {type(local_experts).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: expected an initialised torch.distributed process group, got none "
                             "(call torch.distributed.init_process_group first)")
        # (new_group gives a process outside the group a marker instead: refused below)
        if group is not None and not isinstance(group, dist.ProcessGroup) \
                and not (type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER):
            raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"group: expected a process group this process belongs to, got one without it "
                             f"(global rank {dist.get_rank()})")
        self.num_experts = _integer(num_experts, "num_experts")
        self.group = group
        self._layout_rows: dict = {}  # (its values, device) -> _layout_row
        self._check_local(local_experts)
        self.local_experts = local_experts

    def _check_local(self, local_experts: FP8Experts) -> None:
        """Raises where ``local_experts`` cannot be this rank's shard of ``num_experts``:
        another expert count, or (a shard of :func:`shard_experts`) another rank's."""
        if self.num_experts != local_experts.num_experts * self.world_size:
            raise ValueError(f"num_experts: expected local_experts.num_experts * world_size = "
                             f"{local_experts.num_experts} * {self.world_size}, got {self.num_experts!r}")
        shard = getattr(local_experts, "_shard", None)
        if shard is not None and shard != (self.rank, self.world_size):
            raise ValueError(f"local_experts: expected this rank's shard, shard_experts(experts, {self.rank}, "
                             f"{self.world_size}), got shard_experts(experts, {shard[0]}, {shard[1]})")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self._check(hidden_states, top_k_index, top_k_weights)
        if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
            out = self._forward(hidden_states.detach(), top_k_index, top_k_weights.detach())
            return _InferenceOnly.apply(out, hidden_states, top_k_weights)
        return self._forward(hidden_states, top_k_index, top_k_weights)

    def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape
        world, n_local = self.world_size, self.local_experts.num_experts
        ids = top_k_index.long()
        owner = torch.where((ids >= 0) & (ids < self.num_experts), ids // n_local, world)  # (T, k); world: nowhere
        ranks = torch.arange(world, device=ids.device)
        hit = (owner[None] == ranks[:, None, None]).any(-1)  # (world, T): token t has a slot on rank r
        # rows: (world*T,) sorted position -> r * T + t, the hits first, by rank then token
        rows = torch.sort(torch.where(hit, ranks[:, None], world).flatten(), stable=True).indices
        row_rank, row_tok = rows // max(T, 1), rows % max(T, 1)
        # each row carries its token's local expert ids on that rank, -1 for the other slots
        local = torch.where(owner[row_tok] == row_rank[:, None], ids[row_tok] - row_rank[:, None] * n_local, -1)
        # the int32 ids first (the receiver copies them out of its rows: see the module doc)
        payload = torch.cat([_as_bytes(local.to(torch.int32)), _as_bytes(hidden_states[row_tok])], dim=1)
        counts = torch.stack([hit.sum(1), (owner.reshape(1, -1) == ranks[:, None]).sum(1)], dim=1)  # (world, 2)
        # and what every rank must agree on to read the others' rows (checked on receipt)
        counts = torch.cat([counts, self._layout_row(hidden_states.dtype, k, counts.device).expand(world, -1)], dim=1)
        y_sorted = self._remote_experts(payload, counts, hidden_states.dtype, k)  # (T*k, H)
        # the results come back by rank, token, choice: the stable sort of the slots by owner
        slot_perm = torch.sort(owner.flatten(), stable=True).indices
        y_slots = torch.empty_like(y_sorted).index_copy_(0, slot_perm, y_sorted)  # slot order
        return _combine(y_slots, top_k_index, top_k_weights, self.num_experts, hidden_states.dtype)

    @torch.compiler.disable
    def _remote_experts(self, payload: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype,
                        k: int) -> torch.Tensor:
        """Sends each rank its rows of ``payload`` (k int32 local ids, then token bytes),
        serves the rows received with the local experts, one output row per local slot,
        and returns the outputs of this rank's valid slots by (rank, token, choice),
        followed by unset rows for the sentinel slots: (T*k, H)."""
        world = self.world_size
        H = self.local_experts.hidden_size
        id_bytes = 4 * k
        # counts[r] = (rows, slots) this rank sends to rank r; recv_counts[s]: what s sends here
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        sizes = torch.cat([counts, recv_counts]).tolist()  # the one host sync: split sizes are ints
        self._check_layouts(sizes[0][2:], [c[2:] for c in sizes[world:]])  # this rank's own, every sender's
        send_rows, send_slots = [c[0] for c in sizes[:world]], [c[1] for c in sizes[:world]]
        recv_rows, recv_slots = [c[0] for c in sizes[world:]], [c[1] for c in sizes[world:]]

        recv = payload.new_empty((sum(recv_rows), payload.shape[1]))
        dist.all_to_all_single(recv, payload[:sum(send_rows)], recv_rows, send_rows, group=self.group)

        # the received slots in (source, token, choice) order: the valid ids first, stably
        # (flattened first: a copy, or one row's view, whose row stride then cannot matter)
        local = recv[:, :id_bytes].reshape(-1).view(torch.int32)
        slot = torch.sort((local < 0).to(torch.uint8), stable=True).indices[:sum(recv_slots)]
        x = recv[:, id_bytes:][slot // k].view(dtype)
        y = self._serve(x, local[slot])

        y_sorted = torch.empty((payload.shape[0] // world * k, H), dtype=dtype, device=payload.device)
        dist.all_to_all_single(_as_bytes(y_sorted[:sum(send_slots)]), _as_bytes(y), send_slots, recv_slots,
                               group=self.group)
        return y_sorted

    # what a received row's bytes mean, as (the argument that sets it, what it is)
    _LAYOUT = (("top_k_index", "top_k"), ("hidden_states", "dtype"), ("local_experts", "num_experts"),
               ("local_experts", "hidden_size"))

    def _layout(self, dtype: torch.dtype, k: int) -> list[int]:
        """This rank's :data:`_LAYOUT` values as ints (the dtype by its place in ACT_DTYPES)."""
        return [k, ACT_DTYPES.index(dtype), self.local_experts.num_experts, self.local_experts.hidden_size]

    def _layout_row(self, dtype: torch.dtype, k: int, device: torch.device) -> torch.Tensor:
        """:meth:`_layout` as a (1, 4) int64 tensor on ``device``, made once per its values
        and device (a replaced ``local_experts`` has its own): a copy to a GPU each call would
        wait for the stream.  (Compiled: a constant of the graph.)"""
        values = self._layout(dtype, k)
        if torch.compiler.is_compiling():
            return torch.tensor([values], device=device)
        key = (tuple(values), device)
        row = self._layout_rows.get(key)
        if row is None:
            row = self._layout_rows[key] = torch.tensor([values], device=device)
        return row

    def _check_layouts(self, mine: list, layouts: list) -> None:
        """Raises where a rank's rows are laid out otherwise than this rank's (every rank
        sees a rank that differs from it, so all raise together: none waits in a collective)."""
        for source, theirs in enumerate(layouts):
            for (name, what), a, b in zip(self._LAYOUT, mine, theirs):
                if a != b:
                    if what == "dtype":
                        a, b = ACT_DTYPES[a], ACT_DTYPES[b]
                    raise ValueError(f"{name}: expected the {what} of every rank's call, {a} on rank {self.rank} "
                                     f"(this one), got {b} on rank {source}")

    def _serve(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The local experts on received rows x (n, H), one local expert id each: each
        row's down projection rounded to x's dtype (top_k = 1, weight 1.0: exact)."""
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if self.local_experts._observer is not None:  # calibrate_static_scales: the module records its inputs
            return self.local_experts(x, local_ids[:, None], ones)
        return torch.ops.fp8_moe.grouped_experts(x, local_ids[:, None], ones, *self.local_experts.expert_weights())

    def _calibration_maxima(self, observer: torch.Tensor) -> tuple[tuple[int, int] | None, torch.Tensor]:
        """What ``calibrate_static_scales`` needs of the whole layer from this rank's
        observer (2, E_local) of the local experts' input maxima, reduced over the group
        (a collective: every rank calls it for its layers in the same order): the first
        (projection, global expert) whose maximum is not finite on any rank, or None; and
        the largest maximum of each projection over all experts (2,), for an expert that
        saw no token."""
        E = self.num_experts
        bad = ~torch.isfinite(observer)
        code = torch.full((1,), 2 * E, dtype=torch.int64, device=observer.device)
        if bad.any():
            proj, expert = (int(i) for i in bad.nonzero()[0])
            code.fill_(proj * E + self.rank * self.local_experts.num_experts + expert)
        seen = observer.amax(dim=-1)
        dist.all_reduce(code, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        code = int(code)
        return (None if code == 2 * E else divmod(code, E)), seen

    @staticmethod
    def _any_rank_failed(layers: list, failed: bool) -> bool:
        """Whether ``failed`` holds on any rank that the groups of ``layers`` (the
        ``ExpertParallel`` modules of a model, in module order) connect, through one
        all-reduce per distinct group, in W rounds for the W ranks of the default group
        (collectives every rank makes; a few small ones per rank and group, once per
        calibration): a calibration that one rank refuses is refused by all of them, so
        that none goes on with static scales the others lack."""
        groups = []  # (group, a device of its layer)
        for layer in layers:
            if not any(g is layer.group for g, _ in groups):
                groups.append((layer.group, layer.local_experts.gate_up_proj.device))
        # each rank hands on what it has heard so far, over every group, in as many rounds as
        # there are ranks: a refusal then crosses any chain of overlapping groups (one
        # layer's pairs, another's shifted pairs: a ring) to every rank they connect
        for _ in range(dist.get_world_size()):
            for group, device in groups:
                flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                failed = failed or bool(flag)
        return failed

    def _check(self, hidden_states, top_k_index, top_k_weights) -> None:
        """The checks of ``FP8Experts.forward`` (dtypes, shapes, top_k >= 1, the local
        experts' device), for 2-D hidden states; and that ``local_experts`` (an attribute
        that may have been replaced since construction) is still this rank's shard."""
        if not isinstance(self.local_experts, FP8Experts):
            raise TypeError(f"local_experts: expected an FP8Experts, got {type(self.local_experts).__name__}")
        self._check_local(self.local_experts)
        if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() != 2:
            H = self.local_experts.hidden_size
            raise ValueError(f"hidden_states: expected a 2-D (T, {H}) tensor, got shape {tuple(hidden_states.shape)}")
        self.local_experts._check_inputs(hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, rank={self.rank}, world_size={self.world_size}"


class _InferenceOnly(torch.autograd.Function):
    """``out``, computed without autograd from ``hidden_states`` and ``top_k_weights``
    that require grad: the output requires grad too, and a backward through it raises,
    as through the single-process ops."""

    @staticmethod
    def forward(ctx, out, hidden_states, top_k_weights):
        ctx.metas = ops._metas((out, hidden_states, top_k_weights))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return ops._refused_gradients("ExpertParallel", grad, ctx.metas, ctx.needs_input_grad)


def _combine(y, top_k_index, top_k_weights, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``routing.combine``; eagerly on CUDA the single-GPU op's own combine kernel, which
    sums term by term the same way in one pass (the torch version makes about 2k passes
    over (T, H) float32, milliseconds at large T; compiled, Inductor fuses it)."""
    if not y.is_cuda or torch.compiler.is_compiling() or y.shape[0] == 0:
        return combine(y, top_k_index, top_k_weights, num_experts, out_dtype)
    from .kernels.combine import combine as combine_kernel

    out = torch.empty((top_k_index.shape[0], y.shape[1]), dtype=out_dtype, device=y.device)
    return combine_kernel(y, top_k_index, top_k_weights, num_experts, out)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense (rows, cols) tensor as (rows, cols * itemsize) uint8: every backend moves
    bytes (gloo has no bfloat16/fp8 all-to-all); the split sizes stay in rows.  An empty
    one as a new empty tensor (its strides, say a (0, 1) ``torch.where`` result's 0, need
    not allow a view; there is nothing to read or write)."""
    if t.numel() == 0:
        return t.new_empty((t.shape[0], t.shape[1] * t.element_size()), dtype=torch.uint8)
    return t.view(torch.uint8)
