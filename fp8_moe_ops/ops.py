"""The ``fp8_moe`` operator library: schemas, argument checks, registrations, fakes.

This is the one place that defines each op's contract (``docs/ops.md``).  The ops are
defined on a ``torch.library.Library`` (:func:`_define` says why not ``custom_op``).
Every op has

* a CPU kernel: the pure-torch reference (:mod:`fp8_moe_ops.reference`);
* a CUDA kernel: the Triton implementation (:mod:`fp8_moe_ops.kernels`);
* a fake kernel returning a contiguous tensor of the exact output shape and dtype.

All three run the same metadata checks (dtype, rank, shape agreement, block size vs.
scale grid), so a bad call fails the same way eagerly, under ``torch.compile`` and
under ``torch.export``.  Checks that need tensor *values* (offsets monotonic, scales
positive) run only on CPU, where they cost no device sync; on CUDA the kernels are
safe by construction (ids outside [0, E) are sentinels, offsets are clamped into [0, S]).

``fp8_moe::linear`` is an opaque op (not a ``triton_op``) on purpose: the graph pass
matches it in post-grad graphs, and a ``triton_op`` would be decomposed into its body
before post-grad passes run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as _forward_ad

from . import reference
from ._checks import (ACT_DTYPES, INDEX_DTYPES, SCALE_DTYPES, check_block_size, check_scale_values, check_sizes,
                      check_swiglu_limit, fail, keep_newest, meta_key, metadata_guard, shape_str)
from .functional import ACTIVATIONS, cdiv


_GEMM_TAIL = "SymInt[2] block_size, Tensor? act_scale=None, ScalarType? out_dtype=None) -> Tensor"
LINEAR_SCHEMA = "(Tensor x, Tensor w, Tensor w_scale_inv, " + _GEMM_TAIL
GROUPED_MM_SCHEMA = "(Tensor x, Tensor w, Tensor w_scale_inv, Tensor offsets, " + _GEMM_TAIL
BATCHED_MM_SCHEMA = "(Tensor x, Tensor w, Tensor w_scale_inv, Tensor expert_ids, " + _GEMM_TAIL
EXPERTS_SCHEMA = (
    "(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, "
    "Tensor gate_up_proj, Tensor gate_up_scale_inv, Tensor down_proj, Tensor down_scale_inv, "
    'SymInt[2] block_size, str activation="silu", Tensor? gate_up_act_scale=None, '
    "Tensor? down_act_scale=None, float? swiglu_limit=None) -> Tensor"
)


# --------------------------------------------------------------------------- checks


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a Tensor", type(t).__name__)


def _check_act(name: str, x: torch.Tensor, rank: int = 2) -> None:
    _check_tensor(name, x)
    if x.dtype not in ACT_DTYPES:
        fail(TypeError, name, "dtype bfloat16, float16 or float32", x.dtype)
    if x.dim() != rank:
        fail(ValueError, name, f"a {rank}-D tensor", shape_str(x))


def _check_weight(name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor, block_size: Sequence[int], experts: bool) -> None:
    """w (E?, N, K) e4m3 and its scale grid (E?, ceil(N/bn), ceil(K/bk)) or (E?, 1, 1)."""
    _check_tensor(name, w)
    _check_tensor(scale_name, scale)
    rank = 3 if experts else 2
    if w.dtype != torch.float8_e4m3fn:
        fail(TypeError, name, "dtype torch.float8_e4m3fn", w.dtype)
    if w.dim() != rank:
        fail(ValueError, name, f"a {rank}-D tensor ({'E, ' if experts else ''}N, K)", shape_str(w))
    if not w.is_contiguous():
        fail(ValueError, name, "a contiguous tensor (weights are never copied per call)", f"strides {w.stride()}")
    if scale.dtype not in SCALE_DTYPES:
        fail(TypeError, scale_name, "dtype torch.float32 or torch.float8_e8m0fnu", scale.dtype)
    bn, bk = check_block_size(block_size)
    N, K = w.shape[-2:]
    grid = (cdiv(N, bn), cdiv(K, bk))
    lead = tuple(w.shape[:-2])
    if tuple(scale.shape) not in (lead + grid, lead + (1, 1)):
        per_matrix = "" if grid == (1, 1) else f" or {lead + (1, 1)} (one scale per matrix)"
        fail(ValueError, scale_name,
             f"shape {lead + grid} (ceil of {name} (N, K) = {(N, K)} by block_size {[bn, bk]}){per_matrix}",
             shape_str(scale))


def _check_out_dtype(out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and out_dtype not in ACT_DTYPES:
        fail(TypeError, "out_dtype", "None, bfloat16, float16 or float32", out_dtype)


def _check_act_scale(name: str, s: torch.Tensor | None, E: int | None = None) -> None:
    """A static activation scale: one matrix's (``E`` None) of shape () or (1,); else one
    per expert, exactly (E,) (the kernels and the reference index it by expert: a 0-d
    scale at E = 1 would run on CUDA and fail on the CPU)."""
    if s is None:
        return
    _check_tensor(name, s)
    if s.dtype != torch.float32:
        fail(TypeError, name, "dtype torch.float32", s.dtype)
    if E is None:
        if s.numel() != 1 or s.dim() > 1:
            fail(ValueError, name, "one element (shape () or (1,))", shape_str(s))
    elif tuple(s.shape) != (E,):
        fail(ValueError, name, f"shape ({E},) (one scale per expert)", shape_str(s))


def _check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            fail(ValueError, name, f"a tensor on {first.device} (the device of {first_name})", t.device)


def _check_k(x_name: str, x: torch.Tensor, w_name: str, w: torch.Tensor) -> None:
    if x.shape[-1] != w.shape[-1]:
        fail(ValueError, x_name, f"last dim K = {w.shape[-1]} (from {w_name} (..., N, K))", shape_str(x))


def check_linear(x, w, w_scale_inv, block_size, act_scale=None, out_dtype=None) -> None:
    _check_act("x", x)
    _check_weight("w", w, "w_scale_inv", w_scale_inv, block_size, experts=False)
    _check_k("x", x, "w", w)
    _check_act_scale("act_scale", act_scale)
    _check_out_dtype(out_dtype)
    _check_same_device(x=x, w=w, w_scale_inv=w_scale_inv, act_scale=act_scale)


def _check_expert_gemm(x, w, w_scale_inv, block_size, act_scale, out_dtype) -> None:
    _check_act("x", x)
    _check_weight("w", w, "w_scale_inv", w_scale_inv, block_size, experts=True)
    _check_k("x", x, "w", w)
    E = w.shape[0]
    _check_act_scale("act_scale", act_scale, E)
    _check_out_dtype(out_dtype)


def check_grouped_mm(x, w, w_scale_inv, offsets, block_size, act_scale=None, out_dtype=None) -> None:
    _check_expert_gemm(x, w, w_scale_inv, block_size, act_scale, out_dtype)
    _check_tensor("offsets", offsets)
    if offsets.dtype != torch.int32:
        fail(TypeError, "offsets", "dtype torch.int32", offsets.dtype)
    if tuple(offsets.shape) != (w.shape[0],):
        fail(ValueError, "offsets", f"shape ({w.shape[0]},) (one inclusive cumsum per expert of w)", shape_str(offsets))
    _check_same_device(x=x, w=w, w_scale_inv=w_scale_inv, offsets=offsets, act_scale=act_scale)


def check_batched_mm(x, w, w_scale_inv, expert_ids, block_size, act_scale=None, out_dtype=None) -> None:
    _check_expert_gemm(x, w, w_scale_inv, block_size, act_scale, out_dtype)
    _check_tensor("expert_ids", expert_ids)
    if expert_ids.dtype not in INDEX_DTYPES:
        fail(TypeError, "expert_ids", "dtype torch.int32 or torch.int64", expert_ids.dtype)
    check_sizes("expert_ids", expert_ids.shape, (x.shape[0],),
                lambda: f"shape ({x.shape[0]},) (one expert per row of x)", expert_ids)
    _check_same_device(x=x, w=w, w_scale_inv=w_scale_inv, expert_ids=expert_ids, act_scale=act_scale)


def _check_routing(hidden, top_k_index, top_k_weights) -> None:
    """hidden (T, H), top_k_index (T, k) int, top_k_weights (T, k) float."""
    _check_act("hidden", hidden)
    T = hidden.shape[0]
    _check_tensor("top_k_index", top_k_index)
    _check_tensor("top_k_weights", top_k_weights)
    if top_k_index.dtype not in INDEX_DTYPES:
        fail(TypeError, "top_k_index", "dtype torch.int32 or torch.int64", top_k_index.dtype)
    if top_k_index.dim() != 2:
        fail(ValueError, "top_k_index", f"shape ({T}, top_k) (T from hidden)", shape_str(top_k_index))
    check_sizes("top_k_index", top_k_index.shape[:1], (T,), lambda: f"shape ({T}, top_k) (T from hidden)", top_k_index)
    if top_k_index.shape[1] == 0:
        fail(ValueError, "top_k_index", "top_k >= 1", shape_str(top_k_index))
    if not top_k_weights.is_floating_point() or top_k_weights.dtype not in ACT_DTYPES:
        fail(TypeError, "top_k_weights", "dtype bfloat16, float16 or float32", top_k_weights.dtype)
    check_sizes("top_k_weights", top_k_weights.shape, top_k_index.shape,
                lambda: f"shape {tuple(top_k_index.shape)} (that of top_k_index)", top_k_weights)


def _check_experts_options(E, activation, gate_up_act_scale, down_act_scale, swiglu_limit) -> None:
    if activation not in ACTIVATIONS:
        fail(ValueError, "activation", f"one of {ACTIVATIONS}", repr(activation))
    _check_act_scale("gate_up_act_scale", gate_up_act_scale, E)
    _check_act_scale("down_act_scale", down_act_scale, E)
    # typed as well as ranged: a direct call (call_experts) has no dispatcher to refuse a str
    check_swiglu_limit(swiglu_limit)


def check_experts(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                  block_size, activation, gate_up_act_scale, down_act_scale, swiglu_limit) -> None:
    _check_routing(hidden, top_k_index, top_k_weights)
    T, H = hidden.shape
    _check_weight("gate_up_proj", gate_up_proj, "gate_up_scale_inv", gate_up_scale_inv, block_size, experts=True)
    _check_weight("down_proj", down_proj, "down_scale_inv", down_scale_inv, block_size, experts=True)
    E, two_i, h_in = gate_up_proj.shape
    if two_i % 2:
        fail(ValueError, "gate_up_proj", "an even dim 1 (gate rows then up rows, 2 * I)", shape_str(gate_up_proj))
    if h_in != H:
        fail(ValueError, "gate_up_proj", f"shape (E, 2I, {H}) (H from hidden, of {shape_str(hidden)})",
             shape_str(gate_up_proj))
    if tuple(down_proj.shape) != (E, H, two_i // 2):
        fail(ValueError, "down_proj", f"shape {(E, H, two_i // 2)} (E, H, I from gate_up_proj and hidden)", shape_str(down_proj))
    _check_experts_options(E, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
    _check_same_device(
        hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights, gate_up_proj=gate_up_proj,
        gate_up_scale_inv=gate_up_scale_inv, down_proj=down_proj, down_scale_inv=down_scale_inv,
        gate_up_act_scale=gate_up_act_scale, down_act_scale=down_act_scale,
    )


def _check_offsets_values(offsets: torch.Tensor, rows: int) -> None:
    if offsets.numel() == 0:
        return
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[0]) < 0:
        fail(ValueError, "offsets", "a non-decreasing, non-negative inclusive cumsum", offsets.tolist())
    if int(offsets[-1]) > rows:
        fail(ValueError, "offsets", f"offsets[-1] <= {rows} (rows of x)", int(offsets[-1]))


# --------------------------------------------------------------------------- ops

def _kernels():
    # Imported on first CUDA call: the CPU paths need no Triton at import time.
    from . import kernels

    return kernels


def _refuse_backward(name: str):
    raise RuntimeError(f"{name} has no autograd formula (an inference op): run it under "
                       "torch.no_grad() or torch.inference_mode(), or keep it out of the backward pass")


def _refused_gradient_impl(grad: torch.Tensor, size: Sequence[int], dtype: torch.dtype, op: str) -> torch.Tensor:
    _refuse_backward(op)


# The gradient of an input of ``op`` that requires grad (``grad``: the gradient of op's
# output): raises when it runs.  The ops' backward formulas return it rather than
# raising themselves, so that a backward is refused where it runs: torch.compile traces
# the backward of a forward whose inputs require grad when it compiles that forward, and
# a formula that raised there would fail the compile of a forward that runs eagerly.  It
# takes ``grad`` so that it stays in the compiled backward (without a tensor input the
# partitioner moves it into the forward).
_refused_gradient = torch.library.custom_op(
    "fp8_moe::_refused_gradient", _refused_gradient_impl, mutates_args=(),
    schema="(Tensor grad, SymInt[] size, ScalarType dtype, str op) -> Tensor")


@_refused_gradient.register_fake
def _(grad, size, dtype, op):
    return grad.new_empty(size, dtype=dtype)


def _metas(inputs: Sequence) -> list:
    """(size, dtype) of each tensor of ``inputs``, None for the others: what a refused
    backward needs of them (the tensors themselves would be kept alive for it)."""
    return [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs]


def _refused_gradients(op: str, grad: torch.Tensor, metas: Sequence, needs_grad: Sequence[bool]) -> tuple:
    """A gradient per input (``metas``: :func:`_metas` of the inputs): a
    :data:`_refused_gradient` for each tensor that needs one, None for the others."""
    return tuple(torch.ops.fp8_moe._refused_gradient(grad, *meta, op) if needs else None
                 for meta, needs in zip(metas, needs_grad))


_LIB = torch.library.Library("fp8_moe", "FRAGMENT")  # the ops but _refused_gradient (it owns their registrations)
_KERNELS: dict[str, dict] = {}  # op name -> {device type: its kernel}, for call_experts and call_linear
_UNSEEN = object()


class _NoAutograd(torch.autograd.Function):
    """An op called with inputs that require grad: the forward runs as usual; a
    backward through it raises (the ops are inference-only) instead of producing a
    gradient through the quantisation."""

    @staticmethod
    def forward(ctx, op, keyset, n, *args):
        # args: the op's n arguments, then the tensors of its lists that require grad
        # (autograd does not see into lists: listed again, the output requires grad)
        ctx.name = op.name()
        ctx.metas = _metas((op, keyset, n, *args))
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args[:n])

    @staticmethod
    def backward(ctx, grad):
        return _refused_gradients(ctx.name, grad, ctx.metas, ctx.needs_input_grad)


def _refuse_tangents(op, args: tuple, tensor_lists: list) -> None:
    """Raises where an argument carries a forward-mode tangent (``torch.autograd.forward_ad``,
    ``torch.func.jvp``): the ops have no forward-mode formula, and their kernels would
    otherwise pass a tangent straight through the quantisation or drop it."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [t for i in tensor_lists for t in args[i]]
    if any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(f"{op.name()} has no forward-mode AD formula (an inference op): call it on tensors "
                           "without tangents (torch.autograd.forward_ad.unpack_dual(x).primal)")


def _without_autocast(cpu_impl):
    """``cpu_impl`` with CPU autocast off: the reference's float32 GEMMs are the ops'
    numerics (a float32 sum, each GEMM rounded once to its output dtype), which autocast
    would run in bf16 or fp16.  The CUDA kernels do not see autocast; compiled graphs
    run the op without it."""

    def cpu_kernel(*args):
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return cpu_impl(*args)
        return cpu_impl(*args)

    return cpu_kernel


def _on_its_device(cuda_impl):
    """``cuda_impl`` run with its first argument's GPU as the current device.  Triton
    launches on the current device, and a Python kernel on a Library gets no device guard
    from the dispatcher (torch's own CUDA kernels set the device from their arguments):
    without it a call on tensors of another GPU (a model spread over GPUs in one process,
    ``device_map="auto"``) would launch on the current one, at the other's addresses.
    (The ops' checks hold every tensor argument to that device.)"""

    def cuda_kernel(*args):
        index = args[0].get_device()
        if index != torch._C._cuda_getDevice():  # (torch.cuda.current_device() without its lazy-init check)
            with torch.cuda.device(index):
                return cuda_impl(*args)
        return cuda_impl(*args)

    return cuda_kernel


def _define(name: str, schema: str, cpu_impl, cuda_impl, fake):
    """Defines op ``fp8_moe::<name>`` on :data:`_LIB`: ``cpu_impl`` and ``cuda_impl``
    (called with the op's arguments positionally, trailing defaults possibly left out),
    ``fake``, and an autograd kernel that refuses backward.

    A ``torch.library.Library`` definition rather than ``custom_op``: ``custom_op``'s
    generic Python autograd wrapper, redispatch and output-aliasing check cost 10-14 µs
    of CPU per call on the H200 machine's host (a no-op op: 15-22 µs against 5.5-8.5 µs,
    ``bench/host_parts.py``), a third of a decode step's budget; the autograd kernel
    here costs about 3 µs (measured on the CPU machine).  Returns the op's packet."""
    _LIB.define(name + schema)
    op = getattr(torch.ops.fp8_moe, name).default
    cpu_impl, cuda_impl = _without_autocast(cpu_impl), _on_its_device(cuda_impl)
    tensor_lists = [i for i, a in enumerate(op._schema.arguments) if str(a.type) == "List[Tensor]"]
    backends = {torch._C.DispatchKey.CPU: cpu_impl, torch._C.DispatchKey.CUDA: cuda_impl}
    _KERNELS[name] = {"cpu": cpu_impl, "cuda": cuda_impl}
    # a dispatch key set (its raw representation) -> the kernel of backends the redispatch
    # below autograd would reach, or None (a mode, a subclass, a functorch transform, fake
    # tensors: redispatch); a few sets per process
    reached: dict[int, Callable | None] = {}

    def autograd_impl(keyset, *args):
        # the dispatcher passes every argument positionally (no schema has keyword-only ones);
        # _any_requires_grad does not look into the list op's Tensor[] arguments
        if _forward_ad._current_level >= 0:
            _refuse_tangents(op, args, tensor_lists)
        if torch.is_grad_enabled():
            lists = [args[i] for i in tensor_lists]
            if torch._C._any_requires_grad(*args) or any(torch._C._any_requires_grad(*a) for a in lists):
                if torch._C._functorch.maybe_current_level() is not None:
                    # torch.func.grad / vjp / jacrev: they differentiate now, and their
                    # transform cannot take the function from inside this kernel
                    raise RuntimeError(f"{op.name()} has no autograd formula (an inference op): torch.func "
                                       "transforms that differentiate it (grad, vjp, jacrev) are refused")
                listed = [t for a in lists for t in a if t.requires_grad]
                return _NoAutograd.apply(op, keyset, len(args), *args, *listed)
        # the key set's own lookup (an intersection and the highest key's enum, hashed)
        # costs 1.2 us of CPU more per call than its raw representation's (CPU machine)
        raw = keyset.raw_repr()
        impl = reached.get(raw, _UNSEEN)
        if impl is _UNSEEN:
            impl = reached[raw] = backends.get((keyset & torch._C._after_autograd_keyset).highestPriorityTypeId())
        if impl is not None:
            # the kernel the redispatch would reach, called without boxing the arguments
            # again (a Tensor[] of 1024 weights costs tens of microseconds per boxing)
            return impl(*args)
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    _LIB.impl(name, autograd_impl, "Autograd", with_keyset=True)
    _LIB.impl(name, cpu_impl, "CPU")
    _LIB.impl(name, cuda_impl, "CUDA")
    torch.library.register_fake(f"fp8_moe::{name}", fake, lib=_LIB)
    if tensor_lists:  # torch.func.vmap's own per-sample fallback cannot take a Tensor[]
        torch.library.register_vmap(f"fp8_moe::{name}", _per_sample(op), lib=_LIB)
    return getattr(torch.ops.fp8_moe, name)


def _per_sample(op):
    """A ``torch.func.vmap`` rule for ``op``: the op once per sample, its outputs stacked
    along dim 0 (what vmap's generic fallback does for the ops without a ``Tensor[]``)."""

    def rule(info, in_dims, *args):
        if info.batch_size == 0:
            raise ValueError(f"{op.name()}: torch.func.vmap over an empty batch (no sample to run the op on)")

        def sample(a, dim, b):
            if isinstance(a, (list, tuple)):
                dims = dim if isinstance(dim, (list, tuple)) else [dim] * len(a)
                return [sample(x, d, b) for x, d in zip(a, dims)]
            return a if dim is None else a.select(dim, b)

        outs = [op(*[sample(a, d, b) for a, d in zip(args, in_dims)]) for b in range(info.batch_size)]
        return torch.stack(outs), 0

    return rule


def _gemm_op(name: str, schema: str, check, ref_fn):
    """Defines one fp8 GEMM op (``linear``, ``grouped_mm``, ``batched_mm``): the CPU
    reference and the CUDA kernel behind the same checks, and a fake of shape (rows of
    x, N).  On CUDA the checks run on the first call of each argument metadata, and
    later calls of it replay the launches recorded on its second
    (``fp8_moe_ops.kernels.GemmPlans``, made on the first CUDA call), found through a
    C++ guard of the tensors' metadata.  ``check``'s signature is the op's, its defaults
    the schema's: the dispatcher may leave trailing arguments at their defaults out."""
    defaults = tuple(p.default for p in inspect.signature(check).parameters.values())

    def full(args: tuple) -> tuple:
        return args + defaults[len(args):] if len(args) < len(defaults) else args

    def cpu_impl(*args):
        args = full(args)
        check(*args)
        x, w_scale_inv, act_scale = args[0], args[2], args[-2]
        if name == "grouped_mm":
            _check_offsets_values(args[3], x.shape[0])
        check_scale_values("w_scale_inv", w_scale_inv)
        check_scale_values("act_scale", act_scale)
        return ref_fn(*args)

    plans = None  # the op's GemmPlans, made on its first CUDA call (Triton is imported then)

    def cuda_impl(*args):
        nonlocal plans
        if plans is None:
            plans = _kernels().GemmPlans(name, check)
        return plans(full(args))

    def fake(*args):
        args = full(args)
        check(*args)
        x, w, out_dtype = args[0], args[1], args[-1]
        return x.new_empty((x.shape[0], w.shape[-2]), dtype=out_dtype or x.dtype)

    return _define(name, schema, cpu_impl, cuda_impl, fake)


linear = _gemm_op("linear", LINEAR_SCHEMA, check_linear, reference.linear)
grouped_mm = _gemm_op("grouped_mm", GROUPED_MM_SCHEMA, check_grouped_mm, reference.grouped_mm)
batched_mm = _gemm_op("batched_mm", BATCHED_MM_SCHEMA, check_batched_mm, reference.batched_mm)


def _check_experts_values(gate_up_scale_inv, down_scale_inv, gate_up_act_scale, down_act_scale) -> None:
    check_scale_values("gate_up_scale_inv", gate_up_scale_inv)
    check_scale_values("down_scale_inv", down_scale_inv)
    check_scale_values("gate_up_act_scale", gate_up_act_scale)
    check_scale_values("down_act_scale", down_act_scale)


def _experts_op(name: str, schema: str, check, value_check, *, cuda_check=None):
    """Defines one whole-experts op (:func:`_define`): the CPU reference and the CUDA
    kernel behind ``check``, and a fake.  On CUDA the metadata checks run on the first
    call of each :func:`meta_key`, and its second call records the launches as a plan
    that later calls of the key replay (``fp8_moe_ops.kernels.StackedPlans``, made on
    the first CUDA call); or, given ``cuda_check``, every CUDA call runs it and goes to
    the kernel, which keeps its own plans.  The value checks run on CPU only."""
    plans = None  # the op's StackedPlans, made on its first CUDA call (Triton is imported then)

    def cpu_impl(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                 block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None):
        args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                block_size, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
        check(*args)
        value_check(gate_up_scale_inv, down_scale_inv, gate_up_act_scale, down_act_scale)
        return getattr(reference, name)(*args)

    def cuda_impl(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                  block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None):
        args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                block_size, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
        if cuda_check is not None:
            cuda_check(*args)
            return getattr(_kernels(), name)(*args)
        nonlocal plans
        if plans is None:
            plans = _kernels().StackedPlans(check)
        return plans(args)

    def fake(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
             block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None):
        check(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
              block_size, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)

    return _define(name, schema, cpu_impl, cuda_impl, fake)


grouped_experts = _experts_op("grouped_experts", EXPERTS_SCHEMA, check_experts, _check_experts_values)
batched_experts = _experts_op("batched_experts", EXPERTS_SCHEMA, check_experts, _check_experts_values)


# --------------------------------------------------------------------------- typed Python layer


class ExpertWeights(NamedTuple):
    """The weights and settings of one experts layer, in the experts ops' argument order
    (everything after the routing tensors), so callers never pass 9 arguments by position.

    gate_up_proj (E, 2I, H) e4m3 with gate_up_scale_inv (E, ceil(2I/bn), ceil(H/bk)) or
    (E, 1, 1); down_proj (E, H, I) e4m3 with down_scale_inv likewise; block_size (bn, bk);
    gate_up_act_scale / down_act_scale (E,) float32 for static activation scales."""

    gate_up_proj: torch.Tensor
    gate_up_scale_inv: torch.Tensor
    down_proj: torch.Tensor
    down_scale_inv: torch.Tensor
    block_size: Sequence[int]
    activation: str = "silu"
    gate_up_act_scale: torch.Tensor | None = None
    down_act_scale: torch.Tensor | None = None
    swiglu_limit: float | None = None


def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, weights: ExpertWeights,
            *, dispatch: str = "grouped") -> torch.Tensor:
    """The whole expert forward: ``torch.ops.fp8_moe.grouped_experts`` (``dispatch=
    "grouped"``) or ``batched_experts`` (``"batched"``) on ``weights``, through
    :func:`call_experts`.  hidden (T, H), top_k_index / top_k_weights (T, k) -> (T, H)."""
    if dispatch not in ("grouped", "batched"):
        fail(ValueError, "dispatch", "'grouped' or 'batched'", repr(dispatch))
    return call_experts(dispatch + "_experts", (hidden, top_k_index, top_k_weights, *weights))


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))  # None: an optional tensor not given
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
_tracing = torch._C._is_tracing
_any_requires_grad = torch._C._any_requires_grad


def call_experts(name: str, args: Sequence) -> torch.Tensor:
    """``torch.ops.fp8_moe.<name>(*args)`` for ``grouped_experts`` / ``batched_experts``
    (``args``: all twelve, in the schema's order); in a plain eager call straight to the
    kernel the dispatcher would reach for the arguments' device.  It dispatches where
    anything between would act: compiling, exporting or tracing; a torch function or
    dispatch mode, a functorch transform, a forward-AD level or the profiler active; a
    tensor subclass; grad enabled with an argument that requires it (the autograd kernel
    refuses backward).
    The kernel is the op's own, with its checks, so outputs and errors are the op's, but
    for what the dispatcher would convert (a numpy integer in ``block_size``, a bool or
    0-d tensor ``swiglu_limit``): here a ``TypeError`` naming the argument (docs/ops.md).
    Skipped, the dispatcher's boxing and autograd kernel cost 2.4-4.6 µs of CPU per call
    on the CPU machine (``bench/module_overhead.py``), 9.9-15.0 µs on the H200 machine's
    host (``bench/host_ab.py``).  The modules and the transformers
    plug-in call it, as nn.MultiheadAttention's fast path skips its general code; a
    ``torch.ops.fp8_moe`` call always dispatches."""
    h, i, w, gu, gus, d, ds, _, _, ga, da, _ = args
    if _nothing_to_dispatch(h, i, w, gu, gus, d, ds, ga, da):
        kernel = _KERNELS[name].get(h.device.type)
        if kernel is not None:
            return kernel(*args)
    return getattr(torch.ops.fp8_moe, name)(*args)


def call_linear(x, w, w_scale_inv, block_size, act_scale=None) -> torch.Tensor:
    """``torch.ops.fp8_moe.linear(x, w, w_scale_inv, block_size, act_scale)``, straight to
    the op's kernel for x's device in a plain eager call, as :func:`call_experts` for the
    experts ops (``FP8Linear`` calls it)."""
    if _nothing_to_dispatch(x, w, w_scale_inv, act_scale):
        kernel = _KERNELS["linear"].get(x.device.type)
        if kernel is not None:
            return kernel(x, w, w_scale_inv, block_size, act_scale)
    return torch.ops.fp8_moe.linear(x, w, w_scale_inv, block_size, act_scale)


def _nothing_to_dispatch(*tensors) -> bool:
    """Whether nothing between a caller and an op's kernel would act on a call with these
    tensors (None: an optional one not given)."""
    if torch.compiler.is_compiling() or _dispatch_modes() or _function_modes() or _transforms() or _profiling() \
            or _tracing() or _forward_ad._current_level >= 0:
        return False
    for t in tensors:  # a loop: any() over a generator costs more
        if type(t) not in _PLAIN:
            return False
        if type(t) is torch.Tensor and t.is_neg():
            # a negated view (its data unnegated, a dispatch key saying so): the dispatcher
            # resolves it, the CUDA kernels read memory.  (Parameters, a module's weights,
            # are not looked at: 0.08 us a tensor)
            return False
    return not (torch.is_grad_enabled() and _any_requires_grad(*tensors))


# --------------------------------------------------------------------------- per-expert weight lists

EXPERTS_LIST_SCHEMA = EXPERTS_SCHEMA.replace(
    "Tensor gate_up_proj, Tensor gate_up_scale_inv, Tensor down_proj, Tensor down_scale_inv",
    "Tensor[] gate_up_proj, Tensor[] gate_up_scale_inv, Tensor[] down_proj, Tensor[] down_scale_inv",
)


def _check_weight_list(name: str, ws, scale_name: str, scales, block_size, count: int) -> None:
    """``count`` (N, K) e4m3 matrices and their grids, all of one shape, dtype, device,
    layout and scale grid (the kernel reads every expert with the first one's strides)."""
    for n, v in ((name, ws), (scale_name, scales)):
        if len(v) != count:
            fail(ValueError, n, f"{count} tensors", f"{len(v)}")
    w0, s0 = ws[0], scales[0]
    _check_weight(f"{name}[0]", w0, f"{scale_name}[0]", s0, block_size, experts=False)
    _check_same_device(**{f"{name}[0]": w0, f"{scale_name}[0]": s0})
    w_meta = (w0.shape, w0.dtype, w0.device)
    s_meta = (s0.shape, s0.dtype, s0.device, s0.stride())
    for i in range(1, count):
        w, s = ws[i], scales[i]
        if (w.shape, w.dtype, w.device) != w_meta or not w.is_contiguous():
            _check_weight(f"{name}[{i}]", w, f"{scale_name}[{i}]", s, block_size, experts=False)
            fail(ValueError, f"{name}[{i}]",
                  f"shape {tuple(w0.shape)}, dtype {w0.dtype} on {w0.device} (those of {name}[0])",
                  f"shape {tuple(w.shape)}, dtype {w.dtype} on {w.device}")
        if (s.shape, s.dtype, s.device, s.stride()) != s_meta:
            fail(ValueError if s.dtype == s0.dtype else TypeError, f"{scale_name}[{i}]",
                  f"shape {tuple(s0.shape)}, strides {s0.stride()}, dtype {s0.dtype} on {s0.device} "
                  f"(those of {scale_name}[0])",
                  f"shape {tuple(s.shape)}, strides {s.stride()}, dtype {s.dtype} on {s.device}")


def check_experts_list(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj,
                       down_scale_inv, block_size, activation, gate_up_act_scale, down_act_scale,
                       swiglu_limit) -> None:
    _check_routing(hidden, top_k_index, top_k_weights)
    H = hidden.shape[1]
    if not down_proj:
        fail(ValueError, "down_proj", "a non-empty list (one (H, I) matrix per expert)", "[]")
    E = len(down_proj)
    _check_weight_list("down_proj", down_proj, "down_scale_inv", down_scale_inv, block_size, E)
    h_out, I = down_proj[0].shape
    if h_out != H:
        fail(ValueError, "down_proj[0]", f"shape ({H}, I) (H from hidden, of {shape_str(hidden)})",
             shape_str(down_proj[0]))
    if len(gate_up_proj) not in (E, 2 * E):
        fail(ValueError, "gate_up_proj", f"{E} fused (2I, H) tensors or {2 * E} separate (I, H) "
              f"(E = {E} from down_proj)", f"{len(gate_up_proj)}")
    count = len(gate_up_proj)
    _check_weight_list("gate_up_proj", gate_up_proj, "gate_up_scale_inv", gate_up_scale_inv, block_size, count)
    want = (2 * I, H) if count == E else (I, H)
    if tuple(gate_up_proj[0].shape) != want:
        fail(ValueError, "gate_up_proj[0]",
              f"shape {want} ({'fused gate and up' if count == E else 'the gate, up separate'}; "
              "H from hidden, I from down_proj)", shape_str(gate_up_proj[0]))
    _check_experts_options(E, activation, gate_up_act_scale, down_act_scale, swiglu_limit)
    _check_same_device(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                       gate_up_proj=gate_up_proj[0], down_proj=down_proj[0], gate_up_act_scale=gate_up_act_scale,
                       down_act_scale=down_act_scale)


def _check_experts_list_values(gate_up_scale_inv, down_scale_inv, gate_up_act_scale, down_act_scale) -> None:
    for name, scales in (("gate_up_scale_inv", gate_up_scale_inv), ("down_scale_inv", down_scale_inv)):
        for i, s in enumerate(scales):
            check_scale_values(f"{name}[{i}]", s)
    check_scale_values("gate_up_act_scale", gate_up_act_scale)
    check_scale_values("down_act_scale", down_act_scale)


class ListChecks:
    """``check_experts_list`` on CUDA calls, its per-tensor part run once per metadata.

    The lists hold 4E to 6E tensors (1024 at deepseek_v3's E = 256): their checks cost
    about 0.5 µs a tensor in Python, and so would a Python key of every tensor's
    metadata.  So the key here holds what the lists are checked against: hidden's
    trailing shape and device, the list lengths and the other arguments but the routing
    tensors (:func:`meta_key`).  It maps to C++ guards (:func:`metadata_guard`) of the
    last few sets of lists that passed every check under it (a few: one model may call
    with Parameters in one layer and plain tensors in another, and a guard costs about
    as much to build as the checks).  A call whose list tensors pass one of them has
    every list tensor's dtype, device, shape and strides equal to checked ones, so only
    the routing tensors' checks (which change with the token count) run again; any
    other call runs every check (raising as ever) and keeps a guard of its tensors.
    Where torch offers no such guard, every call runs every check."""

    GUARDS_PER_KEY = 4
    MAX_KEYS = 256  # cleared when full (a model has a handful)

    def __init__(self, check):
        self._check = check
        # (hidden's trailing shape and device, list lengths, meta_key of the rest) -> guards, newest last
        self._guards: dict[tuple, list] = {}

    def __call__(self, *args) -> None:
        hidden, top_k_index, top_k_weights = args[:3]
        lists = args[3:7]
        tensors = [*lists[0], *lists[1], *lists[2], *lists[3]]
        key = (hidden.shape[1:], hidden.device, *map(len, lists), meta_key(args[7:]))
        try:
            guards = self._guards.get(key, ())
        except TypeError:  # an unhashable argument: the checks name it
            self._check(*args)
            raise
        for guard in reversed(guards):
            if guard(*tensors):
                _check_routing(hidden, top_k_index, top_k_weights)
                _check_same_device(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights)
                return
        self._check(*args)
        guard = metadata_guard(tensors)
        if guard is not None:
            keep_newest(self._guards, key, guard, self.GUARDS_PER_KEY, self.MAX_KEYS)


grouped_experts_list = _experts_op("grouped_experts_list", EXPERTS_LIST_SCHEMA, check_experts_list,
                                   _check_experts_list_values, cuda_check=ListChecks(check_experts_list))
