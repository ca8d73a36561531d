"""Gated-activation templates: how ``act(gate) * up`` looks in a post-grad graph.

Post-grad graphs hold decomposed activations (silu as neg/exp/add/div, gelu as erf
ops, tanh-gelu as tanh ops).  Rather than hand-writing each decomposition (and
getting it subtly wrong on the next torch), every template is *traced* from a plain
PyTorch function with Inductor's own decomposition table, then compared node by node
with the candidate subgraph.  Constants are compared exactly, so "gelu" (erf) and
"gelu_tanh" (tanh, 0.7978..., 0.044715) can never be confused, and a hand-written
variant with other constants does not match.

Each template is one of two numeric variants:

* ``"float32"``: ``(act(gate.float()) * up.float()).to(dtype)`` -- the numerics of
  ``fp8_moe_ops.functional.gated_activation`` (and of the grouped op): exact after the rewrite;
* ``"native"``: ``act(gate) * up`` computed in the activation dtype, as model files
  write it (``act_fn(w1(x)) * w3(x)`` in bf16).  The grouped op computes the same in
  float32 from the same rounded inputs and rounds once, so it is at least as accurate.

A ``swiglu_limit`` clamp (gate ``max=L``, up ``[-L, L]``) is traced with a sentinel
limit that the matcher binds to the candidate's constant.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A limit value no model uses, so that the traced clamp constants can be recognised.
LIMIT_SENTINEL = 1234.5

_COMMUTATIVE = {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor}


def _gelu_tanh_formula(x):
    # transformers' NewGELUActivation ("gelu_new"): the same function as
    # F.gelu(approximate="tanh"), spelled out.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# activation name -> spellings found in model files, each the same function.
SPELLINGS = {
    "silu": (F.silu, lambda x: x * torch.sigmoid(x)),
    "gelu": (F.gelu,),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), _gelu_tanh_formula),
    "relu": (F.relu,),
}


@dataclass(frozen=True)
class Template:
    activation: str
    variant: str  # "float32" or "native"
    clamped: bool
    spelling: int  # index into SPELLINGS[activation]; 0 is the reference's own
    graph: torch.fx.Graph

    @property
    def output(self) -> torch.fx.Node:
        out = next(iter(reversed(self.graph.nodes)))
        return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


def _make_fn(act, variant: str, clamped: bool, dtype: torch.dtype):
    def fn(gate, up):
        if clamped:
            gate = gate.clamp(max=LIMIT_SENTINEL)
            up = up.clamp(min=-LIMIT_SENTINEL, max=LIMIT_SENTINEL)
        y = act(gate) * up
        return y.to(dtype) if variant == "float32" else y

    return fn


@functools.cache
def templates(dtype: torch.dtype) -> tuple[Template, ...]:
    """All templates for activations of ``dtype`` (bf16, fp16 or fp32), traced once."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # first called from inside a compile: trace with real tensors
        return _trace_all(fwd_only, dtype)


def _trace_all(fwd_only, dtype: torch.dtype) -> tuple[Template, ...]:
    out = []
    variants = ("float32",) if dtype == torch.float32 else ("float32", "native")
    for name, spellings in SPELLINGS.items():
        for i, act in enumerate(spellings):
            for variant in variants:
                # Clamped first: an unclamped template would bind "gate" to the clamp.
                for clamped in (True, False):
                    in_dtype = torch.float32 if variant == "float32" else dtype
                    ex = [torch.ones(4, 8, dtype=in_dtype) for _ in range(2)]  # values unused; no RNG draw
                    gm = fwd_only(_make_fn(act, variant, clamped, dtype), ex)
                    out.append(Template(name, variant, clamped, i, gm.graph))
    return tuple(out)


class _Matcher:
    """Structural equality of a template subgraph and a candidate subgraph.

    Template placeholders bind to candidate nodes (``env``); the sentinel limit binds
    to one float (``limit``).  Template nodes used twice must map to candidate nodes
    that compute the same thing (identical, or structurally equal duplicates)."""

    def __init__(self):
        self.env: dict[str, torch.fx.Node] = {}
        self.limit: float | None = None

    def node(self, t: torch.fx.Node, c) -> bool:
        if t.op == "placeholder":
            bound = self.env.setdefault(t.target, c)
            return bound is c
        if not isinstance(c, torch.fx.Node) or c.op != "call_function" or c.target != t.target:
            return False
        if set(t.kwargs) != set(c.kwargs) or len(t.args) != len(c.args):
            return False
        for k in t.kwargs:
            if not self.value(t.kwargs[k], c.kwargs[k]):
                return False
        if t.target in _COMMUTATIVE and len(t.args) == 2:
            saved = (dict(self.env), self.limit)
            if self.value(t.args[0], c.args[0]) and self.value(t.args[1], c.args[1]):
                return True
            self.env, self.limit = saved
            return self.value(t.args[0], c.args[1]) and self.value(t.args[1], c.args[0])
        return all(self.value(a, b) for a, b in zip(t.args, c.args))

    def value(self, t, c) -> bool:
        if isinstance(t, torch.fx.Node):
            return self.node(t, c)
        if isinstance(t, (list, tuple)):
            return isinstance(c, (list, tuple)) and len(t) == len(c) and all(map(self.value, t, c))
        if isinstance(t, float) and abs(t) == LIMIT_SENTINEL:
            if not isinstance(c, (float, int)) or isinstance(c, bool):
                return False
            limit = float(c) * math.copysign(1.0, t)
            if self.limit is None:
                self.limit = limit
            return self.limit == limit and limit > 0
        if isinstance(c, torch.fx.Node) or type(t) is not type(c):
            # 1 vs 1.0 are different constants to a graph (int vs float promotion).
            return False
        return operator.eq(t, c)


@dataclass
class ActivationMatch:
    activation: str
    variant: str
    spelling: int
    gate: torch.fx.Node
    up: torch.fx.Node
    limit: float | None


def match_activation(node: torch.fx.Node, dtype: torch.dtype) -> ActivationMatch | None:
    """Matches ``node`` (the input of a down projection) against every template."""
    for t in templates(dtype):
        m = _Matcher()
        gate, up = (p.target for p in t.graph.find_nodes(op="placeholder"))
        if m.node(t.output, node) and {gate, up} <= set(m.env):
            return ActivationMatch(t.activation, t.variant, t.spelling, m.env[gate], m.env[up],
                                   m.limit if t.clamped else None)
    return None
