"""``fp8_moe::grouped_experts_list`` (per-expert weight lists) on CPU: bitwise equal to
``grouped_experts`` on the stacked tensors, bad input, opcheck, torch.compile."""

import pytest
import torch

import fp8_moe_ops
from helpers import as_expert_lists, make_experts_inputs

OPS = torch.ops.fp8_moe

# (T, E, H, I, k, block, extra make_experts_inputs kwargs): what each probes
SHAPES = [
    (0, 4, 64, 32, 2, [16, 16], {}),                               # T = 0
    (1, 4, 64, 32, 2, [16, 16], {}),                               # T = 1
    (9, 7, 40, 48, 3, [16, 16], {}),                               # prime E, H not a multiple of the block
    (7, 5, 72, 40, 2, [32, 16], {}),                               # K (H) and N (2I) not multiples of bn / bk
    (11, 5, 64, 32, 2, [16, 16], dict(routing="empty")),           # an expert with no tokens
    (8, 5, 64, 32, 2, [16, 16], dict(routing="one")),              # all tokens on one expert
    (10, 5, 64, 32, 3, [16, 16], dict(routing="sentinel")),        # ids outside [0, E)
    (9, 3, 48, 32, 2, [16, 16], dict(per_tensor=True)),            # (1, 1) per-tensor scales
    (9, 3, 48, 32, 2, [16, 16], dict(scale_dtype=torch.float8_e8m0fnu)),  # UE8M0 scales
    (9, 3, 48, 32, 2, [16, 16], dict(static=True, dtype=torch.float16)),  # static activation scales
]


@pytest.mark.parametrize("separate", [False, True], ids=["fused", "separate"])
@pytest.mark.parametrize("T,E,H,I,k,block,extra", SHAPES)
def test_list_op_equals_stacked_op_bitwise(T, E, H, I, k, block, extra, separate):
    if separate and I % block[0] and not extra.get("per_tensor"):
        pytest.skip("no stacked grid splits at I (test_separate_gate_up_whose_grid_straddles_i covers it)")
    a = make_experts_inputs(T, E, H, I, k, block, **extra)
    stacked = OPS.grouped_experts(**a, activation="gelu_tanh", swiglu_limit=3.0)
    got = OPS.grouped_experts_list(**as_expert_lists(a, separate), activation="gelu_tanh", swiglu_limit=3.0)
    assert got.shape == (T, H) and got.dtype == a["hidden"].dtype
    assert torch.equal(got, stacked)


def test_separate_gate_up_whose_grid_straddles_i():
    # I = 24, bn = 16: no stacked (2I, H) grid at bn = 16 exists (a block would straddle
    # gate and up); the same real weights stack exactly at bn = 8, each 16-row scale
    # repeated over two 8-row blocks.
    E, H, I = 3, 32, 24
    gen = torch.Generator().manual_seed(3)
    a = make_experts_inputs(6, E, H, I, 2, [16, 16], seed=3)
    gates = [fp8_moe_ops.quantize_weight(torch.randn(I, H, generator=gen) / 4, (16, 16)) for _ in range(E)]
    ups = [fp8_moe_ops.quantize_weight(torch.randn(I, H, generator=gen) / 4, (16, 16)) for _ in range(E)]
    lists = as_expert_lists(a)
    lists["gate_up_proj"] = [w for w, _ in gates + ups]
    lists["gate_up_scale_inv"] = [s for _, s in gates + ups]
    got = OPS.grouped_experts_list(**lists)

    def grid8(s):  # (2, gk) at 16 rows -> (3, gk) at 8 rows for I = 24
        return s.repeat_interleave(2, dim=0)[:3]

    stacked = dict(
        a, block_size=[8, 16],
        gate_up_proj=torch.stack([torch.cat([g, u]) for (g, _), (u, _) in zip(gates, ups)]),
        gate_up_scale_inv=torch.stack([torch.cat([grid8(gs), grid8(us)]) for (_, gs), (_, us) in zip(gates, ups)]),
        down_scale_inv=a["down_scale_inv"].repeat_interleave(2, dim=1),
    )
    assert torch.equal(got, OPS.grouped_experts(**stacked))


def _lists(separate=False, **kw):
    return as_expert_lists(make_experts_inputs(5, 4, 64, 32, 2, [16, 16], seed=7, **kw), separate)


def _replace(lists: dict, name: str, i: int, t) -> dict:
    new = list(lists[name])
    new[i] = t
    return dict(lists, **{name: new})


def _noncontiguous(w):
    return w.t().contiguous().t()  # same shape and values, column-major


# (change of the lists, exception, message fragment): each names the argument and the expert
BAD = [
    (lambda a: _replace(a, "down_proj", 2, a["down_proj"][2][:, :16].contiguous()), ValueError,
     r"down_scale_inv\[2\]: expected shape \(4, 1\)"),                                   # ragged down
    (lambda a: _replace(a, "gate_up_proj", 3, a["gate_up_proj"][3].float()), TypeError,
     r"gate_up_proj\[3\]: expected dtype torch.float8_e4m3fn"),                          # mixed dtypes
    (lambda a: _replace(a, "gate_up_scale_inv", 1, a["gate_up_scale_inv"][1].to(torch.float8_e8m0fnu)), TypeError,
     r"gate_up_scale_inv\[1\]: expected shape \(4, 4\), strides \(4, 1\), dtype torch.float32"),  # mixed scale dtypes
    (lambda a: _replace(a, "down_scale_inv", 2, torch.ones(1, 1)), ValueError,
     r"down_scale_inv\[2\]: expected shape \(4, 2\)"),                                  # mixed block grids
    (lambda a: _replace(a, "down_proj", 1, a["down_proj"][1].to("meta")), ValueError,
     r"down_proj\[1\]: expected shape \(64, 32\), dtype torch.float8_e4m3fn on cpu"),    # mixed devices
    (lambda a: _replace(a, "gate_up_proj", 1, _noncontiguous(a["gate_up_proj"][1])), ValueError,
     r"gate_up_proj\[1\]: expected a contiguous tensor"),
    (lambda a: _replace(a, "gate_up_scale_inv", 2, -a["gate_up_scale_inv"][2]), ValueError,
     r"gate_up_scale_inv\[2\]: expected finite positive"),
    (lambda a: dict(a, gate_up_proj=a["gate_up_proj"] + a["gate_up_proj"][:1]), ValueError,
     r"gate_up_proj: expected 4 fused \(2I, H\) tensors or 8 separate"),                 # neither E nor 2E
    (lambda a: dict(a, down_scale_inv=a["down_scale_inv"][:3]), ValueError, "down_scale_inv: expected 4 tensors"),
    (lambda a: dict(a, down_proj=[], down_scale_inv=[]), ValueError, "down_proj: expected a non-empty list"),
    (lambda a: dict(a, hidden=a["hidden"][:, :48], gate_up_proj=[w[:, :48].contiguous() for w in a["gate_up_proj"]],
                    gate_up_scale_inv=[s[:, :3].contiguous() for s in a["gate_up_scale_inv"]]), ValueError,
     r"down_proj\[0\]: expected shape \(48, I\) \(H from hidden, of shape \(5, 48\)\)"),            # H mismatch
    (lambda a: dict(a, gate_up_proj=[w[:48].contiguous() for w in a["gate_up_proj"]],
                    gate_up_scale_inv=[s[:3].contiguous() for s in a["gate_up_scale_inv"]]), ValueError,
     r"gate_up_proj\[0\]: expected shape \(64, 64\)"),                                       # 2I mismatch
    (lambda a: dict(a, gate_up_act_scale=torch.ones(3)), ValueError, r"gate_up_act_scale: expected shape \(4,\)"),
    (lambda a: dict(a, activation="tanh"), ValueError, "activation: expected one of"),
]


@pytest.mark.parametrize("change,exc,match", BAD)
def test_bad_input(change, exc, match):
    with pytest.raises(exc, match=match):
        OPS.grouped_experts_list(**change(_lists()))


def _positional(a: dict) -> tuple:
    """The op's arguments in schema order, as the dispatcher hands them to a kernel."""
    return (a["hidden"], a["top_k_index"], a["top_k_weights"], a["gate_up_proj"], a["gate_up_scale_inv"],
            a["down_proj"], a["down_scale_inv"], a["block_size"], a.get("activation", "silu"),
            a.get("gate_up_act_scale"), a.get("down_act_scale"), a.get("swiglu_limit"))


def _counted_list_checks():
    from fp8_moe_ops import ops

    runs = []

    def check(*args):
        runs.append(args)
        ops.check_experts_list(*args)

    return ops.ListChecks(check), runs


def test_cuda_list_checks_run_once_per_metadata():
    # the CUDA kernel's checks (ListChecks) are plain Python: driven here on CPU tensors
    checks, runs = _counted_list_checks()
    a = _lists()
    checks(*_positional(a))
    checks(*_positional(a))
    assert len(runs) == 1  # the second call passed the guard of the first call's tensors
    # a replaced tensor of the same metadata (a reloaded parameter) passes the guard too
    checks(*_positional(_replace(a, "down_proj", 1, a["down_proj"][1].clone())))
    assert len(runs) == 1
    # another token count (T = 3): only the routing tensors' checks run again
    b = dict(a, hidden=a["hidden"][:3], top_k_index=a["top_k_index"][:3], top_k_weights=a["top_k_weights"][:3])
    checks(*_positional(b))
    assert len(runs) == 1
    # a separate gate / up layout: other list lengths, another key, so every check runs
    checks(*_positional(_lists(separate=True)))
    assert len(runs) == 2
    # the same lists with static activation scales: another key
    checks(*_positional(dict(a, gate_up_act_scale=torch.ones(4), down_act_scale=torch.ones(4))))
    assert len(runs) == 3


# bad routing tensors: checked on every call, whatever the guard says of the lists
ROUTING_BAD = [
    (lambda a: dict(a, top_k_index=a["top_k_index"].float()), TypeError, "top_k_index: expected dtype torch.int32"),
    (lambda a: dict(a, top_k_weights=a["top_k_weights"][:, :1]), ValueError, r"top_k_weights: expected shape \(5, 2\)"),
    (lambda a: dict(a, top_k_index=a["top_k_index"][:3]), ValueError, r"top_k_index: expected shape \(5, top_k\)"),
    (lambda a: dict(a, hidden=a["hidden"].to(torch.float8_e4m3fn)), TypeError, "hidden: expected dtype bfloat16"),
    (lambda a: dict(a, top_k_weights=a["top_k_weights"].to("meta")), ValueError, "top_k_weights: expected a tensor on cpu"),
]


# every bad input but the value check (negative scales: CPU only, no device sync on CUDA)
METADATA_BAD = [case for case in BAD if "finite positive" not in case[2]]

# values the guards' keys met before their checks: unhashable (a TypeError naming
# nothing) or equal to the good calls' (16.0 == 16: the same key, so no check ran)
KEYED_BAD = [
    (lambda a: dict(a, block_size=dict(enumerate(a["block_size"]))), TypeError, "^block_size: expected a pair"),
    (lambda a: dict(a, block_size=[float(a["block_size"][0]), a["block_size"][1]]), TypeError,
     "^block_size: expected a pair"),
    (lambda a: dict(a, activation=["silu"]), ValueError, "^activation: expected one of"),
]


@pytest.mark.parametrize("change,exc,match", METADATA_BAD + ROUTING_BAD + KEYED_BAD)
def test_cuda_list_checks_catch_bad_input_after_good_calls(change, exc, match):
    checks, runs = _counted_list_checks()
    checks(*_positional(_lists()))
    checks(*_positional(_lists()))
    assert len(runs) == 1  # the second call passed the guard: the bad call meets it
    with pytest.raises(exc, match=match):
        checks(*_positional(change(_lists())))


def test_cuda_list_checks_keep_a_few_sets_per_key():
    # one model may pass Parameters in one layer and plain tensors in another (other
    # requires_grad: the same key, another guard); alternating must not rerun the checks
    checks, runs = _counted_list_checks()
    a = _lists()
    params = dict(a, **{name: [torch.nn.Parameter(t, requires_grad=True) for t in a[name]]
                        for name in ("gate_up_proj", "down_proj")})
    for _ in range(3):
        checks(*_positional(a))
        checks(*_positional(params))
    assert len(runs) == 2
    # more sets than a key keeps: the oldest goes, the newest stay
    views = [dict(a, down_scale_inv=[s.t().contiguous().t() for s in a["down_scale_inv"]]),
             dict(a, gate_up_scale_inv=[s.t().contiguous().t() for s in a["gate_up_scale_inv"]]),
             dict(params, down_scale_inv=[s.t().contiguous().t() for s in a["down_scale_inv"]])]
    for v in views:
        checks(*_positional(v))
    assert len(runs) == 5
    assert [len(g) for g in checks._guards.values()] == [checks.GUARDS_PER_KEY]
    checks(*_positional(params))  # among the newest four: guarded
    assert len(runs) == 5
    checks(*_positional(a))  # the oldest, dropped: checked again
    assert len(runs) == 6


def test_cuda_list_checks_without_a_guard_run_every_call(monkeypatch):
    from fp8_moe_ops import ops

    monkeypatch.setattr(ops, "metadata_guard", lambda tensors: None)
    checks, runs = _counted_list_checks()
    a = _lists()
    for _ in range(3):
        checks(*_positional(a))
    assert len(runs) == 3


def test_metadata_guard_compares_every_tensors_metadata():
    from fp8_moe_ops._checks import metadata_guard

    ws = [torch.zeros(8, 4, dtype=torch.float8_e4m3fn) for _ in range(3)]
    ss = [torch.ones(2, 1) for _ in range(3)]
    if not hasattr(torch._C._dynamo.guards, "TensorGuards"):
        pytest.skip("this torch has no TensorGuards: the list checks run on every call")
    guard = metadata_guard(ws + ss)
    assert guard is not None  # the class exists, so the probe must have accepted it
    assert guard(*[w.clone() for w in ws], *[s + 1 for s in ss])  # metadata, not values nor addresses
    for i, other in [(1, ws[1].float()), (2, ws[2].view(4, 8)), (0, ws[0].t().contiguous().t()),
                     (4, torch.ones(2, 2)[:, :1]), (5, ss[2].view(2, 1, 1)), (3, ss[0].to("meta")),
                     (4, torch.ones(2, 1, requires_grad=True))]:
        changed = ws + ss
        changed[i] = other
        assert not guard(*changed), (i, other.shape, other.stride(), other.dtype, other.device)


def test_backward_through_the_list_op_raises_when_only_a_listed_tensor_requires_grad():
    # autograd does not look into Tensor[] arguments: the op lists them again for it
    a = _lists()
    a["gate_up_scale_inv"] = [s.clone().requires_grad_() for s in a["gate_up_scale_inv"]]
    out = OPS.grouped_experts_list(**a)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="fp8_moe::grouped_experts_list has no autograd formula"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not OPS.grouped_experts_list(**a).requires_grad


@pytest.mark.slow
def test_compiled_list_op_of_a_listed_tensor_requiring_grad_runs_and_its_backward_raises():
    # as the eager op above, compiled: the backward it traces refuses only when it runs
    a = _lists()
    a["down_scale_inv"] = [s.clone().requires_grad_() for s in a["down_scale_inv"]]
    torch._dynamo.reset()
    out = torch.compile(lambda **kw: OPS.grouped_experts_list(**kw), backend="aot_eager", fullgraph=True)(**a)
    assert out.requires_grad and torch.equal(out, OPS.grouped_experts_list(**a))
    with pytest.raises(RuntimeError, match="fp8_moe::grouped_experts_list has no autograd formula"):
        out.float().sum().backward()


def test_bad_separate_gate_up_shape():
    a = _lists(separate=True)
    a = _replace(a, "gate_up_proj", 5, a["gate_up_proj"][5][:16].contiguous())
    with pytest.raises(ValueError, match=r"gate_up_scale_inv\[5\]: expected shape \(1, 4\)"):
        OPS.grouped_experts_list(**a)


def test_errors_also_raise_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = _lists()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: ([mode.from_tensor(t) for t in v] if isinstance(v, list) and isinstance(v[0], torch.Tensor)
                    else mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        assert OPS.grouped_experts_list(**fake).shape == (5, 64)
        with pytest.raises(TypeError, match=r"gate_up_proj\[3\]: expected dtype"):
            OPS.grouped_experts_list(**_replace(fake, "gate_up_proj", 3, fake["gate_up_proj"][3].float()))


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("T", [0, 6])
def test_opcheck(separate, static, T):
    a = as_expert_lists(make_experts_inputs(T, 3, 64, 32, 2, [32, 32], static=static,
                                            scale_dtype=torch.float8_e8m0fnu), separate)
    names = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "gate_up_scale_inv", "down_proj",
             "down_scale_inv", "block_size")
    kwargs = {k: a[k] for k in ("gate_up_act_scale", "down_act_scale") if k in a}
    # test_schema needs allclose, which torch does not implement for float8 on CPU.
    torch.library.opcheck(OPS.grouped_experts_list.default, tuple(a[k] for k in names),
                          dict(kwargs, activation="gelu", swiglu_limit=5.0),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))


def test_vmap_runs_the_list_op_per_sample():
    # torch.func.vmap's generic fallback cannot take a Tensor[]: the op had no batching rule
    a = as_expert_lists(make_experts_inputs(5, 3, 64, 32, 2, [16, 16], seed=3), separate=True)
    b = as_expert_lists(make_experts_inputs(5, 3, 64, 32, 2, [16, 16], seed=4), separate=True)
    lists = ("gate_up_proj", "gate_up_scale_inv", "down_proj", "down_scale_inv")

    def f(hidden, w, gate_up):
        return OPS.grouped_experts_list(hidden, a["top_k_index"], w, gate_up, *(a[n] for n in lists[1:]), [16, 16])

    hidden, w = torch.stack([a["hidden"], b["hidden"]]), torch.stack([a["top_k_weights"], b["top_k_weights"]])
    gate_up = [torch.stack([x, y]) for x, y in zip(a["gate_up_proj"], b["gate_up_proj"])]
    for in_dims in ((None, 0, None), (0, 0, None), (0, None, 0)):  # also a batched Tensor[]
        args = [(hidden, w, gate_up)[i] if d == 0 else (a["hidden"], a["top_k_weights"], a["gate_up_proj"])[i]
                for i, d in enumerate(in_dims)]
        got = torch.func.vmap(f, in_dims=in_dims)(*args)
        want = torch.stack([f(*[x if d is None else (x[s] if isinstance(x, torch.Tensor) else [t[s] for t in x])
                                for x, d in zip(args, in_dims)]) for s in range(2)])
        assert got.shape == (2, 5, 64) and torch.equal(got, want), in_dims
    with pytest.raises(ValueError, match="grouped_experts_list: torch.func.vmap over an empty batch"):
        torch.func.vmap(f, in_dims=(None, 0, None))(a["hidden"], w[:0], a["gate_up_proj"])


def test_compile_fullgraph_dynamic():
    torch._dynamo.reset()
    a = as_expert_lists(make_experts_inputs(7, 3, 64, 32, 2, [16, 16]), separate=True)

    def f(hidden, idx, w):
        return OPS.grouped_experts_list(hidden, idx, w, a["gate_up_proj"], a["gate_up_scale_inv"], a["down_proj"],
                                        a["down_scale_inv"], [16, 16])

    c = torch.compile(f, fullgraph=True, dynamic=True)
    for T in (7, 11):
        b = make_experts_inputs(T, 3, 64, 32, 2, [16, 16], seed=T)
        args = (b["hidden"], b["top_k_index"], b["top_k_weights"])
        assert torch.equal(c(*args), f(*args))


def test_address_table_cached_per_set_of_tensors():
    # pure torch on CPU: the table the Triton kernel reads (its use is tested in the interpreter)
    from fp8_moe_ops.kernels.moe_list import address_table

    a = _lists()
    lists = (a["gate_up_proj"], a["gate_up_scale_inv"], a["down_proj"], a["down_scale_inv"])
    entry = address_table(lists, torch.device("cpu"))
    table, aligned, parts = entry.table, entry.aligned, entry.parts
    want = [t.data_ptr() for ts in lists for t in ts]
    assert table.dtype == torch.int64 and table.tolist() == want
    # one view of the table per list, in the lists' order (what the kernel reads per list)
    assert [p.tolist() for p in parts] == [[t.data_ptr() for t in ts] for ts in lists]
    assert all(p.untyped_storage().data_ptr() == table.untyped_storage().data_ptr() for p in parts)
    assert aligned  # rows of (E, N, K) tensors with N * K a multiple of 16
    # the same tensors (in new lists, as each call passes them): the same table, not rebuilt
    assert address_table(tuple(list(ts) for ts in lists), torch.device("cpu")).table is table
    # updated in place: the addresses hold, so does the table
    a["down_proj"][1].view(torch.uint8).add_(1)
    assert address_table(lists, torch.device("cpu")).table is table
    # a replaced tensor: a new table with its address
    new_w = a["down_proj"][1].clone()
    replaced = (lists[0], lists[1], [lists[2][0], new_w, *lists[2][2:]], lists[3])
    other = address_table(replaced, torch.device("cpu")).table
    assert other is not table and other[2 * 4 + 1].item() == new_w.data_ptr()  # after 4 + 4 gate_up entries


def test_address_tables_of_freed_tensors_are_dropped(monkeypatch):
    # parameters replaced again and again (a reload per step) must not grow the cache
    # without bound: a build, once the cache has doubled, drops the tables of sets with a
    # freed tensor; live sets (views of a live tensor too) and captured tables stay
    from fp8_moe_ops.kernels import moe_list

    monkeypatch.setattr(moe_list, "_TABLES", {})
    monkeypatch.setattr(moe_list, "MIN_SWEEP", 4)
    monkeypatch.setattr(moe_list, "_sweep_at", 4)
    cpu = torch.device("cpu")
    a = _lists()
    gate_up, gate_up_s, down_s = a["gate_up_proj"], a["gate_up_scale_inv"], a["down_scale_inv"]
    live = moe_list.address_table((gate_up, gate_up_s, a["down_proj"], down_s), cpu)
    stacked = torch.stack(a["down_proj"])
    views = moe_list.address_table((gate_up, gate_up_s, list(stacked.unbind()), down_s), cpu)
    gone = [t.clone() for t in a["down_proj"]]
    captured = moe_list.address_table((gate_up, gate_up_s, gone, down_s), cpu)
    with monkeypatch.context() as m:
        m.setattr(moe_list, "_capturing", lambda device: True)
        assert moe_list.address_table((gate_up, gate_up_s, gone, down_s), cpu) is captured  # captured: kept
        with pytest.raises(RuntimeError, match="run one eager call"):  # no table is built while capturing
            moe_list.address_table((gate_up, gate_up_s, [t.clone() for t in gone], down_s), cpu)
    del gone
    assert captured.freed() and not live.freed()
    for _ in range(40):
        moe_list.address_table((gate_up, gate_up_s, [t.clone() for t in a["down_proj"]], down_s), cpu)
        assert len(moe_list._TABLES) <= 6  # the 3 kept, and at most as many again
    tables = list(moe_list._TABLES.values())
    assert any(t is live for t in tables) and any(t is captured for t in tables)
    assert moe_list.address_table((gate_up, gate_up_s, list(stacked.unbind()), down_s), cpu) is views


def test_address_tables_of_moved_or_churning_storages_are_dropped(monkeypatch):
    # a storage freed in place and allocated again (FSDP's resize_) lives on at a new
    # address: its table is stale and dropped; live storages at ever new addresses
    # (expert weights moved between the slots of a buffer pool) keep at most MAX_TABLES
    # uncaptured tables, evicting the least recently used; a captured one stays
    import itertools

    from fp8_moe_ops.kernels import moe_list

    monkeypatch.setattr(moe_list, "_TABLES", {})
    monkeypatch.setattr(moe_list, "MIN_SWEEP", 4)
    monkeypatch.setattr(moe_list, "_sweep_at", 4)
    monkeypatch.setattr(moe_list, "MAX_TABLES", 8)
    monkeypatch.setattr(moe_list, "_RETIRED", [])
    cpu = torch.device("cpu")
    a = _lists()
    gate_up, gate_up_s, down_s = a["gate_up_proj"], a["gate_up_scale_inv"], a["down_scale_inv"]
    moved = [t.clone() for t in a["down_proj"]]
    entry = moe_list.address_table((gate_up, gate_up_s, moved, down_s), cpu)
    storage, before, holds = moved[0].untyped_storage(), moved[0].data_ptr(), []
    for _ in range(10):  # freed in place; its old block held by another tensor, so it moves
        nbytes = storage.nbytes()
        storage.resize_(0)
        holds.append(torch.empty(nbytes, dtype=torch.uint8))
        storage.resize_(nbytes)
        if moved[0].data_ptr() != before:
            break
    assert moved[0].data_ptr() != before
    assert entry.freed()
    pool = torch.zeros(6, *a["down_proj"][0].shape, dtype=a["down_proj"][0].dtype)
    slots = itertools.permutations(range(6), len(moved))
    captured = moe_list.address_table((gate_up, gate_up_s, [pool[i] for i in next(slots)], down_s), cpu)
    with monkeypatch.context() as m:
        m.setattr(moe_list, "_capturing", lambda device: True)
        moe_list.address_table((gate_up, gate_up_s, [pool[i] for i in (0, 1, 2, 3)], down_s), cpu)
    assert captured.captured
    model = (gate_up, gate_up_s, a["down_proj"], down_s)
    in_use = moe_list.address_table(model, cpu)  # looked up at every step: never the least recently used
    evictions = 0
    for _, arrangement in zip(range(40), slots):
        assert moe_list.address_table(model, cpu) is in_use
        views = [pool[i] for i in arrangement]
        table = moe_list.address_table((gate_up, gate_up_s, views, down_s), cpu).table
        assert table[8:12].tolist() == [v.data_ptr() for v in views]  # after 4 + 4 gate_up entries
        assert sum(not t.captured for t in moe_list._TABLES.values()) <= 8
        # live tables evicted are held until the next sweep (a thread may have looked one up just before)
        retired = [t for _, t in moe_list._RETIRED]
        assert not any(t in moe_list._TABLES.values() for t in retired)
        evictions += bool(retired)
    assert evictions and entry not in moe_list._TABLES.values() and captured in moe_list._TABLES.values()
    monkeypatch.setattr(moe_list, "MAX_TABLES", 1000)
    moe_list._sweep()  # nothing to evict: the retired ones go
    assert moe_list._RETIRED == []


def test_address_table_knows_unaligned_weights():
    # a weight view starting 8 bytes into a buffer: the kernel must not be told "16-byte aligned"
    from fp8_moe_ops.kernels.moe_list import address_table

    a = _lists()
    buf = torch.empty(64 * 32 + 8, dtype=torch.float8_e4m3fn)
    odd = buf[8:].view(64, 32)
    lists = (a["gate_up_proj"], a["gate_up_scale_inv"], [odd, *a["down_proj"][1:]], a["down_scale_inv"])
    assert not address_table(lists, torch.device("cpu")).aligned

    def four(**changed):
        return tuple(changed.get(n, a[n]) for n in ("gate_up_proj", "gate_up_scale_inv", "down_proj", "down_scale_inv"))

    # the same for a gate_up weight; a scale grid at an odd address is no weight: still aligned
    odd_gu = torch.empty(64 * 64 + 8, dtype=torch.float8_e4m3fn)[8:].view(64, 64)
    assert not address_table(four(gate_up_proj=[*a["gate_up_proj"][:3], odd_gu]), torch.device("cpu")).aligned
    odd_s = torch.empty(a["down_scale_inv"][0].numel() + 1)[1:].view(a["down_scale_inv"][0].shape)
    assert odd_s.data_ptr() % 16
    assert address_table(four(down_scale_inv=[odd_s, *a["down_scale_inv"][1:]]), torch.device("cpu")).aligned
