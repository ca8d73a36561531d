"""CUDA-only tests of ``fp8_moe::grouped_experts_list`` and the rewritten ModuleList
loop (skipped without a GPU; on the H200: ``python -m pytest tests/test_gpu_modlist.py -q``):
bitwise equal to the stacked op, no second copy of the weights in memory, CUDA graph
capture after one eager call, a replaced parameter read through a new address table,
tables of freed weights dropped."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8_moe_ops
import fp8_moe_ops.passes
from fp8_moe_ops import FP8Linear

from helpers import as_expert_lists, fresh_graph_workspaces, make_experts_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
OPS = torch.ops.fp8_moe


def _cuda(args: dict) -> dict:
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.cuda()
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return [t.cuda() for t in v]
        return v

    return {k: move(v) for k, v in args.items()}


def _stacked_and_lists(T, E, H, I, k, separate, **kw):
    """The stacked op's kwargs and the list op's, each expert's tensors copied to
    addresses of their own (as in a ModuleList)."""
    a = _cuda(make_experts_inputs(T, E, H, I, k, [128, 128], **kw))
    lists = as_expert_lists(a, separate)
    for name in ("gate_up_proj", "gate_up_scale_inv", "down_proj", "down_scale_inv"):
        lists[name] = [t.clone() for t in lists[name]]
    return a, lists


# (T, E, H, I, k, separate, extra): what each probes
SHAPES = [
    (1, 8, 256, 128, 2, False, {}),                                     # decode, fused gate_up
    (64, 16, 512, 256, 4, True, {}),                                    # separate w1 / w3
    (300, 7, 384, 200, 3, True, dict(per_tensor=True, routing="sentinel")),  # I not a multiple of 128, sentinels
    (257, 5, 256, 256, 2, False, dict(static=True, scale_dtype=torch.float8_e8m0fnu)),  # static, UE8M0
    (0, 4, 256, 128, 2, True, {}),                                      # T = 0
    (4096, 8, 512, 256, 2, True, {}),                                   # many rows per expert (big tiles)
]


@pytest.mark.parametrize("T,E,H,I,k,separate,extra", SHAPES)
def test_list_op_equals_stacked_op_bitwise(T, E, H, I, k, separate, extra):
    a, lists = _stacked_and_lists(T, E, H, I, k, separate, **extra)
    want = OPS.grouped_experts(**a, activation="silu", swiglu_limit=7.0)
    got = OPS.grouped_experts_list(**lists, activation="silu", swiglu_limit=7.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("separate", [False, True], ids=["fused", "separate"])
def test_list_op_plan_graphs_replay_new_routing_bitwise(separate, monkeypatch):
    # at decode the list op's plan replays its launches after the first as a CUDA graph
    # (one per address table): every call with new hidden states and routing equals the
    # stacked forward, and each output stays its own
    from fp8_moe_ops import kernels
    from fp8_moe_ops.kernels import moe_list

    monkeypatch.setattr(moe_list, "_PLANS", {})
    fresh_graph_workspaces(monkeypatch)
    T, E, H, I, k = 8, 8, 256, 128, 2
    a, lists = _stacked_and_lists(T, E, H, I, k, separate)
    outs = []
    for seed in range(10, 17):
        fresh = _cuda(make_experts_inputs(T, E, H, I, k, [128, 128], seed=seed))
        for name in ("hidden", "top_k_index", "top_k_weights"):
            a[name] = lists[name] = fresh[name]
        outs.append((OPS.grouped_experts_list(**lists), kernels.grouped_experts(**a)))
    (plan,) = moe_list._PLANS.values()
    assert plan.graphs == 1
    for i, (got, want) in enumerate(outs):
        assert torch.equal(got, want), i


class _Expert(nn.Module):
    def __init__(self, H, I, gen):
        super().__init__()
        lin = [nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)]
        for m in lin:
            m.weight.data = torch.randn(m.weight.shape, generator=gen) * 0.05
        self.w1, self.w2, self.w3 = (FP8Linear.from_float(m) for m in lin)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ModuleListMoE(nn.Module):
    """A Mixtral-style loop over nn.ModuleList experts (w1 gate, w3 up, w2 down)."""

    def __init__(self, E, H, I):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.experts = nn.ModuleList(_Expert(H, I, gen) for _ in range(E))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(len(self.experts)):
            tok, pos = torch.where(top_k_index == e)
            y = self.experts[e](hidden[tok]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(hidden.dtype))
        return out

    def stacked(self):
        ex = self.experts
        return (torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in ex]),
                torch.stack([torch.cat([e.w1.weight_scale_inv, e.w3.weight_scale_inv]) for e in ex]),
                torch.stack([e.w2.weight for e in ex]), torch.stack([e.w2.weight_scale_inv for e in ex]))


def _inputs(T, E, H, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k)
    return x.cuda(), idx.cuda(), w.to(torch.bfloat16).cuda()


def test_rewritten_modulelist_memory_is_the_stacked_ops():
    # 8 experts of 1024 x 2048: 48 MiB of fp8 weights; a stacked copy would show
    E, H, I, T, k = 8, 1024, 2048, 512, 2
    m = _ModuleListMoE(E, H, I).cuda()
    args = _inputs(T, E, H, k, seed=1)
    torch._dynamo.reset()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with fp8_moe_ops.passes.enabled(), torch.no_grad():
        c = torch.compile(m, fullgraph=True)
        got = c(*args)  # compiles, builds the address table
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - got.numel() * got.element_size()
        assert kept <= 1 << 20, f"compiling kept {kept} bytes: a copy of the weights?"
        del got
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = c(*args)
        list_peak = torch.cuda.max_memory_allocated() - base
    stacked = m.stacked()  # allocated before measuring: the stacked op's own peak only
    OPS.grouped_experts(*args, *stacked, [128, 128])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    want = OPS.grouped_experts(*args, *stacked, [128, 128])
    stacked_peak = torch.cuda.max_memory_allocated() - base
    assert list_peak <= stacked_peak + (1 << 20), (list_peak, stacked_peak)
    assert torch.equal(got, want)


def test_cuda_graph_capture_after_one_eager_call():
    _, lists = _stacked_and_lists(16, 8, 256, 128, 2, True)
    eager = OPS.grouped_experts_list(**lists)  # builds the table outside capture
    static_hidden = lists["hidden"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS.grouped_experts_list(**dict(lists, hidden=static_hidden))
    graph.replay()
    assert torch.equal(out, eager)
    new_hidden = torch.randn(static_hidden.shape, generator=torch.Generator().manual_seed(1)).to(static_hidden)
    static_hidden.copy_(new_hidden)
    graph.replay()
    assert torch.equal(out, OPS.grouped_experts_list(**dict(lists, hidden=new_hidden)))


def test_reloaded_weights_do_not_pile_up_tables(monkeypatch):
    # new weight tensors every step (a reload): the tables of freed ones are dropped
    # (after a synchronize) while a graph captured on live weights replays as before
    from fp8_moe_ops.kernels import moe_list

    monkeypatch.setattr(moe_list, "_TABLES", {})
    monkeypatch.setattr(moe_list, "MIN_SWEEP", 4)
    monkeypatch.setattr(moe_list, "_sweep_at", 4)
    _, lists = _stacked_and_lists(16, 8, 256, 128, 2, False, seed=8)
    eager = OPS.grouped_experts_list(**lists)
    static_hidden = lists["hidden"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS.grouped_experts_list(**dict(lists, hidden=static_hidden))
    for _ in range(30):
        down = [t.clone() for t in lists["down_proj"]]  # the last step's tensors are freed here
        assert torch.equal(OPS.grouped_experts_list(**dict(lists, down_proj=down)), eager)
        assert len(moe_list._TABLES) <= 4  # the captured set's, and up to three since the last drop
    graph.replay()
    assert torch.equal(out, eager)


def test_capture_without_a_table_is_a_clear_error():
    _, lists = _stacked_and_lists(16, 4, 256, 128, 2, False, seed=5)
    OPS.grouped_experts_list(**lists)  # Triton compiled for these shapes
    fresh = dict(lists, down_proj=[t.clone() for t in lists["down_proj"]])  # new addresses: no table yet
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one eager call"):
        with torch.cuda.graph(graph):
            OPS.grouped_experts_list(**fresh)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: dict(a, down_proj=[a["down_proj"][0], a["down_proj"][1].t().contiguous().t(), *a["down_proj"][2:]]),
     ValueError, r"down_proj\[1\]: expected a contiguous tensor"),
    (lambda a: dict(a, gate_up_scale_inv=[*a["gate_up_scale_inv"][:3], a["gate_up_scale_inv"][3].cpu()]),
     ValueError, r"gate_up_scale_inv\[3\]: expected shape .* on cuda"),
    (lambda a: dict(a, top_k_index=a["top_k_index"].float()), TypeError, "top_k_index: expected dtype torch.int32"),
], ids=["non-contiguous weight", "scale on the CPU", "float ids"])
def test_bad_input_after_good_calls_still_raises(change, exc, match):
    # the CUDA kernel checks the lists once per metadata (ops.ListChecks): a bad call
    # after good ones must meet the checks all the same
    _, lists = _stacked_and_lists(16, 4, 256, 128, 2, False, seed=6)
    for _ in range(2):
        OPS.grouped_experts_list(**lists)
    with pytest.raises(exc, match=match):
        OPS.grouped_experts_list(**change(lists))


def _negated(w):
    """-w of an e4m3 tensor (a new tensor): the sign bit flipped."""
    return w.view(torch.uint8).bitwise_xor(0x80).view(torch.float8_e4m3fn)


def test_replaced_parameter_gets_a_new_table():
    m = _ModuleListMoE(4, 256, 128).cuda()
    args = _inputs(32, 4, 256, 2, seed=2)
    torch._dynamo.reset()
    with fp8_moe_ops.passes.enabled(), torch.no_grad():
        c = torch.compile(m, fullgraph=True)
        first = c(*args)
        assert torch.equal(first, OPS.grouped_experts(*args, *m.stacked(), [128, 128]))
        # a new tensor (new address) for one expert's gate weight: the next call reads it
        w1 = m.experts[2].w1
        w1.weight = nn.Parameter(_negated(w1.weight.detach()), requires_grad=False)
        second = c(*args)
        assert not torch.equal(first, second)
        assert torch.equal(second, OPS.grouped_experts(*args, *m.stacked(), [128, 128]))
        # updated in place: same addresses, same table, the new values
        m.experts[0].w2.weight.view(torch.uint8).bitwise_xor_(0x80)  # negated in place
        third = c(*args)
        assert torch.equal(third, OPS.grouped_experts(*args, *m.stacked(), [128, 128]))


def test_rewritten_modulelist_in_reduce_overhead_mode():
    # cudagraph trees allocate their warm-up run's memory from the graph pool, where an
    # address table built then would stay alive untracked: as for a manual capture, one
    # call outside CUDA graphs builds the table first (docs/ops.md)
    m = _ModuleListMoE(8, 256, 128).cuda()
    args = _inputs(24, 8, 256, 2, seed=3)
    torch._dynamo.reset()
    with fp8_moe_ops.passes.enabled(), torch.no_grad():
        torch.compile(m)(*args)
        torch._dynamo.reset()
        c = torch.compile(m, mode="reduce-overhead")
        want = OPS.grouped_experts(*args, *m.stacked(), [128, 128])
        for _ in range(4):
            assert torch.equal(c(*args), want)
