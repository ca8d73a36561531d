"""Builders of random fp8 MoE inputs, and the few other helpers the tests share."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import fp8_moe_ops
from fp8_moe_ops import reference
from fp8_moe_ops.kernels import ws_gemm
from fp8_moe_ops.kernels.quant import divide_by_reciprocal, fma_rn

# Tests that build the Gluon GEMM itself: it is written against the Gluon of Triton 3.6 and
# 3.7, and with another Triton the package runs every GEMM through the Triton kernel instead.
needs_gluon = pytest.mark.skipif(not ws_gemm.AVAILABLE, reason=f"the Gluon GEMM is built for the Gluon of Triton "
                                 f"3.6 and 3.7, not {triton.__version__}'s")

# The benchmark layers (bench/ measures them; tests do not import bench/): E, H, I, top_k.
MODELS = {
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "mixtral_8x7b": (8, 4096, 14336, 2),
}

# Relative error bound of an output rounded to each dtype, against float64 on the same
# dequantised operands: a few units of the dtype's rounding (2^-8 bf16, 2^-11 fp16),
# far below what any indexing or scaling bug produces (errors of order 1).
REL_BOUND = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


# Relative Frobenius error bounds vs the CPU reference: GEMMs differ by summation order
# before the output rounding, and Hopper's fp8 MMA adds the products of one K step with
# less than float32 precision (the kernels promote to float32 every K step, as
# DeepSeek-V3 does): 1.3e-4 measured at K = 2048 for a float32 output, far under any
# bf16/fp16 rounding.  Whole experts can also move one re-quantised activation element
# by one e4m3 step.  An indexing or scaling bug is off by order 1.
GEMM_BOUND = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 5e-4}
EXPERTS_BOUND = 1e-2


# the head a fake compiled launcher is recorded with (record_with_fake_launchers)
FAKE_HEAD = ("function", False, False, None, None, "metadata", None, None, None)


def record_with_fake_launchers(monkeypatch, names, env, layout, calls, device: int = 3, packed: bool = False,
                               fed: tuple = (), launched: list | None = None):
    """``LaunchPlan.record`` of a forward's launches (``names``, ``env``, ``layout``,
    ``calls``: what ``kernels.plans`` records from), without a GPU, as on GPU
    ``device``: each compiled launcher is a fake that appends its arguments to the
    returned list (its head ``FAKE_HEAD``; with ``packed``, the kernel's arguments as one
    sequence, as from Triton 3.7), and the current stream is ``100 + device``.
    ``fed``: as ``LaunchPlan.record`` takes it; ``launched``: the list to append to (a
    new one by default).  Returns (plan, the list)."""
    from types import SimpleNamespace

    from fp8_moe_ops.kernels import launch, plans

    launched = [] if launched is None else launched
    fake = launch.Direct(lambda *a: launched.append(a), FAKE_HEAD, packed)
    monkeypatch.setattr(launch.Launch, "compiled", lambda self: (fake, device))
    current = SimpleNamespace(get_current_device=lambda: device, get_current_stream=lambda index: 100 + index)
    monkeypatch.setattr(plans, "driver", SimpleNamespace(active=current))
    return plans.LaunchPlan.record(list(names), env, layout, calls, fed), launched


def fresh_graph_workspaces(monkeypatch) -> None:
    """For one test: no shared workspace of the plans' CUDA graphs and no out-of-memory mark
    left by another test (``fp8_moe_ops.kernels.plans``' process-wide state)."""
    from fp8_moe_ops.kernels import plans

    monkeypatch.setattr(plans, "_ARENAS", {})
    monkeypatch.setattr(plans, "_OUT_OF_MEMORY", {})


def replay_keeping_workspace(monkeypatch, plan, inputs: list, hidden: torch.Tensor):
    """``plan.run(inputs, hidden)``: (its output, the workspace it allocated)."""
    made, empty = [], torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: made.append(empty(*a, **kw)) or made[-1])
        out = plan.run(inputs, hidden)
    (ws,) = [t for t in made if t.dtype == torch.uint8]
    return out, ws


class OpsSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops dispatched under it (``seen``: their names)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def poison_free_memory() -> None:
    """Fill the CUDA caching allocator's free memory with NaN: an output element the
    kernels forget to write reads back as NaN."""
    keep = [torch.full((numel,), float("nan"), device="cuda")
            for numel in (1 << 28, *[1 << s for s in range(8, 19) for _ in range(4)])]
    del keep


# Tests holding a model's full-size weights on the GPU (deepseek_v3's take 11 GiB): under
# pytest-xdist's ``loadgroup`` scheduling (the default on a GPU: conftest.py) they all run
# in one worker, so that several workers never hold such weights at once (eight workers
# on an 80 GB card ran out).
LARGE_WEIGHTS = pytest.mark.xdist_group("large_weights")


def random_fp8_weights(E: int, N: int, K: int, gen: torch.Generator, std: float) -> torch.Tensor:
    """(E, N, K) e4m3 on the GPU, N(0, std) before the cast, made one expert at a time:
    the bf16 draft of a whole deepseek_v3 weight (15 GiB, twice over for the scaling)
    never exists at once."""
    w = torch.empty(E, N, K, device="cuda", dtype=torch.float8_e4m3fn)
    for e in range(E):
        w[e] = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(std)
    return w


# The dispatches (eager loop, grouped, batched) agree to float32 rounding, not always
# bitwise: on CPU, vectorised erf/exp make the last bit of an element depend on its
# position in the tensor (SIMD body vs scalar tail), and the loop's per-expert tensors
# put a row at other positions than the grouped op's.  Measured: 13 of 1200 random
# layers differed (all gelu, float32), by at most 1.0e-7 relative (bench/dispatch_agreement.py).  Garbage is
# off by order 1.
AGREE_BOUND = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 2.5e-6}


def assert_agree(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert rel_err(a, b) <= AGREE_BOUND[a.dtype], rel_err(a, b)


def printed_by_fresh_process(code: str):
    """The literal printed last by ``code``, run with bench/ as ``sys.argv[1]`` in a
    fresh process without the interpreter (which replaces the compiled kernels, so
    offline compiles for the GPU need a process without it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = Path(__file__).resolve().parents[1] / "bench"
    proc = subprocess.run([sys.executable, "-c", code, str(bench)], capture_output=True, text=True, timeout=300,
                          env=env)
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / denom if denom else (out - ref).norm().item()


def make_expert_weights(E, N, K, block_size, scale_dtype=torch.float32, per_tensor=False, std=0.1, gen=None):
    """Random (E, N, K) weights quantised by this package, block-wise or per tensor ((E, 1, 1))."""
    w = torch.randn(E, N, K, generator=gen) * std
    return fp8_moe_ops.quantize_weight(w, None if per_tensor else block_size, scale_dtype)


def uneven_offsets(S: int, E: int, gen: torch.Generator, unrouted: int) -> torch.Tensor:
    """(E,) int32 offsets (inclusive cumsum) of S rows in uneven groups: random cuts,
    the second expert empty (where there is one), the last ``unrouted`` rows past
    ``offsets[-1]`` (fewer where the cuts end later)."""
    cuts = torch.sort(torch.randint(0, S + 1, (E,), generator=gen)).values
    if E > 1:
        cuts[1] = cuts[0]
    cuts[-1] = max(int(cuts[-2]) if E > 1 else 0, S - unrouted)
    return cuts.to(torch.int32)


def make_routing(T, k, E, kind="uniform", gen=None):
    """top_k_index (T, k) int64 and top_k_weights (T, k) float32.

    kinds (each an adversarial case of the ops):
      uniform:  distinct experts per token, uniform scores;
      one:      every slot on the last expert (E - 1), both slots of a token included;
      empty:    expert 0 (and expert E // 2 when E >= 3) gets no token;
      sentinel: expert-parallel ids outside [0, E) on both sides (-1, E, E + 3), and
                token 0 with no valid expert at all (its output must be exactly 0).
    With k > E the extra slots are sentinels (remote experts)."""
    if kind not in ("uniform", "one", "empty", "sentinel"):
        raise ValueError(f"kind: expected 'uniform', 'one', 'empty' or 'sentinel', got {kind!r}")
    if kind == "one":
        idx = torch.full((T, k), E - 1, dtype=torch.long)
    else:
        scores = torch.rand(T, E, generator=gen)
        if kind == "empty":
            scores[:, 0] = -1
            if E >= 3:
                scores[:, E // 2] = -1
        idx = torch.topk(scores, min(k, E), dim=1).indices
        if k > E:
            idx = torch.cat([idx, torch.full((T, k - E), E + 1)], dim=1)
        if kind == "sentinel" and T:
            idx[::2, 0] = -1
            idx[1::3, -1] = E + 3
            idx[0, :] = E
    weights = torch.rand(T, k, generator=gen)
    return idx, weights


def make_experts_inputs(T, E, H, I, k, block_size, dtype=torch.bfloat16, scale_dtype=torch.float32,
                        static=False, routing="uniform", per_tensor=False, seed=0):
    """Everything ``torch.ops.fp8_moe.grouped_experts`` takes, as a dict of kwargs."""
    gen = torch.Generator().manual_seed(seed)
    gu, gus = make_expert_weights(E, 2 * I, H, block_size, scale_dtype, per_tensor, gen=gen)
    dp, dps = make_expert_weights(E, H, I, block_size, scale_dtype, per_tensor, gen=gen)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    idx, weights = make_routing(T, k, E, routing, gen=gen)
    args = dict(hidden=hidden, top_k_index=idx, top_k_weights=weights, gate_up_proj=gu, gate_up_scale_inv=gus,
                down_proj=dp, down_scale_inv=dps, block_size=list(block_size))
    if static:
        # Plausible calibrated scales: amax/448 of a unit normal is ~ 4/448; the
        # intermediate activation is smaller.
        args["gate_up_act_scale"] = torch.rand(E, generator=gen) * 0.01 + 0.005
        args["down_act_scale"] = torch.rand(E, generator=gen) * 0.002 + 0.0005
    return args


def experts_float64(hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_scale_inv, down_proj, down_scale_inv,
                    block_size, activation="silu", gate_up_act_scale=None, down_act_scale=None, swiglu_limit=None):
    """The whole expert forward in float64 on the dequantised weights, one token and
    slot at a time, with the activation quantisation and the intermediate roundings of
    docs/ops.md but float64 products and sums: the accuracy yardstick."""
    T, k = top_k_index.shape
    E = gate_up_proj.shape[0]
    bk = block_size[1]
    out = torch.zeros(hidden.shape, dtype=torch.float64)

    def qdq(x, static_scale):
        if static_scale is None:
            q, s = reference.quantize_act_dynamic(x, bk)
            return reference.dequantize_act(q, s, bk).double()
        return reference.quantize_act_static(x, static_scale).double() * static_scale.double()

    for t in range(T):
        for j in range(k):
            e = int(top_k_index[t, j])
            if not 0 <= e < E:
                continue
            wg = reference.dequantize_weight(gate_up_proj[e], gate_up_scale_inv[e], block_size).double()
            wd = reference.dequantize_weight(down_proj[e], down_scale_inv[e], block_size).double()
            x = qdq(hidden[t : t + 1], None if gate_up_act_scale is None else gate_up_act_scale[e])
            gate, up = (x @ wg.t()).to(hidden.dtype).double().chunk(2, dim=-1)
            if swiglu_limit is not None:
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            act = {"silu": torch.nn.functional.silu, "relu": torch.relu,
                   "gelu": torch.nn.functional.gelu,
                   "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[activation]
            a = act(gate) * up
            a = qdq(a.to(hidden.dtype), None if down_act_scale is None else down_act_scale[e])
            out[t] += (a @ wd.t())[0].to(hidden.dtype).double() * float(top_k_weights[t, j])
    return out


def as_expert_lists(args: dict, separate: bool = False) -> dict:
    """``make_experts_inputs`` kwargs for ``grouped_experts_list``: each expert's own
    tensor (views of the stacked ones, so no copy), gate and up as two lists when
    ``separate`` (the gate_up scale grid must then split at I: I % bn == 0 or (1, 1))."""
    out = dict(args)
    gu, gus = args["gate_up_proj"], args["gate_up_scale_inv"]
    E, two_i, _ = gu.shape
    out["down_proj"] = list(args["down_proj"].unbind(0))
    out["down_scale_inv"] = list(args["down_scale_inv"].unbind(0))
    if not separate:
        out["gate_up_proj"], out["gate_up_scale_inv"] = list(gu.unbind(0)), list(gus.unbind(0))
        return out
    I, g = two_i // 2, gus.shape[1] // 2
    out["gate_up_proj"] = [gu[e, :I] for e in range(E)] + [gu[e, I:] for e in range(E)]
    if gus.shape[1] == 1:
        out["gate_up_scale_inv"] = [gus[e] for e in range(E)] * 2
    else:
        out["gate_up_scale_inv"] = [gus[e, :g] for e in range(E)] + [gus[e, g:] for e in range(E)]
    return out


def with_split_k(gemm_config, split: int, rows: int | None = None):
    """``gemm_config`` (``fp8_moe_ops.kernels.moe``'s) giving the down GEMM with the fused
    combine ``split`` K ranges (and, with ``rows``, row tiles of that many rows): to
    monkeypatch in, so small test shapes run split-K."""

    def config(S, E, N, K, split_k=False, sms=None):
        cfg = gemm_config(S, E, N, K, split_k, sms)
        if split_k:
            cfg["SPLIT"] = split
            if rows is not None:
                cfg["BM"] = rows
        return cfg

    return config


# --------------------------------------------------------------------------- float32 division and fma


@triton.jit
def _elementwise_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n, FMA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    b = tl.load(b_ptr + offs, mask=m, other=1.0)
    if FMA:
        out = fma_rn(a, b, tl.load(c_ptr + offs, mask=m, other=0.0))
    else:
        out = divide_by_reciprocal(a, b, tl.math.div_rn(1.0, b))
    tl.store(out_ptr + offs, out, mask=m)


def run_elementwise(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' ``fma_rn(a, b, c)`` (given c) or ``divide_by_reciprocal(a, b, 1 / b)``
    (the reciprocal IEEE), elementwise over float32 vectors, on their device."""
    out = torch.empty_like(a)
    block = 1024
    _elementwise_kernel[(triton.cdiv(a.numel(), block),)](a, b, a if c is None else c, out, a.numel(),
                                                          FMA=c is not None, BLOCK=block)
    return out


def division_matches(got: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether ``got`` is x / d as IEEE divides (float32, on the CPU): bitwise where the
    quotient is zero or normal; below float32's normal range (where ``divide_by_reciprocal``
    leaves the last bits to chance) below 2^-60 and of the quotient's sign, which every
    quantisation turns into the same signed zero."""
    want = x / d
    exact = (want == 0) | (want.abs() >= 2.0 ** -126)
    tiny = ~exact
    return (torch.equal(got[exact].view(torch.int32), want[exact].view(torch.int32))
            and bool((got[tiny].abs() < 2.0 ** -60).all())
            and torch.equal(got[tiny].signbit(), want[tiny].signbit()))


def _float32(sign, exp, mantissa) -> torch.Tensor:
    return (((exp + 127) << 23) | mantissa).to(torch.int32).view(torch.float32) * sign


def division_cases(n: int = 20000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (x, d) pairs within ``divide_by_reciprocal``'s bounds (d in [2^-40, 2^40],
    |x| at most 2^50): random bits over those binades, mantissas of all
    ones and of a few low bits (the quotients nearest a power of two), x / d on an
    e4m3 grid point or midpoint and one float32 either side of it, signed zeros,
    subnormal and tiny x, and the bounds themselves."""
    gen = torch.Generator().manual_seed(seed)

    def ints(lo, hi):
        return torch.randint(lo, hi, (n,), generator=gen)

    def mantissas():
        kind = ints(0, 3)
        low = ints(0, 64)
        return torch.where(kind == 0, ints(0, 1 << 23), torch.where(kind == 1, (1 << 23) - 1 - low, low))

    sign = torch.where(ints(0, 2) == 0, -1.0, 1.0)
    x = _float32(sign, ints(-100, 50), mantissas())
    d = _float32(1.0, ints(-40, 40), mantissas())
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    targets = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    on_grid = targets[ints(0, targets.numel())[: n // 2]] * d[: n // 2]
    away = torch.where(ints(0, 2)[: n // 2] == 0, -float("inf"), float("inf"))
    near = torch.cat([on_grid, torch.nextafter(on_grid, away)])
    special_x = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -2.0 ** -110, 2.0 ** -100, 2.0 ** 50, -2.0 ** 50,
                              -(2.0 ** 50 - 2.0 ** 26)])
    special_d = torch.tensor([2.0 ** -40, 2.0 ** 40, 1.0, 3.0, 1.0 / 448, 1.7e-10, 2.0 ** 40 - 2.0 ** 16])
    sx, sd = torch.cartesian_prod(special_x, special_d).unbind(1)
    return torch.cat([x, near, sx]), torch.cat([d, d[: n // 2], d[: n // 2], sd])


def _round_to_float32(v: Fraction) -> float:
    """v rounded to the nearest float32, ties to even (no overflow)."""
    c = torch.tensor(float(v), dtype=torch.float32)
    around = [torch.nextafter(c, torch.tensor(-float("inf"))), c, torch.nextafter(c, torch.tensor(float("inf")))]
    return min(around, key=lambda f: (abs(Fraction(f.item()) - v), f.view(torch.int32).item() & 1)).item()


def fma_cases(n: int = 1000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (a, b, c) with ``a * b + c`` rounded once (the fourth tensor, computed
    exactly): random operands with c cancelling most of a * b, or far smaller than it,
    and two where rounding the product first goes wrong (twice rounded: 2^-11 instead
    of 2^-11 + 2^-24; and a sum just past a float32 tie that float64 rounds onto it)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-20, 20, (n,), generator=gen)
    b = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-20, 20, (n,), generator=gen)
    ab = a * b
    perturb = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-90, -10, (n,), generator=gen)
    c = torch.where(torch.arange(n) % 2 == 0, -ab * (1 + perturb.clamp(-1e-3, 1e-3)), ab * perturb)
    a = torch.cat([a, torch.tensor([1 + 2.0 ** -12, 1 + 2.0 ** -23])])
    b = torch.cat([b, torch.tensor([1 + 2.0 ** -12, 1 - 2.0 ** -24])])
    c = torch.cat([c, torch.tensor([-1.0, 2.0 ** -47 + 2.0 ** -70])])
    want = torch.tensor([_round_to_float32(Fraction(x) * Fraction(y) + Fraction(z))
                         for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    return a, b, c, want


# static scales inside divide_by_reciprocal's bounds (including them: 2^+-40) and outside
# (the kernels divide those blocks with div_rn): 2^+-41, a subnormal, near float32's max,
# a negative one
STATIC_SCALES = (1.0, 3.0, 0.1, 0.0123 / 448, 1 - 2.0 ** -24, 1.5 * 2.0 ** 39, 2.0 ** -40, 2.0 ** 40, 2.0 ** -41,
                 2.0 ** 41, 1e-40, 3e38, -3.0)


def static_scale_cases(group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``group`` values for each expert e of ``STATIC_SCALES``: quotients by its
    scale on every e4m3 value and midpoint and one float32 either side (ties, roundings
    across a power of two, subnormals, saturation), signed zeros and infinities.  Row
    counts are not multiples of a row block, so blocks mix experts and scales.  At the
    largest scales the largest quotients' dividends pass 2^50, where the kernels clamp
    them.
    Returns (x (R, group), offsets (E,) int32 inclusive row ends, scales (E,))."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    quotients = torch.cat([e4m3, mids, torch.tensor([0.0, -0.0, 500.0, -1e6, float("inf"), -float("inf")])])
    xs, ends = [], []
    for i, s in enumerate(STATIC_SCALES):
        x = quotients * s
        inf = torch.tensor(float("inf"))
        x = torch.cat([x, torch.nextafter(x, inf), torch.nextafter(x, -inf)])
        x = torch.cat([x, x.new_zeros(-x.numel() % group)]).view(-1, group)
        x = torch.cat([x, x[: i + 3]])
        xs.append(x)
        ends.append((ends[-1] if ends else 0) + x.shape[0])
    return torch.cat(xs), torch.tensor(ends, dtype=torch.int32), torch.tensor(STATIC_SCALES)


def row_experts(offsets: torch.Tensor) -> torch.Tensor:
    """The expert of each row of :func:`static_scale_cases` (``offsets``: its row ends)."""
    return torch.searchsorted(offsets, torch.arange(int(offsets[-1])), right=True)


def static_slot_ids(offsets: torch.Tensor) -> torch.Tensor:
    """(rows, 3) int32 expert ids of three slots per row of :func:`static_scale_cases`:
    the row's own expert, another one's ((own * 5 + 1) % E), and none (-1)."""
    own = row_experts(offsets)
    return torch.stack([own, (own * 5 + 1) % offsets.numel(), torch.full_like(own, -1)], 1).to(torch.int32)
