"""``FP8Linear`` and ``FP8Experts``: modules holding fp8 weights, calling ``torch.ops.fp8_moe``.

Their parameters use the attribute names of transformers' FineGrainedFP8 layers
(``weight_scale_inv``, ``gate_up_proj_scale_inv``, ``*_activation_scale``) so that
checkpoints map one to one (but for a gate_up grid at ``bn/2 < I < bn``, which transformers
reads as separate gate and up halves: docs/integrations.md).  Static activation scales are set by
:func:`fp8_moe_ops.calibrate_static_scales` or loaded from a checkpoint.

Both modules check what they are given as the ops do -- a ``TypeError`` or
``ValueError`` naming the argument (or state-dict key), with expected and got -- at
construction, on assignment of ``activation_scheme`` / ``dispatch`` / ``activation`` /
``swiglu_limit`` or of a parameter, in ``forward`` and in ``load_state_dict``, so misuse
never runs silently.  What shapes the weights (sizes, ``block_size``) is fixed at construction.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from . import ops
from ._checks import (
    ACT_DTYPES,
    INDEX_DTYPES,
    check_block_size,
    check_choice,
    check_positive_int,
    check_scale_dtype,
    check_scale_values,
    check_sizes,
    check_swiglu_limit,
    fail,
    keep_newest,
    metadata_guard,
    shape_str,
)
from .functional import ACTIVATIONS, cdiv, gated_activation
from .quantization import quantize_named

SCHEMES = ("dynamic", "static")
DISPATCHES = ("eager", "grouped", "batched")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _scale_grid(rows: int, cols: int, block_size: Sequence[int]) -> tuple[int, int]:
    return cdiv(rows, block_size[0]), cdiv(cols, block_size[1])


def _fixed(name: str) -> property:
    """A construction argument that shapes the weights: set once by ``__init__``, then
    read-only (a new value would not match the weights; ``block_size`` reads as a copy,
    the module's own code reads ``_block_size``)."""
    attr = "_" + name

    def get(self):
        try:
            value = self.__dict__[attr]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None
        return list(value) if isinstance(value, list) else value

    def set(self, value) -> None:
        current = self.__dict__.get(attr)
        if current is None:
            self.__dict__[attr] = value
        elif (list(value) if isinstance(value, (list, tuple)) else value) != current:
            fail(AttributeError, name, f"{current} (fixed at construction by the weights' layout; build a new "
                 f"{type(self).__name__} for another)", repr(value))

    return property(get, set, doc=f"``{name}``, fixed at construction.")


def _check_activations(name: str, x: object, last_dim: int, last_dim_name: str) -> None:
    if not isinstance(x, torch.Tensor):
        fail(TypeError, name, "a Tensor", type(x).__name__)
    if x.dtype not in ACT_DTYPES:
        fail(TypeError, name, "dtype bfloat16, float16 or float32", x.dtype)
    if x.dim() < 1 or x.shape[-1] != last_dim:
        fail(ValueError, name, f"shape (..., {last_dim}) (last dim = {last_dim_name})", shape_str(x))


class _CheckedStateDict:
    """A parameter replaced (``module.gate_up_proj = nn.Parameter(...)``) or loaded
    (``load_state_dict``) must keep its dtype and shape (nn.Module would cast a float
    weight to fp8 silently on load), weights must be contiguous and scales finite and
    positive: a ``TypeError`` / ``ValueError`` names the attribute or key.  An optional
    parameter that is unset (static scales under the dynamic scheme, a bias) is checked
    against what the module would hold (:meth:`_optional`); a static scale cannot be
    unset while the scheme is static, nor the scheme set static before they exist
    (``activation_scheme``).  A module pickled whole (``torch.save(module)``)
    before its settings became properties loads too.  Dtype casts of a whole model leave
    the parameters' dtypes alone (:meth:`_apply`)."""

    _PROPERTIES: tuple[str, ...] = ()  # settings stored as ``_<name>`` behind a property since 2026-12-04
    _STATIC_SCALES: tuple[str, ...] = ()  # the parameters the static scheme reads

    def _optional(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """(dtype, shape) of ``name`` if it is an optional parameter, else None."""
        return None

    @property
    def activation_scheme(self) -> str:
        return self._activation_scheme

    @activation_scheme.setter
    def activation_scheme(self, value: str) -> None:
        check_choice("activation_scheme", value, SCHEMES)
        if value == "static":
            _check_static_ready(self, self._STATIC_SCALES)
        self._activation_scheme = value

    def _apply(self, fn, recurse: bool = True):
        """``model.half()`` / ``model.to(torch.bfloat16)`` cast every floating parameter, the
        fp8 weights and float32 scales too: here they keep their dtypes (the activations'
        dtype is the input's) and move devices as asked."""

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            # where fn casts, asked of an empty tensor first: cast and dropped, a stacked fp8
            # weight cost twice its size (in bf16) and, moved too, two copies to the device
            probe = fn(t.new_empty(0))
            return fn(t) if probe.dtype == t.dtype else t.to(probe.device)

        return super()._apply(keep_dtype, recurse)

    def _tensor(self, name: str) -> torch.Tensor | None:
        # a parameter through nn.Module.__getattr__ costs about 0.7 us of CPU, and a call reads
        # several; a parametrised or unset one is found by the usual lookup
        t = self._parameters.get(name)
        return t if t is not None else getattr(self, name)

    def __setstate__(self, state: dict) -> None:
        for name in self._PROPERTIES:
            if name in state and "_" + name not in state:
                state["_" + name] = state.pop(name)
        super().__setstate__(state)

    def _check_replacement(self, key: str, name: str, value: object, becomes_param: bool = True) -> None:
        """``value`` in place of parameter ``name`` (``key``: how the caller named it);
        ``becomes_param``: the tensor itself is the new parameter (else its values are
        copied into the parameter's)."""
        param = self._parameters.get(name)
        dtype, shape = (param.dtype, tuple(param.shape)) if param is not None else self._optional(name)
        what = f"that of {type(self).__name__}.{name}"
        if not isinstance(value, torch.Tensor):
            fail(TypeError, key, "a Tensor", type(value).__name__)
        if name == "bias":  # any float dtype: the forward adds it in the activations' dtype
            if value.dtype not in ACT_DTYPES:
                fail(TypeError, key, f"dtype float32, bfloat16 or float16 ({what})", value.dtype)
        elif value.dtype != dtype:
            fail(TypeError, key, f"dtype {dtype} ({what})", value.dtype)
        if tuple(value.shape) != shape:
            fail(ValueError, key, f"shape {shape} ({what})", shape_str(value))
        if becomes_param and value.dtype == torch.float8_e4m3fn and not value.is_contiguous():
            fail(ValueError, key, "a contiguous tensor (weights are never copied per call)", f"strides {value.stride()}")
        if name.endswith(("_scale_inv", "activation_scale")) and value.device.type != "meta":
            check_scale_values(key, value)  # once per replacement; a forward on CUDA checks no values

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        if params is not None:  # (nn.Module.__init__ has run)
            if value is not None:
                if params.get(name) is not None or self._optional(name) is not None:
                    self._check_replacement(name, name, value)
            elif name in self._STATIC_SCALES and self.__dict__.get("_activation_scheme") == "static":
                fail(ValueError, name, "a tensor while activation_scheme is 'static' (set activation_scheme = "
                     "'dynamic' first)", "None")
            elif params.get(name) is not None and self._optional(name) is None:
                fail(ValueError, name, "a tensor (a weight or weight scale every forward reads)", "None")
        super().__setattr__(name, value)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        assign = local_metadata.get("assign_to_params_buffers", False)  # load_state_dict(..., assign=True)
        for name, param in self._parameters.items():
            if param is not None and prefix + name in state_dict:
                self._check_replacement(prefix + name, name, state_dict[prefix + name], assign)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _check_static_ready(module: nn.Module, names: Sequence[str]) -> None:
    missing = [n for n in names if getattr(module, n, None) is None]
    if missing:
        fail(ValueError, "activation_scheme",
             f"'dynamic' until the static scales {missing} exist (calibrate_static_scales sets them)", "'static'")


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """The largest |t| as a float32 scalar, 0 for an empty t (a calibration observer's
    update): a zero is appended rather than branching on ``t.numel()``, which a compile
    whose row count is data-dependent (the graph pass's settings) cannot evaluate."""
    return F.pad(t.detach().reshape(-1).float().abs(), (0, 1)).amax()


class FP8Linear(_CheckedStateDict, nn.Module):
    """A linear layer with block-quantised fp8 weights: ``y = x @ W^T (+ bias)``.

    Attributes:
        weight: (out_features, in_features) ``float8_e4m3fn``.
        weight_scale_inv: (ceil(out/bn), ceil(in/bk)) float32 or UE8M0.
        activation_scale: (1,) float32, static scheme only (else ``None``).
        bias: (out_features,) float32 (an assigned or ``assign=True``-loaded one may be bf16 / fp16), or ``None``.

    ``forward`` takes (..., in_features) in bf16/fp16/fp32 and returns (..., out_features)
    in the same dtype, through ``fp8_moe::linear`` (in a plain eager call straight to its
    kernel: :func:`fp8_moe_ops.ops.call_linear`).
    """

    in_features, out_features, block_size = _fixed("in_features"), _fixed("out_features"), _fixed("block_size")
    _PROPERTIES = ("in_features", "out_features", "block_size")
    _STATIC_SCALES = ("activation_scale",)

    def _optional(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        if name == "activation_scale":
            return torch.float32, (1,)
        if name == "bias":  # (the constructor's dtype; a bias may be any float dtype: _check_replacement)
            return torch.float32, (self.out_features,)
        return None

    def __init__(self, in_features: int, out_features: int, block_size: Sequence[int] = (128, 128),
                 activation_scheme: str = "dynamic", scale_dtype: torch.dtype = torch.float32,
                 bias: bool = False, device=None):
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.block_size = [int(b) for b in check_block_size(block_size)]
        check_choice("activation_scheme", activation_scheme, SCHEMES)
        check_scale_dtype(scale_dtype)
        if not isinstance(bias, bool):
            fail(TypeError, "bias", "a bool", repr(bias))
        grid = _scale_grid(out_features, in_features, self.block_size)
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.weight_scale_inv = _frozen(torch.ones(grid, device=device).to(scale_dtype))
        static = activation_scheme == "static"
        self.activation_scale = _frozen(torch.ones(1, device=device)) if static else None
        self.bias = _frozen(torch.zeros(out_features, device=device)) if bias else None
        self.activation_scheme = activation_scheme

    @classmethod
    def from_float(cls, linear: nn.Linear, block_size: Sequence[int] = (128, 128),
                   scale_dtype: torch.dtype = torch.float32) -> FP8Linear:
        """Quantises an ``nn.Linear`` (dynamic scheme; see ``calibrate_static_scales``)."""
        if not isinstance(linear, nn.Linear):
            fail(TypeError, "linear", "an nn.Linear", type(linear).__name__)
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, block_size, "dynamic", scale_dtype,
                  bias=linear.bias is not None, device=w.device)
        q, s = quantize_named(w, block_size, scale_dtype, "linear.weight")
        mod.weight.data, mod.weight_scale_inv.data = q, s
        if linear.bias is not None:  # float32 as the constructor's (exact for any float bias; added in y's dtype)
            mod.bias.data = linear.bias.detach().to(torch.float32, copy=True)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_activations("x", x, self.in_features, "in_features")
        weight = self._tensor("weight")
        if x.device != weight.device:
            fail(ValueError, "x", f"a tensor on {weight.device} (the device of the weights)", x.device)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self._observer is not None:
            self._observer.copy_(torch.maximum(self._observer, _abs_max(x2)))
        act_scale = self.activation_scale if self.activation_scheme == "static" else None
        y = ops.call_linear(x2, weight, self.weight_scale_inv, self._block_size, act_scale)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    _observer: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
                f"activation_scheme={self.activation_scheme!r}, scale_dtype={self.weight_scale_inv.dtype}, "
                f"bias={self.bias is not None}")


# FP8Experts -> {hidden_states' shape: [guard of inputs that passed its checks]} (_check_inputs_once)
_CHECKED_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHECKED_SHAPES = 16  # per module; cleared when full (decode has one shape per batch size)


class FP8Experts(_CheckedStateDict, nn.Module):
    """Gated MoE experts with fp8 block-quantised weights.

    Attributes:
        gate_up_proj: (E, 2I, H) e4m3 (first I rows gate, last I up);
        gate_up_proj_scale_inv: (E, ceil(2I/bn), ceil(H/bk)) float32 or UE8M0;
        down_proj: (E, H, I) e4m3; down_proj_scale_inv: (E, ceil(H/bn), ceil(I/bk));
        gate_up_proj_activation_scale, down_proj_activation_scale: (E,) float32
        (static scheme only, else ``None``).

    ``forward(hidden_states (..., H), top_k_index (..., k), top_k_weights (..., k)) ->
    (..., H)``: any leading dims, the same for the three tensors.  ``dispatch``:
    ``"eager"`` is a Python loop over ``range(num_experts)`` calling
    ``torch.ops.fp8_moe.linear`` (what the graph pass rewrites); ``"grouped"`` and
    ``"batched"`` call ``torch.ops.fp8_moe.grouped_experts`` / ``batched_experts``.
    All three give the same result up to float32 summation order.
    """

    _STATIC_SCALES = ("gate_up_proj_activation_scale", "down_proj_activation_scale")
    num_experts, hidden_size = _fixed("num_experts"), _fixed("hidden_size")
    intermediate_size, block_size = _fixed("intermediate_size"), _fixed("block_size")
    _PROPERTIES = ("num_experts", "hidden_size", "intermediate_size", "block_size", "swiglu_limit")

    def _optional(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        return (torch.float32, (self.num_experts,)) if name in self._STATIC_SCALES else None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 block_size: Sequence[int] = (128, 128), activation: str = "silu",
                 activation_scheme: str = "dynamic", dispatch: str = "eager",
                 scale_dtype: torch.dtype = torch.float32, swiglu_limit: float | None = None, device=None):
        super().__init__()
        E = self.num_experts = check_positive_int("num_experts", num_experts)
        H = self.hidden_size = check_positive_int("hidden_size", hidden_size)
        I = self.intermediate_size = check_positive_int("intermediate_size", intermediate_size)
        self.block_size = [int(b) for b in check_block_size(block_size)]
        check_choice("activation_scheme", activation_scheme, SCHEMES)
        check_scale_dtype(scale_dtype)
        self.activation, self.dispatch, self.swiglu_limit = activation, dispatch, swiglu_limit
        fp8 = torch.float8_e4m3fn
        self.gate_up_proj = _frozen(torch.zeros(E, 2 * I, H, dtype=fp8, device=device))
        self.gate_up_proj_scale_inv = _frozen(torch.ones(E, *_scale_grid(2 * I, H, self.block_size), device=device).to(scale_dtype))
        self.down_proj = _frozen(torch.zeros(E, H, I, dtype=fp8, device=device))
        self.down_proj_scale_inv = _frozen(torch.ones(E, *_scale_grid(H, I, self.block_size), device=device).to(scale_dtype))
        static = activation_scheme == "static"
        self.gate_up_proj_activation_scale = _frozen(torch.ones(E, device=device)) if static else None
        self.down_proj_activation_scale = _frozen(torch.ones(E, device=device)) if static else None
        self.activation_scheme = activation_scheme

    # Settings checked on every assignment: a typo after construction raises at once.
    @property
    def dispatch(self) -> str:
        return self._dispatch

    @dispatch.setter
    def dispatch(self, value: str) -> None:
        self._dispatch = check_choice("dispatch", value, DISPATCHES)

    @property
    def activation(self) -> str:
        return self._activation

    @activation.setter
    def activation(self, value: str) -> None:
        self._activation = check_choice("activation", value, ACTIVATIONS)

    @property
    def swiglu_limit(self) -> float | None:
        return self._swiglu_limit

    @swiglu_limit.setter
    def swiglu_limit(self, value: float | None) -> None:
        self._swiglu_limit = check_swiglu_limit(value)

    @classmethod
    def from_float(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, block_size: Sequence[int] = (128, 128),
                   activation: str = "silu", dispatch: str = "eager", scale_dtype: torch.dtype = torch.float32,
                   swiglu_limit: float | None = None) -> FP8Experts:
        """Quantises float expert weights gate_up_proj (E, 2I, H) and down_proj (E, H, I).

        The result uses the dynamic scheme; :func:`fp8_moe_ops.calibrate_static_scales`
        turns it static."""
        for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if not isinstance(t, torch.Tensor):
                fail(TypeError, name, "a Tensor", type(t).__name__)
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2 or 0 in gate_up_proj.shape:
            fail(ValueError, "gate_up_proj", "shape (E, 2I, H) with E, I, H >= 1", shape_str(gate_up_proj))
        E, two_i, H = gate_up_proj.shape
        if tuple(down_proj.shape) != (E, H, two_i // 2):
            fail(ValueError, "down_proj", f"shape {(E, H, two_i // 2)} (E, H, I from gate_up_proj)", shape_str(down_proj))
        mod = cls(E, H, two_i // 2, block_size, activation, "dynamic", dispatch, scale_dtype, swiglu_limit,
                  device=gate_up_proj.device)
        mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data = quantize_named(gate_up_proj, block_size, scale_dtype,
                                                                                "gate_up_proj")
        mod.down_proj.data, mod.down_proj_scale_inv.data = quantize_named(down_proj, block_size, scale_dtype,
                                                                          "down_proj")
        return mod

    def expert_weights(self) -> ops.ExpertWeights:
        """The weights and settings as the experts ops take them (static scales only
        under the static scheme)."""
        static = self.activation_scheme == "static"
        get = self._tensor
        return ops.ExpertWeights(
            get("gate_up_proj"), get("gate_up_proj_scale_inv"), get("down_proj"), get("down_proj_scale_inv"),
            list(self._block_size), self.activation,  # a copy, as ``block_size`` reads: the caller's to change
            get("gate_up_proj_activation_scale") if static else None,
            get("down_proj_activation_scale") if static else None,
            self.swiglu_limit)

    def _check_inputs(self, hidden_states, top_k_index, top_k_weights) -> None:
        _check_activations("hidden_states", hidden_states, self.hidden_size, "hidden_size")
        lead = tuple(hidden_states.shape[:-1])
        if not isinstance(top_k_index, torch.Tensor):
            fail(TypeError, "top_k_index", "a Tensor", type(top_k_index).__name__)
        if top_k_index.dtype not in INDEX_DTYPES:
            fail(TypeError, "top_k_index", "dtype torch.int32 or torch.int64 (expert ids)", top_k_index.dtype)
        def index_shape() -> str:
            return f"shape {lead + ('top_k',)} (leading dims of hidden_states, top_k >= 1)"

        if top_k_index.dim() != hidden_states.dim() or top_k_index.shape[-1] < 1:
            fail(ValueError, "top_k_index", index_shape(), shape_str(top_k_index))
        check_sizes("top_k_index", top_k_index.shape[:-1], lead, index_shape, top_k_index)
        if not isinstance(top_k_weights, torch.Tensor):
            fail(TypeError, "top_k_weights", "a Tensor", type(top_k_weights).__name__)
        if top_k_weights.dtype not in ACT_DTYPES:
            fail(TypeError, "top_k_weights", "dtype bfloat16, float16 or float32 (routing weights)",
                 top_k_weights.dtype)
        check_sizes("top_k_weights", top_k_weights.shape, top_k_index.shape,
                    lambda: f"shape {tuple(top_k_index.shape)} (that of top_k_index)", top_k_weights)
        device = self._tensor("gate_up_proj").device
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
            if t.device != device:
                fail(ValueError, name, f"a tensor on {device} (the device of the expert weights)", t.device)

    def _check_inputs_once(self, hidden_states, top_k_index, top_k_weights) -> None:
        """:meth:`_check_inputs`, skipped for inputs whose metadata (dtype, device, shape,
        strides, type) and the weights' are those of a call that passed it: a C++ guard
        (``metadata_guard``) costs a fraction of the checks' Python, which a decode step
        pays per layer.  Guards are kept per hidden_states shape, a few per module, outside
        the module (a copy or a pickle of it carries none).  Traced (``torch.compile``,
        ``torch.export``): the checks themselves, on the traced metadata."""
        if torch.compiler.is_compiling():
            self._check_inputs(hidden_states, top_k_index, top_k_weights)
            return
        weight = self._tensor("gate_up_proj")
        shape = getattr(hidden_states, "shape", None)
        guards = _CHECKED_INPUTS.get(self)
        if guards is not None:
            for guard in guards.get(shape, ()):
                if guard(hidden_states, top_k_index, top_k_weights, weight):
                    return
        self._check_inputs(hidden_states, top_k_index, top_k_weights)
        guard = metadata_guard([hidden_states, top_k_index, top_k_weights, weight])
        if guard is not None:
            keep_newest(_CHECKED_INPUTS.setdefault(self, {}), shape, guard, 1, _CHECKED_SHAPES)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self._check_inputs_once(hidden_states, top_k_index, top_k_weights)
        shape = hidden_states.shape
        if hidden_states.dim() != 2:  # any leading dims: the ops take (T, H) and (T, k)
            k = top_k_index.shape[-1]
            hidden_states = hidden_states.reshape(-1, self.hidden_size)
            top_k_index, top_k_weights = top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)
        if self.dispatch == "eager" or self._observer is not None:
            out = self._forward_eager(hidden_states, top_k_index, top_k_weights)
        else:
            out = ops.experts(hidden_states, top_k_index, top_k_weights, self.expert_weights(), dispatch=self.dispatch)
        return out if len(shape) == 2 else out.reshape(shape)

    _observer: torch.Tensor | None = None  # (2, E) running amax of gate_up and down inputs

    def _forward_eager(self, hidden_states, top_k_index, top_k_weights):
        static = self.activation_scheme == "static"
        gu_scale = self.gate_up_proj_activation_scale if static else None
        down_scale = self.down_proj_activation_scale if static else None
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            x = hidden_states[tok]
            h = torch.ops.fp8_moe.linear(x, self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self._block_size,
                                         None if gu_scale is None else gu_scale[e])
            a = gated_activation(h, self.activation, self.swiglu_limit)
            y = torch.ops.fp8_moe.linear(a, self.down_proj[e], self.down_proj_scale_inv[e], self._block_size,
                                         None if down_scale is None else down_scale[e])
            out.index_add_(0, tok, y.float() * top_k_weights[tok, pos, None].float())
            if self._observer is not None:
                self._observe(e, x, a)
        return out.to(hidden_states.dtype)

    def _observe(self, e: int, x: torch.Tensor, a: torch.Tensor) -> None:
        self._observer[0, e] = torch.maximum(self._observer[0, e], _abs_max(x))
        self._observer[1, e] = torch.maximum(self._observer[1, e], _abs_max(a))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, block_size={self.block_size}, "
                f"activation={self.activation!r}, activation_scheme={self.activation_scheme!r}, "
                f"dispatch={self.dispatch!r}, scale_dtype={self.gate_up_proj_scale_inv.dtype}")
