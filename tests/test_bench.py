"""bench/ on CPU: every script imports without a GPU, and the shared module's runner,
result types, writers, inputs and floors work (tiny sizes).  The benchmarks themselves
run on a CUDA machine only; kernel_resources compiles for one, here, without it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_moe_ops import reference

from helpers import needs_gluon, printed_by_fresh_process

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "common")


def _load(name: str, monkeypatch) -> object:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # removed again after the test
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def common(monkeypatch):
    return _load("common", monkeypatch)


def test_every_script_imports_without_a_gpu_and_has_a_main():
    # a fresh process: the scripts import ``common`` from bench/ as a script would
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); "
            "[getattr(importlib.import_module(m), 'main') for m in sys.argv[2:]]")
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH), *SCRIPTS], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"bench_moe", "host_overhead", "gemm_ceiling", "bench_model", "dispatch_agreement"} <= set(SCRIPTS)


def test_runner_records_a_failure_goes_on_and_exits_nonzero(common, tmp_path):
    runner = common.Runner("smoke", str(tmp_path))
    cfg = common.ExperimentConfig("smoke", "tiny", 4, "ok", params=(("proj", "down"),))
    ok = runner.run(cfg, lambda: {"ms": 0.5})
    bad = runner.run(common.ExperimentConfig("smoke", "tiny", 8, "broken"), lambda: 1 / 0)
    assert ok.ok and ok.metrics == {"ms": 0.5}
    assert not bad.ok and bad.error.startswith("ZeroDivisionError")
    assert runner.exit_code() == 1
    runner.save(common.results_table(runner.results, [("T", "tokens", ""), ("ms", "ms", ".3f")]))
    meta, results = common.read_json(str(tmp_path / "smoke.json"))
    assert results == runner.results  # frozen dataclasses round-trip through the JSON
    assert meta["device"] == "cpu"
    table = (tmp_path / "smoke.md").read_text()
    assert "| 4 | 0.500 | — |" in table and "| 8 | — | ZeroDivisionError: division by zero |" in table


def test_runner_all_ok_exits_zero(common):
    runner = common.Runner("smoke")
    runner.run(common.ExperimentConfig("smoke", "tiny", 1, "a"), lambda: {"x": 1})
    assert runner.exit_code() == 0
    assert runner.results[0].flat() == {"experiment": "smoke", "model": "tiny", "tokens": 1, "variant": "a",
                                        "routing": "uniform", "x": 1, "error": None}


def test_inputs_on_cpu(common):
    tiny = common.Model("tiny", E=16, H=256, I=128, top_k=4)
    gen = torch.Generator().manual_seed(0)
    w = common.layer_weights(tiny, gen, device="cpu")
    assert w.gate_up.shape == (16, 256, 256) and w.gate_up.dtype == torch.float8_e4m3fn
    assert w.down_scale.shape == (16, 2, 1) and (w.down_scale > 0).all()
    # the bf16 baseline's weights are the block dequantisation of ours
    expected = reference.dequantize_weight(w.down[3], w.down_scale[3], common.BLOCK).to(torch.bfloat16)
    assert torch.equal(common.dequant_bf16(w.down, w.down_scale)[3], expected)
    x, idx, wts = common.layer_inputs(tiny, 2000, gen, "uniform", device="cpu")
    assert x.shape == (2000, 256) and idx.shape == wts.shape == (2000, 4)
    assert torch.allclose(wts.sum(-1), torch.ones(2000))
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
    _, skewed, _ = common.layer_inputs(tiny, 2000, gen, "skewed", device="cpu")
    uniform_hot = torch.bincount(idx.flatten(), minlength=16)[0] / idx.numel()
    skewed_hot = torch.bincount(skewed.flatten(), minlength=16)[0] / skewed.numel()
    assert skewed_hot > 2 * uniform_hot  # Zipf-like: expert 0 is the hottest
    with pytest.raises(ValueError, match="kind"):
        common.make_routing(4, 16, 2, "zipf", gen, device="cpu")


def test_each_scheme_case_draws_weights_scales_then_inputs_per_model(common, monkeypatch):
    tiny, small = common.Model("tiny", E=4, H=128, I=128, top_k=2), common.Model("small", E=6, H=256, I=128, top_k=3)
    monkeypatch.setitem(common.MODELS, "tiny", tiny)
    monkeypatch.setitem(common.MODELS, "small", small)
    calls, saved = [], []
    common.each_scheme_case({"tiny": [1, 3], "small": [2]}, torch.Generator().manual_seed(4),
                            lambda *case: calls.append(case), after_model=lambda: saved.append(len(calls)),
                            device="cpu")
    assert [(name, T, scheme) for name, T, _, _, scheme, _ in calls] == [
        ("tiny", 1, "dynamic"), ("tiny", 1, "static"), ("tiny", 3, "dynamic"), ("tiny", 3, "static"),
        ("small", 2, "dynamic"), ("small", 2, "static")]
    assert saved == [4, 6]
    # the draws of the inline loops it replaced, in their order
    gen = torch.Generator().manual_seed(4)
    for model, tokens, first in ((tiny, [1, 3], 0), (small, [2], 4)):
        w = common.layer_weights(model, gen, device="cpu")
        scales = common.static_scales(model, gen, device="cpu")
        for i, T in enumerate(tokens):
            inputs = common.layer_inputs(model, T, gen, device="cpu")
            dynamic, static = calls[first + 2 * i], calls[first + 2 * i + 1]
            assert all(torch.equal(a, b) for a, b in zip(dynamic[2], w, strict=True)) and dynamic[2] is static[2]
            assert all(torch.equal(a, b) for a, b in zip(dynamic[3], inputs, strict=True)) and dynamic[3] is static[3]
            assert dynamic[5] == (None, None) and all(torch.equal(a, b) for a, b in zip(static[5], scales, strict=True))


def test_floor_is_the_larger_term(common):
    m = common.MODELS["deepseek_v3"]
    assert common.layer_flops(m, 1) == 6 * 8 * 7168 * 2048
    nbytes = common.weight_bytes(m, 8)
    assert nbytes == 8 * (3 * 7168 * 2048 + 4 * (32 * 56 + 56 * 16))
    assert common.floor_ms(common.layer_flops(m, 1), nbytes) == pytest.approx(nbytes / 4.22e12 * 1e3)
    flops = common.layer_flops(m, 16384)
    assert common.floor_ms(flops, nbytes) == pytest.approx(flops / 1357e12 * 1e3)
    slower = common.Ceilings(copy_bandwidth=2e12, fp8_dense_rate=1000e12, source="test")
    assert common.floor_ms(flops, nbytes, slower) == pytest.approx(flops / 1000e12 * 1e3)
    assert common.floor_ms(1.0, nbytes, slower) == pytest.approx(nbytes / 2e12 * 1e3)
    assert common.ceilings_for("h200") is common.H200_CEILINGS
    assert [common.gemm_shape(m, p) for p in common.PROJS] == [(4096, 7168), (7168, 2048)]
    with pytest.raises(ValueError, match="expected one of \\('gate_up', 'down'\\), got 'up'"):
        common.gemm_shape(m, "up")
    with pytest.raises(ValueError, match="expected 'measured' or 'h200', got 'h100'"):
        common.ceilings_for("h100")


def test_smi_summary_reads_clocks_power_and_capping(common):
    text = ("1980, 650.10, 0x0000000000000000\n"
            "1410, 702.50, 0x0000000000000004\n"  # the software power cap
            "[N/A], 12.0, 0x1\n"                   # unreadable: skipped
            "1830, 690.00, 0x0000000000000001\n")  # idle only: not capping
    summary = common.smi_summary(text)
    assert summary == {"samples": 3, "sm_mhz_median": 1830.0, "sm_mhz_min": 1410.0, "power_w_max": 702.5,
                       "capped": 1 / 3}
    assert common.smi_summary("") == {}


def test_gpu_clocks_without_nvidia_smi_is_empty(common, monkeypatch):
    monkeypatch.setattr(common.shutil, "which", lambda name: None)
    with common.GpuClocks() as clocks:
        pass
    assert clocks.summary == {} and clocks.metrics() == {}
    clocks.summary = common.smi_summary("1500, 690.0, 0x4\n1700, 600.0, 0x0\n")
    assert clocks.metrics() == {"clock_sm_mhz_median": 1600.0, "clock_capped": 0.5}


def test_parse_sweep(common):
    assert common.parse_sweep("qwen3_30b_a3b:1,8;mixtral_8x7b:64") == {"qwen3_30b_a3b": [1, 8], "mixtral_8x7b": [64]}
    with pytest.raises(ValueError, match="llama"):
        common.parse_sweep("llama:1")


def test_table_override_changes_every_entry_and_removes_keys(common, monkeypatch):
    from fp8_moe_ops.kernels import config

    monkeypatch.setattr(config, "_table", config._table)  # restored after the test
    # the shipped decode entry: its own form, and its dense form (mixtral_8x7b's T=1 gate_up)
    assert config.gemm_config(8, 128, 1536, 2048)["maxnreg"] == 128
    assert config.gemm_config(2, 8, 28672, 4096)["maxnreg"] == 72
    common.table_override("maxnreg=none,num_stages=3")
    for S in (2, 8192):  # decode and prefill entries, default and per-shape lists, both forms
        for N, K in ((28672, 4096), (4096, 7168), (1536, 2048)):
            cfg = config.gemm_config(S, 8, N, K)
            assert "maxnreg" not in cfg and cfg["num_stages"] == 3
    assert config.gemm_config(2, 8, 28672, 4096)["BN"] == 64  # still the dense form
    assert config.gemm_config(8192, 8, 28672, 4096)["BM"] == 128  # the rest as shipped
    common.table_override("dense=none")
    assert config.gemm_config(2, 8, 28672, 4096)["BN"] == 128  # the entry's own form only


def test_table_override_of_one_form_leaves_the_other(common, monkeypatch):
    from fp8_moe_ops.kernels import config

    shipped = config._table
    monkeypatch.setattr(config, "_table", shipped)  # restored after the test
    # mixtral_8x7b's gate_up: T=4 takes the dense form (72 registers), T=8 the entry's own (128)
    assert config.gemm_config(8, 8, 28672, 4096)["maxnreg"] == 72
    assert config.gemm_config(16, 8, 28672, 4096)["maxnreg"] == 128
    common.table_override("own.maxnreg=none,own.num_stages=6")
    assert config.gemm_config(8, 8, 28672, 4096)["maxnreg"] == 72  # the dense form keeps its own cap
    assert config.gemm_config(8, 8, 28672, 4096)["num_stages"] == 4  # and the stages it inherited
    assert "maxnreg" not in config.gemm_config(16, 8, 28672, 4096)
    assert config.gemm_config(16, 8, 28672, 4096)["num_stages"] == 6
    common.table_override("own.per_sm=3")  # on the table above: 3 uncapped programs per SM, so at T=4
    assert config.gemm_config(8, 8, 28672, 4096)["BN"] == 128  # the own form fills its waves better
    monkeypatch.setattr(config, "_table", shipped)
    common.table_override("dense.maxnreg=80")
    assert config.gemm_config(4, 8, 28672, 4096)["maxnreg"] == 80  # T=2: the dense form
    with pytest.raises(ValueError, match="own.KEY or dense.KEY, got 'both.BN'"):
        common.table_override("both.BN=64")
    with pytest.raises(ValueError, match="own.split would reach the dense form"):
        common.table_override("own.split=2")


def test_table_override_of_one_shape_leaves_the_others(common, monkeypatch):
    from fp8_moe_ops.kernels import config

    monkeypatch.setattr(config, "_table", config._table)  # restored after the test
    assert config.gemm_config(8, 256, 7168, 2048, split_k=True)["BN"] == 64
    common.table_override("7168,2048:min_programs=1800")
    # deepseek_v3's T=1 down GEMM: 8 experts x 112 column tiles of 64 < 1800, so 32-wide tiles
    assert config.gemm_config(8, 256, 7168, 2048, split_k=True)["BN"] == 32
    assert config.gemm_config(8, 256, 4096, 7168)["BN"] == 64  # its gate_up as shipped (min_programs 264)
    assert config.gemm_config(2, 8, 28672, 4096)["BN"] == 64  # the default list as shipped
    with pytest.raises(ValueError, match="shape '1,2'"):
        common.table_override("1,2:maxnreg=none")


def test_slots_override_sets_the_thresholds_and_refuses_others(common, monkeypatch):
    from fp8_moe_ops.kernels import experts

    for name in common.SLOT_THRESHOLDS:
        monkeypatch.setattr(experts, name, getattr(experts, name))  # restored after the test
    assert len(experts.shape_calls(16, 8, 128, 256, 96, (128, 128))) == 5  # 128 slots: the combine on its own
    common.slots_override("COMBINE_SLOTS=128")
    assert (experts.ACT_SLOTS, experts.COMBINE_SLOTS) == (16, 128)
    assert len(experts.shape_calls(16, 8, 128, 256, 96, (128, 128))) == 4
    for bad in ("MAX_SLOTS=8", "ACT_SLOTS=x", "ACT_SLOTS=-1", "ACT_SLOTS=256", "COMBINE_SLOTS=4096"):
        with pytest.raises(ValueError, match="slots_override"):
            common.slots_override(bad)
    assert (experts.ACT_SLOTS, experts.COMBINE_SLOTS) == (16, 128)  # a refused spec changes nothing


def test_bench_moe_table_from_results(common, monkeypatch):
    bench_moe = _load("bench_moe", monkeypatch)
    runner = common.Runner("bench_moe")
    shape = {"flops": 6e9, "weight_bytes": 2e9, "floor_ms": 0.5}
    runner.meta["ceilings"] = {"copy_bandwidth": 3.1e12, "fp8_dense_rate": 1.2e15, "source": "measured in a test"}
    metrics = {"ms": 1.0, "graph_ms": 0.8, "clock_sm_mhz_median": 1755.0, "clock_capped": 0.5}
    for variant, metrics in (("ours_dynamic", metrics), ("bf16", {"ms": 2.4})):
        runner.run(common.ExperimentConfig("layer", "qwen3_30b_a3b", 64, variant), lambda m=metrics: {**shape, **m})
    runner.run(common.ExperimentConfig("layer", "qwen3_30b_a3b", 64, "fp8_rowwise"), lambda: 1 / 0)
    table = bench_moe.report(runner)
    row = next(line for line in table.splitlines() if line.startswith("| 64 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    cols = [h for h, _, _ in bench_moe.COLUMNS]
    assert cells[cols.index("ours dyn ms")] == "1.000"
    assert cells[cols.index("TFLOP/s")] == "8"  # flops / best time (the graph's 0.8 ms)
    assert cells[cols.index("% of floor")] == "62"
    assert cells[cols.index("x bf16")] == "3.00"
    assert cells[cols.index("rowwise ms")] == "err"
    assert cells[cols.index("SM MHz (ours dyn)")] == "1755"
    assert table.startswith("Floor: max(weight bytes / 3.10 TB/s, FLOPs / 1200 TFLOP/s) (measured in a test).")


def test_dispatch_agreement_runs_on_cpu(monkeypatch, common, tmp_path):
    agreement = _load("dispatch_agreement", monkeypatch)
    monkeypatch.setattr(agreement, "SEEDS", 2)
    res = agreement.scan(torch.float32, "silu")
    assert res["layers"] == 2 and 0 <= res["differ"] <= 2 and res["worst_rel_err"] < 1e-5


def test_gemm_ceiling_table_reports_the_ratio_and_errors(common, monkeypatch):
    ceiling = _load("gemm_ceiling", monkeypatch)
    runner = common.Runner("gemm_ceiling")
    params = (("proj", "down"), ("M", 65536), ("N", 7168), ("K", 2048), ("rows_per_expert", 256))
    runner.run(common.ExperimentConfig("gemm_ceiling", "deepseek_v3", 8192, "dense_blockwise", params=params),
               lambda: {"api": "F.scaled_mm", "ms": 1.0, "tflops": 1200.0})
    runner.run(common.ExperimentConfig("gemm_ceiling", "deepseek_v3", 8192, "ours", params=params),
               lambda: {"ms": 2.0, "tflops": 600.0, "kernel_tflops": 900.0})
    runner.run(common.ExperimentConfig("gemm_ceiling", "deepseek_v3", 8192, "dense_tensorwise", params=params),
               lambda: 1 / 0)
    table = ceiling.table(runner)
    assert "| 0.50 | 0.75 | F.scaled_mm | dense_tensorwise: ZeroDivisionError" in table


def test_results_json_is_plain_json(common, tmp_path):
    results = [common.ExperimentResult(common.ExperimentConfig("e", "m", 1, "v"), {"kernels": ["a", "b"]})]
    common.write_json(str(tmp_path / "r.json"), {"command": "x"}, results)
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["metrics"] == {"kernels": ["a", "b"]}


def test_experts_module_holds_the_weights_without_a_copy(common):
    tiny = common.Model("tiny", E=4, H=256, I=128, top_k=2)
    gen = torch.Generator().manual_seed(1)
    w = common.layer_weights(tiny, gen, device="cpu")
    experts = common.experts_module(tiny, w, dispatch="grouped")
    assert experts.down_proj.data_ptr() == w.down.data_ptr()
    x, idx, wts = common.layer_inputs(tiny, 5, gen, device="cpu")
    assert torch.equal(experts(x, idx, wts), torch.ops.fp8_moe.grouped_experts(x, idx, wts, *w, common.BLOCK))


def test_bench_model_decode_step_repeats_the_same_step(common, monkeypatch):
    # Each call rewinds the static cache, so timing hundreds of calls measures one step
    # at a fixed context (and never writes past the cache): equal to a full prefill's
    # last position, call after call.
    pytest.importorskip("transformers")
    bench_model = _load("bench_model", monkeypatch)
    tiny = common.Model("tiny", E=8, H=128, I=64, top_k=2)
    with torch.no_grad():
        model = bench_model.build_model(2, 64, tiny, heads=(4, 2, 32), device="cpu").float()
        step = bench_model.decode_step(model, 2, 16, torch.Generator().manual_seed(5), device="cpu")
        gen = torch.Generator().manual_seed(5)  # the same draws as decode_step's: prompt, then the step's tokens
        prompt, ids = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 1), generator=gen)
        full = model(torch.cat([prompt, ids], 1), use_cache=False).logits[:, -1:]
        for _ in range(3):
            assert torch.allclose(step(), full, atol=1e-5)


def test_host_overhead_table_shows_the_cost_beyond_the_op(common, monkeypatch):
    overhead = _load("host_overhead", monkeypatch)
    runner = common.Runner("host_overhead")
    for variant, us in (("op grouped_experts", 40.0), ("FP8Experts.forward", 52.5)):
        runner.run(common.ExperimentConfig("host_overhead", "qwen3_30b_a3b", 1, variant),
                   lambda us=us: {"cpu_us": us, "wall_us": 90.0, "launches": 6.0})
    assert "| qwen3_30b_a3b | 1 | FP8Experts.forward | 52.5 | +12.5 | 90.0 | 6.0 |" in overhead.table(runner)


def test_host_layers_table_pairs_each_layers_idle_and_busy_times(common, monkeypatch):
    layers = _load("host_layers", monkeypatch)
    runner = common.Runner("host_layers")
    for variant, us, error in (("op idle", [35.2, 34.0, 33.8], None), ("op busy", [32.7, 29.7, 33.0], None),
                               ("launch plan idle", [22.1, 20.7, 23.0], None),
                               ("launch plan busy", [], RuntimeError("the layer raised"))):
        runner.run(common.ExperimentConfig("host_layers", "qwen3_30b_a3b", 1, variant),
                   lambda us=us, error=error: layers.summary(us, error))
    assert [r.error for r in runner.results if not r.ok] == ["RuntimeError: the layer raised"]
    table = layers.table(runner)
    assert "| qwen3_30b_a3b | op | 34.0 (33.8) | 32.7 (29.7) |" in table  # median (least) of the rounds
    assert "| qwen3_30b_a3b | launch plan | 22.1 (20.7) | — |" in table  # its busy case failed
    assert table.count("| qwen3_30b_a3b |") == 2


def test_module_overhead_runs_on_cpu_and_restores_the_op(common, monkeypatch, tmp_path):
    # a fresh process: the script registers no-op ops (fp8_moe::noop_experts, noop_linear)
    # in the fp8_moe namespace, which a test process should not keep for its other tests
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; sys.argv = ['module_overhead.py', '--out-dir', sys.argv[3], "
            "'--calls', '3']; import module_overhead; from fp8_moe_ops import ops; real = ops.experts; "
            "assert module_overhead.main() == 0; assert ops.experts is real, 'the op was not restored'")
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH), str(BENCH.parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not hasattr(torch.ops.fp8_moe, "noop_experts")
    overhead = _load("module_overhead", monkeypatch)
    _, results = common.read_json(str(tmp_path / "module_overhead.json"))
    # and, where transformers' FP8 experts interface is installed, the plug-in's case; then
    # the dispatcher's cost per grad mode
    assert [r.config.variant for r in results if r.ok] == [
        f"{scheme} {part}" for scheme in ("dynamic", "static")
        for part in ("forward, op stubbed", "_check_inputs", "expert_weights")] + list(overhead.plugin_parts()) + [
        f"{mode}: {way}" for mode in ("grad enabled", "no_grad", "inference_mode")
        for way in ("through the dispatcher", "ops.call_experts", "noop_linear")] + [
        "linear, one token: through the dispatcher", "linear, one token: ops.call_linear"]


def test_list_parts_runs_on_cpu(common, monkeypatch, tmp_path):
    parts = _load("list_parts", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["list_parts.py", "--out-dir", str(tmp_path), "--device", "cpu",
                                      "--experts", "4", "--calls", "2"])
    assert parts.main() == 0
    _, results = common.read_json(str(tmp_path / "list_parts.json"))
    pieces = ["boxing", "check_experts_list", "ListChecks", "address_table"]
    if hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal"):  # CUDA builds of torch
        pieces.append("addresses, torch's C++ compare")
    assert [(r.config.model, r.config.variant, r.metrics["tensors"]) for r in results if r.ok] == [
        (f"E=4 {form}", part, count) for form, count in (("fused", 16), ("separate", 24)) for part in pieces]


def test_tune_forces_its_candidate_on_the_gemm_call(common, monkeypatch):
    # the candidate replaces the launch table for every argument the forward passes it
    # (its SM count too); the table comes back after
    from fp8_moe_ops.kernels import config, moe

    tune = _load("tune", monkeypatch)
    built = []
    monkeypatch.setattr(tune, "graph_ms", lambda fn: built.append(fn()) or 1.5)
    w = torch.zeros(2, 256, 256, dtype=torch.float8_e4m3fn)
    gemm = lambda: moe._gemm_call(torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(64, 2), w,  # noqa: E731
                                  torch.ones(2, 2, 2), (128, 128), torch.empty(64, 256, dtype=torch.bfloat16),
                                  offsets=torch.tensor([32, 64], dtype=torch.int32))
    assert gemm().constexprs["BM"] == 64  # the table's
    assert tune.forced((16, 32, 2, 3), gemm) == {"graph_ms": 1.5}
    (call,) = built
    assert (call.constexprs["BM"], call.constexprs["BN"]) == (16, 32)
    assert (call.options["num_warps"], call.options["num_stages"]) == (2, 3)
    assert moe.gemm_config is config.gemm_config


def test_decode_forms_change_one_launch_and_keep_its_result(common, monkeypatch):
    # each form rebuilds one GEMM launch of a decode forward (its grid, K ranges and
    # partials); run under the interpreter, a form that keeps its epilogue computes the
    # layer's output: narrower tiles bitwise, the down GEMM split into K ranges (a new
    # partials buffer, summed by its combine) within float32 rounding.  ``read=1`` puts
    # the read kernel over the weight bytes the GEMM reads in its place, on each copy's.
    from fp8_moe_ops.kernels.experts import _stacked, _stacked_sources
    from fp8_moe_ops.kernels.launch import launch

    _load("stream_floor", monkeypatch)  # its read kernel
    forms = _load("decode_forms", monkeypatch)
    gen = torch.Generator().manual_seed(3)
    E, H, I, k, T = 5, 256, 256, 2, 3
    gate_up, down = common.make_weights(E, 2 * I, H, gen, "cpu"), common.make_weights(E, H, I, gen, "cpu")
    x, ids, weights = common.layer_inputs(common.Model("tiny", E, H, I, k), T, gen, device="cpu")
    args = (x, ids, weights, *gate_up, *down, [128, 128], "silu", None, None, None)
    out, env, _, calls = _stacked(args, _stacked_sources(args))
    shipped = out.clone()
    at = {"gate_up": 1, "down": 2}
    assert [c.constexprs["GATED"] for c in calls[1:]] == [True, False] and calls[2].constexprs["COMBINE"]
    parsed = forms.parse_forms("gate_up:BN=64;down:BN=64,SPLIT=2,num_warps=2;gate_up:read=1&down:epilogue=0")
    assert [forms.form_label(f) for f in parsed] == ["gate_up:BN=64", "down:BN=64,SPLIT=2,num_warps=2",
                                                     "gate_up:read=1&down:epilogue=0"]
    # 7 row tiles (cdiv(6, 16) + min(E, 6) + 1) times 512 / 64 column tiles; times 256 / 64
    # and 2 K ranges
    for form, grid, exact in zip(parsed[:2], (56, 56), (True, False)):
        ((gemm, changes),) = form.items()
        new = list(calls)
        new[at[gemm]] = forms.reformed(calls[at[gemm]], changes)
        assert (new[at[gemm]].grid, new[at[gemm]].constexprs["BN"]) == ((grid,), 64)
        env["out"].zero_()
        for c in new:
            launch(c)
        if exact:
            assert torch.equal(env["out"], shipped)
        else:
            assert (new[2].constexprs["SPLIT"], new[2].constexprs["KS"], new[2].options["num_warps"]) == (2, 128, 2)
            torch.testing.assert_close(env["out"], shipped, rtol=1e-2, atol=0)
    # weights whose int32 words are small (the read kernel sums them in int32), two copies
    small = [torch.zeros(E, 2 * I, H // 4, 4, dtype=torch.uint8) for _ in range(2)]
    for i, w in enumerate(small):
        w[..., 0] = torch.randint(0, 4, w.shape[:3], generator=gen, dtype=torch.uint8) + i
    w0, w1 = (w.view(torch.float8_e4m3fn).reshape(E, 2 * I, H) for w in small)
    read = forms.read_instead(calls[1]._replace(args=tuple(w0 if a is gate_up[0] else a for a in calls[1].args)),
                              experts_hit=3, sms=1)
    for c, w in ((read, w0), (forms.on_weights(read, {w0.data_ptr(): w1}), w1)):
        launch(c)
        assert int(c.args[1].sum()) == int(w[:3].reshape(-1).view(torch.int32).sum()) > 0
    with pytest.raises(ValueError, match="epilogue=0"):
        forms.reformed(calls[1], {"SPLIT": 2})
    with pytest.raises(ValueError, match="keys from"):
        forms.parse_forms("down:BM=32")
    with pytest.raises(ValueError, match="each once"):
        forms.parse_forms("down:BN=32&down:SPLIT=2")


def test_ws_gemm_ab_way_sets_the_gluon_kernels_group_m(common, monkeypatch):
    ab = _load("ws_gemm_ab", monkeypatch)
    from fp8_moe_ops.kernels import ws_gemm

    seen = []
    monkeypatch.setattr(ws_gemm, "ws_gemm_call", lambda *a, **kw: seen.append((kw["group_m"], ws_gemm.BY_EXPERT)))
    for way, group_m, by_expert in (("ws_group16", 16, True), ("ws_col", 1, True), ("ws_row_groups", 8, False),
                                    ("shipped", 8, True)):
        with ab._way(way):
            ws_gemm.ws_gemm_call(group_m=8)
        assert seen[-1] == (group_m, by_expert)
    ab.check_ways(["shipped", "ws_group3"])
    with pytest.raises(ValueError, match="got \\['ws_groups', 'fast', 'ws_group0'\\]"):
        ab.check_ways(["shipped", "ws_groups", "fast", "ws_group0"])  # GROUP_M 0 would divide by zero


def test_fused_read_probe_ways_sum_what_torch_sums(common, monkeypatch):
    # under the interpreter (programs one after another, so in ticket order) every way
    # reads both buffers whole: the first part's chunks, then the second's, and the
    # one-launch ways count every first-part program and hand out every ticket
    _load("stream_floor", monkeypatch)  # its read kernel
    probe = _load("fused_read_probe", monkeypatch)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 7, (50000,), dtype=torch.int32, generator=gen)
    b = torch.randint(0, 7, (20001,), dtype=torch.int32, generator=gen)
    for way in probe.WAYS:
        run, out, sync, expected = probe.pair_calls(a, b, way, sms=2)
        run()
        assert torch.equal(out, expected) and int(out.sum()) == int(a.sum() + b.sum())
        chunks_a = probe.read_shape(a.numel(), probe.PER_SM * 2, probe.BLOCK)[1]
        assert sync is None or sync.tolist() == [out.numel(), chunks_a]


def test_static_gap_calibrates_each_expert_on_its_own_tokens(common, monkeypatch):
    # the gate_up scale of expert e is the amax of the tokens routed to e / 448 (an expert
    # without tokens gets the layer's largest, as calibrate_static_scales gives it); the
    # down scales are positive for every expert
    gap = _load("static_gap", monkeypatch)
    tiny = common.Model("tiny", E=5, H=64, I=32, top_k=2)
    gen = torch.Generator().manual_seed(3)
    w = common.layer_weights(tiny, gen, device="cpu")
    x, idx, wts = common.layer_inputs(tiny, 7, gen, device="cpu")
    _, env, down = gap.forward(gap.op_args(tuple(w), (x, idx, wts), (None, None)))
    gate_up, down_scales = gap.calibrated(env, tiny.E, tiny.I, tiny.top_k)
    largest = x.float().abs().amax() / 448
    for e in range(tiny.E):
        tokens = (idx == e).any(1)
        want = x[tokens].float().abs().amax() / 448 if tokens.any() else largest
        assert gate_up[e] == want, e
    assert (down_scales > 0).all()
    assert not (idx == 4).any()  # the draw leaves expert 4 without tokens: the loop checked its scale


def test_read_json_refuses_untyped_results(common, tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"meta": {}, "results": [{"model": "m", "T": 1}]}))
    with pytest.raises(ValueError, match="typed results"):
        common.read_json(str(tmp_path / "old.json"))


def test_bench_and_tests_name_the_same_benchmark_layers(monkeypatch):
    # tests do not import bench/ (nor bench tests/): the two tables must agree
    from helpers import MODELS

    bench = _load("common", monkeypatch)
    assert {m.name: (m.E, m.H, m.I, m.top_k) for m in bench.MODELS.values()} == MODELS


def test_kernel_resources_compiles_a_launch_for_sm90_without_a_gpu():
    # the gated activation and the combine launches of a small forward (80 slots: each its
    # own kernel), compiled for sm_90a
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kernel_resources as kr; "
            "from fp8_moe_ops.kernels.experts import shape_calls; "
            "print([kr.resources(c) for c in shape_calls(20, 4, 8, 64, 32, (16, 16))[2::2]])")
    act, combine = printed_by_fresh_process(code)
    assert (act["kernel"], combine["kernel"]) == ("_gated_act_quant_kernel", "_combine_kernel")
    for res in (act, combine):
        assert res["warps"] == 4 and 0 < res["registers"] <= 255 and res["spill_bytes"] == 0
        assert res["shared_bytes"] >= 0 and res["instructions"] > 100
    # 16 x 16 elements over 128 threads: each thread's two quotients by its row's scale in
    # the branch for scales past the reciprocal's bounds, the reciprocal of the other
    # (quant.reciprocals; silu's division is an approximate reciprocal on the GPU), and the
    # scale's own division by 448; the combine divides nothing
    assert (act["divisions"], combine["divisions"]) == (4, 0)


def test_sass_counts_local_memory_in_the_innermost_loops_around_mmas_only(common, monkeypatch):
    kr = _load("kernel_resources", monkeypatch)
    sass = """
        /*0000*/                   LDL R3, [R1] ;
        /*0010*/                   STL [R1+0x4], R3 ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT ;
        /*0040*/                   LDL R5, [R1+0x8] ;
        /*0050*/               @P1 BRA 0x20 ;
        /*0060*/                   STL [R1+0xc], R5 ;
        /*0070*/                   LDL R6, [R1+0x10] ;
        /*0080*/              @!P0 BRA 0x70 ;
        /*0090*/                   STL [R1+0x14], R6 ;
        /*00a0*/              @!P2 BRA 0x0 ;
        /*00b0*/                   FCHK P0, R2, R3 ;
        /*00c0*/                   EXIT ;
        /*00d0*/                   BRA 0xd0 ;
        /*00e0*/                   NOP ;
    """
    # the loop [0x20, 0x50] holds the MMA and one local load; the loop [0x70, 0x80] holds
    # a load but no MMA; the outer loop [0x0, 0xa0] holds both, but is not the innermost
    # around the MMA; the branch to itself after EXIT is not a loop back
    assert kr.sass_counts(sass) == {"instructions": 13, "divisions": 1, "mma_loop_local_ops": 1}


def test_decode_forms_fit_their_programs_per_sm_on_sm90():
    # the launch table's per_sm (programs of 4 warps per SM) for both forms of the decode
    # entry, compiled for sm_90a: deepseek_v3 T=2's gate_up takes the entry's own form
    # (128-column tiles), its down GEMM the dense one (64 columns, 72 registers); each
    # fits per_sm times in the H200 SM's 65536 registers and 228 KB of shared memory
    # (1 KB reserved per program), without spilling
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kernel_resources as kr; "
            "from fp8_moe_ops.kernels.experts import shape_calls; "
            "calls = shape_calls(2, 8, 256, 7168, 2048, (128, 128))[1:]; "
            "print([dict(kr.resources(c), BN=c.constexprs['BN'], maxnreg=c.options['maxnreg']) for c in calls])")
    gate_up, down = printed_by_fresh_process(code)
    from fp8_moe_ops.kernels import config

    own = config._table()["default"][0]
    assert (gate_up["BN"], gate_up["maxnreg"]) == (own["BN"], own["maxnreg"])
    assert (down["BN"], down["maxnreg"]) == (own["dense"]["BN"], own["dense"]["maxnreg"])
    for res, per_sm in ((gate_up, own["per_sm"]), (down, own["dense"]["per_sm"])):
        assert res["spill_bytes"] == 0 and res["registers"] <= res["maxnreg"]
        assert -(-res["registers"] // 8) * 8 * 32 * res["warps"] * per_sm <= 65536
        assert (res["shared_bytes"] + 1024) * per_sm <= 228 * 1024


def test_overlap_probe_compiles_every_form_for_sm90_without_a_gpu():
    # the Gluon probe of the compute-bound GEMM (docs/benchmarks.md), compiled for sm_90a;
    # no form may be serialised by ptxas
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import overlap_probe as op; "
            "print({form: op.offline(form) for form in op.FORMS})")
    res = printed_by_fresh_process(code)
    assert set(res) == {"lag0", "lag1", "ws", "ws6"}
    assert res["lag0"]["ffma_overlapped"] is None  # lag0 has no wait that leaves a group in flight
    assert res["lag1"]["ffma_overlapped"] > 0
    assert res["ws"]["warps"] > 8  # the producer and the second consumer are extra warps
    assert all(not r["serialised"] and 0 < r["registers"] <= 255 for r in res.values())


@needs_gluon
def test_ws_gemm_limits_variants_still_match_and_compile_for_sm90_without_a_gpu():
    # each variant edits kernels/gluon_gemm.py's text: every edit must still find its
    # text (variant_kernel raises otherwise), and two variants compile for sm_90a without spills
    code = """
import sys, tempfile; sys.path.insert(0, sys.argv[1])
import torch, kernel_resources as kr, ws_gemm_limits as L
from fp8_moe_ops.kernels import ws_gemm
E, N, K, S = 4, 256, 512, 4096
w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
ws = torch.ones(E, 2, 4)
ws_gemm.WIDE = False  # the edits are to the K loop of 128 x 128 tiles: the variants run it
call = ws_gemm.ws_gemm_call(torch.zeros(S, K, dtype=torch.float8_e4m3fn), torch.ones(S, 4), w, ws, ws.stride(),
                            (128, 128), torch.empty(S, N, dtype=torch.bfloat16), offsets=torch.ones(E, dtype=torch.int32),
                            perm=None, scatter_out=False, static=False, e8m0=False, num_pid_m=40, group_m=8,
                            max_programs=132)
with tempfile.TemporaryDirectory() as d:
    kernels = {v: L.variant_kernel(v, d) for v in L.VARIANTS}
    print({v: kr.resources(call._replace(kernel=kernels[v])) for v in ("no_rescale+no_loads", "no_store")})
"""
    res = printed_by_fresh_process(code)
    assert set(res) == {"no_rescale+no_loads", "no_store"}
    assert all(r["kernel"] == "_ws_gemm_kernel" and r["spill_bytes"] == 0 for r in res.values())


def test_ncu_summary_keeps_each_kernels_named_metrics(monkeypatch, tmp_path):
    ncu = _load("ncu_layers", monkeypatch)
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def row(i, kernel, section, name, unit, value):
        return ",".join(f'"{v}"' for v in (i, 1, "python", "h", kernel, 1, 7, "(128, 1, 1)", "(8, 1, 1)", 0, "9.0",
                                            section, name, unit, value))

    path = tmp_path / "ncu.csv"
    path.write_text("\n".join([
        "==WARNING== Note: Running with unmodified GPU clocks.", head,
        row(0, "_sort_quant_kernel", "GPU Speed Of Light Throughput", "Duration", "ns", "5,120"),
        row(0, "_sort_quant_kernel", "GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", "10,042"),
        row(1, "_grouped_gemm_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "66.70"),
        row(1, "_grouped_gemm_kernel", "Launch Statistics", "Grid Size", "", "560"),
    ]) + "\n")
    assert ncu.summarize(str(path)) == [
        {"kernel": "_sort_quant_kernel", "Duration": "5,120 ns"},  # Elapsed Cycles: not in SUMMARY
        {"kernel": "_grouped_gemm_kernel", "DRAM Throughput": "66.70 %", "Grid Size": "560"}]


def test_ncu_labels_follow_the_profiled_order_of_ways_cases_and_gemms(monkeypatch):
    ncu = _load("ncu_layers", monkeypatch)
    kernels = [{"kernel": "_ws_gemm_kernel", "gpu__time_duration.sum": f"{i} ns"} for i in range(8)]
    got = ncu.label(kernels, [("deepseek_v3", [8192, 16384])], "BY_EXPERT=0;BY_EXPERT=1", static=True)
    assert [(k["way"], k["case"], k["gemm"], k["gpu__time_duration.sum"]) for k in got] == [
        ("BY_EXPERT=0", "deepseek_v3:8192", "gate_up", "0 ns"), ("BY_EXPERT=0", "deepseek_v3:8192", "down", "1 ns"),
        ("BY_EXPERT=0", "deepseek_v3:16384", "gate_up", "2 ns"), ("BY_EXPERT=0", "deepseek_v3:16384", "down", "3 ns"),
        ("BY_EXPERT=1", "deepseek_v3:8192", "gate_up", "4 ns"), ("BY_EXPERT=1", "deepseek_v3:8192", "down", "5 ns"),
        ("BY_EXPERT=1", "deepseek_v3:16384", "gate_up", "6 ns"), ("BY_EXPERT=1", "deepseek_v3:16384", "down", "7 ns")]
    assert {k["scheme"] for k in got} == {"static"}
    one = ncu.label(kernels[:2], [("mixtral_8x7b", [16384])], None, static=False)
    assert [(k["way"], k["scheme"]) for k in one] == [("shipped", "dynamic")] * 2
    with pytest.raises(ValueError, match="expected 4 Gluon GEMM launches .* got 8 kernels"):
        ncu.label(kernels, [("deepseek_v3", [8192])], "a;b", static=False)
    mixed = kernels[:3] + [{"kernel": "_gated_act_quant_kernel"}]
    with pytest.raises(ValueError, match="_gated_act_quant_kernel"):
        ncu.label(mixed, [("deepseek_v3", [8192])], "a;b", static=False)


def test_ncu_ways_set_the_gluon_gemm_and_go_back_to_shipped(common, monkeypatch):
    ncu = _load("ncu_layers", monkeypatch)
    from fp8_moe_ops.kernels import ws_gemm

    ways = ncu.parse_ways("group_m=4;WIDE=0,group_m=16;WIDE_MAX_K=4096;max_programs=0")
    assert ways == [{"group_m": 4}, {"WIDE": 0, "group_m": 16}, {"WIDE_MAX_K": 4096}, {"max_programs": 0}]
    for bad in ("group_m=x", "GROUPS=4", "lag=1", "max_programs=", "group_m=0", "WIDE=-1"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            ncu.parse_ways(bad)
    seen = []
    monkeypatch.setattr(ws_gemm, "ws_gemm_call", lambda *a, **kw: seen.append((kw["group_m"], kw["max_programs"])))
    for name in ("WIDE", "WIDE_MAX_K"):
        monkeypatch.setattr(ws_gemm, name, getattr(ws_gemm, name))  # restored after the test
    wide, max_k = ws_gemm.WIDE, ws_gemm.WIDE_MAX_K
    set_way = ncu.way_setter(ways)
    for way in ways[1:]:
        set_way(way)
        ws_gemm.ws_gemm_call(group_m=8, max_programs=132)
        if way is ways[1]:
            assert ws_gemm.WIDE is False and ws_gemm.WIDE_MAX_K == max_k
        else:  # what an earlier way changed is back to shipped
            assert ws_gemm.WIDE is wide and ws_gemm.WIDE_MAX_K == (4096 if way is ways[2] else max_k)
    # group_m 16, then the launch's own; max_programs 0: one program per tile
    assert seen == [(16, 132), (8, 132), (8, None)]


def test_plot_dram_takes_the_runs_of_one_case_and_averages_repeats(monkeypatch, tmp_path):
    _load("common", monkeypatch)  # plot_dram imports it as a script would
    plot = _load("plot_dram", monkeypatch)
    # deepseek_v3 gate_up: 256 experts' 4096 x 7168 weights and T * 8 rows of 7168
    assert plot.least_bytes("deepseek_v3", 8192, "gate_up") == 256 * 4096 * 7168 + 8192 * 8 * 7168
    assert plot.least_bytes("deepseek_v3", 8192, "down") == 256 * 7168 * 2048 + 8192 * 8 * 2048

    def kernel(way, gemm, gb, **case):
        return {"way": way, "gemm": gemm, "dram__bytes_read.sum": f"{gb * 1e9:,.0f} byte", **case}

    runs = {"meta": {}, "runs": [
        {"command": "ncu ... python bench/ncu_layers.py --cases deepseek_v3:8192 --ways a;b;a",
         "kernels": [kernel("a", "gate_up", 10), kernel("a", "down", 5), kernel("b", "gate_up", 12),
                     kernel("b", "down", 6), kernel("a", "gate_up", 11), kernel("a", "down", 4)]},
        {"command": "ncu ... --cases deepseek_v3:16384 --ways a", "kernels": [kernel("a", "gate_up", 99)]}]}
    flat = {"meta": {"command": "ncu ... --cases deepseek_v3:8192;mixtral_8x7b:16384 --ways c"},  # a case per kernel
            "kernels": [kernel("c", "down", 3, case="deepseek_v3:8192"), kernel("c", "down", 7, case="mixtral_8x7b:16384")]}
    (tmp_path / "r.json").write_text(json.dumps(runs))
    (tmp_path / "f.json").write_text(json.dumps(flat))
    got = plot.dram_bytes([str(tmp_path / "r.json"), str(tmp_path / "f.json")], "deepseek_v3:8192")
    assert got == {"gate_up": {"r: a": 10.5e9, "r: b": 12e9}, "down": {"r: a": 4.5e9, "r: b": 6e9, "f: c": 3e9}}
    assert plot.dram_bytes([str(tmp_path / "r.json")], "qwen3_30b_a3b:8192") == {}


def test_aux_kernels_launch_shapes_give_the_shipped_bytes(common, monkeypatch):
    # the benchmark reports equality on the GPU; here every swept shape of each kernel
    # (interpreted, a tiny layer with partial column blocks) writes what the forward's writes
    aux = _load("aux_kernels", monkeypatch)
    tiny = common.Model("tiny", E=5, H=384, I=192, top_k=2)
    tensors = aux._tensors(tiny, 6, torch.Generator().manual_seed(3), "cpu")
    for kernel, (shipped, reshaped, outputs, nbytes) in aux._calls(tiny, 6, tensors).items():
        assert nbytes > 0
        aux.launch(shipped)
        expected = [o.clone() for o in outputs]
        assert any(e.view(torch.uint8).any() for e in expected), kernel
        for size, warps in aux.SHAPES[kernel][::2]:
            for o in outputs:
                o.fill_(0)
            aux.launch(reshaped(size, warps))
            assert all(torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(outputs, expected)), \
                (kernel, size, warps)


def test_plot_host_groups_runs_of_one_case_by_variant(common, monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = _load("plot_host", monkeypatch)
    run = BENCH.parent / "docs" / "benchmarks" / "module_overhead_library_new_1.json"
    monkeypatch.setattr(sys, "argv", ["plot_host.py", "--out", str(tmp_path / "p.png"), "--target", "0", "--variants",
                                      "no_grad: noop_linear;no_grad: ops.call_experts", f"a={run}", f"b={run}@cpu_us"])
    assert plot.main() == 0 and (tmp_path / "p.png").stat().st_size > 0
    assert "(2 cases, 2 runs)" in capsys.readouterr().out
