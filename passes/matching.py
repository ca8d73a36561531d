"""Matching: find an unrolled loop over experts in a post-grad graph and prove it
computes what one ``fp8_moe::grouped_experts`` call computes (``rewrite.py`` replaces it).

What an unrolled loop looks like post-grad (one iteration, expert ``e``)::

    mask  = eq.Scalar(top_k_index, e)              # or select(permute(one_hot), 0, e)
    nz    = nonzero(mask); tok, pos = unbind(nz, 1) # (roles swap for a (k, T) mask)
    x     = index.Tensor(hidden, [tok])             # or index_select / [None, tok].reshape
    h     = fp8_moe.linear(x, W_gu[e], S_gu[e], bs) # or w1(x) and w3(x)
    a     = act(gate) * up                          # see activations.py
    y     = fp8_moe.linear(a, W_d[e], S_d[e], bs)
    acc_e = index_put(acc_{e-1}, [tok], y * w[tok, pos, None], accumulate=True)
                                                    # or index_add(acc, 0, tok, ...)

The pass walks every accumulation chain (``index_put``/``index_add`` steps starting
from a zero tensor). :func:`find_loop` decides whether a chain is a loop over experts
at all (rows from ``nonzero``, ``fp8_moe::linear`` inside: a :class:`Candidate`);
:func:`prove` then proves each step is such an iteration (an :class:`Iteration`) and
that the steps together cover experts ``0..E-1`` of the same weights (a :class:`Loop`),
and only then does ``rewrite.py`` rewrite.  Anything it
cannot prove is counted and logged, never rewritten: a wrong rewrite is the worst bug
this package can have; a missed one costs only speed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.fx import Node
from torch._inductor.virtualized import V
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

import fp8_moe_ops.ops  # noqa: F401  (registers the torch.ops.fp8_moe ops read below)

from .activations import match_activation

aten = torch.ops.aten
prims = torch.ops.prims
LINEAR = torch.ops.fp8_moe.linear.default
GROUPED = torch.ops.fp8_moe.grouped_experts.default
GROUPED_LIST = torch.ops.fp8_moe.grouped_experts_list.default
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class Skip(Exception):
    """A loop that is left as it is; ``static`` says why in the counter's name."""

    def __init__(self, reason: str, static: bool = False, experts: int | None = None):
        super().__init__(reason)
        self.static = static
        self.experts = experts  # the loop's expert steps, where not every step of its chain is one


# --------------------------------------------------------------------------- small helpers


def is_call(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _dtype(n):
    v = _val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape_of(n) -> tuple:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def same_size(a, b) -> bool:
    return statically_known_true(a == b)


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def same_or_guarded(a: tuple, b: tuple) -> bool:
    """Whether two shapes of activations (hidden states, ids, routing weights, the
    accumulator, a gathered row block) agree.  Under ``torch.compile(dynamic=True)``, or
    once Dynamo makes the token count dynamic (a second batch size), each input's sizes
    are their own symbols, and nothing in the graph proves that two inputs have as many
    rows, or that the hidden width equals a model's constant ``H`` (``hidden[None,
    tok].reshape(-1, H)``, ``torch.zeros(T, H)``).  Under ``torch.compile`` they must then
    be equal in this compilation's example, and the equality becomes a guard, so an input
    where they differ recompiles.  Ahead of time (AOTInductor) no guard is checked at run
    time, so only a proven equality counts (export the three inputs with one ``Dim`` for
    the token count)."""
    if V.aot_compilation:
        return _same_shape(a, b)
    return len(a) == len(b) and all(guard_or_false(x == y) for x, y in zip(a, b))


def _arg(n: Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _widen(n):
    """Strips exact casts (bf16/fp16/fp32 -> fp32, or to the same dtype)."""
    while is_call(n, prims.convert_element_type.default):
        src, dst = _dtype(n.args[0]), n.args[1]
        if src not in _FLOATS or dst not in (torch.float32, src):
            break
        n = n.args[0]
    return n


META_ASSERT = aten._assert_tensor_metadata.default


def users_of(n: Node) -> list:
    """Users that compute something; torch.export adds ``_assert_tensor_metadata``
    checks of static metadata, which Inductor drops right after this pass anyway."""
    return [u for u in n.users if not is_call(u, META_ASSERT)]


def _linear_args(n: Node):
    """(x, w, w_scale_inv, block_size, act_scale, out_dtype) of an fp8_moe.linear node."""
    return (*n.args[:4], _arg(n, 4, "act_scale"), _arg(n, 5, "out_dtype"))


def _is_zeros(n) -> bool:
    if is_call(n, aten.permute.default):  # zeros_like of a transposed tensor
        return _is_zeros(n.args[0])
    if is_call(n, aten.zeros.default):
        return True
    if is_call(n, aten.full.default):
        fill = n.args[1]
        return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0
    return False


class Step(NamedTuple):
    """One accumulation step: ``value`` added into rows ``rows`` of ``acc`` (``via``: the
    nodes that repeat ``rows`` into a scatter's index; ``links``: copies of ``acc`` the
    step adds into instead, which only it reads)."""

    acc: Node
    rows: Node
    value: Node
    via: tuple = ()
    links: tuple = ()


ACCUMULATIONS = (aten.index_put.default, aten.index_add.default, aten.scatter_add.default)


def _repeated_rows(index: Node, columns) -> tuple | None:
    """(rows, the nodes between) where ``index`` is the 1-D ``rows`` repeated along all
    ``columns`` columns: ``rows[:, None].expand(-1, columns)`` (unsqueeze, expand)."""
    if is_call(index, aten.expand.default) and is_call(index.args[0], aten.unsqueeze.default):
        unsqueezed = index.args[0]
        rows = unsqueezed.args[0]
        if unsqueezed.args[1] in (1, -1) and len(shape_of(rows)) == 1 and len(shape_of(index)) == 2 \
                and same_size(shape_of(index)[1], columns):
            return rows, (unsqueezed, index)
    return None


def accumulation_step(n) -> Step | None:
    """``n`` as an accumulation step, its accumulator past any copies of it that only ``n``
    reads: functionalization copies a non-contiguous accumulator (zeros_like of a
    transposed tensor) to a contiguous one between two in-place adds."""
    step = _accumulation(n)
    if step is None:
        return None
    acc, links, reader = step.acc, (), n
    while is_call(acc, aten.clone.default) and users_of(acc) == [reader]:
        links, reader, acc = (acc, *links), acc, acc.args[0]
    return step._replace(acc=acc, links=links)


def _accumulation(n) -> Step | None:
    if is_call(n, aten.index_put.default):
        acc, indices, value = n.args[:3]
        if _arg(n, 3, "accumulate", False) is True and len(indices) == 1 and isinstance(indices[0], Node):
            return Step(acc, indices[0], value)
    if is_call(n, aten.index_add.default):
        acc, dim, rows, value = n.args[:4]
        if dim in (0, -2) and _arg(n, 4, "alpha", 1) == 1:
            return Step(acc, rows, value)
    if is_call(n, aten.scatter_add.default):
        # out.scatter_add_(0, rows[:, None].expand(-1, H), value): index_add's sum where the
        # index covers every column of the (rows, H) accumulator and all of value
        acc, dim, index, value = n.args[:4]
        acc_shape = shape_of(acc)
        found = _repeated_rows(index, acc_shape[1]) if len(acc_shape) == 2 and dim in (0, -2) else None
        if found is not None and _same_shape(shape_of(value), shape_of(index)):
            return Step(acc, found[0], value, found[1])
    return None


# --------------------------------------------------------------------------- routing


def _coord(n):
    """(nz, c) if ``n`` is coordinate column ``c`` of ``nz = nonzero(mask)``."""
    if is_call(n, operator.getitem) and is_call(n.args[0], aten.unbind.int):
        ub, c = n.args
        nz, dim = ub.args[0], _arg(ub, 1, "dim", 0)
        if is_call(nz, aten.nonzero.default) and dim in (1, -1):
            return nz, c
    if is_call(n, aten.select.int) and is_call(n.args[0], aten.nonzero.default) and n.args[1] in (1, -1):
        return n.args[0], n.args[2]
    return None


def _strip_int_casts(n):
    while is_call(n, prims.convert_element_type.default) and not n.args[1].is_floating_point:
        n = n.args[0]
    return n


def _one_hot(n):
    """(top_k_index, E) if ``n`` is ``one_hot(top_k_index, E)`` (T, k, E)."""
    n = _strip_int_casts(n)
    if not is_call(n, aten.eq.Tensor):
        return None
    for col, iota in (n.args, reversed(n.args)):
        if (is_call(col, aten.unsqueeze.default) and col.args[1] in (-1, 2) and is_call(iota, prims.iota.default)
                and iota.kwargs.get("start") == 0 and iota.kwargs.get("step") == 1 and len(shape_of(col.args[0])) == 2):
            return col.args[0], iota.args[0]
    return None


def _mask(n):
    """(top_k_index, e, transposed) if ``n`` is the expert-``e`` mask over (T, k),
    or over (k, T) when ``transposed`` (the one-hot ``permute(2, 1, 0)[e]`` form)."""
    n = _strip_int_casts(n)
    if is_call(n, aten.eq.Scalar):
        x, e = n.args
        if len(shape_of(x)) == 2 and isinstance(e, int) and not isinstance(e, bool):
            return x, e, False
        return None
    if is_call(n, aten.select.int):
        src, dim, e = n.args
        if is_call(src, aten.permute.default) and dim == 0:
            perm = [d % 3 for d in src.args[1]]
            oh = _one_hot(src.args[0])
            if oh and perm[0] == 2 and 0 <= e < oh[1]:
                return oh[0], e, perm[1:] == [1, 0]
        oh = _one_hot(src)
        if oh and dim in (2, -1) and 0 <= e < oh[1]:
            return oh[0], e, False
    return None


def _gather(n):
    """(src, rows) if ``n`` is ``src[rows]`` for a 2-D ``src``."""
    if is_call(n, aten.index.Tensor) and len(n.args[1]) == 1 and len(shape_of(n.args[0])) == 2:
        return n.args[0], n.args[1][0]
    if is_call(n, aten.index_select.default) and n.args[1] in (0, -2) and len(shape_of(n.args[0])) == 2:
        return n.args[0], n.args[2]
    if is_call(n, *_VIEWS) and len(shape_of(n)) == 2:
        # hidden[None, rows].reshape(-1, H): (1, n, H) -> (n, H)
        inner = n.args[0]
        if is_call(inner, aten.index.Tensor) and len(inner.args[1]) == 2 and inner.args[1][0] is None:
            u = inner.args[0]
            if (is_call(u, aten.unsqueeze.default) and u.args[1] == 0 and len(shape_of(u.args[0])) == 2
                    and same_or_guarded(shape_of(n)[1:], shape_of(u.args[0])[1:])):
                return u.args[0], inner.args[1][1]
    return None


def _routing(n):
    """(weights, rows, cols) if ``n`` is ``weights[rows, cols]`` as an (n, 1) column."""
    n = _widen(n)
    if is_call(n, aten.index.Tensor) and len(n.args[1]) == 2:
        u = n.args[0]
        if is_call(u, aten.unsqueeze.default) and u.args[1] in (2, -1) and len(shape_of(u.args[0])) == 2:
            return u.args[0], *n.args[1]
    column = len(shape_of(n)) == 2 and same_size(shape_of(n)[1], 1)
    if (is_call(n, aten.unsqueeze.default) and n.args[1] in (1, -1)) or (is_call(n, *_VIEWS) and column):
        i = _widen(n.args[0])
        if is_call(i, aten.index.Tensor) and len(i.args[1]) == 2 and len(shape_of(i.args[0])) == 2 and len(shape_of(i)) == 1:
            return i.args[0], *i.args[1]
    return None


class _Operand(NamedTuple):
    """Where a gate or up operand comes from: a projection's whole output
    (``half`` None) or its first (0) or second (1) half along the columns."""

    linear: Node
    half: int | None


def _half(n) -> _Operand | None:
    n = _widen(n)
    if is_call(n, LINEAR):
        return _Operand(n, None)
    if is_call(n, operator.getitem) and is_call(n.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        sp, i = n.args
        src, size, dim = sp.args[0], sp.args[1], _arg(sp, 2, "dim", 0)
        lin = _widen(src)
        if is_call(lin, LINEAR) and dim in (1, -1) and i in (0, 1):
            N = shape_of(lin)[1]
            sizes = [size, size] if isinstance(size, int) else list(size)
            if len(sizes) == 2 and same_size(sizes[0] * 2, N) and same_size(sizes[1] * 2, N):
                return _Operand(lin, i)
    if is_call(n, aten.slice.Tensor):
        src, dim = n.args[0], _arg(n, 1, "dim", 0)
        start, end, step = _arg(n, 2, "start", 0), _arg(n, 3, "end", None), _arg(n, 4, "step", 1)
        lin = _widen(src)
        if is_call(lin, LINEAR) and dim in (1, -1) and step == 1:
            N = shape_of(lin)[1]
            if start in (0, None) and end is not None and same_size(end * 2, N):
                return _Operand(lin, 0)
            if isinstance(start, int) and same_size(start * 2, N) and (end is None or statically_known_true(end >= N)):
                return _Operand(lin, 1)
    return None


# --------------------------------------------------------------------------- one iteration


class Projection(NamedTuple):
    """The weight and scale operands of one expert's ``fp8_moe::linear``."""

    weight: Node
    scale: Node


class Activation(NamedTuple):
    name: str  # the op's activation argument
    variant: str  # "float32" or "native" (activations.py)
    spelling: int  # index into activations.SPELLINGS[name]
    limit: float | None  # swiglu_limit


@dataclass
class Iteration:
    """One proven iteration of the loop: expert ``expert``'s computation."""

    expert: int
    nz: Node
    hidden: Node
    top_k_index: Node
    top_k_weights: Node
    gate_up: Projection  # fused (2I, H); the gate (I, H) when ``up`` is set
    up: Projection | None  # a separate up projection (Mixtral's w3)
    down: Projection
    block_size: list
    activation: Activation
    exact: bool  # same roundings as the grouped op


def _projection(lin: Node) -> Projection:
    return Projection(*_linear_args(lin)[1:3])


def _match_iter(rows: Node, value: Node, acc_dtype: torch.dtype) -> Iteration:
    nz, c = _coord(rows)
    mask = _mask(nz.args[0])
    if mask is None:
        raise Skip("the expert mask is neither top_k_index == e nor a one-hot expert mask")
    top_k_index, e, transposed = mask
    tok_c, pos_c = (1, 0) if transposed else (0, 1)
    if c != tok_c:
        raise Skip("rows are accumulated at the top-k positions, not at the tokens")

    def is_coord(n, col):
        return _coord(n) == (nz, col)

    v = value
    if is_call(v, prims.convert_element_type.default) and v.args[1] == acc_dtype:
        v = v.args[0]  # .to(out.dtype): a no-op, or one rounding the grouped op does not need
    if not is_call(v, aten.mul.Tensor):
        raise Skip("the expert output is not multiplied by its routing weight just before accumulation")
    for y, r in (v.args, reversed(v.args)):
        down, rw = _widen(y), _routing(r)
        if is_call(down, LINEAR) and rw is not None:
            break
    else:
        raise Skip("the accumulated value is not down_proj(...) * routing_weight[tok, pos]")
    top_k_weights, rw_tok, rw_pos = rw
    if not (is_coord(rw_tok, tok_c) and is_coord(rw_pos, pos_c)):
        raise Skip("the routing weight is not top_k_weights[tok, pos] of this expert's tokens")
    if not same_or_guarded(shape_of(top_k_weights), shape_of(top_k_index)) or _dtype(top_k_weights) not in _FLOATS:
        raise Skip("routing weights and top_k_index differ in shape, or the weights are not bf16/fp16/fp32")

    a, wd, sd, bs, _, od = _linear_args(down)
    act_dtype = _dtype(a)
    if od not in (None, act_dtype):
        raise Skip(f"the down projection has out_dtype={od}")
    am = match_activation(a, act_dtype)
    if am is None:
        raise Skip("the down projection's input is not a supported gated activation act(gate) * up "
                   "(silu, gelu, gelu_tanh or relu, optional swiglu_limit clamps)")
    leaf_dtype = torch.float32 if am.variant == "float32" else act_dtype
    if _dtype(am.gate) != leaf_dtype or _dtype(am.up) != leaf_dtype:
        raise Skip("gate and up reach the activation in an unexpected dtype")
    if am.limit is not None and am.variant == "native" and torch.tensor(am.limit, dtype=act_dtype).item() != am.limit:
        raise Skip(f"swiglu_limit {am.limit} is not exact in {act_dtype}; its clamp would round differently")
    g, u = _half(am.gate), _half(am.up)
    if g is None or u is None:
        raise Skip("gate and up are not the two halves of one projection nor two projections of the same input")
    if g.half is not None and u.half is not None and g.linear is u.linear:
        if (g.half, u.half) != (0, 1):
            raise Skip("gate is not the first half of gate_up (halves swapped)")
        gu_linears = [g.linear]
    elif g.half is None and u.half is None and g.linear is not u.linear:
        gu_linears = [g.linear, u.linear]
    else:
        raise Skip("gate and up come from a mix of fused and separate projections")

    srcs = set()
    for lin in gu_linears:
        x, _, _, bs_i, _, od_i = _linear_args(lin)
        if od_i not in (None, _dtype(x)) or _dtype(lin) != act_dtype:
            raise Skip("a gate/up projection changes dtype")
        if list(bs_i) != list(bs):
            raise Skip(f"mixed block sizes in one expert: {list(bs_i)} and {list(bs)}")
        gat = _gather(x)
        if gat is None or not is_coord(gat[1], tok_c):
            raise Skip("the projection input is not hidden[tok] of this expert's tokens")
        srcs.add(gat[0])
    if len(srcs) != 1:
        raise Skip("gate and up read different inputs")
    hidden = srcs.pop()
    if _dtype(hidden) != act_dtype or act_dtype not in _FLOATS:
        raise Skip("the activation dtype differs from the hidden states dtype")
    # bitwise with the op only when every rounding matches fp8_moe_ops.functional.gated_activation
    # and the combine accumulates float32 products in float32
    exact = (am.variant == "float32" and am.spelling == 0 and _dtype(v) == torch.float32
             and acc_dtype == torch.float32)
    up = _projection(gu_linears[1]) if len(gu_linears) == 2 else None
    return Iteration(e, nz, hidden, top_k_index, top_k_weights, _projection(gu_linears[0]), up, Projection(wd, sd),
                     list(bs), Activation(am.activation, am.variant, am.spelling, am.limit), exact)


# --------------------------------------------------------------------------- the loop


def _body(value: Node, nz: Node) -> set:
    """Nodes on a path from ``nz`` to ``value``: this iteration's own computation."""
    back, stack = set(), [value]
    while stack:
        n = stack.pop()
        if n in back or not n > nz:  # graph order (fx keeps a sort key per node)
            continue
        back.add(n)
        stack.extend(n.all_input_nodes)
    body = set()
    for n in sorted(back):
        if any(i is nz or i in body for i in n.all_input_nodes):
            body.add(n)
    return body


_ASSERTS = (aten._assert_scalar.default, aten.sym_constrain_range_for_size.default)


def scalar_only(n: Node) -> bool:
    """Shape arithmetic and runtime asserts on sizes: what keeps a dead ``nonzero`` alive."""
    if n.op != "call_function":
        return False
    return n.target in _ASSERTS or isinstance(_val(n), (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float))


@dataclass
class Candidate:
    """An accumulation chain found to be a loop over experts (not yet proven equivalent)."""

    steps: list  # accumulation nodes, in graph order
    nzs: list  # the nonzero of each step
    bodies: list  # each step's own computation (set of nodes), from its nonzero to its value


@dataclass
class Loop:
    """A loop proven to compute what one grouped expert call computes."""

    steps: list  # accumulation nodes, in graph order
    iters: list  # Iteration, in expert order
    nzs: list
    nodes: set  # every node of every iteration (nonzero, body, step)
    targets: list  # nodes the grouped op replaces
    numerics: str  # how the grouped op's result relates to the loop's, for the log


def collect_chain(head: Node) -> list:
    steps, cur = [head], head
    while len(users_of(cur)) == 1:
        (u,) = users_of(cur)
        while is_call(u, aten.clone.default) and len(users_of(u)) == 1:  # a copy only the next step reads
            (u,) = users_of(u)
        s = accumulation_step(u)
        if s is None or s.acc is not cur:
            break
        steps.append(u)
        cur = u
    return steps


def read_modify_write_step(n) -> Step | None:
    """``acc[rows] += value``: an ``index_put`` (not accumulating) of ``acc``'s own rows
    ``rows`` plus ``value``.  No accumulation: where ``rows`` repeats a row, the last of
    its sums is kept, not their total."""
    if is_call(n, aten.index_put.default, aten.index_put_.default) and _arg(n, 3, "accumulate", False) is False:
        acc, indices, new = n.args[:3]
        if len(indices) == 1 and is_call(new, aten.add.Tensor):
            for read, value in (new.args[:2], new.args[1::-1]):
                if is_call(read, aten.index.Tensor) and read.args[0] is acc and list(read.args[1]) == list(indices):
                    return Step(acc, indices[0], value)
    return None


def chain_heads(graph, targets, step_of=accumulation_step) -> list:
    """First steps of chains (``step_of`` reads a node of ``targets`` as a step), in graph
    order: steps adding into something that is not itself a step.  A chain that forks
    is analysed once, from its head."""
    steps = sorted(n for t in targets for n in graph.find_nodes(op="call_function", target=t))
    return [n for n in steps if (step := step_of(n)) is not None and step_of(step.acc) is None]


def read_modify_write_chains(graph) -> list:
    """The chains of :func:`read_modify_write_step` steps, each step writing into the
    previous one's result, from their heads."""
    chains = []
    for head in chain_heads(graph, (aten.index_put.default, aten.index_put_.default), read_modify_write_step):
        chain = [head]
        while True:
            nxt = [u for u in users_of(chain[-1])
                   if (step := read_modify_write_step(u)) is not None and step.acc is chain[-1]]
            if len(nxt) != 1:
                break
            chain.append(nxt[0])
        chains.append(chain)
    return chains


def find_loop(steps: list, step_of=accumulation_step) -> Candidate | None:
    """The chain as a loop over experts, or None when it is none: every step (as
    ``step_of`` reads it) adds rows selected by a ``nonzero`` (possibly through an
    integer cast), and the steps' bodies call ``fp8_moe::linear``.  Raises Skip for a
    chain whose steps with such rows call it with static activation scales (``static``),
    or where other steps add other rows."""
    nzs, bodies, strays = [], [], 0
    for s in steps:
        step = step_of(s)
        co = _coord(_strip_int_casts(step.rows))
        if co is None:
            strays += 1
            continue
        nzs.append(co[0])
        bodies.append(_body(step.value, co[0]))
    linears = [n for b in bodies for n in b if is_call(n, LINEAR)]
    if not linears:
        return None
    if any(_linear_args(n)[4] is not None for n in linears):  # before any other reason: counted as static
        raise Skip("its activation scheme is static (fp8_moe::linear has an act_scale)", static=True)
    if strays:
        raise Skip(f"{strays} of the {len(steps)} steps of its accumulation add{'s' if strays == 1 else ''} rows "
                   f"that no torch.where of top_k_index selects (say a shared term added into the same accumulator)",
                   experts=len(steps) - strays)
    return Candidate(steps, nzs, bodies)


def prove(c: Candidate) -> Loop:
    """The proof that the loop equals one grouped expert call; raises Skip (with the
    reason) for a loop that is left eager."""
    steps = c.steps  # (find_loop has refused a static scheme)
    if any(_coord(accumulation_step(s).rows) is None for s in steps):
        # e.g. index_add_(0, tok.int(), ...): an expert loop, but not a spelling we prove
        raise Skip("the token index of an accumulation step is a cast torch.where coordinate")

    acc = accumulation_step(steps[0]).acc
    if not _is_zeros(acc):
        raise Skip("the accumulator does not start as a zero tensor")
    last = steps[-1]
    # collect_chain stops at a step with several users; one of them continuing the chain means a
    # partial sum is also used elsewhere
    if any(accumulation_step(u) is not None and accumulation_step(u).acc is last for u in users_of(last)):
        raise Skip("a partial sum of the loop is used outside the loop")
    acc_dtype = _dtype(acc)

    iters, nodes = [], set(steps)
    for s, nz, body in zip(steps, c.nzs, c.bodies):
        step = accumulation_step(s)
        nodes |= body | {nz, *step.via, *step.links}
        it = _match_iter(step.rows, step.value, acc_dtype)
        inside = body | {s, *step.via}
        for n in [nz, *body]:
            outside = [u for u in users_of(n) if u not in inside and not scalar_only(u)]
            if any(u.op == "output" for u in outside):
                # a forward whose inputs require grad also returns what its backward reads
                raise Skip("an intermediate result of an expert is used outside the loop (an output of the graph: "
                           "returned by the model, or saved for the backward where an input requires grad, which "
                           "torch.no_grad() or torch.inference_mode() avoids)")
            if outside:
                raise Skip("an intermediate result of an expert is used outside the loop")
        iters.append(it)

    first = iters[0]
    for it in iters[1:]:
        if (it.hidden, it.top_k_index, it.top_k_weights) != (first.hidden, first.top_k_index, first.top_k_weights):
            raise Skip("experts read different hidden states or routing tensors")
        if it.block_size != first.block_size:
            raise Skip(f"mixed block sizes: {first.block_size} and {it.block_size}")
        if it.activation != first.activation:
            a, b = first.activation, it.activation
            raise Skip(f"experts use different activations: {a.name} (swiglu_limit {a.limit}) and {b.name} "
                       f"(swiglu_limit {b.limit})" if a.name == b.name else
                       f"experts use different activations: {a.name} and {b.name}")
        if (it.up is None) != (first.up is None):
            raise Skip("some experts use fused gate_up weights, others separate gate and up")
    ids = sorted(it.expert for it in iters)
    if ids != list(range(len(iters))):
        raise Skip(f"the loop does not visit experts 0..E-1 once each (visits {ids})")
    # the grouped op adds a token's experts in ascending id: the loop's order if it visits them so
    in_order = [it.expert for it in iters] == ids
    iters.sort(key=lambda it: it.expert)

    hidden_dtype = _dtype(first.hidden)
    hs = shape_of(first.hidden)
    if not same_or_guarded(shape_of(acc), hs) or _val(acc).device != _val(first.hidden).device:
        raise Skip("the accumulator's shape or device is not that of the hidden states")
    if not same_or_guarded(shape_of(first.top_k_index)[:1], hs[:1]):
        raise Skip("top_k_index does not have one row per token")
    if _dtype(first.top_k_index) not in (torch.int32, torch.int64):
        raise Skip("top_k_index is not int32/int64")
    if acc_dtype == hidden_dtype:
        targets = [last]
    elif acc_dtype == torch.float32:
        targets = users_of(last)
        if not targets or any(not (is_call(t, prims.convert_element_type.default) and t.args[1] == hidden_dtype)
                              for t in targets):
            raise Skip(f"the float32 accumulator is used in float32, not only cast back to {hidden_dtype}")
    else:
        raise Skip(f"the accumulator dtype {acc_dtype} is neither float32 nor the hidden dtype {hidden_dtype}")
    if not all(it.exact for it in iters):
        numerics = "more accurate than the loop: fewer roundings"
    elif in_order:
        numerics = "bitwise equal to eager"
    else:
        numerics = "equal to eager up to the order of each token's float32 sum (the loop adds experts in another order)"
    return Loop(steps, iters, [it.nz for it in iters], nodes, targets, numerics)
