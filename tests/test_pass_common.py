"""Shared models and helpers of the graph-pass tests (no tests here): the expert loops the pass must
rewrite and their near misses, plus compile helpers.  Sizes are tiny (E=4, H=32, I=16, blocks of
16) so that every compile stays fast on two CPU cores."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import fp8_moe_ops.passes as passes
from fp8_moe_ops import FP8Experts, FP8Linear, reference

E, H, I, K = 4, 32, 16, 2
BLOCK = (16, 16)


def inputs(T: int, seed: int = 0, dtype=torch.bfloat16, num_experts: int = E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w, idx = torch.topk(torch.randn(T, num_experts, generator=g).softmax(-1), K)
    return x, idx, w.to(dtype)


def experts(activation="silu", swiglu_limit=None, seed=0, block_size=BLOCK, inter=I) -> FP8Experts:
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g) / 4, torch.randn(E, H, inter, generator=g) / 4
    return FP8Experts.from_float(gate_up, down, block_size=block_size, activation=activation,
                                 swiglu_limit=swiglu_limit)


def static_experts() -> FP8Experts:
    dyn = experts()
    m = FP8Experts(E, H, I, BLOCK, activation_scheme="static")
    m.load_state_dict(dyn.state_dict(), strict=False)
    return m


class Loop(nn.Module):
    """A hand-written loop over the stacked weights of ``ex`` with one knob per
    spelling (the pass must match all) or near miss (the pass must leave alone).

    mask: "eq" (torch.where(top_k_index == e)) or "onehot" (one_hot(...).permute(2, 1, 0)[e]);
    gather: "index", "none_reshape" (x[None, tok].reshape(-1, H)) or "index_select";
    split: "chunk" (reference.gated_activation), "slice", "swapped" (near miss);
    routing: "none_index" (w[tok, pos, None]), "unsqueeze", "pos0" (near miss: w[tok, 0]);
    experts: the expert ids visited; shift: use the weights of expert e + shift;
    extra: multiply the expert output by 2; bias: add a bias to it;
    acc: "zeros", "ones" (near miss) or "float32_out" (near miss: float32 returned);
    act_fn: the activation of the "slice"/"swapped" split (F.silu unless given);
    aux: also return the last expert's output (near miss: an intermediate escapes the loop);
    peek: also return the partial sum after expert 1 (near miss: a partial sum escapes).
    tok_int: accumulate with ``index_add_(0, tok.int(), ...)`` (a spelling the pass skips).
    stray: after the loop, add ones into the accumulator at rows ``arange(T)``, which no
    ``torch.where`` selects (near miss: a step of the accumulation that is no expert's).
    combine: "index_add" (out.index_add_(0, tok, v)), "scatter_add" (out.scatter_add_(0,
    tok[:, None].expand(-1, C), v) over C = H columns, or "scatter_add_half" over C = H // 2:
    a near miss), "plus_equals" (out[tok] += v: a spelling the pass skips), or
    "scatter_add_view" (tok.view(-1, 1).expand(-1, H)) / "scatter_reduce" (scatter_reduce_
    "sum"): spellings the pass does not read as an accumulation;
    mask "nonzero_t": ``tok, pos = (top_k_index == e).nonzero().T`` (not read either);
    static: pass the experts' act scales to fp8_moe::linear (``ex`` static).
    """

    def __init__(self, ex: FP8Experts, mask="eq", gather="index", split="chunk", routing="none_index",
                 experts=None, shift=0, extra=False, bias=False, acc="zeros", act_fn=F.silu, aux=False,
                 peek=False, tok_int=False, combine="index_add", stray=False, static=False):
        super().__init__()
        self.ex = ex
        self.mask, self.gather, self.split, self.routing = mask, gather, split, routing
        self.experts = list(range(ex.num_experts)) if experts is None else experts
        self.shift, self.extra, self.acc, self.act_fn, self.aux, self.peek = shift, extra, acc, act_fn, aux, peek
        self.bias = nn.Parameter(torch.full((H,), 0.5), requires_grad=False) if bias else None
        self.tok_int, self.combine, self.stray, self.static = tok_int, combine, stray, static

    def _act(self, h):
        ex = self.ex
        if self.split == "chunk":
            return reference.gated_activation(h, ex.activation, ex.swiglu_limit)
        hf = h.float()
        n = hf.shape[-1] // 2
        gate, up = hf[:, :n], hf[:, n:]
        if self.split == "swapped":
            gate, up = up, gate
        return (self.act_fn(gate) * up).to(h.dtype)

    def forward(self, hidden, top_k_index, top_k_weights):
        ex = self.ex
        if self.acc == "ones":
            out = torch.ones_like(hidden, dtype=torch.float32)
        else:
            out = torch.zeros_like(hidden, dtype=torch.float32)
        onehot = F.one_hot(top_k_index, ex.num_experts).permute(2, 1, 0) if self.mask == "onehot" else None
        for e in self.experts:
            if onehot is not None:
                pos, tok = torch.where(onehot[e])
            elif self.mask == "nonzero_t":
                tok, pos = (top_k_index == e).nonzero().T
            else:
                tok, pos = torch.where(top_k_index == e)
            if self.gather == "index":
                x = hidden[tok]
            elif self.gather == "none_reshape":
                x = hidden[None, tok].reshape(-1, H)
            else:
                x = hidden.index_select(0, tok)
            w = (e + self.shift) % ex.num_experts
            s_gu, s_d = ((ex.gate_up_proj_activation_scale[w], ex.down_proj_activation_scale[w]) if self.static
                         else (None, None))
            h = torch.ops.fp8_moe.linear(x, ex.gate_up_proj[w], ex.gate_up_proj_scale_inv[w], ex.block_size, s_gu)
            a = self._act(h)
            y = torch.ops.fp8_moe.linear(a, ex.down_proj[w], ex.down_proj_scale_inv[w], ex.block_size, s_d)
            if self.extra:
                y = y * 2
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            if self.routing == "none_index":
                r = top_k_weights[tok, pos, None]
            elif self.routing == "unsqueeze":
                r = top_k_weights[tok, pos].unsqueeze(-1)
            else:
                r = top_k_weights[tok, 0, None]
            v = y.float() * r.float()
            if self.combine == "plus_equals":
                out[tok] += v
            elif self.combine == "scatter_add_view":
                out.scatter_add_(0, tok.view(-1, 1).expand(-1, H), v)
            elif self.combine == "scatter_reduce":
                out.scatter_reduce_(0, tok[:, None].expand(-1, H), v, "sum")
            elif self.combine.startswith("scatter_add"):
                cols = H // 2 if self.combine == "scatter_add_half" else H
                out.scatter_add_(0, tok[:, None].expand(-1, cols), v[:, :cols])
            else:
                out.index_add_(0, tok.int() if self.tok_int else tok, v)
            if self.peek and e == 1:
                partial = out.clone()
        if self.stray:
            out.index_add_(0, torch.arange(out.shape[0], device=out.device), torch.ones_like(out))
        out = out if self.acc == "float32_out" else out.to(hidden.dtype)
        if self.peek:
            return out, partial
        return (out, y) if self.aux else out


class MixtralExpert(nn.Module):
    """transformers' MixtralBlockSparseTop2MLP with FP8Linear w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, seed: int, block_size=BLOCK, inter=I):
        super().__init__()
        torch.manual_seed(seed)
        self.w1 = FP8Linear.from_float(nn.Linear(H, inter, bias=False), block_size)
        self.w2 = FP8Linear.from_float(nn.Linear(inter, H, bias=False), block_size)
        self.w3 = FP8Linear.from_float(nn.Linear(H, inter, bias=False), block_size)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralLoop(nn.Module):
    """The transformers 4.x Mixtral expert loop (one-hot mask, x[None, top_x], bf16
    accumulator) over ``nn.ModuleList`` experts."""

    def __init__(self, block_sizes=None, inter=I):
        super().__init__()
        block_sizes = block_sizes or [BLOCK] * E
        self.experts = nn.ModuleList(MixtralExpert(100 + e, block_sizes[e], inter) for e in range(E))

    def forward(self, hidden_states, selected_experts, routing_weights):
        final = torch.zeros((hidden_states.shape[0], H), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for expert_idx in range(E):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, H)
            cur = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(hidden_states.dtype))
        return final


def stacked_from_mixtral(m: MixtralLoop):
    """The grouped op's operands built from Mixtral experts by hand (the reference)."""
    gu = torch.stack([torch.cat([x.w1.weight, x.w3.weight]) for x in m.experts])
    gus = torch.stack([torch.cat([x.w1.weight_scale_inv, x.w3.weight_scale_inv]) for x in m.experts])
    d = torch.stack([x.w2.weight for x in m.experts])
    ds = torch.stack([x.w2.weight_scale_inv for x in m.experts])
    return gu, gus, d, ds


# --------------------------------------------------------------------------- compiling


def post_grad_only_backend(graphs: list):
    """An Inductor backend that runs AOT autograd, decompositions, freezing and the
    post-grad passes exactly as Inductor does, then runs the post-grad graph eagerly
    instead of generating code: what the pass did, without seconds of C++ compile."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx
    from torch._inductor.virtualized import V

    def inner(gm, example_inputs, **kwargs):
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            _recursive_post_grad_passes(gm, is_inference=True)
        gm.recompile()
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return functools.partial(compile_fx, inner_compile=inner)


def post_grad(model, *args, **compile_kwargs):
    """(output, post-grad GraphModule) of ``model`` compiled with the post-grad-only backend."""
    graphs: list = []
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend=post_grad_only_backend(graphs), **compile_kwargs)(*args)
    (gm,) = graphs
    return out, gm


def fp8_counters() -> dict:
    return dict(counters["fp8_moe"])


@contextlib.contextmanager
def fresh_counters():
    """No FX cache (a hit runs no pass), zeroed counters, the pass on."""
    counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), passes.enabled():
        yield
    torch._dynamo.reset()


def graph_text(gm) -> str:
    return str(gm.graph).strip()


def count_linear(gm) -> int:
    return sum(n.target is torch.ops.fp8_moe.linear.default for n in gm.graph.nodes)


_ACT64 = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


def ideal_output(gate_up, gate_up_scale, down, down_scale, x, top_k_index, top_k_weights, activation="silu"):
    """The expert layer in float64 with unquantised activations: what both the loop and
    the grouped op approximate (fp8 activations, bf16 roundings)."""
    wgu = reference.dequantize_weight(gate_up, gate_up_scale, BLOCK).double()
    wd = reference.dequantize_weight(down, down_scale, BLOCK).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(wgu.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        gate, up = (x[tok].double() @ wgu[e].T).chunk(2, dim=-1)
        y = (_ACT64[activation](gate) * up) @ wd[e].T
        out.index_add_(0, tok, y * top_k_weights[tok, pos, None].double())
    return out


def error_vs(out, ideal) -> float:
    """Root-mean-square error against the float64 layer.  RMS, not max: one bf16 ulp of
    difference in act(gate) * up can flip an fp8 rounding of the down projection's
    input, so the max error of two equally accurate layers differs by up to ~1.6x on
    rare inputs (200-seed scan), while their RMS errors agree within 5%."""
    return (out.double() - ideal).pow(2).mean().sqrt().item()
