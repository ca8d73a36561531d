"""The Hopper prefill GEMM (``fp8_moe_ops/kernels/ws_gemm.py``, Gluon) without a GPU:
which GEMMs it takes, the launch it builds, and that it compiles for sm_90a.  Its
results (bitwise equal to the grouped Triton kernel's) are checked on the H200 by
``tests/test_gpu_ws_gemm.py``; the sorted activations it reads, under the interpreter
by ``tests/test_kernels_interpreter.py``."""

from __future__ import annotations

import pytest
import torch
import triton

from fp8_moe_ops.kernels import moe, ws_gemm
from fp8_moe_ops.kernels.config import gemm_config
from fp8_moe_ops.kernels.grouped_gemm import _grouped_gemm_kernel, max_row_tiles

from helpers import (FAKE_HEAD, needs_gluon, printed_by_fresh_process, record_with_fake_launchers,
                     replay_keeping_workspace)

CUDA = torch.device("cuda", 0)
FP8 = torch.float8_e4m3fn
PREFILL = {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "ws_min_k": 512}


def _on_fake_hopper(monkeypatch):
    # what usable() asks of the machine, answered as an H200 would
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(ws_gemm, "_sm90", lambda index: True)
    monkeypatch.setattr(ws_gemm, "AVAILABLE", True)
    monkeypatch.setattr(ws_gemm, "programs", lambda device: 132)  # its SMs
    monkeypatch.delenv("FP8_MOE_GLUON", raising=False)


def _weights(E=3, N=256, K=512, grid=(2, 4)):
    return torch.zeros(E, N, K, dtype=FP8), torch.ones(E, *grid)


def test_usable_takes_the_prefill_tiles_of_stacked_tma_aligned_weights(monkeypatch):
    _on_fake_hopper(monkeypatch)
    w, ws = _weights()
    assert ws_gemm.usable(CUDA, w, ws, (128, 128), PREFILL)
    assert ws_gemm.usable(CUDA, w, torch.ones(3, 1, 2), (256, 256), PREFILL)  # coarser blocks
    assert ws_gemm.usable(CUDA, w, torch.ones(3, 1, 4), (64, 128), PREFILL)  # one row of scales per matrix
    assert not ws_gemm.usable(CUDA, w, torch.ones(3, 1, 1), (64, 64), PREFILL)  # two act scales per K step
    assert not ws_gemm.usable(torch.device("cpu"), w, ws, (128, 128), PREFILL)
    # an entry naming ws_min_k hands its GEMMs over whatever its (the Triton kernel's) tiles
    assert ws_gemm.usable(CUDA, w, ws, (128, 128), {**PREFILL, "BM": 64, "num_warps": 4})  # a mid-size entry
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), {**PREFILL, "SPLIT": 2})
    assert not ws_gemm.usable(CUDA, w, torch.ones(3, 4, 4), (64, 128), PREFILL)  # two scales per column tile
    assert not ws_gemm.usable(CUDA, w, torch.ones(3, 2, 8), (128, 64), PREFILL)  # two scales per K step
    w_odd, ws_odd = _weights(K=504)  # K rows of 504 bytes: not a TMA stride
    assert not ws_gemm.usable(CUDA, w_odd, ws_odd, (128, 128), PREFILL)
    assert not ws_gemm.usable(CUDA, w.transpose(1, 2), ws, (128, 128), PREFILL)
    monkeypatch.setenv("FP8_MOE_GLUON", "0")
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), PREFILL)


def test_the_launch_table_chooses_unless_the_environment_says(monkeypatch):
    _on_fake_hopper(monkeypatch)
    w, ws = _weights()  # K = 512
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), {**PREFILL, "ws_min_k": 1024})
    triton_entry = {k: v for k, v in PREFILL.items() if k != "ws_min_k"}
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), triton_entry)
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    assert ws_gemm.usable(CUDA, w, ws, (128, 128), triton_entry)
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), {**triton_entry, "BM": 64})  # still only where it can run


def test_the_shipped_table_takes_the_measured_winners(monkeypatch):
    # on the H200 the persistent kernel made the layers faster at every K measured, 768
    # to 14336 (bench/ws_gemm_ab.py): the table's prefill entries choose it from K = 768
    _on_fake_hopper(monkeypatch)
    shapes = {  # E, S (prefill), N, K, chosen
        "deepseek_v3 gate_up": (256, 8192 * 8, 4096, 7168, True), "deepseek_v3 down": (256, 8192 * 8, 7168, 2048, True),
        "qwen3 gate_up": (128, 16384 * 8, 1536, 2048, True), "qwen3 down": (128, 16384 * 8, 2048, 768, True),
        "mixtral gate_up": (8, 4096 * 2, 28672, 4096, True), "mixtral down": (8, 4096 * 2, 4096, 14336, True),
        "K below what was measured": (8, 4096 * 2, 4096, 512, False),
        # mid sizes: the layers were faster with it than with the Triton kernel's 64-row tiles
        # at 64 rows per expert and more, slower at 48; its GEMMs slower at 16 and 32
        "qwen3 T=2048 gate_up, 128 rows": (128, 2048 * 8, 1536, 2048, True),
        "deepseek_v3 T=2048 down, 64 rows": (256, 2048 * 8, 7168, 2048, True),
        "mixtral down, 300 rows": (8, 300 * 8, 4096, 14336, True),
        "qwen3 T=768 down, 48 rows": (128, 768 * 8, 2048, 768, False),
        "qwen3 T=512 gate_up, 32 rows": (128, 512 * 8, 1536, 2048, False),
        "deepseek_v3 T=1024 gate_up, 32 rows": (256, 1024 * 8, 4096, 7168, False),
        "mixtral T=8 gate_up, decode": (8, 8 * 2, 28672, 4096, False)}
    for name, (E, S, N, K, chosen) in shapes.items():
        w = torch.empty(E, N, K, dtype=FP8, device="meta")
        assert ws_gemm.usable(CUDA, w, torch.ones(E, 1, 1), (128, 128), gemm_config(S, E, N, K)) == chosen, name


def test_the_gluon_kernel_runs_with_the_tritons_it_ran_under_on_the_gpu():
    assert ws_gemm.AVAILABLE == triton.__version__.startswith(("3.6.", "3.7."))


@needs_gluon
def test_a_replayed_descriptor_has_every_field_tritons_launcher_reads():
    # a launch plan replays a Gluon launch with its own descriptor object on the new
    # address; Triton's CUDA launcher reads the descriptor's fields (3.7 added
    # round_f32_to_tf32: without it every replay raised AttributeError on the GPU)
    import dataclasses

    from fp8_moe_ops.kernels import plans

    read = {f.name for f in dataclasses.fields(ws_gemm.TensorDescriptor)} - {"block_shape", "layout"}
    assert read <= set(plans._Descriptor._fields)
    x = torch.zeros(256, 128, dtype=FP8)
    desc = ws_gemm.TensorDescriptor.from_tensor(x, [128, 128], ws_gemm.shared_layout([128, 128]))
    replay = plans._Described(0, tuple(desc.shape), tuple(desc.strides), desc.padding).at(x.data_ptr())
    assert all(getattr(replay, name) == getattr(desc, name) for name in read - {"base"})


def test_usable_is_false_without_the_gluon_kernel(monkeypatch):
    _on_fake_hopper(monkeypatch)
    monkeypatch.setattr(ws_gemm, "AVAILABLE", False)  # another Triton release
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    w, ws = _weights()
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), PREFILL)


def test_the_package_imports_and_runs_without_gluon():
    # a Triton without Gluon's Hopper API: the package imports, the kernel is unavailable,
    # and the ops run (here the CPU reference)
    code = """
import sys
sys.modules["triton.experimental.gluon.language.nvidia.hopper"] = None  # its import raises ImportError
import torch, fp8_moe_ops
from fp8_moe_ops.kernels import launch, ws_gemm
x = torch.randn(5, 256)
w, s = fp8_moe_ops.quantize_weight(torch.randn(2, 128, 256), [128, 128])
out = torch.ops.fp8_moe.grouped_mm(x, w, s, torch.tensor([2, 5], dtype=torch.int32), [128, 128])
print({"available": ws_gemm.AVAILABLE, "shape": tuple(out.shape), "finite": bool(out.isfinite().all())})
"""
    res = printed_by_fresh_process(code)
    assert res == {"available": False, "shape": (5, 128), "finite": True}


def test_usable_is_false_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    monkeypatch.setattr(ws_gemm, "_sm90", lambda index: True)
    w, ws = _weights()
    assert not ws_gemm.usable(CUDA, w, ws, (128, 128), PREFILL)


def test_tma_ready_needs_unit_k_stride_and_16_byte_rows():
    q = torch.zeros(64, 48, dtype=FP8)
    assert ws_gemm.tma_ready(q)
    assert not ws_gemm.tma_ready(torch.zeros(64, 40, dtype=FP8))  # 40-byte rows
    assert not ws_gemm.tma_ready(q[:, 8:].t())
    assert not ws_gemm.tma_ready(q.view(-1)[8:8 + 63 * 48].view(63, 48))  # base 8 bytes off


def _gemm_call(monkeypatch, S=4096, E=4, N=256, K=512, out=None, qs=None, **kw):
    """``moe._gemm_call`` of a prefill-sized grouped GEMM on CPU tensors, with usable()
    seeing an H200 and told to take every GEMM it can run."""
    _on_fake_hopper(monkeypatch)
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    real = ws_gemm.usable
    monkeypatch.setattr(ws_gemm, "usable", lambda device, *a: real(CUDA, *a))
    w, ws = _weights(E, N, K)
    q = torch.zeros(S, K, dtype=FP8)
    qs = torch.ones(K // 128, S).t() if qs is None else qs  # scales K-group major, as at prefill
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * (S // E)
    out = torch.empty(S, N, dtype=torch.bfloat16) if out is None else out
    return moe._gemm_call(q, qs, w, ws, (128, 128), out, offsets=offsets, **kw)


def test_prefill_grouped_gemm_launches_the_ws_kernel(monkeypatch):
    call = _gemm_call(monkeypatch, N=384, perm=torch.arange(4096), scatter_out=True)
    assert call.kernel is ws_gemm._ws_gemm_kernel
    tiles_m = max_row_tiles(4096, 4, 128, True)
    assert call.args[-1] == tiles_m  # num_pid_m: the tile map's bound
    assert call.grid == (tiles_m * 3,)  # fewer tiles than SMs: one program per tile
    many = _gemm_call(monkeypatch, N=1024, perm=torch.arange(4096), scatter_out=True)
    assert tiles_m * 4 > 132 and many.grid == (132,)  # persistent: one program per SM, every 132nd tile each
    assert call.constexprs["SCATTER_OUT"] and not call.constexprs["STATIC"]
    a_desc, w_desc = call.args[0], call.args[3]
    assert list(a_desc.shape) == [4096, 512] and list(w_desc.shape) == [4 * 384, 512]  # (E * N, K) view
    assert a_desc.block_shape == w_desc.block_shape == [128, 128]  # N = 384: not a whole number of wide tiles
    assert call.constexprs["WN"] == 1 and call.constexprs["LAG"] == ws_gemm.LAG
    assert call.constexprs["BY_EXPERT"] is ws_gemm.BY_EXPERT is True  # tiles in order by expert
    assert call.constexprs["STAGES"] == ws_gemm.STAGES


def test_a_mid_size_entry_launches_the_ws_kernel_with_its_own_tiles(monkeypatch):
    # 64 rows per expert: the table's entry has the Triton kernel's 64-row tiles and a
    # ws_min_k; the Gluon kernel's tile map is bounded by its 128-row tiles
    assert gemm_config(256, 4, 256, 512)["BM"] == 64
    call = _gemm_call(monkeypatch, S=256)
    assert call.kernel is ws_gemm._ws_gemm_kernel
    assert call.args[-1] == max_row_tiles(256, 4, 128, True) < max_row_tiles(256, 4, 64, True)


def test_wide_tiles_where_n_is_a_multiple_of_256_and_the_output_2_bytes(monkeypatch):
    # 128 x 256 output tiles: the weight tile twice as wide, half the column tiles, a
    # shallower ring, one MMA in flight per warpgroup (no LAG)
    call = _gemm_call(monkeypatch, N=512)
    assert call.grid == (call.args[-1] * 2,) and call.args[3].block_shape == [256, 128]  # num_pid_m x 2
    assert call.args[0].block_shape == [128, 128] and call.args[10].block_shape == [64, 128]  # A; a store
    assert call.constexprs["WN"] == 2 and not call.constexprs["LAG"]
    assert call.constexprs["STAGES"] == ws_gemm.WIDE_STAGES
    for narrow in (_gemm_call(monkeypatch, N=640),  # 640 = 2.5 x 256
                   _gemm_call(monkeypatch, N=512, out=torch.empty(4096, 512, dtype=torch.float32))):
        assert narrow.constexprs["WN"] == 1 and narrow.args[3].block_shape == [128, 128]
    # a long K (deepseek_v3's gate_up) only from WIDE_LONG_MIN_ROWS rows per expert; longer K never
    assert ws_gemm.WIDE_MAX_K < 7168 <= ws_gemm.WIDE_LONG_MAX_K and ws_gemm.WIDE_LONG_MIN_ROWS == 128
    assert _gemm_call(monkeypatch, S=2048, E=16, K=7168).constexprs["WN"] == 2  # 128 rows per expert
    assert _gemm_call(monkeypatch, S=2032, E=16, K=7168).constexprs["WN"] == 1  # 127
    assert _gemm_call(monkeypatch, S=2032, E=16, K=ws_gemm.WIDE_MAX_K).constexprs["WN"] == 2
    assert _gemm_call(monkeypatch, K=ws_gemm.WIDE_LONG_MAX_K + 128).constexprs["WN"] == 1
    # tests/test_gpu_ws_gemm.py's "wide tiles, long K" case takes them
    assert _gemm_call(monkeypatch, S=2200, E=3, N=512, K=4160).constexprs["WN"] == 2
    monkeypatch.setattr(ws_gemm, "WIDE", False)  # the A/B switch
    assert _gemm_call(monkeypatch, N=512).constexprs["WN"] == 1


def test_the_output_is_stored_by_tma_only_where_its_rows_are_in_place(monkeypatch):
    # EPILOGUE 2 (TMA, with the output's descriptor of half tiles) for an output written in
    # sorted order; scattered rows, or an output TMA cannot address, are stored whole rows
    # at a time (1), with no descriptor
    in_place = _gemm_call(monkeypatch)
    out_desc = in_place.args[10]
    assert in_place.constexprs["EPILOGUE"] == 2 and not in_place.constexprs["SCATTER_OUT"]
    assert isinstance(out_desc, ws_gemm.TensorDescriptor) and out_desc.block_shape == [64, 128]
    assert list(out_desc.shape) == [4096, 256]
    scattered = _gemm_call(monkeypatch, perm=torch.arange(4096), scatter_out=True)
    assert scattered.constexprs["EPILOGUE"] == 1 and scattered.args[10] is None
    padded = torch.empty(4096, 260, dtype=torch.bfloat16)[:, :256]  # rows 520 bytes apart: not a TMA stride
    unaligned = _gemm_call(monkeypatch, out=padded)
    assert unaligned.constexprs["EPILOGUE"] == 1 and unaligned.args[10] is None
    wide = _gemm_call(monkeypatch, out=torch.empty(4096, 256, dtype=torch.float64))  # no staging layout for it
    assert wide.constexprs["EPILOGUE"] == 1 and wide.args[10] is None
    monkeypatch.setattr(ws_gemm, "EPILOGUE", 0)  # the A/B switch: the store from the MMA layout
    assert _gemm_call(monkeypatch).constexprs["EPILOGUE"] == 0


def test_gathered_or_fused_or_small_gemms_keep_the_triton_kernel(monkeypatch):
    perm = torch.arange(4096)
    assert _gemm_call(monkeypatch, perm=perm, gather_a=True).kernel is _grouped_gemm_kernel
    assert _gemm_call(monkeypatch, S=128).kernel is _grouped_gemm_kernel  # 32 rows per expert: BM 64
    assert _gemm_call(monkeypatch, K=520).kernel is _grouped_gemm_kernel  # 520-byte rows


def test_ws_gemm_reads_activation_scales_either_way(monkeypatch):
    # K-group major, the producer copies each K step's scales of a tile's rows (adjacent
    # there) into shared memory; row-major, the consumers load them; static, one per expert
    cases = {"kmajor": (torch.ones(4, 4096).t(), False, True, 4096),
             "row-major": (torch.ones(4096, 4), False, False, 4),
             "static": (torch.ones(4), True, False, 0)}
    for name, (qs, static, kmajor, stride) in cases.items():
        call = _gemm_call(monkeypatch, qs=qs, static=static)
        assert call.kernel is ws_gemm._ws_gemm_kernel, name
        assert call.constexprs["KMAJOR"] == kmajor and call.args[1] is qs and call.args[2] == stride, name
    assert ws_gemm.kmajor(torch.ones(3, 4096).t()) and not ws_gemm.kmajor(torch.ones(4096, 3))
    # K groups 2 apart: neither layout; the Triton kernel, which reads any strides, runs
    strided = torch.ones(4096, 8)[:, ::2]
    assert not ws_gemm.scales_readable(strided) and ws_gemm.scales_readable(torch.ones(4096, 8)[::2])
    assert _gemm_call(monkeypatch, qs=strided).kernel is _grouped_gemm_kernel
    w, ws = _weights(4, 256, 512)
    with pytest.raises(ValueError, match=r"q_scale: expected .* row-major .* K-group major .* got strides \(8, 2\)"):
        ws_gemm.ws_gemm_call(torch.zeros(4096, 512, dtype=FP8), strided, w, ws, ws.stride(), (128, 128),
                             torch.empty(4096, 256, dtype=torch.bfloat16), offsets=torch.ones(4, dtype=torch.int32),
                             perm=None, scatter_out=False, static=False, e8m0=False, num_pid_m=36, group_m=8,
                             max_programs=132)


@needs_gluon
def test_the_launch_cache_keys_a_descriptor_on_what_the_jit_specialises():
    # a descriptor's base dtype, block shape, layout and padding (its shape and strides
    # are run-time arguments of the compiled launcher); unhashable as it is
    from fp8_moe_ops.kernels.launch import _spec

    def desc(t, block, padding="zero"):  # the layout of the tensor's element width (Triton 3.7 checks it)
        layout = ws_gemm.out_layout(block, t.dtype) if t.dtype == torch.bfloat16 else ws_gemm.shared_layout(block)
        return ws_gemm.TensorDescriptor.from_tensor(t, block, layout, padding)

    q = torch.zeros(256, 512, dtype=FP8)
    key = _spec(desc(q, [128, 128]))
    hash(key)
    assert _spec(desc(q[:128], [128, 128])) == key  # other rows
    assert _spec(desc(q.view(torch.int8), [128, 128])) != key
    assert _spec(desc(q, [64, 128])) != key
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    assert _spec(desc(x, [64, 128])) != _spec(desc(x, [64, 128], padding="nan"))


def _experts_sources(T, k, E, H, I, seed):
    """The sources of an experts forward (routing, stacked fp8 weights), on the CPU."""
    from fp8_moe_ops.kernels import experts

    g = torch.Generator().manual_seed(seed)
    routing = experts.routing_sources(torch.zeros(T, H, dtype=torch.bfloat16),
                                      torch.randint(0, E, (T, k), generator=g), torch.ones(T, k), None, None)
    return dict(routing, gate_up_proj=torch.zeros(E, 2 * I, H, dtype=FP8), gate_up_scale_inv=torch.ones(E, 2, 2),
                down_proj=torch.zeros(E, H, I, dtype=FP8), down_scale_inv=torch.ones(E, 2, 1))


def _experts_calls(monkeypatch, sources, E, I):
    """The launches of the experts forward on ``sources`` (built, not run) on a fake
    H200 told to take every GEMM the Gluon kernel can run: (env, layout, calls)."""
    from fp8_moe_ops.kernels import experts

    _on_fake_hopper(monkeypatch)
    monkeypatch.setenv("FP8_MOE_GLUON", "1")
    real = ws_gemm.usable
    monkeypatch.setattr(ws_gemm, "usable", lambda device, *a: real(CUDA, *a))
    (T, H), k = sources["hidden"].shape, sources["top_k_index"].shape[1]
    gate_up = (sources["gate_up_proj"], sources["gate_up_scale_inv"])
    sorted_a = experts._sorted_a(CUDA, gate_up, T * k, E, I, H, (128, 128))
    layout = experts._layout(T, k, E, H, I, 128, torch.bfloat16, False, False, sorted_a)
    env = dict(sources, out=torch.empty(T, H, dtype=torch.bfloat16))
    env.update(zip((name for name, *_ in layout.buffers), layout.views(torch.empty(layout.nbytes, dtype=torch.uint8))))
    down = (sources["down_proj"], sources["down_scale_inv"])
    return env, layout, experts._calls(env, E, I, (128, 128), "silu", None, gate_up, down, sorted_a)


def test_gate_up_rows_in_place_sort_in_three_launches_at_any_size(monkeypatch):
    # where the Gluon kernel takes the gate_up GEMM its A rows are stored per sorted slot,
    # which the one-launch sort cannot do: at 2048 slots or fewer, from 72 rows per expert
    # (mixtral_8x7b's T=288 to 1024), the sort takes its three launches and the
    # quantisation its own; below, the one-launch sort runs and the GEMM gathers its rows
    from fp8_moe_ops.kernels import moe, sort

    for T, k, E, in_place in [(1100, 2, 4, True), (144, 2, 4, True), (143, 2, 4, False), (32, 2, 1, False)]:
        env, _, calls = _experts_calls(monkeypatch, _experts_sources(T, k, E, 256, 128, seed=T), E, 128)
        kernels = [c.kernel for c in calls]
        if in_place:
            assert kernels[:5] == [sort._sort_hist_kernel, sort._sort_scan_kernel, sort._sort_scatter_kernel,
                                   moe._quant_kernel, ws_gemm._ws_gemm_kernel], T
            assert "slot_rows" in env and env["q"].shape == (T * k, 256)  # a row per slot
        else:
            assert kernels[:2] == [sort._sort_quant_kernel, _grouped_gemm_kernel], T


def test_a_plan_replays_gluon_gemms_on_descriptors_of_the_new_calls_tensors(monkeypatch):
    # a prefill forward whose two GEMMs the Gluon kernel takes, recorded with fake
    # launchers: a replay hands each launcher, for each TMA descriptor, the recorded one's
    # shape, strides and padding on the address of the new call's tensor of its base
    # (the weights given, the workspace's buffers of this replay)
    from fp8_moe_ops.kernels import launch

    T, k, E, H, I = 1100, 2, 4, 256, 128
    first = _experts_sources(T, k, E, H, I, seed=1)
    env, layout, calls = _experts_calls(monkeypatch, first, E, I)
    assert [c.kernel for c in calls].count(ws_gemm._ws_gemm_kernel) == 2  # gate_up and down

    plan, got = record_with_fake_launchers(monkeypatch, first, env, layout, calls)
    assert plan is not None
    second = _experts_sources(T, k, E, H, I, seed=2)
    out, ws = replay_keeping_workspace(monkeypatch, plan, list(second.values()), second["hidden"])
    assert len(got) == len(calls)

    offsets = {name: off for name, *_, off in layout.buffers}
    new_address = {id(env[name]): t.data_ptr() for name, t in second.items() if t is not None}
    new_address[id(env["out"])] = out.data_ptr()
    new_address.update({id(env[name]): ws.data_ptr() + off for name, off in offsets.items()})
    descriptors = 0
    for call, args in zip(calls, got):
        for value, arg in zip(args[4 + len(FAKE_HEAD):], launch.cached(call).full_args(call.args)):
            if isinstance(arg, ws_gemm.TensorDescriptor):
                descriptors += 1
                assert value.base.data_ptr() == new_address[id(arg.base)]
                assert (value.shape, value.strides, value.padding) == (tuple(arg.shape), tuple(arg.strides),
                                                                       arg.padding)
            elif isinstance(arg, torch.Tensor):
                assert value == new_address[id(arg)]
    assert descriptors == 5  # A and weights of both GEMMs, the gate_up GEMM's output (stored by TMA)


@needs_gluon
def test_ws_kernel_compiles_for_sm90_without_a_gpu():
    # every scheme / scale / output form of the kernel, compiled for sm_90a as
    # bench/kernel_resources.py compiles the forward's launches
    code = """
import sys; sys.path.insert(0, sys.argv[1])
import torch, kernel_resources as kr
from fp8_moe_ops.kernels import ws_gemm
res = []  # with and without the two-step overlap (N = 384), and wide tiles (N = 256)
# dynamic scales row-major where rows are scattered (as the down GEMM's), K-group major where in place;
# the last at deepseek_v3's 256 experts with int32 offsets and rows, as the forward's, where its K loops once spilled
for static, e8m0, scatter, lag, N, E in [(False, False, True, True, 384, 4), (True, False, True, False, 384, 4),
                                         (False, True, False, True, 384, 4), (False, False, False, False, 384, 4),
                                         (False, False, True, True, 256, 4), (True, True, False, True, 256, 4),
                                         (False, False, False, True, 256, 4), (True, False, True, True, 256, 256)]:
    K, S = 512, 4096
    w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    ws = torch.ones(E, N // 128, 4, dtype=torch.uint8 if e8m0 else torch.float32)
    q = torch.zeros(S, K, dtype=torch.float8_e4m3fn)
    qs = torch.ones(E) if static else torch.ones(S, 4) if scatter else torch.ones(4, S).t()
    ws_gemm.LAG = lag
    idx = torch.int32 if E == 256 else torch.int64
    call = ws_gemm.ws_gemm_call(q, qs, w, ws, ws.stride(), (128, 128), torch.empty(S, N, dtype=torch.bfloat16),
                                offsets=torch.ones(E, dtype=idx), perm=torch.arange(S, dtype=idx), scatter_out=scatter,
                                static=static, e8m0=e8m0, num_pid_m=40, group_m=8, max_programs=132)
    res.append(kr.resources(call))
print(res)
"""
    res = printed_by_fresh_process(code)
    assert len(res) == 8
    for i, r in enumerate(res):
        assert r["kernel"] == "_ws_gemm_kernel" and r["warps"] == 4
        # wide tiles with scattered rows spill a few per-tile values, stored before the K
        # loop and reloaded at the store: never inside the loops around the MMAs
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] <= (64 if i in (4, 7) else 0)
        assert r["mma_loop_local_ops"] == 0
        assert r["shared_bytes"] >= ws_gemm.STAGES * 2 * 128 * 128  # the ring of A and weight tiles
