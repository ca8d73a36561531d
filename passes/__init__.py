"""The MoE-loop graph pass (installed as ``fp8_moe_ops.passes``).

While installed, every Inductor compile (``torch.compile`` and
``torch._inductor.aoti_compile_and_package``) runs :class:`MoELoopPass` on the
post-grad graph: an unrolled Python loop over experts calling ``fp8_moe::linear``
with dynamic activation scales becomes one ``fp8_moe::grouped_experts`` call
(``fp8_moe::grouped_experts_list`` where each expert holds its own tensors, e.g.
``nn.ModuleList`` experts).  See
``docs/pass.md`` for what is matched, what is skipped and how to debug it.

    import fp8_moe_ops.passes

    with fp8_moe_ops.passes.enabled():
        model = torch.compile(model)
        model(hidden, top_k_index, top_k_weights)

Counters: ``torch._dynamo.utils.counters["fp8_moe"]`` (``loops_rewritten``,
``loops_skipped_static``, ``loops_skipped_unsupported``); reasons are logged at INFO
on the ``fp8_moe_ops.passes`` logger.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch._inductor import custom_graph_pass as _cgp

from .rewrite import rewrite_moe_loops

__all__ = ["MoELoopPass", "enabled", "install", "is_installed", "uninstall"]

log = logging.getLogger("fp8_moe_ops.passes")

# torch 2.13+ accepts a list of passes in one hook; 2.11/2.12 take one object.
_HOOK_TAKES_LIST = hasattr(_cgp, "get_custom_graph_passes")
_HOOK = "post_grad_custom_pre_pass"


@functools.cache
def _uuid() -> str:
    files = tuple(str(p) for p in sorted(Path(__file__).parent.glob("*.py")))
    return _cgp.get_hash_for_files(files, extra=torch.__version__).hex()


class MoELoopPass(_cgp.CustomGraphPass):
    """Post-grad pass: replaces unrolled expert loops with ``fp8_moe::grouped_experts``
    (``fp8_moe::grouped_experts_list`` for experts that hold their own tensors).

    ``uuid()`` hashes this package's pass sources, so the FX graph cache never serves
    a graph compiled by another version of the pass (or with the pass off)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite_moe_loops(graph)

    def uuid(self) -> str:
        return _uuid()


# Inductor calls a pass of this kind with is_inference (where the class exists).
_INFERENCE_AWARE = getattr(_cgp, "CustomInferenceAwareGraphPass", None)


class _Chained(_INFERENCE_AWARE or _cgp.CustomGraphPass):
    """A user's pass and ours in one hook object (torch 2.11/2.12 hooks hold one).

    Its uuid is None (FX cache bypassed, as Inductor does itself) when the user's
    pass is a bare callable or has no uuid."""

    def __init__(self, user, ours: MoELoopPass):
        self.user, self.ours = user, ours

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = True) -> None:
        if _INFERENCE_AWARE is not None and isinstance(self.user, _INFERENCE_AWARE):
            self.user(graph, is_inference=is_inference)
        else:
            self.user(graph)
        self.ours(graph)

    def uuid(self):
        user = self.user.uuid() if isinstance(self.user, _cgp.CustomGraphPass) else None
        return None if user is None else (user, self.ours.uuid())


_PASS = MoELoopPass()
# (hook value before install, hook value we set, dynamo flag before install) while installed
_state: tuple | None = None


def _with_ours(current, force_chain: bool):
    if current is None:
        return _PASS
    if isinstance(current, (list, tuple)):
        return [*current, _PASS]
    if _HOOK_TAKES_LIST and not force_chain:
        return [current, _PASS]
    return _Chained(current, _PASS)


def _in_hook(value) -> bool:
    if value is _PASS:
        return True
    if isinstance(value, (list, tuple)):
        return any(_in_hook(v) for v in value)
    return isinstance(value, _Chained) and value.ours is _PASS


def is_installed() -> bool:
    """Whether the next compile runs the pass: installed, and neither the hook nor the
    Dynamo flag changed since (by code that set them without knowing of it)."""
    return (_state is not None and _in_hook(getattr(inductor_config, _HOOK))
            and dynamo_config.capture_dynamic_output_shape_ops)


def install(*, _force_chain: bool = False) -> None:
    """Turns the pass on for every Inductor compile in this process (idempotent).

    Adds the pass to ``torch._inductor.config.post_grad_custom_pre_pass`` next to any
    pass already there, and sets ``torch._dynamo.config.capture_dynamic_output_shape_ops``
    so that ``torch.where(mask)`` in the loop is captured without a graph break.  If
    either was changed since an earlier ``install()``, the pass is added again (with a
    warning).  ``_force_chain`` composes as torch 2.11/2.12 must (tests use it on newer
    torch)."""
    global _state
    if is_installed():
        return
    current = getattr(inductor_config, _HOOK)
    if _state is None:
        before, capture = current, dynamo_config.capture_dynamic_output_shape_ops
    else:
        log.warning("fp8_moe_ops.passes: %s or capture_dynamic_output_shape_ops was changed since install(); "
                    "installing again", _HOOK)
        # uninstall() then restores the hook as changed, without this pass, and the first flag
        before, capture = (_state[0] if _in_hook(current) else current), _state[2]
    ours = current if _in_hook(current) else _with_ours(current, _force_chain)
    setattr(inductor_config, _HOOK, ours)
    _state = (before, ours, capture)
    dynamo_config.capture_dynamic_output_shape_ops = True


def uninstall() -> None:
    """Turns the pass off and restores what :func:`install` changed (idempotent).

    If the hook was changed after ``install``, only this pass is taken out of it."""
    global _state
    if _state is None:
        return
    before, ours, capture = _state
    current = getattr(inductor_config, _HOOK)
    if current is ours:
        setattr(inductor_config, _HOOK, before)
    elif isinstance(current, (list, tuple)) and _PASS in current:
        rest = [p for p in current if p is not _PASS]
        setattr(inductor_config, _HOOK, rest or None)
    elif current is _PASS:
        setattr(inductor_config, _HOOK, None)
    else:
        log.warning("fp8_moe_ops.passes: %s was changed since install(); this pass is no longer in it", _HOOK)
    dynamo_config.capture_dynamic_output_shape_ops = capture
    _state = None


@contextlib.contextmanager
def enabled():
    """Context manager: the pass is on inside, and off after unless it was installed
    before (even where other code has since changed the hook or the flag, which the
    ``install()`` inside repairs: a permanent install outlives the block)."""
    was_on = _state is not None
    install()
    try:
        yield
    finally:
        if not was_on:
            uninstall()
