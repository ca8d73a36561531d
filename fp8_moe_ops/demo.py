"""The demo behind ``python -m fp8_moe_ops demo`` (also ``fp8-moe demo``).

Builds a small FP8 MoE model whose experts are eager Python loops (one layer with
static activation scales; one layer whose experts are an ``nn.ModuleList`` of
per-expert ``FP8Linear`` w1/w3/w2, looped over as transformers 4.x Mixtral does),
compiles each layer with the graph pass and shows what the pass did (which grouped
op replaced the loop), checks numerics against eager, then exports the whole model to
an AOTInductor package, reloads it and checks it against ``torch.compile`` of the same
model (and reports its distance from eager).  Runs on the GPU (Triton
kernels) when there is one, else on the CPU (reference kernels).  Exits non-zero
if any check fails.  The AOTInductor package is loaded in a child process: if that
crashes, a plain ``nn.Linear`` package is tried the same way, and when it crashes too
the step is reported as skipped (AOTInductor is broken in that environment), not failed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import fp8_moe_ops


class MoELayer(nn.Module):
    """Router (full precision) + top-k softmax + FP8 experts, with a residual."""

    def __init__(self, experts: fp8_moe_ops.FP8Experts, router: nn.Linear, top_k: int):
        super().__init__()
        self.router, self.experts, self.top_k = router, experts, top_k

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(hidden.float()), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return hidden + self.experts(hidden, index, weights)


class MixtralExpert(nn.Module):
    """One expert as transformers 4.x writes it (``MixtralBlockSparseTop2MLP``): w1 (gate),
    w3 (up), w2 (down), ``nn.Linear`` until ``convert_linears`` makes them ``FP8Linear``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ModuleListMoELayer(nn.Module):
    """Router (full precision) + top-k softmax + an ``nn.ModuleList`` of experts run by
    transformers 4.x Mixtral's Python loop (one-hot mask, bf16 accumulator), with a residual."""

    def __init__(self, experts: list[MixtralExpert], router: nn.Linear, top_k: int):
        super().__init__()
        self.router, self.experts, self.top_k = router, nn.ModuleList(experts), top_k

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(hidden.float()), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype)
        out = torch.zeros_like(hidden)
        expert_mask = F.one_hot(index, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in range(len(self.experts)):
            pos, tok = torch.where(expert_mask[e])
            y = self.experts[e](hidden[tok]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(hidden.dtype))
        return hidden + out


def _experts_kind(layer: nn.Module) -> str:
    return "ModuleList" if isinstance(layer, ModuleListMoELayer) else "FP8Experts"


def _activation_scheme(layer: nn.Module) -> str:
    experts = layer.experts[0].w1 if isinstance(layer, ModuleListMoELayer) else layer.experts
    return experts.activation_scheme


class TinyMoE(nn.Module):
    def __init__(self, layers: list[MoELayer | ModuleListMoELayer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def build_model(num_layers, num_experts, hidden, inter, top_k, static_layers, device, dtype, seed=0,
                modulelist_layers=()):
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(num_layers):
        gu = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
        dp = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
        router = nn.Linear(hidden, num_experts, bias=False).to(device)  # routers stay float32
        with torch.no_grad():
            router.weight.copy_(torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5)
        if i in modulelist_layers:
            # A model as written, with nn.Linear experts; convert_linears makes them FP8Linear
            # in place (the router's name is skipped: it stays float32).
            experts = [MixtralExpert(hidden, inter).to(device) for _ in range(num_experts)]
            with torch.no_grad():
                for e, expert in enumerate(experts):
                    expert.w1.weight.copy_(gu[e, :inter])
                    expert.w3.weight.copy_(gu[e, inter:])
                    expert.w2.weight.copy_(dp[e])
            layer = fp8_moe_ops.convert_linears(ModuleListMoELayer(experts, router, top_k), block_size=(128, 128))
        else:
            experts = fp8_moe_ops.FP8Experts.from_float(gu.to(device), dp.to(device), block_size=(128, 128))
            layer = MoELayer(experts, router, top_k)
        if i in static_layers:
            calib = torch.randn(64, hidden, generator=gen).to(device, dtype)
            fp8_moe_ops.calibrate_static_scales(layer, [calib])
        layers.append(layer)
    return TinyMoE(layers)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _time(fn, *args, repeat=10):
    """Median wall time of one call in ms (synchronised on the GPU)."""
    times = []
    for _ in range(repeat + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeat // 2] * 1e3


WIDTH = 100  # the demo's output fits a 100-column terminal


def _say(msg: str) -> None:
    print(msg, flush=True)


LEGEND = """\
What the columns say:
  layer        the layer's index in the model
  experts      how the layer holds its experts: FP8Experts (one stacked (E, ...) tensor per
               weight) or ModuleList (an nn.ModuleList of experts, each with its own FP8Linear
               w1 (gate), w3 (up) and w2 (down), run by transformers 4.x Mixtral's loop)
  scheme       activation scales: dynamic (computed per token) or static (calibrated)
  expert loop  what the graph pass did with the layer's Python loop over experts, under plain
               torch.compile (no freezing): replaced it with one call of the fp8_moe op named
               (grouped_experts on the stacked tensors; grouped_experts_list on each expert's
               own tensors, read where they are, with no stacked copy), or left it as it is
               (why: above)
  rel err      |compiled - eager| / |eager| (Frobenius norm) of the layer's output; must be
               < 2e-2.  A rewritten loop sums in float32 in another order, and where the loop
               rounds its activation and its sum to bf16 (Mixtral's) the op does not; a loop
               left as it is still gets its activation, weighting and accumulation fused by
               Inductor, so it too can move an element by one bf16 step
  eager ms     median wall time of one call of the eager layer (the Python loop)
  compiled ms  the same for the compiled layer
  compile s    time of the first compiled call: tracing, the pass, Inductor's code generation"""


# The pass's log line for a rewrite names the op it inserted.
_REWRITE = re.compile(r"replaced a loop over \d+ experts with fp8_moe::(\w+)")
_LEFT = "left as it is"


def _rewrites(messages: list[str]) -> list[str]:
    """The ops the pass inserted, in the order of its log lines."""
    return [m.group(1) for m in map(_REWRITE.search, messages) if m]


@contextlib.contextmanager
def _recording(records: _Records):
    """The pass's INFO log lines go to ``records`` (and the logger's level is restored)."""
    pass_log = logging.getLogger("fp8_moe_ops.passes")
    old_level = pass_log.level
    pass_log.addHandler(records)
    pass_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        pass_log.removeHandler(records)
        pass_log.setLevel(old_level)


def _check_package_rewrites(rewrites: list[str], left_static: int, expected: list[str]) -> str | None:
    """Says what the pass did to the package's loops; returns a failure if that is not
    what it did to the layers one by one (``expected``, one entry per layer)."""
    done = ", ".join(f"{op} x{n}" for op, n in sorted(collections.Counter(rewrites).items())) or "none"
    _say(textwrap.fill(f"in the package the pass rewrote {len(rewrites)} loops ({done}), left {left_static} "
                       "(static)", width=WIDTH, initial_indent="  ", subsequent_indent="    "))
    want_static = expected.count(_LEFT)
    if sorted(rewrites) != sorted(e for e in expected if e != _LEFT) or left_static != want_static:
        return (f"the package's loops: expected {sorted(e for e in expected if e != _LEFT)} rewritten and "
                f"{want_static} left as it is, got {sorted(rewrites)} and {left_static}")
    return None


def _no_compile_caches():
    """Compile for real: a graph served from the FX graph or AOTAutograd cache runs no
    pass and counts nothing (and the layers here share one graph).  A context manager,
    so the configuration is as the caller left it afterwards."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def demo(args) -> int:
    from torch._dynamo.utils import counters

    import fp8_moe_ops.passes as passes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    where = torch.cuda.get_device_name() if device == "cuda" else "the CPU reference kernels"
    _say(f"fp8_moe_ops {fp8_moe_ops.__version__}, torch {torch.__version__}, on {device} ({where})")
    _say(f"model: {args.layers} MoE layers, {args.experts} experts each (hidden {args.hidden}, intermediate "
         f"{args.inter}, top-{args.top_k}), {args.tokens} tokens;")
    _say(f"       layer {args.static_layer} has static activation scales, the others dynamic;"
         if 0 <= args.static_layer < args.layers else "       all layers have dynamic activation scales;")
    _say(f"       layer {args.modulelist_layer}'s experts are an nn.ModuleList (Mixtral's loop), the others "
         "FP8Experts" if 0 <= args.modulelist_layer < args.layers else "       all layers' experts are FP8Experts")
    model = build_model(args.layers, args.experts, args.hidden, args.inter, args.top_k, {args.static_layer},
                        device, dtype, modulelist_layers={args.modulelist_layer}).eval()
    # what the pass must do with each layer's loop
    expected = [_LEFT if i == args.static_layer else
                "grouped_experts_list" if isinstance(layer, ModuleListMoELayer) else "grouped_experts"
                for i, layer in enumerate(model.layers)]
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    failures = []
    rows, reasons = [], []
    records = _Records()
    h = x
    with torch.no_grad(), passes.enabled(), _no_compile_caches(), _recording(records):
        for i, layer in enumerate(model.layers):
            _say(f"[{i + 1}/{len(model.layers)}] compiling layer {i} with the pass ...")
            torch._dynamo.reset()  # layers share code: without a reset Dynamo reuses layer 0's graph
            counters["fp8_moe"].clear()
            records.messages.clear()
            compiled = torch.compile(layer, fullgraph=True)
            eager_out = layer(h)
            t0 = time.perf_counter()
            comp_out = compiled(h)
            compile_s = time.perf_counter() - t0
            c = counters["fp8_moe"]
            if c["loops_rewritten"]:
                status = ", ".join(_rewrites(records.messages)) or "rewritten into an unnamed op"
            elif c["loops_skipped_static"] or c["loops_skipped_unsupported"]:
                status = _LEFT
                reasons.append((i, records.messages[-1] if records.messages else "(no log line)"))
            else:
                status = "no loop found"
            rel = rel_err(comp_out, eager_out)
            if not (rel < 2e-2 and not torch.isnan(comp_out).any()):
                failures.append(f"layer {i}: compiled vs eager relative error {rel:.2e}")
            if status != expected[i]:
                failures.append(f"layer {i}: expected the loop {expected[i]}, got {status}")
            rows.append((i, _experts_kind(layer), _activation_scheme(layer), status, rel, _time(layer, h),
                         _time(compiled, h), compile_s))
            h = eager_out
    _print_table(rows)
    for i, reason in reasons:
        _say(textwrap.fill(f"layer {i}: {reason}", width=WIDTH, initial_indent="  ", subsequent_indent="    "))
    _say(LEGEND)

    _say("exporting the whole model to an AOTInductor package (with the pass) ...")
    # Inductor keeps a fused bf16 residual add in float32 where eager rounds it, unless
    # emulate_precision_casts: with it the package equals eager bitwise on the CPU (torch 2.13).
    configs = {"emulate_precision_casts": True}
    skipped = None
    with (torch.no_grad(), tempfile.TemporaryDirectory() as tmp, passes.enabled(), _no_compile_caches(),
          torch._inductor.config.patch(configs), warnings.catch_warnings(), _recording(records)):
        # torch 2.13's own export code trips its own LeafSpec deprecation warning
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("tokens", min=1)},))
        t0 = time.perf_counter()
        records.messages.clear()
        counters["fp8_moe"].clear()
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "tiny_moe.pt2"),
                                                        inductor_configs=configs)
        packaged_s = time.perf_counter() - t0
        failure = _check_package_rewrites(_rewrites(records.messages), counters["fp8_moe"]["loops_skipped_static"],
                                          expected)
        if failure:
            failures.append(failure)
        _say(f"  packaged in {packaged_s:.1f} s; compiling the whole model with torch.compile to compare ...")
        torch._dynamo.reset()
        whole = torch.compile(model, fullgraph=True, dynamic=True)
        cases = [(x[:t], whole(x[:t]), model(x[:t])) for t in (args.tokens, max(1, args.tokens // 3))]
        _say("  loading the package in a fresh process ...")
        failure, skipped = _check_package(path, cases, tmp, device)
        if failure:
            failures.append(failure)
        if skipped:
            _say(textwrap.fill(f"SKIPPED: {skipped}", width=WIDTH, initial_indent="  ", subsequent_indent="    "))
    if failures:
        _say("FAILED:\n  " + "\n  ".join(failures))
        return 1
    _say("all checks passed" + (" (the AOTInductor step was skipped, see above)" if skipped else ""))
    return 0


# Loads an AOTInductor package and runs it on saved (input, compiled output, eager
# output) cases; prints one line per case.  A child process, so that a crash inside
# AOTInductor's loader is reported, not fatal.
_CHILD = """
import sys, torch
from fp8_moe_ops.demo import rel_err  # importing the package registers the ops the package calls
loaded = torch._inductor.aoti_load_package(sys.argv[1])
for x, compiled, eager in torch.load(sys.argv[2]):
    got = loaded(x)
    print("rel_err", x.shape[0], rel_err(got, compiled), rel_err(got, eager), flush=True)
"""
# The package is Inductor's code for the whole model: it must compute what torch.compile
# of the same model computes.  Against eager, a model of several bf16 layers moves by
# ~1e-2: one-ulp differences (the static layer's compiled loop) flip a top-k choice in a
# later layer's router (2.2e-2 measured on torch 2.12).  The per-layer table above
# checks compiled vs eager on the same input; here eager is reported, not bounded.
PACKAGE_BOUND = 1e-3


def _run_package(path: str, cases, tmp: str) -> subprocess.CompletedProcess:
    cases_path = os.path.join(tmp, os.path.basename(path) + ".cases.pt")
    torch.save(cases, cases_path)
    return subprocess.run([sys.executable, "-c", _CHILD, path, cases_path], capture_output=True, text=True)


def _check_package(path: str, cases, tmp: str, device: str) -> tuple[str | None, str | None]:
    """Run the package on ``cases`` ((input, torch.compile output, eager output)) in a
    child.  Returns (failure, skip reason).

    If the child dies from a signal, the same is tried with a package of a plain
    ``nn.Linear``: when that crashes too, AOTInductor itself is broken in this
    environment (seen on CUDA with torch 2.11.0+cu130), and the step is skipped."""
    proc = _run_package(path, cases, tmp)
    if proc.returncode == 0:
        results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("rel_err ")]
        if len(results) != len(cases):
            return f"the AOTInductor package ran {len(results)} of {len(cases)} cases:\n{proc.stdout[-2000:]}", None
        for tokens, vs_compiled, vs_eager in results:
            _say(f"  AOTInductor package at {tokens} tokens: relative error vs torch.compile "
                 f"{float(vs_compiled):.2e}, vs eager {float(vs_eager):.2e}")
            if not float(vs_compiled) < PACKAGE_BOUND:
                return (f"AOTInductor output differs from torch.compile at {tokens} tokens "
                        f"({float(vs_compiled):.2e})"), None
        return None, None
    if proc.returncode > 0:
        return f"loading/running the AOTInductor package failed:\n{proc.stderr[-2000:]}", None
    _say(f"  the process loading the package died from signal {-proc.returncode}; "
         "trying a package of a plain nn.Linear ...")
    if plain_package_crashes(device, tmp):
        return None, (f"AOTInductor crashes loading any {device} package in this environment (a plain nn.Linear "
                      f"too; torch {torch.__version__}): not a fault of fp8_moe_ops")
    return f"the AOTInductor package crashed (signal {-proc.returncode}) where a plain nn.Linear package runs", None


def plain_package_crashes(device: str, tmp: str) -> bool:
    """Whether loading a package of a plain ``nn.Linear`` on ``device`` kills a child
    process: the control that tells a broken AOTInductor from a fault of ours."""
    linear = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(4, 8, device=device)
    control = torch._inductor.aoti_compile_and_package(torch.export.export(linear, (x,)),
                                                       package_path=os.path.join(tmp, "control.pt2"))
    y = linear(x).detach()
    return _run_package(control, [(x, y, y)], tmp).returncode < 0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _print_table(rows) -> None:
    head = ("layer", "experts", "scheme", "expert loop", "rel err", "eager ms", "compiled ms", "compile s")
    cells = [head] + [(str(i), k, s, st, f"{e:.1e}", f"{te:.2f}", f"{tc:.2f}", f"{cs:.1f}")
                      for i, k, s, st, e, te, tc, cs in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(head))]
    for n, r in enumerate(cells):
        _say("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if n == 0:
            _say("  " + "  ".join("-" * w for w in widths))


DESCRIPTION = """\
Builds a small FP8 MoE model whose experts run as Python loops over experts (one
layer with static activation scales, one whose experts are an nn.ModuleList of
per-expert FP8Linear modules, as in transformers 4.x Mixtral), compiles each layer
with the fp8_moe graph pass, shows what the pass did (which grouped op replaced each
loop) and checks the result against eager; then exports
the whole model to an AOTInductor package, loads it in a fresh process and checks
it against torch.compile of the same model.  Runs on the GPU (Triton kernels) when
there is one, else on the CPU (the reference kernels).  Exits non-zero if a check
fails."""


def add_arguments(parser) -> None:
    """The demo's options, on an ``argparse`` (sub)parser."""
    parser.add_argument("--layers", type=int, default=3, help="number of MoE layers (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H (default: %(default)s)")
    parser.add_argument("--inter", type=int, default=128, help="expert intermediate size I (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens in the batch (default: %(default)s)")
    parser.add_argument("--static-layer", type=int, default=1,
                        help="index of the layer with static activation scales, -1 for none (default: %(default)s)")
    parser.add_argument("--modulelist-layer", type=int, default=2,
                        help="index of the layer whose experts are an nn.ModuleList of FP8Linear w1/w3/w2 modules "
                             "(Mixtral's loop), -1 for none (default: %(default)s)")


def run(args) -> int:
    return demo(args)
