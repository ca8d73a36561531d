"""The README's main job, ``python -m fp8_moe_ops demo``, on the CPU (the GPU run is in
test_gpu.py), and its AOTInductor step's handling of a loader that crashes."""

import re
import subprocess
import sys

import pytest
import torch

from fp8_moe_ops import demo


@pytest.mark.slow
def test_demo_runs_and_passes_its_checks():
    proc = subprocess.run([sys.executable, "-m", "fp8_moe_ops", "demo"], capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert max(len(line) for line in out.splitlines()) <= 100, "the demo's output fits 100 columns"
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    rows = [line.split() for line in out.splitlines() if re.match(r"  \d+  ", line)]
    assert [r[1:3] for r in rows] == [["FP8Experts", "dynamic"], ["FP8Experts", "static"], ["ModuleList", "dynamic"]]
    # each loop became the op of its kind of experts, under plain torch.compile (no freezing)
    assert [" ".join(r[3:-4]) for r in rows] == ["grouped_experts", "left as it is", "grouped_experts_list"]
    assert all(float(r[-4]) < 2e-2 for r in rows)  # rel err vs eager
    # The same in the AOTInductor package.
    assert re.search(r"in\s+the\s+package\s+the\s+pass\s+rewrote\s+2\s+loops\s+\(grouped_experts\s+x1,\s+"
                     r"grouped_experts_list\s+x1\),\s+left\s+1\s+\(static\)", out)
    assert re.search(r"layer 1: fp8_moe_ops.passes: a loop over 8 experts was left eager because its\s+activation"
                     r"\s+scheme\s+is\s+static", out)
    # The package computes what torch.compile of the same model computes: bitwise on CPU.
    errs = re.findall(r"AOTInductor package at (\d+) tokens: relative error vs torch.compile (\S+), vs eager (\S+)",
                      out)
    assert [(t, float(c)) for t, c, _ in errs] == [("32", 0.0), ("10", 0.0)]
    assert out.rstrip().endswith("all checks passed")


class _Proc:
    def __init__(self, returncode, stdout="", stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _fake_runs(monkeypatch, *returncodes):
    calls = []

    def run(path, cases, tmp):
        calls.append(path)
        return _Proc(returncodes[len(calls) - 1])

    monkeypatch.setattr(demo, "_run_package", run)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda ep, package_path: package_path)
    return calls


def test_package_rewrites_must_be_the_layers_rewrites(capsys):
    expected = ["grouped_experts", "left as it is", "grouped_experts_list"]
    assert demo._check_package_rewrites(["grouped_experts", "grouped_experts_list"], 1, expected) is None
    # a ModuleList loop left as it is in the package, or rewritten into the stacked op, is a failure
    assert "expected ['grouped_experts', 'grouped_experts_list'] rewritten" in demo._check_package_rewrites(
        ["grouped_experts"], 1, expected)
    assert demo._check_package_rewrites(["grouped_experts", "grouped_experts"], 1, expected) is not None
    assert demo._check_package_rewrites(["grouped_experts", "grouped_experts_list"], 0, expected) is not None
    assert "rewrote 2 loops (grouped_experts x1, grouped_experts_list x1), left 1" in capsys.readouterr().out


def test_rewrites_are_read_from_the_pass_log_lines():
    messages = ["fp8_moe_ops.passes: replaced a loop over 8 experts with fp8_moe::grouped_experts_list "
                "(activation=silu, swiglu_limit=None, more accurate than the loop: fewer roundings)",
                "fp8_moe_ops.passes: a loop over 8 experts was left eager because its activation scheme is static"]
    assert demo._rewrites(messages) == ["grouped_experts_list"]


def test_package_crash_with_a_crashing_control_is_a_skip(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, -11, -11)
    failure, skipped = demo._check_package("model.pt2", [], str(tmp_path), "cpu")
    assert failure is None and "crashes loading any cpu package" in skipped
    assert calls == ["model.pt2", str(tmp_path / "control.pt2")]


def test_package_crash_with_a_working_control_is_a_failure(monkeypatch, tmp_path):
    _fake_runs(monkeypatch, -11, 0)
    failure, skipped = demo._check_package("model.pt2", [], str(tmp_path), "cpu")
    assert skipped is None and "crashed (signal 11) where a plain nn.Linear package runs" in failure


def test_package_error_is_a_failure_without_control(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, 1)
    failure, skipped = demo._check_package("model.pt2", [], str(tmp_path), "cpu")
    assert skipped is None and failure.startswith("loading/running the AOTInductor package failed")
    assert calls == ["model.pt2"]


def test_package_output_mismatch_is_a_failure(monkeypatch, tmp_path):
    # Far from eager is reported, not a failure (routing amplifies ulps); far from torch.compile is.
    monkeypatch.setattr(demo, "_run_package", lambda *a: _Proc(0, "rel_err 32 0.0 0.5\nrel_err 10 0.5 0.0\n"))
    failure, skipped = demo._check_package("model.pt2", [None, None], str(tmp_path), "cpu")
    assert skipped is None and failure == "AOTInductor output differs from torch.compile at 10 tokens (5.00e-01)"


def test_package_that_reports_fewer_cases_is_a_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "_run_package", lambda *a: _Proc(0, "rel_err 32 0.0 0.0\n"))
    failure, skipped = demo._check_package("model.pt2", [None, None], str(tmp_path), "cpu")
    assert skipped is None and failure.startswith("the AOTInductor package ran 1 of 2 cases")


def test_demo_leaves_the_compile_caches_as_it_found_them():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    before = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    with demo._no_compile_caches():
        assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == (False, False)
    assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == before


def test_help_is_plain_text():
    proc = subprocess.run([sys.executable, "-m", "fp8_moe_ops", "demo", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "``" not in proc.stdout and ":func:" not in proc.stdout  # no reStructuredText markup
    assert proc.stdout.count("(default:") == 8  # every option says what it does and its default
