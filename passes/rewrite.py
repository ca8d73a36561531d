"""Rewriting: insert one grouped expert call in place of a loop proven by
``matching.py`` -- ``fp8_moe::grouped_experts`` when the experts' weights are the rows
of stacked tensors, else ``fp8_moe::grouped_experts_list`` on the per-expert tensors
(``nn.ModuleList`` experts) -- never copying a weight; erase the loop and the range
asserts that would keep its ``nonzero``s alive; plus the entry point that counts and
logs what was done."""

from __future__ import annotations

import functools
import logging

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node

import fp8_moe_ops.ops

from .matching import (
    ACCUMULATIONS, GROUPED, GROUPED_LIST, LINEAR, META_ASSERT, Loop, Skip, _linear_args, accumulation_step, aten,
    chain_heads, collect_chain, find_loop, is_call, prove, read_modify_write_chains, read_modify_write_step,
    same_size, scalar_only, shape_of,
)

log = logging.getLogger("fp8_moe_ops.passes")


# --------------------------------------------------------------------------- weights


def _attr(gm, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def _common_base(ts: list, what: str):
    """The (E, ...) tensor whose rows are exactly ``ts`` (frozen ``w[e]`` views of a
    stacked parameter), or None; raises Skip, as :func:`_stacked` for the unfrozen
    graph, where they are rows of one but not each expert's own, or not all of them."""
    base = ts[0]._base
    if (base is not None and base.dim() == ts[0].dim() + 1 and base.is_contiguous()
            and all(t._base is base and t.dtype == base.dtype for t in ts)):
        rows = [_row_of(base, t) for t in ts]
        if None not in rows:
            if rows != list(range(len(ts))):
                raise Skip(f"experts 0..{len(ts) - 1} use {what} {rows} of the stacked tensor, not their own")
            if base.shape[0] != len(ts):
                raise Skip(f"the loop covers {len(ts)} of the {base.shape[0]} experts of its {what}")
            return base
    return None


def _row_of(base: torch.Tensor, t: torch.Tensor) -> int | None:
    """Which row ``base[i]`` the view ``t`` of contiguous ``base`` is, or None."""
    row_bytes = base.stride(0) * base.element_size()
    offset = t.data_ptr() - base.data_ptr()
    if row_bytes == 0 or offset % row_bytes or not 0 <= offset // row_bytes < base.shape[0]:
        return None
    i = offset // row_bytes
    return i if t.shape == base[i].shape and t.stride() == base[i].stride() else None


def _stacked(gm, nodes: list, what: str):
    """The stacked (E, ...) tensor the experts' ``nodes`` are the rows of: a node
    (``select.int`` of a graph tensor) or a real tensor (the base of frozen views) to
    add as a constant; None for separate per-expert tensors (``nn.ModuleList``)."""
    b = nodes[0].args[0] if is_call(nodes[0], aten.select.int) else None
    if b is not None and all(is_call(n, aten.select.int) and n.args[0] is b and n.args[1] == 0 for n in nodes):
        used = [n.args[2] for n in nodes]
        if used != list(range(len(nodes))):
            raise Skip(f"experts 0..{len(nodes) - 1} use {what} {used} of the stacked tensor, not their own")
        if not same_size(shape_of(b)[0], len(nodes)):
            raise Skip(f"the loop covers {len(nodes)} of the {shape_of(b)[0]} experts of its {what}")
        return b
    if all(n.op == "get_attr" for n in nodes):
        return _common_base([_attr(gm, n.target) for n in nodes], what)
    return None


def _operands(gm, loop: Loop):
    """(op, [gate_up, gate_up scales, down, down scales]): one stacked tensor each for
    ``grouped_experts`` when the weights are the rows of stacked tensors, else lists of
    the per-expert nodes for ``grouped_experts_list`` (weights read where they are)."""
    iters = loop.iters
    gate_up = [[it.gate_up.weight for it in iters], [it.gate_up.scale for it in iters]]
    down = [[it.down.weight for it in iters], [it.down.scale for it in iters]]
    if iters[0].up is None:  # fused gate_up
        names = ("gate_up weights", "gate_up scales", "down weights", "down scales")
        stacked = [_stacked(gm, nodes, what) for nodes, what in zip([*gate_up, *down], names)]
        if all(t is not None for t in stacked):
            return GROUPED, stacked
        return GROUPED_LIST, [*gate_up, *down]
    # separate gate (w1) and up (w3): every gate, then every up
    up = [[it.up.weight for it in iters], [it.up.scale for it in iters]]
    return GROUPED_LIST, [gate_up[0] + up[0], gate_up[1] + up[1], *down]


# --------------------------------------------------------------------------- rewrite


def _fake(gm, fake_mode, o):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if isinstance(o, list):
        return [_fake(gm, fake_mode, n) for n in o]
    if isinstance(o, Node) and isinstance(o.meta.get("val"), torch.Tensor):
        return o.meta["val"]
    real = _attr(gm, o.target) if isinstance(o, Node) else o
    with unset_fake_temporarily():
        fake = fake_mode.from_tensor(real, static_shapes=True)
    if isinstance(o, Node):
        o.meta["val"] = fake
    return fake


def _prepare(graph: Graph, loop: Loop) -> tuple:
    """What :func:`_rewrite` inserts for ``loop``, checked by the op's own checks (raises
    Skip where they refuse it); nothing in ``graph`` is changed yet."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gm = graph.owning_module
    first = loop.iters[0]
    bs = first.block_size
    with unset_fake_temporarily(), torch.no_grad():
        op, operands = _operands(gm, loop)
    from torch._guards import detect_fake_mode

    head = [first.hidden, first.top_k_index, first.top_k_weights]
    fake_mode = detect_fake_mode([n.meta["val"] for n in head])
    fakes = [_fake(gm, fake_mode, o) for o in operands]
    name, limit = first.activation.name, first.activation.limit
    args = (*[n.meta["val"] for n in head], *fakes, bs, name, None, None, limit)
    check = fp8_moe_ops.ops.check_experts if op is GROUPED else fp8_moe_ops.ops.check_experts_list
    try:
        # the op's own checks (never insert a call it rejects), first called directly:
        # raised inside the fake kernel, a TypeError also reaches torch's log as an error
        check(*args)
        with fake_mode:
            out_val = op(*args)
    except (TypeError, ValueError) as exc:
        raise Skip(f"{op.name()} rejects the loop's operands: {exc}") from exc
    return op, operands, fakes, head, out_val


def _rewrite(graph: Graph, loop: Loop, prepared: tuple) -> str:
    """Replaces ``loop`` with the call :func:`_prepare` made; returns the op's name."""
    op, operands, fakes, head, out_val = prepared
    gm = graph.owning_module
    first = loop.iters[0]
    bs, name, limit = first.block_size, first.activation.name, first.activation.limit
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    for i, o in enumerate(operands):
        if isinstance(o, torch.Tensor):
            attr = _new_attr_name(gm, ("gate_up_proj", "gate_up_scale_inv", "down_proj", "down_scale_inv")[i])
            gm.register_buffer(attr, o)
            with graph.inserting_before(anchor):
                node = graph.get_attr(attr)
            node.meta["val"] = fakes[i]
            operands[i] = node
    targets = sorted(loop.targets)  # graph order
    with graph.inserting_before(targets[0]):
        new = graph.call_function(op, (*head, *operands, bs, name, None, None, limit))
    new.meta["val"] = out_val
    new.meta["stack_trace"] = loop.steps[-1].meta.get("stack_trace")
    for n in loop.nodes | set(targets):
        for u in [u for u in n.users if is_call(u, META_ASSERT)]:
            graph.erase_node(u)
    for t in targets:
        t.replace_all_uses_with(new)
        if t not in loop.steps:
            graph.erase_node(t)
    for s in reversed(loop.steps):
        links = accumulation_step(s).links  # the copies of the accumulator that s adds into
        graph.erase_node(s)
        for link in reversed(links):
            graph.erase_node(link)
    graph.eliminate_dead_code()
    _erase_dead_nonzeros(graph, loop.nzs)
    return op.name()


def _new_attr_name(gm, role: str) -> str:
    i = 0
    while hasattr(gm, f"_fp8_moe_{role}_{i}"):
        i += 1
    return f"_fp8_moe_{role}_{i}"


def _other_nonzero_above(n: Node, nz: Node, down: set) -> bool:
    """Whether scalar node ``n`` is computed from the size of a nonzero other than ``nz``."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen or m is nz or m in down:
            continue
        seen.add(m)
        if is_call(m, aten.nonzero.default):
            return True
        if scalar_only(m):
            stack.extend(m.all_input_nodes)
    return False


def _erase_dead_nonzeros(graph: Graph, nzs: list) -> None:
    """Erases the range asserts on the unbacked sizes of nonzeros that nothing else
    uses: each one would otherwise keep its nonzero, and a device sync, alive.  An
    assert that also involves another, live nonzero is kept (and with it ``nz``)."""
    for nz in nzs:
        down, stack = set(), list(nz.users)
        while stack:
            n = stack.pop()
            if n in down:
                continue
            if not scalar_only(n):
                break  # a real use of this nonzero outside the loop: keep everything
            down.add(n)
            stack.extend(n.users)
        else:
            if any(_other_nonzero_above(i, nz, down) for n in down for i in n.all_input_nodes):
                continue
            for n in sorted(down, reverse=True):
                graph.erase_node(n)
    graph.eliminate_dead_code()


# --------------------------------------------------------------------------- entry point


def rewrite_moe_loops(graph: Graph) -> int:
    """Rewrites every provable expert loop of ``graph``; returns how many.  Every loop
    left eager is counted and logged: those it reads as loops with their reason, then
    the expert loops in no chain it reads (:func:`_unread_loops`).  An error of the pass
    itself while it reads the graph leaves the loop it was reading eager (counted, and
    logged as a warning with the traceback), or, in a search over the whole graph, that
    search's loops uncounted: never the compile's failure.  (A loop proven and checked is
    then rewritten in place; an error there, which would leave the graph half changed,
    propagates.)"""
    if not graph.find_nodes(op="call_function", target=LINEAR):
        return 0
    done, seen = 0, set()  # seen: the nodes above the chains counted as skipped
    for head in _guarded(lambda: chain_heads(graph, ACCUMULATIONS), []):
        if head._erased:  # dead code of an earlier rewrite
            continue
        steps = [head]
        try:
            steps = collect_chain(head)
            candidate = find_loop(steps)
            if candidate is None:
                continue
            loop = prove(candidate)
            prepared = _prepare(graph, loop)
        except Skip as skip:
            _skipped("static" if skip.static else "unsupported", steps, skip)
            seen |= _claimed(steps, accumulation_step)
            continue
        except Exception as exc:  # a bug of the pass: the loop stays as it is
            _failed(steps, exc)
            seen |= _claimed(steps, accumulation_step)
            continue
        op = _rewrite(graph, loop, prepared)
        counters["fp8_moe"]["loops_rewritten"] += 1
        done += 1
        log.info("fp8_moe_ops.passes: replaced a loop over %d experts with %s "
                 "(activation=%s, swiglu_limit=%s, %s)", len(steps), op, loop.iters[0].activation.name,
                 loop.iters[0].activation.limit, loop.numerics)
    for steps in _guarded(lambda: read_modify_write_chains(graph), []):
        kind = "unsupported"
        try:
            if find_loop(steps, read_modify_write_step) is None:
                continue
            reason = ("it combines with out[tok] += v, which keeps one sum of a token that top_k_index routes to an "
                      "expert twice (the grouped op adds both); out.index_add_(0, tok, v) is the combine it replaces")
        except Skip as skip:
            reason, kind = skip, ("static" if skip.static else "unsupported")
        except Exception as exc:
            _failed(steps, exc)
            seen |= _claimed(steps, read_modify_write_step)
            continue
        _skipped(kind, steps, reason)
        seen |= _claimed(steps, read_modify_write_step)
    _guarded(lambda: _unread_loops(graph, seen), None)
    return done


def _guarded(search, default):
    """``search()``, or ``default`` where it raises (a bug of the pass: logged as a
    warning, and what it would have found is left as it is)."""
    try:
        return search()
    except Exception as exc:
        log.warning("fp8_moe_ops.passes: the pass failed while searching the graph; what it would have found is "
                    "left eager and uncounted", exc_info=exc)
        return default


def _claimed(steps: list, step_of) -> set:
    """The nodes of a loop counted as skipped, for :func:`_unread_loops` (empty where
    finding them fails: a bug of the pass, logged)."""
    return _guarded(lambda: _above(_with_rest(steps, step_of)), set())


# how far above a node the searches for a loop's parts look (an expert's body is a
# handful of nodes deep: index, linear, activation, linear, product, accumulation)
_DEPTH = 16


def _with_rest(steps: list, step_of) -> list:
    """``steps`` and the steps that go on adding into the last of them (a chain read up
    to a partial sum used elsewhere stops there: the loop is all of them)."""
    steps, frontier = list(steps), [steps[-1]]
    while frontier:
        frontier = [u for n in frontier for u in n.users if (step := step_of(u)) is not None and step.acc is n]
        steps += frontier
    return steps


def _above(nodes) -> set:
    """The nodes up to ``_DEPTH`` inputs above ``nodes``, with them."""
    found, frontier = set(nodes), list(nodes)
    for _ in range(_DEPTH):
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in found]
        found.update(frontier)
        if not frontier:
            break
    return found


def _unary_above(n, depth: int = 6):
    """``n`` and the nodes above it through ops of one tensor input (views, casts,
    getitems), up to ``depth`` of them."""
    while isinstance(n, Node) and depth >= 0:
        yield n
        inputs = n.all_input_nodes
        if len(inputs) != 1:
            return
        n, depth = inputs[0], depth - 1


def _selected_rows(x) -> tuple | None:
    """(the routing tensor, the expert) where the rows of ``x`` (an ``fp8_moe::linear``
    input) are an expert's tokens: rows of a tensor indexed (``hidden[tok]``,
    ``hidden.index_select(0, tok)``, ``hidden[mask]``) by a boolean mask or a ``nonzero``
    of one, the mask computed from a comparison with an expert (:func:`_expert_of`); else
    None."""
    for n in _unary_above(x):
        if is_call(n, aten.index.Tensor):
            index = [i for i in n.args[1] if isinstance(i, Node)]
        elif is_call(n, aten.index_select.default):
            index = [n.args[2]]
        else:
            continue
        for i in index:
            masks = [i] if getattr(i.meta.get("val"), "dtype", None) == torch.bool else \
                [m.args[0] for m in _unary_above(i) if is_call(m, aten.nonzero.default)][:1]
            for mask in masks:
                found = _expert_of(mask)
                if found is not None:
                    return found
        return None
    return None


def _root(n: Node) -> Node:
    """The topmost node above ``n`` through ops of one tensor input (views written inside
    a loop are new nodes on each pass; their root is the tensor they view)."""
    top = n
    for top in _unary_above(n, depth=8):
        pass
    return top


_COMPARED = (aten.eq.Scalar, aten.eq.Tensor)


def _expert_of(mask: Node) -> tuple | None:
    """(the routing tensor, the expert) that ``mask`` selects, from the comparisons a few
    nodes above it: ``top_k_index == e`` (also of a view or a column of it, or ``|`` of
    such) gives (the root of ``top_k_index``, e); a row of a computed tensor (a one-hot
    of ``top_k_index``: ``one_hot(top_k_index).permute(2, 1, 0)[e]``, or a column of its
    sum) gives (its root, the row).  None where neither is found (a padding mask, a label
    mask, a row of a mask given as input)."""
    frontier, seen = [mask], {mask}
    for _ in range(8):
        nxt = []
        for n in frontier:
            if is_call(n, *_COMPARED) and isinstance(n.args[0], Node):
                other = n.args[1]  # a number, or a constant tensor of its own
                if not isinstance(other, Node) or other.op == "get_attr" or not other.all_input_nodes:
                    return _root(n.args[0]), ("==", other)
            if is_call(n, aten.select.int) and isinstance(n.args[0], Node):
                top = _root(n.args[0])
                if top.op == "call_function":  # computed (a one-hot of top_k_index), not a mask given as input
                    if is_call(top, *_COMPARED) and isinstance(top.args[0], Node):
                        top = _root(top.args[0])  # the one-hot's top_k_index (one-hots made per expert too)
                    return top, ("row", n.args[1], n.args[2])  # (before the one-hot's own comparison)
            for i in n.all_input_nodes:
                if i not in seen:
                    seen.add(i)
                    nxt.append(i)
        frontier = nxt
    return None


def _unread_loops(graph: Graph, seen: set) -> None:
    """Counts the expert loops that no chain read above covers (``seen``), one per
    routing tensor: the calls of ``fp8_moe::linear`` left in ``graph`` whose input rows
    are an expert's tokens (:func:`_selected_rows`), where at least two experts (two
    values compared, or rows) of one routing tensor are selected.  Such a loop would
    otherwise stay eager without a word (a spelling of its accumulation that the pass
    does not read)."""
    loops: dict = {}  # routing tensor -> {expert: static}
    for n in graph.find_nodes(op="call_function", target=LINEAR):
        if n in seen:
            continue
        found = _selected_rows(n.args[0])
        if found is not None:
            source, expert = found
            static = _linear_args(n)[4] is not None  # an act_scale
            experts = loops.setdefault(source, {})
            experts[expert] = experts.get(expert, False) or static
    for experts in loops.values():
        if len(experts) < 2:
            continue
        static = any(experts.values())
        reason = (f"its experts' fp8_moe::linear calls take rows selected by torch.where / nonzero or a boolean "
                  f"mask, but no accumulation the pass reads adds them up (out.index_add_(0, tok, v), index_put_ "
                  f"with accumulate=True or scatter_add_ of tok[:, None].expand_as(v), tok a torch.where "
                  f"coordinate{'; its activation scheme is static as well' if static else ''})")
        _skipped("static" if static else "unsupported", [None] * len(experts), reason)


def _failed(steps: list, exc: Exception) -> None:
    """Counts a loop the pass failed on as left eager, with a warning and the traceback."""
    log.warning("fp8_moe_ops.passes: the pass failed while reading a loop; left eager", exc_info=exc)
    _skipped("unsupported", steps, f"the pass failed on it ({type(exc).__name__}: {exc}; a bug of fp8_moe_ops)")


def _skipped(kind: str, steps: list, reason) -> None:
    """Counts a loop left eager (``loops_skipped_<kind>``) and logs why: ``reason``, a
    :class:`Skip` or a string; the loop's experts, its chain's ``steps`` but where the
    Skip counted fewer."""
    experts = len(steps) if getattr(reason, "experts", None) is None else reason.experts
    counters["fp8_moe"][f"loops_skipped_{kind}"] += 1
    log.info("fp8_moe_ops.passes: a loop over %d experts was left eager because %s", experts, reason)
