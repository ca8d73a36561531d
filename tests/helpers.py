"""Builders of random fp8 MoE inputs, and the few other helpers the tests share."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

import fp8_moe_ops
from fp8_moe_ops import reference

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


def record_with_fake_launchers(monkeypatch, names, env, layout, calls, device: int = 3):
    """``ExpertsPlan.record`` of a forward's launches (``names``, ``env``, ``layout``,
    ``calls``: what ``kernels.experts`` records from), without a GPU, as on GPU
    ``device``: each compiled launcher is a fake that appends its arguments to the
    returned list (its head ``FAKE_HEAD``), and the current stream is ``100 + device``.
    Returns (plan, the list)."""
    from types import SimpleNamespace

    from fp8_moe_ops.kernels import experts, launch

    launched = []
    monkeypatch.setattr(launch.Launch, "compiled", lambda self: (lambda *a: launched.append(a), FAKE_HEAD, device))
    current = SimpleNamespace(get_current_device=lambda: device, get_current_stream=lambda index: 100 + index)
    monkeypatch.setattr(experts, "driver", SimpleNamespace(active=current))
    return experts.ExpertsPlan.record(list(names), env, layout, calls), launched


def replay_keeping_workspace(monkeypatch, plan, inputs: list, hidden: torch.Tensor):
    """``plan.run(inputs, hidden)``: (its output, the workspace it allocated)."""
    made, empty = [], torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: made.append(empty(*a, **kw)) or made[-1])
        out = plan.run(inputs, hidden)
    (ws,) = [t for t in made if t.dtype == torch.uint8]
    return out, ws


def poison_free_memory() -> None:
    """Fill the CUDA caching allocator's free memory with NaN: an output element the
    kernels forget to write reads back as NaN."""
    keep = [torch.full((numel,), float("nan"), device="cuda")
            for numel in (1 << 28, *[1 << s for s in range(8, 19) for _ in range(4)])]
    del keep


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
