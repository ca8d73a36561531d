"""Rewriting: stack the experts' weights (without a per-call copy), insert one
``fp8_moe::grouped_experts`` call in place of a loop proven by ``matching.py``, erase
the loop and the range asserts that would keep its ``nonzero``s alive; plus the entry
point that counts and logs what was done."""

from __future__ import annotations

import functools
import logging

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node

from fp8_moe_ops.functional import cdiv

from .matching import (
    GROUPED, LINEAR, META_ASSERT, Loop, Skip, accumulation_step, analyse, aten, collect_chain, is_call, same_size,
    scalar_only, shape_of,
)

log = logging.getLogger("fp8_moe_ops.passes")


# --------------------------------------------------------------------------- weights


def _attr(gm, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def _tensors(gm, nodes: list, what: str) -> list:
    if not all(n.op == "get_attr" for n in nodes):
        raise Skip(f"the {what} of each expert is a graph input, so stacking them would copy weights on every "
                   "call; enable torch._inductor.config.freezing (or compile with AOTInductor) so they are "
                   "constants stacked once at compile time")
    return [_attr(gm, n.target) for n in nodes]


def _grid(s: torch.Tensor, n_rows: int, n_cols: int, bs) -> torch.Tensor:
    """A (1, 1) per-matrix scale as the full block grid (the same dequantisation)."""
    if tuple(s.shape) == (1, 1):
        return s.expand(cdiv(n_rows, bs[0]), cdiv(n_cols, bs[1]))
    return s


def _stack(ts: list, what: str) -> torch.Tensor:
    """One (E, ...) tensor from E per-expert tensors: the common base when they are
    exactly its rows (frozen ``w[e]`` views: no copy), else a stacked copy (once)."""
    base = ts[0]._base
    if (base is not None and base.dim() == ts[0].dim() + 1 and base.is_contiguous()
            and all(t._base is base and t.dtype == base.dtype for t in ts)):
        if all(t.data_ptr() == base[i].data_ptr() and t.shape == base[i].shape and t.stride() == base[i].stride()
               for i, t in enumerate(ts)):
            if base.shape[0] != len(ts):
                raise Skip(f"the loop covers {len(ts)} of the {base.shape[0]} experts of its {what}")
            return base
    if len({(tuple(t.shape), t.dtype) for t in ts}) != 1:
        raise Skip(f"experts' {what} differ in shape or dtype")
    return torch.stack(ts).contiguous()


def _expert_tensor(gm, nodes: list, what: str):
    """A node for the stacked tensor (existing) or a real tensor to add as a constant."""
    b = nodes[0].args[0] if is_call(nodes[0], aten.select.int) else None
    if b is not None and all(is_call(n, aten.select.int) and n.args[0] is b and n.args[1] == 0 for n in nodes):
        used = [n.args[2] for n in nodes]
        if used != list(range(len(nodes))):
            raise Skip(f"experts 0..{len(nodes) - 1} use {what} {used} of the stacked tensor, not their own")
        if not same_size(shape_of(b)[0], len(nodes)):
            raise Skip(f"the loop covers {len(nodes)} of the {shape_of(b)[0]} experts of its {what}")
        return b
    return _stack(_tensors(gm, nodes, what), what)


def _scales(ts: list, rows: int, cols: int, bs, what: str) -> torch.Tensor:
    if len({t.dtype for t in ts}) != 1:
        raise Skip(f"experts' {what} mix scale dtypes")
    if len({tuple(t.shape) for t in ts}) != 1:
        ts = [_grid(t, rows, cols, bs) for t in ts]
    return _stack(ts, what)


def _separate_gate_up(gm, iters: list, bs):
    """Fused (E, 2I, H) weights and scales from Mixtral-style w1 (gate) / w3 (up)."""
    w1 = _tensors(gm, [it.gate_up[0] for it in iters], "gate weight (w1)")
    s1 = _tensors(gm, [it.gate_up[1] for it in iters], "gate scale")
    w3 = _tensors(gm, [it.gate_up[2] for it in iters], "up weight (w3)")
    s3 = _tensors(gm, [it.gate_up[3] for it in iters], "up scale")
    I, H = w1[0].shape
    ws, ss = [], []
    for a, sa, b, sb in zip(w1, s1, w3, s3):
        if a.shape != b.shape or a.dtype != b.dtype or sa.dtype != sb.dtype:
            raise Skip("gate and up weights differ in shape or dtype")
        ws.append(torch.cat([a, b]))
        if tuple(sa.shape) == tuple(sb.shape) == (1, 1) and torch.equal(sa, sb):
            ss.append(sa)  # one per-tensor scale for the fused matrix
        elif I % bs[0]:
            raise Skip(f"gate and up scale grids cannot be stacked: I={I} is not a multiple of "
                       f"block_size[0]={bs[0]}, so a scale block would straddle gate and up")
        else:
            ss.append(torch.cat([_grid(sa, I, H, bs), _grid(sb, I, H, bs)]))
    return _stack(ws, "gate_up weights"), _scales(ss, 2 * I, H, bs, "gate_up scales")


# --------------------------------------------------------------------------- rewrite


def _fake_mode(graph: Graph):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)])


def _rewrite(graph: Graph, loop: Loop) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gm = graph.owning_module
    first = loop.iters[0]
    bs = first.block_size
    with unset_fake_temporarily(), torch.no_grad():
        if len(first.gate_up) == 4:
            gu, gus = _separate_gate_up(gm, loop.iters, bs)
        else:
            gu = _expert_tensor(gm, [it.gate_up[0] for it in loop.iters], "gate_up weights")
            gus = _expert_tensor(gm, [it.gate_up[1] for it in loop.iters], "gate_up scales")
        dn = _expert_tensor(gm, [it.down[0] for it in loop.iters], "down weights")
        dns = _expert_tensor(gm, [it.down[1] for it in loop.iters], "down scales")
    fake_mode = _fake_mode(graph)
    operands = [gu, gus, dn, dns]
    fakes = []
    for o in operands:
        if isinstance(o, Node):
            fakes.append(o.meta["val"])
        else:
            with unset_fake_temporarily():
                fakes.append(fake_mode.from_tensor(o, static_shapes=True))
    name, _, _, limit = first.activation
    head = [first.hidden, first.top_k_index, first.top_k_weights]
    try:
        with fake_mode:
            out_val = GROUPED(*[n.meta["val"] for n in head], *fakes, bs, name, None, None, limit)
    except (TypeError, ValueError) as exc:  # the op's own checks: never insert a call it rejects
        raise Skip(f"fp8_moe::grouped_experts rejects the loop's operands: {exc}") from exc

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
    targets = sorted(loop.targets, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(targets[0]):
        new = graph.call_function(GROUPED, (*head, *operands, bs, name, None, None, limit))
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
        graph.erase_node(s)
    graph.eliminate_dead_code()
    _erase_dead_nonzeros(graph, loop.nzs)


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
            pos = {n: i for i, n in enumerate(graph.nodes)}
            for n in sorted(down, key=pos.__getitem__, reverse=True):
                graph.erase_node(n)
    graph.eliminate_dead_code()


# --------------------------------------------------------------------------- entry point


def _heads(graph: Graph) -> list:
    """First steps of accumulation chains (a step adding into something that is not
    itself a step).  A chain that forks is analysed once, from its head."""
    return [n for n in graph.nodes
            if accumulation_step(n) is not None and accumulation_step(accumulation_step(n)[0]) is None]


def rewrite_moe_loops(graph: Graph) -> int:
    """Rewrites every provable expert loop of ``graph``; returns how many."""
    if not any(is_call(n, LINEAR) for n in graph.nodes):
        return 0
    done = 0
    for head in _heads(graph):
        if head._erased:  # dead code of an earlier rewrite
            continue
        steps = collect_chain(head)
        pos = {n: i for i, n in enumerate(graph.nodes)}
        try:
            loop = analyse(steps, pos)
            if loop is None:
                continue
            _rewrite(graph, loop)
        except Skip as skip:
            kind = "static" if skip.static else "unsupported"
            counters["fp8_moe"][f"loops_skipped_{kind}"] += 1
            log.info("fp8_moe_ops.passes: a loop over %d experts was left eager because %s", len(steps), skip)
            continue
        counters["fp8_moe"]["loops_rewritten"] += 1
        done += 1
        log.info("fp8_moe_ops.passes: replaced a loop over %d experts with fp8_moe::grouped_experts "
                 "(activation=%s, swiglu_limit=%s, %s)", len(steps), loop.iters[0].activation[0],
                 loop.iters[0].activation[3], "bitwise equal to eager" if loop.exact else
                 "more accurate than the loop: fewer roundings")
    return done
