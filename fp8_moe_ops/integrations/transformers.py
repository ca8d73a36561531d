"""transformers integration: FP8 experts of transformers models through ``torch.ops.fp8_moe``.

Importing this module (it imports transformers; ``import fp8_moe_ops`` does not) registers
two implementations in transformers' FP8 experts interface
(``transformers.integrations.finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS``):

* ``"fp8_moe_grouped"``: ``torch.ops.fp8_moe.grouped_experts``;
* ``"fp8_moe_batched"``: ``torch.ops.fp8_moe.batched_experts``.

A model loaded with ``FineGrainedFP8Config`` (dynamic *or* static activation scheme) then
runs its experts through them after ``model.set_experts_implementation("fp8_moe_grouped")``
(or ``from_pretrained(..., experts_implementation="fp8_moe_grouped")``).

:func:`quantize_experts` does the same for a bf16 transformers model: it replaces each
fused-experts module with :class:`fp8_moe_ops.FP8Experts` (block-quantised weights,
optionally static activation scales calibrated from sample batches); no GPU, no hub.

transformers' FP8 layout, and how it maps onto the ops (see ``docs/integrations.md``):

* ``gate_up_proj`` (E, 2I, H) e4m3, gate rows first; ``down_proj`` (E, H, I).
* ``gate_up_proj_scale_inv`` has ``max(ceil(2I/bn), 2)`` rows (``min_sf_out=2``). A
  checkpoint stores gate and up projections separately and transformers concatenates
  their scale grids, so when ``I < bn`` the two rows are *the gate's and the up's own
  scales*, not padding: slicing to the op's ``ceil(2I/bn) = 1`` row would apply the gate's
  scale to the up half.  That grid is exactly the op's grid for block ``[I, bk]``, so the
  gate_up GEMM runs with that block (no copy) and the down GEMM with ``[bn, bk]``.
* ``block_size=None`` (per-tensor weights): gate_up has one scale per half (E, 2, 1),
  down one per matrix (E, 1, 1); dynamic activations are quantised per token over all
  of K.  Expressed exactly with blocks ``[I, H]`` and ``[H, I]``.
* static ``gate_up_proj_activation_scale`` / ``down_proj_activation_scale`` (E,) float32
  are the dequant multipliers (``x_fp8 = x / s``), as in the ops.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence

import torch
import transformers
from torch import nn
from transformers import modeling_utils as _tf_modeling_utils
from transformers.integrations import finegrained_fp8 as _tf_fp8
from transformers.integrations import moe as _tf_moe

from .. import ops as _ops
from .. import functional
from .._checks import check_batches, check_block_size, check_choice, check_scale_dtype, fail
from ..calibration import calibrate_static_scales
from ..modules import DISPATCHES, SCHEMES, FP8Experts

__all__ = ["BATCHED", "GROUPED", "fp8_moe_batched_forward", "fp8_moe_grouped_forward", "quantize_experts", "register"]

logger = logging.getLogger(__name__)

GROUPED = "fp8_moe_grouped"
BATCHED = "fp8_moe_batched"

if not hasattr(_tf_fp8, "ALL_FP8_EXPERTS_FUNCTIONS"):
    raise ImportError(
        "fp8_moe_ops.integrations.transformers: expected a transformers with an FP8 experts interface "
        "(transformers.integrations.finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS, present in 5.17), "
        f"got transformers {transformers.__version__} without it"
    )


# transformers activation modules -> the ops' activation names.  Matched on the module
# actually used (``act_fn``), by class name so that renamed classes across releases
# (``PytorchGELUTanh`` -> ``GELUTanh``) need no import.
_ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",  # the tanh formula written out: the same function
    "ReLU": "relu",
}


def _activation_name(act_fn: nn.Module | None) -> str:
    name = type(act_fn).__name__ if act_fn is not None else "no act_fn attribute"
    if name == "GELU":  # torch.nn.GELU
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    if name not in _ACTIVATIONS:
        raise NotImplementedError(
            f"act_fn: expected one of {sorted(_ACTIVATIONS)} or nn.GELU (the ops support "
            f"{functional.ACTIVATIONS}), got {name}"
        )
    return _ACTIVATIONS[name]


_NO_ATTR = object()


def _attr(module: nn.Module, name: str, default=_NO_ATTR):
    """``getattr(module, name[, default])`` without ``nn.Module.__getattr__``: that one is
    reached for every parameter, buffer and submodule and for every missing name (which
    it answers by raising, for ``getattr`` to catch): 0.5-1.5 µs of CPU each on the CPU
    machine, and the experts forward reads about fifteen per call.  The same lookup
    order: the instance's own attributes, then its parameters, buffers and submodules;
    class attributes and properties, and modules with their own ``__getattr__``, through
    ``getattr``.  Not for traced code (``torch.compile`` reads attributes its own way)."""
    d = module.__dict__
    value = d.get(name, _NO_ATTR)
    if value is not _NO_ATTR:
        return value
    for table in ("_parameters", "_buffers", "_modules"):
        entries = d.get(table)
        if entries is not None and name in entries:
            return entries[name]
    cls = type(module)
    if default is not _NO_ATTR and cls.__getattr__ is nn.Module.__getattr__ and not hasattr(cls, name):
        return default  # what nn.Module.__getattr__ would raise for
    return getattr(module, name) if default is _NO_ATTR else getattr(module, name, default)


def _check_gating(module: nn.Module, allow_transposed: bool = False, get=getattr) -> None:
    """Raises for every experts feature the ops cannot express (never a silent wrong result).

    ``allow_transposed``: weights stored (E, H, 2I) / (E, I, H) are fine when they are about
    to be quantised (and so copied) anyway.  ``get``: how attributes are read (``getattr``,
    or :func:`_attr` on a forward's hot path)."""
    if not get(module, "has_gate", True):
        raise NotImplementedError(
            f"{type(module).__name__}: has_gate=False (ungated experts, act(up) without a gate) is not "
            "supported: the fp8_moe ops compute act(gate) * up"
        )
    if get(module, "has_bias", False):
        raise NotImplementedError(f"{type(module).__name__}: has_bias=True (expert biases) is not supported by the fp8_moe ops")
    if get(module, "swiglu_alpha", None) is not None:
        raise NotImplementedError(
            f"{type(module).__name__}: swiglu_alpha={module.swiglu_alpha} (the gpt-oss clamped SwiGLU gate "
            "(up + 1) * gate * sigmoid(alpha * gate)) is not supported by the fp8_moe ops"
        )
    for attr in ("gate_softcap", "up_softcap"):
        if get(module, attr, None) is not None:
            raise NotImplementedError(
                f"{type(module).__name__}: {attr}={get(module, attr)} (softcapped SwiGLU) is not supported by the fp8_moe ops"
            )
    if get(module, "is_transposed", False) and not allow_transposed:
        raise NotImplementedError(f"{type(module).__name__}: is_transposed=True (weights stored (E, H, 2I)) is not supported")
    if not get(module, "is_concatenated", True):
        raise NotImplementedError(
            f"{type(module).__name__}: is_concatenated=False (interleaved gate/up rows) is not supported"
        )
    if get(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{type(module).__name__}: has_post_expert_norm=True is not supported by the fp8_moe ops")


# --------------------------------------------------------------------------- experts forwards


def _blocks(module: nn.Module, get=getattr) -> tuple[list[int], list[int]]:
    """(gate_up block, down block) that make the ops read transformers' scale grids exactly."""
    _, two_i, H = get(module, "gate_up_proj").shape
    I = two_i // 2
    block_size = get(module, "block_size")
    if block_size is None:
        # Per-tensor: (E, 2, 1) gate/up scales = block [I, H]; (E, 1, 1) down; bk = K quantises
        # dynamic activations per token over the whole row, as transformers' tensor kernel does.
        return [I, H], [H, I]
    bn, bk = (int(b) for b in block_size)
    rows = get(module, "gate_up_proj_scale_inv").shape[1]
    if I % bn == 0:
        return [bn, bk], [bn, bk]
    if I < bn and rows == 2:
        return [I, bk], [bn, bk]
    if rows == functional.cdiv(2 * I, bn) != 2 * functional.cdiv(I, bn):
        # Only a uniform quantisation of the fused (2I, H) matrix fits this grid.
        return [bn, bk], [bn, bk]
    raise NotImplementedError(
        f"gate_up_proj_scale_inv: shape {tuple(get(module, 'gate_up_proj_scale_inv').shape)} holds separate gate and up "
        f"grids of I = {I} rows with a partial last block of {bn} rows; the ops need one uniform block size "
        "per GEMM (I a multiple of block_size[0], or I < block_size[0])"
    )


def _check_fp8_experts(module: nn.Module, get=getattr) -> None:
    if isinstance(module, FP8Experts):
        raise TypeError("self: expected a transformers experts module, got fp8_moe_ops.FP8Experts, which runs "
                        "the ops itself (call it: module(hidden_states, top_k_index, top_k_weights))")
    _check_gating(module, get=get)
    for name in ("gate_up_proj", "down_proj"):
        w = get(module, name)
        if w.dtype == torch.int8:
            raise NotImplementedError(f"{name}: FP4-packed experts (expert_dtype='fp4', int8 weights) are not supported")
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn (FineGrainedFP8 experts), got {w.dtype} "
                            "(quantise bf16 experts with fp8_moe_ops.integrations.transformers.quantize_experts)")


def _op_args(module: nn.Module, get=getattr):
    static = get(module, "activation_scheme") == "static"
    return (
        get(module, "gate_up_proj"), get(module, "gate_up_proj_scale_inv"), get(module, "down_proj"),
        get(module, "down_proj_scale_inv"),
        _activation_name(get(module, "act_fn")),
        get(module, "gate_up_proj_activation_scale") if static else None,
        get(module, "down_proj_activation_scale") if static else None,
        get(module, "limit", None),
    )


def _experts_forward(module, hidden_states, top_k_index, top_k_weights, grouped: bool) -> torch.Tensor:
    get = getattr if torch.compiler.is_compiling() else _attr
    _check_fp8_experts(module, get)
    gate_up, gate_up_scale, down, down_scale, activation, gate_up_act, down_act, limit = _op_args(module, get)
    gate_up_block, down_block = _blocks(module, get)
    if gate_up_block == down_block:
        return _ops.call_experts("grouped_experts" if grouped else "batched_experts",
                                 (hidden_states, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale,
                                  gate_up_block, activation, gate_up_act, down_act, limit))
    # Two block sizes: the experts ops' pipeline with one GEMM op per projection, so
    # each reads its own scale grid.
    E = gate_up.shape[0]
    pipeline, gemm = ((functional.grouped_pipeline, torch.ops.fp8_moe.grouped_mm) if grouped
                      else (functional.batched_pipeline, torch.ops.fp8_moe.batched_mm))
    return pipeline(
        hidden_states, top_k_index, top_k_weights, E,
        lambda x, rows: gemm(x, gate_up, gate_up_scale, rows, gate_up_block, gate_up_act),
        lambda a, rows: gemm(a, down, down_scale, rows, down_block, down_act),
        activation, limit,
    )


def fp8_moe_grouped_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers FP8 experts forward through ``torch.ops.fp8_moe.grouped_experts``.

    ``self`` is a transformers ``FP8Experts``; hidden_states (T, H), top_k_index (T, k),
    top_k_weights (T, k) -> (T, H).  Dynamic and static activation schemes.  Raises
    ``NotImplementedError`` naming any feature the ops cannot express."""
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, grouped=True)


def fp8_moe_batched_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """As :func:`fp8_moe_grouped_forward`, through ``torch.ops.fp8_moe.batched_experts``."""
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, grouped=False)


# --------------------------------------------------------------------------- registration

_NAMES = (GROUPED, BATCHED)


def _validator_accepts(name: str) -> bool:
    # ``get_correct_experts_implementation`` only touches ``self`` for "grouped_mm"; a
    # version that needs it for any name cannot be probed and is left as it is.
    try:
        _tf_modeling_utils.PreTrainedModel.get_correct_experts_implementation(None, name)
    except ValueError:
        return False
    except (AttributeError, TypeError):
        logger.debug("could not probe transformers' experts implementation check for %r", name)
    return True


def _accept_names_in_validator() -> None:
    """Some 5.x releases check the name against a fixed list instead of the interfaces'
    keys; wrap that check so our names pass (only where it rejects them)."""
    cls = _tf_modeling_utils.PreTrainedModel
    if all(_validator_accepts(n) for n in _NAMES):
        return
    original = cls.get_correct_experts_implementation

    def get_correct_experts_implementation(self, requested_experts):
        if requested_experts in _NAMES:
            return requested_experts
        return original(self, requested_experts)

    cls.get_correct_experts_implementation = get_correct_experts_implementation
    logger.info("transformers validates experts implementations against a fixed list; allowed %s", _NAMES)


def register() -> None:
    """Registers ``"fp8_moe_grouped"`` and ``"fp8_moe_batched"`` in transformers' FP8 experts
    interface (idempotent; done on import of this module).

    They are registered in the bf16 experts interface too, where they raise a ``TypeError``
    pointing to :func:`quantize_experts` (instead of transformers' "not a valid experts
    implementation" for the bf16 experts of a partly quantised model)."""
    for interface in (_tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS, _tf_moe.ALL_EXPERTS_FUNCTIONS):
        interface.register(GROUPED, fp8_moe_grouped_forward)
        interface.register(BATCHED, fp8_moe_batched_forward)
    _accept_names_in_validator()


register()


# --------------------------------------------------------------------------- bf16 models


def _is_fused_experts(module: nn.Module) -> bool:
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.Tensor) and down.dim() == 3


class _Scoped(nn.Module):
    """Exposes only ``targets`` to :func:`calibrate_static_scales` while running the whole model
    (so FP8 modules outside the experts, e.g. from ``convert_linears``, stay as they are)."""

    def __init__(self, model: nn.Module, targets: Sequence[nn.Module]):
        super().__init__()
        self.targets = nn.ModuleList(targets)
        object.__setattr__(self, "model", model)  # not a submodule: not calibrated

    def forward(self, *args, **kwargs):  # a batch as calibrate_static_scales runs it
        return self.model(*args, **kwargs)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """The targets, by their paths in the model (what calibration errors name)."""
        paths = {m: name for name, m in self.model.named_modules()}
        for m in self.targets:
            yield paths[m], m


def quantize_experts(
    model: nn.Module,
    activation_scheme: str = "dynamic",
    calibration_batches: Iterable | None = None,
    *,
    block_size: Sequence[int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
    dispatch: str = "grouped",
) -> nn.Module:
    """Turns the fused bf16 experts of a transformers 5.x model into :class:`fp8_moe_ops.FP8Experts`.

    Every module holding 3-D ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) float
    parameters (the modules behind transformers' experts interface; ``is_transposed``
    ones store (E, H, 2I) and (E, I, H)) is replaced by an
    ``FP8Experts`` with block-quantised weights (``block_size``, ``scale_dtype``) running
    ``torch.ops.fp8_moe.grouped_experts`` (``dispatch="grouped"``), ``batched_experts``
    (``"batched"``) or the per-expert loop (``"eager"``, what the graph pass rewrites).

    Args:
        model: a transformers model (or any module containing such experts), modified in place.
        activation_scheme: ``"dynamic"`` or ``"static"``; static scales are calibrated from
            ``calibration_batches`` (required then, refused otherwise): each batch is passed to
            ``model`` as ``model(**batch)`` (a mapping), ``model(*batch)`` (tuple/list) or
            ``model(batch)`` (e.g. input_ids (B, S)).
        block_size, scale_dtype: weight quantisation (see :func:`fp8_moe_ops.quantize_weight`).
        dispatch: ``"grouped"``, ``"batched"`` or ``"eager"``.

    A module with a 3-D ``down_proj`` but no fused ``gate_up_proj`` (e.g. a family's shared
    experts with separate 3-D ``gate_proj`` / ``up_proj``) is left as it is, with a
    ``UserWarning`` naming it.

    Returns ``model``.  Raises ``NotImplementedError`` naming any expert feature the ops
    cannot express (ungated or biased experts, gpt-oss ``swiglu_alpha``, custom gates,
    unsupported activations) before changing anything; where calibration fails (an error
    in the model's forward, a NaN), the original experts are put back before the error
    propagates.
    """
    if not isinstance(model, nn.Module):
        fail(TypeError, "model", "an nn.Module", type(model).__name__)
    check_choice("activation_scheme", activation_scheme, SCHEMES)
    check_choice("dispatch", dispatch, DISPATCHES)
    check_block_size(block_size)
    check_scale_dtype(scale_dtype)
    if activation_scheme == "static" and calibration_batches is None:
        raise ValueError("calibration_batches: expected sample batches to calibrate activation_scheme='static', got None")
    if activation_scheme == "dynamic" and calibration_batches is not None:
        raise ValueError("calibration_batches: expected None with activation_scheme='dynamic' (only static scales are calibrated)")
    check_batches(calibration_batches, "[input_ids]")

    found, places, already = {}, [], set()  # each experts module once -> its activation; where each is; quantised
    skipped = {}  # modules with a 3-D down_proj but no fused gate_up_proj -> where one is held
    for parent in model.modules():
        # _modules, not named_children(): that one lists a module held twice by one parent once; a module
        # held in several places becomes one FP8Experts held in the same places (shared, as it was)
        for name, child in parent._modules.items():
            if child in found:
                places.append((parent, name, child))
                continue
            if child is None or isinstance(child, FP8Experts) or not _is_fused_experts(child):
                if isinstance(child, FP8Experts):
                    already.add(child)
                continue
            if not child.down_proj.is_floating_point() or child.down_proj.element_size() == 1:
                logger.info("quantize_experts: %s.%s already holds %s experts, left as is",
                            type(parent).__name__, name, child.down_proj.dtype)
                already.add(child)
                continue
            _check_gating(child, allow_transposed=True)  # (the interface's flags: ungated ones refused)
            if not isinstance(getattr(child, "gate_up_proj", None), torch.Tensor):
                # not the experts interface's layout (say a family's shared experts with 3-D
                # gate_proj / up_proj and a forward of their own): the others are still quantised
                skipped.setdefault(child, f"{type(parent).__name__}.{name} ({type(child).__name__})")
                continue
            gate = getattr(type(child), "_apply_gate", None)
            if gate is not None and gate is not getattr(_tf_moe, "_default_apply_gate", gate):
                raise NotImplementedError(
                    f"{type(child).__name__}: a custom _apply_gate (model-specific gating) is not supported by the fp8_moe ops"
                )
            found[child] = _activation_name(getattr(child, "act_fn", None))
            places.append((parent, name, child))
    if not found:
        if _is_fused_experts(model) and isinstance(getattr(model, "gate_up_proj", None), torch.Tensor) \
                and model.down_proj.is_floating_point() and model.down_proj.element_size() > 1:
            raise ValueError(f"model: expected a module containing the experts (their parent, e.g. the MoE block or the "
                             f"whole model: they are replaced where they are held), got the experts module "
                             f"{type(model).__name__} itself")
        raise ValueError("model: expected fused experts modules (3-D gate_up_proj / down_proj float parameters), "
                         f"found none ({len(already)} already quantised"
                         f"{f'; without a fused gate_up_proj: {len(skipped)}' if skipped else ''})")
    if skipped:
        warnings.warn(f"quantize_experts: left {', '.join(skipped.values())} in their own dtype: a 3-D down_proj without a fused "
                      "gate_up_proj (E, 2I, H) is not the transformers experts layout the ops take", stacklevel=2)

    new_experts = {}
    for child, activation in found.items():
        gate_up, down = child.gate_up_proj.detach(), child.down_proj.detach()
        if getattr(child, "is_transposed", False):
            # Stored (E, H, 2I) / (E, I, H) for ``x @ w``; the ops take (out, in).
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        with torch.no_grad():
            new_experts[child] = FP8Experts.from_float(gate_up, down, block_size, activation, dispatch, scale_dtype)
    for parent, name, child in places:
        setattr(parent, name, new_experts[child])
    if activation_scheme == "static":
        try:
            # each batch run as model(**batch), model(*batch) or model(batch): calibrate_static_scales' rule
            calibrate_static_scales(_Scoped(model, list(new_experts.values())), calibration_batches)
        except BaseException:
            for parent, name, child in places:  # the model as it was: the call can be retried
                setattr(parent, name, child)
            raise
    if isinstance(model, _tf_modeling_utils.PreTrainedModel):
        # its checkpoint would load as garbage (docs/integrations.md, "Saving"): refused
        model.save_pretrained = _refuse_save_pretrained
    logger.info("quantize_experts: %d experts modules quantised (%s, dispatch=%s)", len(found), activation_scheme, dispatch)
    return model


def _refuse_save_pretrained(*args, **kwargs):
    """``save_pretrained`` of a model :func:`quantize_experts` changed (an attribute of the
    model, over transformers' method): its files would hold fp8 expert weights under the
    bf16 model's names, without scales or a quantization config, and ``from_pretrained``
    would load them into bf16 experts without a word."""
    raise NotImplementedError(
        "save_pretrained: a model whose experts quantize_experts replaced has no transformers checkpoint format "
        "(from_pretrained would load its fp8 weights into bf16 experts, without their scales); save "
        "model.state_dict() with torch.save, and to load, run quantize_experts on a model built from the same config "
        "(same scheme, block_size and scale_dtype) and load_state_dict into it (docs/integrations.md, \"Saving\")")
