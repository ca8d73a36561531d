"""Static activation scales: calibrate them from sample batches."""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ._checks import check_batches
from .modules import FP8Experts, FP8Linear
from .functional import FP8_MAX


def _scale_from_amax(amax: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor | None:
    """amax (one value, or (2, E): gate_up and down inputs per expert) -> dequant
    multiplier ``amax / 448`` (at least float32's smallest positive value, so that a
    tiny amax never makes a zero scale).  An expert that saw no token (amax 0) takes the
    largest scale of its projection in the layer (``seen`` (2,): those maxima, where the
    layer's experts are spread over ranks), so it never saturates needlessly.
    None where there is nothing to scale by: a linear, or a projection of every expert
    of a layer, whose inputs were all zero or that was never called."""
    if seen is not None:
        seen = seen[:, None]
    else:
        seen = amax.amax(dim=-1, keepdim=True) if amax.dim() else amax
    if not bool((seen > 0).all()):
        return None
    return (torch.where(amax > 0, amax, seen) / FP8_MAX).clamp_min(2.0 ** -149)  # float32's smallest positive


def _check_finite(m: nn.Module, name: str, shared: tuple | None = None) -> None:
    """Raises where ``m``'s recorded input maxima hold a NaN or an infinity (``shared``:
    the layer's experts are spread over ranks, and these are the reduced
    :meth:`~fp8_moe_ops.parallel.ExpertParallel._calibration_maxima`)."""
    if shared is not None:
        bad = shared[0]
        if bad is None:
            return
    else:
        mask = ~torch.isfinite(m._observer)
        if not mask.any():
            return
        bad = None if isinstance(m, FP8Linear) else tuple(int(i) for i in mask.nonzero()[0])
    where = f"model.{name}" if name else "model"
    if isinstance(m, FP8Linear):
        what = "its input"
    else:
        proj, expert = bad
        what = f"the {('gate_up', 'down')[proj]} input of expert {expert}"
    raise ValueError(f"calibration_batches: expected finite activations, got NaN or Inf in {where} "
                     f"({type(m).__name__}): {what}; no static scale can represent it")


def _run_batch(model: nn.Module, batch, batches, index: int) -> None:
    """``model(*batch)`` for a tuple or list, ``model(**batch)`` for a mapping (a
    tokenizer's ``BatchEncoding``), else ``model(batch)`` (``index``: the batch's place in
    ``batches``).  Where ``batches`` is a list of tensors and the model's forward cannot
    take one tensor alone (a module of several arguments), running the first raises: it
    was most likely one batch passed alone, and the error says so (a tuple of tensors is
    refused before any runs: :func:`check_batches`)."""
    if isinstance(batch, (tuple, list)):
        model(*batch)
        return
    if isinstance(batch, Mapping):
        model(**batch)
        return
    try:
        model(batch)
    except TypeError as exc:
        if index == 0 and isinstance(batches, list) and len(batches) > 1 \
                and all(isinstance(b, torch.Tensor) for b in batches) and not _takes_one(model, batch):
            raise TypeError(f"calibration_batches: expected an iterable of batches, got a list "
                            f"of {len(batches)} tensors, each run as a batch alone (model(tensor) raised: {exc}); "
                            f"to calibrate on one batch of several arguments, wrap it in a list: "
                            f"[(hidden, top_k_index, top_k_weights)]") from exc
        raise


def _takes_one(model: nn.Module, batch) -> bool:
    """Whether ``model.forward`` binds one positional argument (True where its signature
    cannot be read): only where it does not was a TypeError the calling convention's."""
    try:
        inspect.signature(model.forward).bind(batch)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _expert_parallel(model: nn.Module) -> dict:
    """{local experts: their ``ExpertParallel``} in ``model``, in module order (none where
    :mod:`fp8_moe_ops.parallel` was never imported)."""
    parallel = sys.modules.get(f"{__package__}.parallel")
    if parallel is None:
        return {}
    return {m.local_experts: m for m in model.modules() if isinstance(m, parallel.ExpertParallel)}


@torch.no_grad()
def calibrate_static_scales(model: nn.Module, calibration_batches: Iterable) -> nn.Module:
    """Switches every ``FP8Linear`` / ``FP8Experts`` in ``model`` to static activation scales.

    Runs ``model(*batch)`` for each batch (a tuple of positional arguments, a mapping of
    keyword arguments run as ``model(**batch)``, such as a tokenizer's ``BatchEncoding``, or
    a single tensor; ``calibration_batches`` is an iterable of batches, and one batch passed
    alone, a tensor, a mapping or a tuple of tensors, is refused: wrap it in a list) with the current
    (dynamic) scheme, records the largest absolute input of every linear and, per
    expert, of the gate_up and down projections, then sets
    ``activation_scheme = "static"`` with scale ``amax / 448`` (the dequant multiplier).
    Returns ``model``, modified in place.  A NaN or an infinity in any recorded input
    raises ``ValueError`` naming the module and the projection, and leaves every module
    as it was (dynamic): no finite scale can represent it.  A module that saw no
    nonzero input (never called by the batches, or only with zeros; for experts: no
    nonzero input to one of the projections of any expert) stays dynamic, with a
    ``UserWarning`` naming it: no maximum was observed to scale by.  Empty batches
    (no tokens) record nothing.  Experts spread over ranks
    (:class:`fp8_moe_ops.parallel.ExpertParallel`) calibrate as one process holding every
    expert would, their layer's maxima reduced over its group: every rank of the group
    calls this with the same model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_batches(calibration_batches, "[x] or [(hidden, top_k_index, top_k_weights)]")
    names = {m: name for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    targets = list(names)
    if not targets:
        raise ValueError("model: expected a module containing FP8Linear or FP8Experts, found none")
    for m in targets:
        if m.activation_scheme != "dynamic":
            raise ValueError(f"model: expected dynamic-scheme modules to calibrate, got {type(m).__name__} "
                             f"with activation_scheme={m.activation_scheme!r}")
    for m in targets:  # only once every module is known to be calibratable: a refusal leaves none set
        device = m.weight.device if isinstance(m, FP8Linear) else m.gate_up_proj.device
        shape = () if isinstance(m, FP8Linear) else (2, m.num_experts)
        m._observer = torch.zeros(shape, device=device)
    seen = 0
    try:
        for batch in calibration_batches:
            _run_batch(model, batch, calibration_batches, seen)
            seen += 1
        if seen == 0:
            raise ValueError("calibration_batches: expected at least one batch, got none")
        # experts spread over ranks (fp8_moe_ops.parallel): their layer's maxima reduced
        # over the group, every layer's before anything raises (collectives, in the same
        # order on every rank), so that every rank raises alike and calibrates as one
        # process holding every expert would
        layers = _expert_parallel(model)
        shared = {m: ep._calibration_maxima(m._observer) for m, ep in layers.items() if m in names}
        refusal = None
        try:
            for m in targets:
                _check_finite(m, names[m], shared.get(m))
        except ValueError as e:
            refusal = e
        # and a refusal on any rank (say a NaN in a linear of its own) is every rank's
        spread = list(layers.values())
        if spread and spread[0]._any_rank_failed(spread, refusal is not None) and refusal is None:
            raise ValueError("calibration_batches: expected finite activations on every rank, got a NaN or Inf "
                             "on another rank of the expert-parallel group (its error names the module); no "
                             "module is made static")
        if refusal is not None:
            raise refusal
        unseen = []
        for m in targets:
            scales = _scale_from_amax(m._observer, shared[m][1] if m in shared else None)
            if scales is None:
                unseen.append(f"model.{names[m]}" if names[m] else "model")
                continue
            if isinstance(m, FP8Linear):
                m.activation_scale = nn.Parameter(scales.reshape(1), requires_grad=False)
            else:
                m.gate_up_proj_activation_scale = nn.Parameter(scales[0].contiguous(), requires_grad=False)
                m.down_proj_activation_scale = nn.Parameter(scales[1].contiguous(), requires_grad=False)
            m.activation_scheme = "static"
        if unseen:
            warnings.warn(f"calibrate_static_scales: no nonzero input reached {', '.join(unseen)} in the calibration "
                          "batches; left dynamic (a static scale needs an observed maximum)", stacklevel=3)
    finally:
        for m in targets:
            m._observer = None
    return model
