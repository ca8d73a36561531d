"""``convert_linears``: swap a model's linear layers for :class:`fp8_moe_ops.FP8Linear`.

Made for existing models whose MoE block is a Python loop over ``nn.ModuleList`` experts
(the Mixtral / Qwen2-MoE style of transformers 4.x and of many research code bases):
after conversion every expert projection calls ``torch.ops.fp8_moe.linear``, which is
what the graph pass (``fp8_moe_ops.passes``) recognises and rewrites into one grouped op.

transformers is not imported here.  Its own ``FP8Linear`` (FineGrainedFP8 models) is
recognised only when ``transformers.integrations.finegrained_fp8`` is already loaded,
which it must be for such a module to exist.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from .._checks import check_block_size, check_scale_dtype, fail
from ..modules import FP8Linear

__all__ = ["convert_linears"]

logger = logging.getLogger(__name__)


def _transformers_fp8_linear_class() -> type | None:
    module = sys.modules.get("transformers.integrations.finegrained_fp8")
    return getattr(module, "FP8Linear", None)


def _frozen_view(t: torch.Tensor, shape: Sequence[int] | None = None) -> nn.Parameter:
    """A parameter sharing ``t``'s storage (no copy), reshaped by a view when asked."""
    t = t.detach()
    return nn.Parameter(t if shape is None else t.view(*shape), requires_grad=False)


def _from_transformers_fp8(tf_linear: nn.Linear) -> FP8Linear:
    """transformers ``FP8Linear`` -> ``FP8Linear`` sharing its fp8 weight, scales and bias."""
    w, scale = tf_linear.weight, tf_linear.weight_scale_inv
    out_features, in_features = w.shape
    if tf_linear.block_size is None:
        # Per-tensor weights: one scale (shape ()) = a (1, 1) grid; transformers quantises
        # dynamic activations per token over the whole row, i.e. a group of K = in_features.
        block_size, grid = [out_features, in_features], (1, 1)
    else:
        block_size, grid = [int(b) for b in tf_linear.block_size], None
    scheme = getattr(tf_linear, "activation_scheme", "dynamic")
    has_bias = tf_linear.bias is not None
    # Built on "meta" so that no weight-sized zeros are allocated before sharing.
    mod = FP8Linear(in_features, out_features, block_size, scheme, scale.dtype, bias=has_bias, device="meta")
    mod.weight = _frozen_view(w)
    mod.weight_scale_inv = _frozen_view(scale, grid)
    if scheme == "static":
        mod.activation_scale = _frozen_view(tf_linear.activation_scale, (1,))
    if has_bias:
        mod.bias = _frozen_view(tf_linear.bias)
    return mod


def _stacked_expert_weights(module: nn.Module) -> list[str]:
    """The names of ``module``'s own 3-D floating parameters where it is a transformers
    5.x-style fused experts module (a 3-D ``down_proj`` (E, H, I) beside ``gate_up_proj``
    (E, 2I, H) or ``gate_proj`` / ``up_proj``) holding no fp8 weight, else []: expert
    weights that no linear layer holds.  (Conv1d weights and (1, N, D) position
    embeddings are 3-D too, and no experts.)"""
    params = dict(module.named_parameters(recurse=False))
    down = params.get("down_proj")
    if down is None or down.dim() != 3 or not down.is_floating_point() or down.dtype == torch.float8_e4m3fn:
        return []
    return [name for name, p in params.items() if p.dim() == 3 and p.is_floating_point()]


def _convert(module: nn.Module, tf_class: type | None, block_size: Sequence[int], scale_dtype: torch.dtype) -> FP8Linear | None:
    # exactly transformers' FP8Linear: a subclass (FP8GroupedLinear, block-diagonal groups) computes
    # something else with the same weights and is left as it is
    if tf_class is not None and type(module) is tf_class:
        if module.weight.dtype == torch.float8_e4m3fn:
            return _from_transformers_fp8(module)
        if module.weight.dtype == torch.int8:
            raise NotImplementedError("weight: FP4-packed (int8) transformers FP8Linear weights are not supported")
        # A dequantised FineGrainedFP8 model (dequantize=True) holds plain float weights.
        return FP8Linear.from_float(module, block_size, scale_dtype)
    if type(module) is nn.Linear:
        return FP8Linear.from_float(module, block_size, scale_dtype)
    return None


def convert_linears(
    model: nn.Module,
    skip: Sequence[str] = ("gate", "router", "lm_head"),
    *,
    block_size: Sequence[int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Replaces the linear layers of ``model`` with :class:`fp8_moe_ops.FP8Linear`, in place.

    * ``nn.Linear`` (exactly that class, not subclasses of other libraries): its weight
      (out, in) is block-quantised with :func:`fp8_moe_ops.quantize_weight` (``block_size``,
      ``scale_dtype``); a bias is kept.  Dynamic activation scheme (see
      :func:`fp8_moe_ops.calibrate_static_scales` for static scales).
    * transformers' ``FP8Linear`` (exactly that class; its subclasses, such as
      ``FP8GroupedLinear``, are left as they are): the new module shares its fp8 weight,
      ``weight_scale_inv``, static ``activation_scale`` and bias (no copy), with its block
      size and scheme.

    A module whose own attribute name (the last part of its qualified name) is exactly one
    of ``skip`` is left in full precision, and so is every module inside it: routers and
    heads, also those that hold their linear layer under another name (``router.classifier``,
    ``gate.wg``).  ``gate_proj`` is not ``gate``.

    Expert weights stacked in 3-D parameters (transformers 5.x's fused experts) are no
    linear layer's: they stay in full precision, with a ``UserWarning`` that points to
    :func:`fp8_moe_ops.integrations.transformers.quantize_experts`.

    A linear layer registered under several names (tied) becomes one ``FP8Linear``
    registered under the same names.  Every layer is converted before any is replaced: one
    that cannot be (a weight on the meta device, say) raises, naming its path, and leaves
    ``model`` as it was.  Returns ``model`` (or, when ``model`` itself is a linear layer,
    its replacement).
    """
    if not isinstance(model, nn.Module):
        fail(TypeError, "model", "an nn.Module", type(model).__name__)
    check_block_size(block_size)
    check_scale_dtype(scale_dtype)
    if isinstance(skip, str):
        raise TypeError(f"skip: expected a sequence of attribute names, got the string {skip!r}")
    skip = frozenset(skip)
    tf_class = _transformers_fp8_linear_class()
    root = _convert(model, tf_class, block_size, scale_dtype)
    if root is not None:
        return root
    # every replacement is made before any is set: a layer that cannot be converted leaves
    # the model as it was, and the error names that layer
    converted = {}  # a linear layer registered in several places becomes one FP8Linear (shared, as it was)
    places = []
    stacked = []  # (path, class, names) of modules holding stacked expert weights, left as they are
    for path, parent in model.named_modules():
        if not skip.isdisjoint(path.split(".")):
            continue  # inside a skipped module (named_modules still walks into it)
        names = _stacked_expert_weights(parent)
        if names:
            stacked.append((path, type(parent).__name__, names))
        # _modules, not named_children(): that one lists a module held twice by one parent once
        for name, child in parent._modules.items():
            if child is None or name in skip:
                continue
            if child not in converted:
                try:
                    converted[child] = _convert(child, tf_class, block_size, scale_dtype)
                except (ValueError, TypeError, NotImplementedError) as e:
                    raise type(e)(f"convert_linears: {path + '.' if path else ''}{name} "
                                  f"({type(child).__name__}): {e}") from e
            if converted[child] is not None:
                places.append((parent, name, converted[child]))
    for parent, name, new in places:
        setattr(parent, name, new)
    replaced = sum(new is not None for new in converted.values())
    if stacked:
        path, cls, names = stacked[0]
        warnings.warn(
            f"convert_linears: {len(stacked)} module(s) hold expert weights stacked in 3-D tensors, which it "
            f"leaves in full precision (the first: {path or 'the model'} ({cls}): {', '.join(names)}); it converts "
            f"linear layers only. For transformers 5.x MoE models, quantise those experts with "
            f"fp8_moe_ops.integrations.transformers.quantize_experts(model)", UserWarning, stacklevel=2)
    logger.info("convert_linears: %d linear layers converted to FP8Linear (skipped names: %s)", replaced, sorted(skip))
    return model
