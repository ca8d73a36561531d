"""Correctness of every fp8_moe op's CUDA (Triton) implementation against the CPU reference.

Run on a CUDA machine:  ``PYTHONPATH=. python bench/check_gpu.py [--out gpu_check.md]``.
Exits non-zero on any mismatch.  Checks, each on fresh random inputs:

* activation quantisation (dynamic and static): bytes and scales bitwise equal to
  torch's (the CPU reference), on random data and on every e4m3 rounding case;
* linear / grouped_mm / batched_mm / grouped_experts / batched_experts through
  ``torch.ops.fp8_moe`` on CUDA vs the same op on CPU, at adversarial shapes
  (T = 1, T < block, prime E, N and K not multiples of the block, an expert with no
  tokens, all tokens on one expert, sentinel ids), static and dynamic, float32 and
  UE8M0 scales, per-tensor scales, bf16 / fp16 / fp32 activations;
* every output element written: before each call the CUDA caching allocator's free
  blocks are filled with NaN, so an unwritten element shows as NaN (none allowed
  where the reference has none); sentinel-only rows must be exactly zero;
* grouped and batched experts bitwise equal, and deterministic run to run;
* ``grouped_experts`` captured in a CUDA graph and replayed with *new* routing
  equals eager on that routing, bitwise (no host sync, routing-independent grid);
* every launch config of the shipped table, at the PERF.md model shapes, agrees
  with the BM = 16 config checked against the reference above.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import fp8_moe_ops  # noqa: F401  (registers torch.ops.fp8_moe)
from fp8_moe_ops import reference
from fp8_moe_ops.kernels import moe

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import MODELS  # noqa: E402  (the PERF.md shapes)

DEV = "cuda"
E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn
OPS = torch.ops.fp8_moe
# relative Frobenius error bounds vs the CPU reference: GEMMs differ by summation
# order before the output rounding, and Hopper's fp8 MMA adds the products of one
# K step with less than float32 precision (the kernels promote to float32 every
# K step of bk, as DeepSeek-V3 does): 1.3e-4 measured at K = 2048 for a float32
# output, far under any bf16/fp16 rounding.  Whole experts can also move one
# re-quantised activation element by one e4m3 step.
GEMM_BOUND = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 5e-4}
EXPERTS_BOUND = 1e-2

results: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def poison() -> None:
    """Fill the caching allocator's free memory with NaN: an output element the
    kernels forget to write reads back as NaN."""
    keep = []
    for numel in (1 << 28, *[1 << s for s in range(8, 19) for _ in range(4)]):
        keep.append(torch.full((numel,), float("nan"), device=DEV))
    del keep


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    n = ref.norm().item()
    return (out - ref).norm().item() / n if n else (out - ref).norm().item()


def weights(gen, E, N, K, block, scale_dtype=torch.float32, per_tensor=False, std=0.05):
    w = torch.randn(E, N, K, generator=gen) * std
    return reference.quantize_weight_blockwise(w, w.shape[-2:] if per_tensor else block, scale_dtype)


def routing(gen, T, k, E, kind):
    if kind == "one":
        idx = torch.full((T, k), E // 2, dtype=torch.long)
    else:
        scores = torch.rand(T, E, generator=gen)
        if kind == "empty":
            scores[:, 0] = -1
        idx = torch.topk(scores, min(k, E), dim=1).indices
        if kind == "sentinel" and T:
            idx[::2, 0] = -1
            idx[1::3, -1] = E + 3
            idx[0, :] = E
    return idx, torch.rand(T, k, generator=gen)


def cuda(t):
    return t.to(DEV) if isinstance(t, torch.Tensor) else t


def check_nan_and_zero(name, out, ref):
    ref_nan = ref.isnan().cpu()
    bad = (out.isnan().cpu() & ~ref_nan).sum().item()
    return bad == 0, f"unwritten/NaN elements {bad}"


# --------------------------------------------------------------------------- quantisation


def check_quantisation(gen) -> None:
    grid = torch.arange(0, 256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    edge = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9)),
                      torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-3, 126.24, 17.0, float("inf"), float("-inf")])])
    x = edge[:, None].expand(-1, 128).contiguous()
    one = torch.ones(1)
    q, _ = moe._quantize(cuda(x), 128, x.shape[0], offsets=cuda(torch.tensor([x.shape[0]], dtype=torch.int32)),
                         act_scale=cuda(one))
    ref = reference.quantize_act_static(x, one)
    record("quant static: every e4m3 rounding case, bitwise", torch.equal(q.cpu().view(torch.uint8), ref.view(torch.uint8)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for T, K, g in ((1, 128, 128), (333, 7168, 128), (64, 400, 128), (50, 96, 32)):
            x = (torch.randn(T, K, generator=gen) * torch.logspace(-4, 3, K)).to(dtype)
            x[0, :g] = 0
            poison()
            q, s = moe._quantize(cuda(x), g, T)
            rq, rs = reference.quantize_act_dynamic(x, g)
            ok = torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
            record(f"quant dynamic {str(dtype)[6:]} T={T} K={K} group={g}, bitwise", ok)


# --------------------------------------------------------------------------- GEMMs


def check_gemms(gen) -> None:
    cases = [
        # name, S, E, N, K, block
        ("T=1", 1, 3, 256, 384, [128, 128]),
        ("T<block, prime E, N/K not multiples", 45, 7, 200, 400, [128, 128]),
        ("block 32", 300, 5, 96, 160, [32, 32]),
        ("bn!=bk, bk=96", 130, 4, 150, 288, [64, 96]),
        ("large", 2048, 8, 1024, 2048, [128, 128]),
    ]
    for name, S, E, N, K, block in cases:
        for static in (False, True):
            for scale_dtype in (torch.float32, E8M0):
                for dtype, out_dtype in ((torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32)):
                    tag = f"{name} {'static' if static else 'dynamic'} {str(scale_dtype)[6:]} {str(dtype)[6:]}" \
                          f"{'->f32' if out_dtype else ''}"
                    w, ws = weights(gen, E, N, K, block, scale_dtype, per_tensor=(S == 45 and scale_dtype == E8M0))
                    x = torch.randn(S, K, generator=gen).to(dtype)
                    a = torch.rand(E, generator=gen) * 0.01 + 0.002 if static else None
                    bound = GEMM_BOUND[out_dtype or dtype]
                    # linear (expert 0)
                    poison()
                    out = OPS.linear(cuda(x), cuda(w[0]), cuda(ws[0]), block, cuda(None if a is None else a[:1]), out_dtype)
                    ref = OPS.linear(x, w[0], ws[0], block, None if a is None else a[:1], out_dtype)
                    ok, d = check_nan_and_zero("linear", out, ref)
                    r = rel(out, ref)
                    record(f"linear {tag}", ok and r < bound, f"rel {r:.2e} {d}")
                    # grouped_mm: uneven groups, one empty, rows past offsets[-1]
                    cuts = torch.sort(torch.randint(0, S + 1, (E,), generator=gen)).values
                    cuts[1] = cuts[0]
                    cuts[-1] = max(int(cuts[-2]), S - S // 5)
                    offsets = cuts.to(torch.int32)
                    poison()
                    out = OPS.grouped_mm(cuda(x), cuda(w), cuda(ws), cuda(offsets), block, cuda(a), out_dtype)
                    ref = OPS.grouped_mm(x, w, ws, offsets, block, a, out_dtype)
                    ok, d = check_nan_and_zero("grouped", out, ref)
                    tail = int(offsets[-1])
                    ok = ok and bool((out[tail:] == 0).all())
                    r = rel(out, ref)
                    record(f"grouped_mm {tag}", ok and r < bound, f"rel {r:.2e} {d}")
                    # batched_mm with sentinels
                    ids = torch.randint(-1, E + 1, (S,), generator=gen)
                    poison()
                    out = OPS.batched_mm(cuda(x), cuda(w), cuda(ws), cuda(ids), block, cuda(a), out_dtype)
                    ref = OPS.batched_mm(x, w, ws, ids, block, a, out_dtype)
                    ok, d = check_nan_and_zero("batched", out, ref)
                    sent = ((ids < 0) | (ids >= E)).to(DEV)
                    ok = ok and bool((out[sent] == 0).all())
                    r = rel(out, ref)
                    record(f"batched_mm {tag}", ok and r < bound, f"rel {r:.2e} {d}")


# --------------------------------------------------------------------------- experts


def experts_args(gen, T, E, H, I, k, block, kind, dtype, scale_dtype, static, per_tensor=False):
    gu, gus = weights(gen, E, 2 * I, H, block, scale_dtype, per_tensor)
    dp, dps = weights(gen, E, H, I, block, scale_dtype, per_tensor)
    idx, wts = routing(gen, T, k, E, kind)
    args = [torch.randn(T, H, generator=gen).to(dtype), idx, wts, gu, gus, dp, dps, block]
    kw = {}
    if static:
        kw = dict(gate_up_act_scale=torch.rand(E, generator=gen) * 0.005 + 0.004,
                  down_act_scale=torch.rand(E, generator=gen) * 0.0005 + 0.0003)
    return args, kw


def check_experts(gen) -> None:
    cases = [
        # name, T, E, H, I, k, block, routing
        ("T=1", 1, 8, 256, 128, 2, [128, 128], "uniform"),
        ("T<block prime E, H/I not multiples", 37, 13, 400, 200, 4, [128, 128], "uniform"),
        ("expert with no tokens", 130, 6, 256, 256, 2, [128, 128], "empty"),
        ("all tokens on one expert", 300, 5, 384, 256, 2, [128, 128], "one"),
        ("sentinels", 257, 9, 512, 384, 3, [128, 128], "sentinel"),
        ("block 32", 100, 4, 160, 96, 2, [32, 32], "sentinel"),
        ("mid-size", 600, 16, 1024, 512, 4, [128, 128], "uniform"),
    ]
    combos = [
        (torch.bfloat16, torch.float32, False, False, "silu", None),
        (torch.bfloat16, torch.float32, True, False, "silu", None),
        (torch.float16, E8M0, False, False, "gelu", None),
        (torch.bfloat16, E8M0, True, True, "gelu_tanh", 2.0),
        (torch.float32, torch.float32, True, False, "relu", None),
        (torch.bfloat16, torch.float32, False, True, "silu", 0.7),
    ]
    for name, T, E, H, I, k, block, kind in cases:
        for dtype, sd, static, per_tensor, act, limit in combos:
            tag = f"{name} {str(dtype)[6:]} {str(sd)[6:]} {'static' if static else 'dynamic'}" \
                  f"{' per-tensor' if per_tensor else ''} {act}{f' limit={limit}' if limit else ''}"
            args, kw = experts_args(gen, T, E, H, I, k, block, kind, dtype, sd, static, per_tensor)
            args = args + [act]
            kw["swiglu_limit"] = limit
            cargs = [cuda(a) for a in args]
            ckw = {key: cuda(v) for key, v in kw.items()}
            poison()
            out = OPS.grouped_experts(*cargs, **ckw)
            ref = OPS.grouped_experts(*args, **kw)
            ok, d = check_nan_and_zero("experts", out, ref)
            idx = args[1]
            none = ((idx < 0) | (idx >= E)).all(dim=1)
            ok = ok and bool((out.cpu()[none] == 0).all())
            r = rel(out, ref)
            poison()
            out_b = OPS.batched_experts(*cargs, **ckw)
            same = torch.equal(out_b, out) and torch.equal(OPS.grouped_experts(*cargs, **ckw), out)
            record(f"experts {tag}", ok and r < EXPERTS_BOUND and same,
                   f"rel {r:.2e} {d} batched==grouped&deterministic {same}")


def check_cuda_graph(gen) -> None:
    T, E, H, I, k, block = 64, 16, 512, 256, 4, [128, 128]
    for static in (False, True):
        args, kw = experts_args(gen, T, E, H, I, k, block, "uniform", torch.bfloat16, torch.float32, static)
        cargs = [cuda(a) for a in args]
        ckw = {key: cuda(v) for key, v in kw.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            OPS.grouped_experts(*cargs, **ckw)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = OPS.grouped_experts(*cargs, **ckw)
        ok = True
        for kind in ("uniform", "sentinel", "one", "empty"):
            idx, wts = routing(gen, T, k, E, kind)
            cargs[1].copy_(idx)
            cargs[2].copy_(wts)
            cargs[0].copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
            g.replay()
            eager = OPS.grouped_experts(*cargs, **ckw)
            ok = ok and torch.equal(out, eager)
        record(f"cuda graph replay with new routing == eager ({'static' if static else 'dynamic'})", ok)


def check_shipped_configs(gen) -> None:
    """Every config of the shipped table, on the PERF.md model shapes (too large for
    the CPU reference), against the BM = 16 config that the small-shape checks above
    compare with the reference: same K steps, so they must agree to rounding."""
    from fp8_moe_ops.kernels import config

    small = {"BM": 16, "BN": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    for name, (E, H, I, k) in MODELS.items():
        gu = (torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 32).to(FP8)
        dp = (torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 32).to(FP8)
        gus = torch.rand(E, 2 * I // 128, H // 128, device=DEV) * 2e-4 + 1e-4
        dps = torch.rand(E, H // 128, I // 128, device=DEV) * 2e-4 + 1e-4
        for T in (1, 64, 512, 4096, 16384):
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            idx = torch.topk(torch.rand(T, E, device=DEV), k, dim=1).indices
            wts = torch.rand(T, k, device=DEV)
            used = {str(config.gemm_config(T * k, E, 2 * I, H)), str(config.gemm_config(T * k, E, H, I))}
            poison()
            out = OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, [128, 128])
            moe.gemm_config = lambda *a: dict(small)
            try:
                ref = OPS.grouped_experts(x, idx, wts, gu, gus, dp, dps, [128, 128])
            finally:
                moe.gemm_config = config.gemm_config
            r = rel(out, ref)
            ok = not out.isnan().any().item() and r < EXPERTS_BOUND
            record(f"shipped config {name} T={T} {sorted(used)} vs BM=16", ok, f"rel {r:.2e}")
        del gu, dp
        torch.cuda.empty_cache()


SECTIONS = {"quant": check_quantisation, "gemms": check_gemms, "experts": check_experts,
            "graph": check_cuda_graph, "configs": check_shipped_configs}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="write a markdown report here")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh inputs every run
    t0 = time.time()
    for section in (SECTIONS[name] for name in args.only.split(",")):
        t1 = time.time()
        section(gen)
        print(f"{section.__name__}: {time.time() - t1:.0f} s", flush=True)
    failed = [r for r in results if not r[1]]
    summary = f"{len(results) - len(failed)}/{len(results)} checks passed in {time.time() - t0:.0f} s on " \
              f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    print(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# GPU correctness check\n\n")
            f.write("Output of `PYTHONPATH=. python bench/check_gpu.py --out docs/gpu_check.md` "
                    "(what it checks: the module docstring of `bench/check_gpu.py`).\n\n")
            f.write(summary + "\n\n| result | check | detail |\n| --- | --- | --- |\n")
            for name, ok, detail in results:
                f.write(f"| {'PASS' if ok else 'FAIL'} | {name} | {detail} |\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
