"""The shared pieces of the benchmarks: model shapes, inputs, floors, timers, a typed
result, one runner, and the JSON / markdown / PNG writers.

Every script of ``bench/`` is a short experiment on top of this module.  Run them on a
CUDA machine (never in CI) from the repository root with ``PYTHONPATH=.``; this module
itself imports on a machine without a GPU (the timers touch CUDA only when called).

A case that fails is recorded with its error (``ExperimentResult.error``), the script
goes on with the next case, and ``Runner.exit_code()`` is 1 at the end: a failure is
reported, never swallowed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Ceilings:
    """What a layer's floor divides by: a device-to-device copy's rate (bytes read plus
    written per second) and a dense fp8 GEMM's (``torch._scaled_mm``, tensorwise scales,
    8192^3, FLOP per second), and where they come from."""

    copy_bandwidth: float
    fp8_dense_rate: float
    source: str


# Measured on one H200 (torch 2.11.0+cu130, triton 3.6.0, 2026-11-29, median of CUDA-event
# timings): the floors of the H200 results in docs/benchmarks.md.  Another GPU has its own:
# :func:`measure_ceilings`.
H200_CEILINGS = Ceilings(4.22e12, 1357e12, "H200, 2026-11-29")
BLOCK = [128, 128]  # DeepSeek-V3's weight blocks: every benchmark uses them


@dataclass(frozen=True)
class Model:
    """An MoE layer's shape: E experts, hidden size H, expert intermediate size I, top_k."""

    name: str
    E: int
    H: int
    I: int  # noqa: E741
    top_k: int


# The three benchmark layers (the public configs of these models).
MODELS = {m.name: m for m in (
    Model("deepseek_v3", E=256, H=7168, I=2048, top_k=8),
    Model("qwen3_30b_a3b", E=128, H=2048, I=768, top_k=8),
    Model("mixtral_8x7b", E=8, H=4096, I=14336, top_k=2),
)}
TOKENS = [1, 8, 64, 512, 1024, 4096, 8192, 16384]


def log(*args: Any) -> None:
    print(*args, flush=True)


def parse_sweep(text: str) -> dict[str, list[int]]:
    """``"model:T,T;model:T"`` -> {model: [T, ...]} (the scripts' ``--cases`` / ``--models``)."""
    sweep = {}
    for part in text.split(";"):
        name, _, tokens = part.partition(":")
        if name not in MODELS:
            raise ValueError(f"--cases: expected model names from {sorted(MODELS)}, got {name!r}")
        sweep[name] = [int(t) for t in tokens.split(",")]
    return sweep


# --------------------------------------------------------------------------- inputs


class LayerWeights(NamedTuple):
    """gate_up (E, 2I, H) e4m3 and its (E, 2I/128, H/128) float32 scales; down (E, H, I) and its scales."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor


def make_weights(E: int, N: int, K: int, gen: torch.Generator, device: str = "cuda"):
    """Random e4m3 weights (E, N, K) and float32 block scales (never zero), built one
    expert at a time (no float copy of the whole tensor)."""
    w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device)
    for e in range(E):
        w[e] = (torch.randn(N, K, device=device, generator=gen, dtype=torch.bfloat16) * 32).to(torch.float8_e4m3fn)
    s = torch.rand(E, -(-N // BLOCK[0]), -(-K // BLOCK[1]), device=device, generator=gen) * 2e-4 + 1e-4
    return w, s


def layer_weights(model: Model, gen: torch.Generator, device: str = "cuda") -> LayerWeights:
    return LayerWeights(*make_weights(model.E, 2 * model.I, model.H, gen, device),
                        *make_weights(model.E, model.H, model.I, gen, device))


def static_scales(model: Model, gen: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert activation scales (E,) of the static scheme for gate_up and down."""
    return tuple(torch.rand(model.E, device=device, generator=gen) * 0.01 + 0.01 for _ in range(2))


ROUTINGS = ("uniform", "skewed")


def make_routing(T: int, E: int, k: int, kind: str, gen: torch.Generator, device: str = "cuda"):
    """(top_k_index (T, k) int64, top_k_weights (T, k) float32 summing to 1) from
    ``topk(softmax(logits))``: ``uniform`` logits ~ randn; ``skewed`` adds -2 log(rank) to
    expert ``rank - 1``'s logit (Zipf-like: a few hot experts)."""
    if kind not in ROUTINGS:
        raise ValueError(f"kind: expected one of {ROUTINGS}, got {kind!r}")
    logits = torch.randn(T, E, device=device, generator=gen)
    if kind == "skewed":
        logits = logits - 2.0 * torch.log(torch.arange(1, E + 1, device=device, dtype=torch.float32))
    w, idx = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).float()


def layer_inputs(model: Model, T: int, gen: torch.Generator, kind: str = "uniform", device: str = "cuda"):
    """(hidden (T, H) bf16, top_k_index, top_k_weights) for T tokens."""
    x = torch.randn(T, model.H, device=device, generator=gen, dtype=torch.bfloat16)
    return (x, *make_routing(T, model.E, model.top_k, kind, gen, device))


def each_scheme_case(sweep: Mapping[str, Sequence[int]], gen: torch.Generator, run: Callable[..., Any],
                     after_model: Callable[[], Any] | None = None, device: str = "cuda") -> None:
    """``run(name, T, weights, (x, top_k_index, top_k_weights), scheme, act_scales)`` for
    every model of ``sweep`` (name -> token counts), T and scheme: ``"dynamic"`` with act
    scales ``(None, None)``, then ``"static"`` with random ones.  Draws from ``gen`` per
    model its weights and static scales, then per T its inputs.  A model's weights are
    freed (and the CUDA cache emptied) before the next model's are made; ``after_model()``
    runs after each model."""
    for name, tokens in sweep.items():
        model = MODELS[name]
        weights = layer_weights(model, gen, device)
        schemes = {"dynamic": (None, None), "static": static_scales(model, gen, device)}
        for T in tokens:
            inputs = layer_inputs(model, T, gen, device=device)
            for scheme, scales in schemes.items():
                run(name, T, weights, inputs, scheme, scales)
        del weights, schemes
        torch.cuda.empty_cache()
        if after_model is not None:
            after_model()


def experts_module(model: Model, weights: LayerWeights, dispatch: str):
    """``fp8_moe_ops.FP8Experts`` (dynamic scheme) holding ``weights`` (no copy)."""
    import fp8_moe_ops

    experts = fp8_moe_ops.FP8Experts(model.E, model.H, model.I, BLOCK, dispatch=dispatch, device="meta")
    for name, t in zip(("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"), weights):
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    return experts


def dequant_bf16(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """bf16 copy of block-quantised weights (E, N, K), one expert at a time."""
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    bn, bk = BLOCK
    for e in range(w.shape[0]):
        scale = s[e].repeat_interleave(bn, 0)[: w.shape[1]].repeat_interleave(bk, 1)[:, : w.shape[2]]
        out[e] = (w[e].float() * scale).to(torch.bfloat16)
    return out


# --------------------------------------------------------------------------- floors


PROJS = ("gate_up", "down")  # a layer's two GEMMs


def gemm_shape(model: Model, proj: str) -> tuple[int, int]:
    """(N, K) of one of a layer's GEMMs (:data:`PROJS`): gate_up (2I, H), down (H, I)."""
    if proj not in PROJS:
        raise ValueError(f"proj: expected one of {PROJS}, got {proj!r}")
    return (2 * model.I, model.H) if proj == "gate_up" else (model.H, model.I)


def layer_flops(model: Model, T: int) -> int:
    """Two GEMMs of one layer: gate_up (2I outputs) and down, 2 FLOPs per MAC, T*k rows."""
    return 6 * T * model.top_k * model.H * model.I


def weight_bytes(model: Model, experts_hit: int) -> int:
    """fp8 weights of the experts hit plus their float32 128x128 block scales."""
    scales = -(-2 * model.I // 128) * -(-model.H // 128) + -(-model.H // 128) * -(-model.I // 128)
    return experts_hit * (3 * model.H * model.I + 4 * scales)


def floor_ms(flops: float, nbytes: float, ceilings: Ceilings = H200_CEILINGS) -> float:
    """max(bytes / copy bandwidth, FLOPs / fp8 dense rate), in ms."""
    return max(nbytes / ceilings.copy_bandwidth, flops / ceilings.fp8_dense_rate) * 1e3


def _copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def tensorwise_fp8_ms(a: torch.Tensor, b_nk: torch.Tensor) -> float:
    """Median ms of cuBLAS's e4m3 GEMM ``a @ b_nk.T`` with one scale per tensor
    (``torch._scaled_mm``, bf16 out): the plain fp8 rate of the GPU at hand."""
    one = torch.ones((), device=a.device)
    return time_ms(lambda: torch._scaled_mm(a, b_nk.t(), one, one, out_dtype=torch.bfloat16))


def measure_ceilings(copy_bytes: int = 1 << 30, n: int = 8192) -> Ceilings:
    """:class:`Ceilings` of the current GPU, measured as :data:`H200_CEILINGS` were: a copy
    of ``copy_bytes`` and a tensorwise-scaled e4m3 GEMM of ``n``^3 (random operands)."""
    copy_ms = _copy_ms(copy_bytes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, n, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    mm_ms = tensorwise_fp8_ms(a, b)
    return Ceilings(2 * copy_bytes / copy_ms * 1e3, 2 * n ** 3 / mm_ms * 1e3,
                    f"measured in this run on {torch.cuda.get_device_name()}")


CEILING_KINDS = ("measured", "h200")  # a script's --ceilings


def ceilings_for(kind: str) -> Ceilings:
    """``--ceilings`` of a script (:data:`CEILING_KINDS`): ``measured`` (this GPU, now) or
    ``h200`` (the constants)."""
    if kind == "h200":
        return H200_CEILINGS
    if kind == "measured":
        return measure_ceilings()
    raise ValueError(f"ceilings: expected 'measured' or 'h200', got {kind!r}")


# --------------------------------------------------------------------------- launch experiments


def table_override(table: str) -> None:
    """For the rest of the process: ``table`` ("KEY=VALUE,...", integer values; "KEY=none"
    removes the key) set on every entry of the grouped GEMM's launch-config table, as if
    checked in (so at a T whose rows per expert fall in one bucket, on that bucket's
    entry), and on an entry's ``dense`` form where that holds the key ("dense=none" leaves
    the entries their own form only).  "own.KEY=VALUE" sets the entry's own form only (a
    dense form keeps what it had, inherited or its own), "dense.KEY=VALUE" the dense form
    only, where an entry has one.  With a weight shape before a colon ("N,K:KEY=VALUE,..."),
    only on the entries of that shape's own list.  Call before the first launch: launches
    and launch plans are cached."""
    from fp8_moe_ops.kernels import config

    shape, _, table = table.rpartition(":")
    changes: dict[str, dict] = {"": {}, "own": {}, "dense": {}}  # both forms, the entry's own, the dense one
    for pair in table.split(","):
        name, value = pair.split("=")
        form, _, key = name.rpartition(".")
        if form not in changes:
            raise ValueError(f"table_override: expected KEY, own.KEY or dense.KEY, got {name!r}")
        changes[form][key] = None if value == "none" else int(value)
    shipped = config._table()
    if shape and shape not in shipped["shapes"]:
        raise ValueError(f"table_override: shape {shape!r} has no list of its own in the table "
                         f"(expected one of {sorted(shipped['shapes'])})")

    def change(entry: dict, entry_shape: str | None) -> dict:
        if shape and entry_shape != shape:
            return entry
        shipped_entry, entry = entry, {**entry, **changes[""], **changes["own"]}
        dense = entry.get("dense")
        if isinstance(dense, dict):
            # the dense form inherits the keys it does not hold: an own-form change must not reach it
            inherited = {key for key in changes["own"] if key not in dense}
            unpinned = sorted(inherited - shipped_entry.keys())  # in neither form: no value to keep
            if unpinned:
                raise ValueError(f"table_override: own.{unpinned[0]} would reach the dense form, which inherits "
                                 f"it (set dense.{unpinned[0]} too)")
            dense = {**{key: shipped_entry[key] for key in inherited},
                     **{key: changes[""].get(key, value) for key, value in dense.items()}, **changes["dense"]}
            entry["dense"] = {key: value for key, value in dense.items() if value is not None}
        return {key: value for key, value in entry.items() if value is not None or key == "max_rows"}

    patched = {**shipped, "default": [change(e, None) for e in shipped["default"]],
               "shapes": {s: [change(e, s) for e in entries] for s, entries in shipped["shapes"].items()}}
    config._table = lambda: patched


def ws_launch_with(call: Callable[..., Any], **launch: Any) -> Callable[..., Any]:
    """``call`` (the Gluon GEMM's ``ws_gemm.ws_gemm_call`` as shipped) with the keyword
    arguments ``launch`` (``group_m``, ``max_programs``) in place of the caller's: a way of
    the launch that an experiment sets on ``ws_gemm`` for a run."""
    return lambda *args, **kwargs: call(*args, **{**kwargs, **launch})


SLOT_THRESHOLDS = ("ACT_SLOTS", "COMBINE_SLOTS")  # fp8_moe_ops.kernels.experts: what fuses where


def slots_override(spec: str) -> None:
    """For the rest of the process: the experts forward's fusion thresholds
    (``fp8_moe_ops.kernels.experts``: ``ACT_SLOTS``, up to which the activation runs in the
    gate_up GEMM's launch; ``COMBINE_SLOTS``, the combine in the down GEMM's) set from
    ``spec`` ("NAME=VALUE,...", integers), as if checked in.  Call before the first launch:
    launch plans are recorded under the thresholds of their call."""
    from fp8_moe_ops.kernels import experts

    values = {name: getattr(experts, name) for name in SLOT_THRESHOLDS}
    for pair in spec.split(","):
        name, _, value = pair.partition("=")
        if name not in values or not value.isdigit():  # digits only: an integer >= 0
            raise ValueError(f"slots_override: expected NAME=VALUE with NAME one of {SLOT_THRESHOLDS} and VALUE an "
                             f"integer >= 0, got {pair!r}")
        values[name] = int(value)
    if values["ACT_SLOTS"] > values["COMBINE_SLOTS"]:
        raise ValueError(f"slots_override: expected ACT_SLOTS <= COMBINE_SLOTS (the activation's counters are the "
                         f"combine's), got {values}")
    if values["COMBINE_SLOTS"] > experts.MAX_SLOTS:
        raise ValueError(f"slots_override: expected COMBINE_SLOTS <= MAX_SLOTS = {experts.MAX_SLOTS} (the one-launch "
                         f"sort zeroes the counters), got {values}")
    for name, value in values.items():
        setattr(experts, name, value)


# --------------------------------------------------------------------------- timers


def time_ms(fn: Callable[[], Any], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median ms of back-to-back calls, each timed with CUDA events (``triton.testing.do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


# nvidia-smi's throttle-reason bits that lower the SM clock under load: software power cap
# (0x4), hardware slowdown (0x8), software and hardware thermal slowdown (0x20, 0x40),
# hardware power brake (0x80)
CAPPING_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def smi_summary(text: str) -> dict:
    """The summary of ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active
    --format=csv,noheader,nounits`` samples (one line each; lines it cannot read are
    skipped): their count, the median and lowest SM clock (MHz), the highest power draw
    (W), and the fraction of samples held down by a power or thermal limit
    (:data:`CAPPING_REASONS`); {} without a sample."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except (IndexError, ValueError):
            continue
    if not samples:
        return {}
    mhz = [m for m, _, _ in samples]
    return {"samples": len(samples), "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_max": max(w for _, w, _ in samples),
            "capped": sum(1 for *_, r in samples if r & CAPPING_REASONS) / len(samples)}


class GpuClocks:
    """Samples the current GPU's SM clock, power draw and throttle reasons with
    ``nvidia-smi`` every ``interval_ms`` while the block runs (the block starts once the
    first sample is in, which is left out); ``summary`` then holds :func:`smi_summary` of
    them ({} where ``nvidia-smi`` is missing).  A GPU at its power limit runs its kernels
    at a lower clock: a timing next to its clocks says whether two ways ran on the same
    GPU."""

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.summary: dict = {}
        self._proc = None

    def __enter__(self) -> GpuClocks:
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
            select = ["-i", f"GPU-{uuid}"] if uuid is not None else []
            self._proc = subprocess.Popen(
                [smi, *select, "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._proc.stdout.readline()  # sampling has started (this sample precedes the block)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate()
            self.summary = smi_summary(out)

    def metrics(self) -> dict:
        """What a result records of the block's clocks: ``clock_sm_mhz_median`` and
        ``clock_capped`` ({} without samples)."""
        return {f"clock_{key}": self.summary[key] for key in ("sm_mhz_median", "capped") if self.summary}


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after one call on a side stream: compiles and
    allocator warm-up stay out of the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_ms(fn: Callable[[], Any], rep_ms: int = 200) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (launch gaps removed: GPU time)."""
    return time_ms(capture_graph(fn).replay, rep_ms)


def host_us_per_call(fn: Callable[[], Any], calls: int = 100, warmup: int = 20,
                     repeats: int = 7) -> tuple[float, float]:
    """(CPU µs per call, wall µs per call): ``calls`` back-to-back calls timed before the
    final synchronize (the CPU's time when the GPU keeps up), and including it; the
    median of ``repeats`` such runs (the host's timing varies run to run: one run of
    100 calls alone moved by up to 2x).  Without CUDA in use (CPU-only work) the two
    are the same time."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    cpu, wall = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        cpu.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(cpu), statistics.median(wall)


def with_plan_setting(name: str, value, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` as a call made with ``fp8_moe_ops.kernels.plans.<name>`` set to ``value``
    (``GRAPHS``; ``_DRIVER_LAUNCH``, False: graphs replayed by torch) and restored after."""
    from fp8_moe_ops.kernels import plans

    def call():
        before = getattr(plans, name)
        setattr(plans, name, value)
        try:
            return fn()
        finally:
            setattr(plans, name, before)

    return call


def cuda_events(fn: Callable[[], Any], calls: int = 10) -> list:
    """``torch.profiler``'s CUDA events (kernels, memsets, copies) of ``calls`` calls of
    ``fn`` after one unprofiled call, in the order they started, with the launch plans'
    CUDA graphs off (``fp8_moe_ops.kernels.plans.GRAPHS``): the same kernels, each
    launched on its own.  (With them on, the events of the kernels a plan's graph
    replays did not sort into one order per call: per-position times mixed kernels.)"""
    from torch.profiler import ProfilerActivity, profile

    def profiled():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        return prof.events()

    events = with_plan_setting("GRAPHS", False, profiled)()
    return sorted((ev for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda ev: ev.time_range.start)


def kernels_per_call(fn: Callable[[], Any], calls: int = 10) -> tuple[float, list[str]]:
    """(GPU kernels, memsets and copies launched per call, their names in one call's
    order), counted from ``torch.profiler``'s CUDA events."""
    events = cuda_events(fn, calls)
    per_call = len(events) / calls
    return per_call, [ev.name for ev in events[: int(per_call)]]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ExperimentConfig:
    """One case of an experiment: what was run (``variant``: implementation, scheme or
    candidate), on which model and token count, with which routing; ``params`` holds an
    experiment's further knobs as sorted (name, value) pairs."""

    experiment: str
    model: str
    tokens: int
    variant: str
    routing: str = "uniform"
    params: tuple[tuple[str, Any], ...] = ()

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.params)
        return f"{self.experiment} {self.model} T={self.tokens} {self.routing} {self.variant}{extra}"


@dataclass(frozen=True)
class ExperimentResult:
    """The measurements of one case (``metrics``: name -> number or text), or why it failed."""

    config: ExperimentConfig
    metrics: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def flat(self) -> dict[str, Any]:
        """config fields, params, metrics and error as one flat dict (tables, JSON)."""
        cfg = asdict(self.config)
        params = dict(cfg.pop("params"))
        return {**cfg, **params, **self.metrics, "error": self.error}


def environment() -> dict[str, str]:
    """Where and when a run happened (device, versions, command, UTC date)."""
    meta = {"torch": torch.__version__, "command": "PYTHONPATH=. python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "not installed"
    meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return meta


def _recover_device() -> None:
    # a failed case may leave queued work or an aborted capture behind; the next case
    # must not inherit it (and a dead context must not hide the original error)
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - reported, the runner goes on
            log(f"  device did not recover: {type(e).__name__}: {e}")


class Runner:
    """Runs cases, keeps every result (failed ones with their error), writes them."""

    def __init__(self, name: str, out_dir: str | None = None):
        self.name = name
        self.out_dir = out_dir
        self.meta = environment()
        self.results: list[ExperimentResult] = []

    def run(self, config: ExperimentConfig, measure: Callable[[], Mapping[str, Any]]) -> ExperimentResult:
        """``measure()`` returns the case's metrics; any exception becomes a failed result."""
        try:
            result = ExperimentResult(config, dict(measure()))
        except Exception as e:  # noqa: BLE001 - recorded as a failed case, exit code 1 at the end
            traceback.print_exc()
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            result = ExperimentResult(config, {}, f"{type(e).__name__}: {first}")
            _recover_device()
        self.results.append(result)
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in result.metrics.items() if not isinstance(v, (list, dict)))
        log(f"{'ok  ' if result.ok else 'FAIL'} {config.label()}: {shown or result.error}")
        return result

    def add(self, results: Iterable[ExperimentResult]) -> None:
        """Results measured elsewhere (e.g. copied from an earlier run's JSON)."""
        self.results.extend(results)

    def failures(self) -> list[ExperimentResult]:
        return [r for r in self.results if not r.ok]

    def exit_code(self) -> int:
        failed = self.failures()
        for r in failed:
            log(f"FAILED: {r.config.label()}: {r.error}")
        log(f"{self.name}: {len(self.results) - len(failed)}/{len(self.results)} cases ran")
        return 1 if failed else 0

    def save(self, markdown: str | None = None) -> None:
        """``<out_dir>/<name>.json`` (and ``<name>.md`` when given): call after each
        model, so that a run cut short keeps what it measured."""
        if self.out_dir is None:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        write_json(os.path.join(self.out_dir, f"{self.name}.json"), self.meta, self.results)
        if markdown is not None:
            with open(os.path.join(self.out_dir, f"{self.name}.md"), "w") as f:
                f.write(f"Command: `{self.meta['command']}` ({self.meta['device']}, torch {self.meta['torch']}, "
                        f"{self.meta['date']})\n\n{markdown}\n")


# --------------------------------------------------------------------------- writers


def write_json(path: str, meta: Mapping[str, Any], results: Sequence[ExperimentResult]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": dict(meta), "results": [asdict(r) for r in results]}, f, indent=1)


def read_json(path: str) -> tuple[dict[str, Any], list[ExperimentResult]]:
    """What :func:`write_json` wrote."""
    with open(path) as f:
        data = json.load(f)
    results = []
    for r in data["results"]:
        if "config" not in r:
            raise ValueError(f"{path}: expected results written by bench/common.py (each with a 'config'), got "
                             f"keys {sorted(r)} (a file from before the typed results)")
        cfg = dict(r["config"])
        cfg["params"] = tuple(tuple(p) for p in cfg.get("params", ()))
        results.append(ExperimentResult(ExperimentConfig(**cfg), r["metrics"], r["error"]))
    return data["meta"], results


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return format(v, spec) if v == 0 or 1e-3 <= abs(v) < 1e6 else format(v, ".3g")
    return str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table: one line per row, ``columns`` = (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key), spec) for _, key, spec in columns) + " |")
    return "\n".join(lines)


def results_table(results: Sequence[ExperimentResult], columns: Sequence[tuple[str, str, str]]) -> str:
    """:func:`markdown_table` of the results' flat dicts, with an error column when any failed."""
    if any(not r.ok for r in results):
        columns = [*columns, ("error", "error", "")]
    return markdown_table([r.flat() for r in results], columns)


def plot_lines(path: str, title: str, series: Mapping[str, Sequence[tuple[float, float]]], xlabel: str,
               ylabel: str, caption: str = "", dashed: Sequence[str] = ()) -> None:
    """A log-log line plot (one line per series, ``dashed`` ones as floors) as a PNG."""
    try:
        import matplotlib
    except ImportError:
        log(f"matplotlib not installed: no {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        if pts:
            ax.plot(*zip(*sorted(pts)), "k--" if label in dashed else "-", marker=None if label in dashed else "o",
                    label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
