"""Expert parallelism on 2 GPUs (NCCL): equality with one GPU, and time per layer.

Run on a machine with 2 CUDA GPUs (never in CI):

    torchrun --nproc-per-node 2 bench/bench_parallel.py --check --out-dir OUT [--tokens 1,64,1024,8192,16384]

deepseek_v3 dimensions (E=256 experts split 128/128, H=7168, I=2048, top_k=8, 128x128
blocks), random weights quantised on the GPU with ``fp8_moe_ops.quantize_weight``.

* ``--check``: ``ExpertParallel`` on each rank's own tokens against the full
  ``FP8Experts`` (grouped dispatch, all 256 experts) on the same GPU and tokens: uneven
  T per rank, a rank with no tokens, static scales, caller sentinels, bf16/fp16/fp32,
  skewed routing, ``torch.compile``.  Relative error bound as the GPU kernel tests'
  whole-layer bound: Hopper's fp8 MMA rounds its K-step sums differently per tile
  shape, and the local op sees other row counts per expert (so other tiles) than the
  full layer: a one-ulp change of h can move a re-quantised activation by one e4m3
  step (measured on 2 H200s: bitwise in 19 of 24 rank checks, at most 6.0e-3 in the
  rest).  Also reports whether the outputs are bitwise equal.
  Exit code 1 on any mismatch.
* timings (skip with ``--no-bench``), for T tokens per GPU and uniform / skewed routing:
  ``ep_ms`` the layer on 2 GPUs (median of CUDA-event times, the slower rank),
  ``a2a_ms`` the transport alone (counts, tokens out, results back, with the local op
  replaced by an identity: its share of the layer), ``overhead_ms`` the whole call with
  that identity (all but the experts), ``expert_ms`` each rank's local grouped op on
  the slots it received, peak transient memory and resident weights per GPU; then rank 0
  alone runs the full 256-expert ``FP8Experts`` on its T tokens (``one_gpu_ms``).
  ``x_time = ep_ms / one_gpu_ms`` (2T tokens on 2 GPUs vs T on one) and ``x_tput = 2 /
  x_time``.

Writes ``OUT/bench_parallel.json`` and ``OUT/bench_parallel.md``.  Stops starting new
configurations after ``--budget-s`` seconds.  Any error: traceback printed, exit 1.
"""

from __future__ import annotations

import os

# NVLink multicast stays off (before torch.distributed starts NCCL).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp8_moe_ops  # noqa: E402
from fp8_moe_ops import FP8Experts  # noqa: E402
from fp8_moe_ops.parallel import ExpertParallel, shard_experts  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8  # --dims changes them (tiny dims rehearse the script on CPU over gloo)
BLOCK = [128, 128]
CHUNK = 16  # experts generated per step (a bf16 (16, 4096, 7168) draft is 0.9 GB)
CUDA = True
AGREE_BOUND = {dt: 1e-2 for dt in (torch.bfloat16, torch.float16, torch.float32)}  # GPU whole-layer bound
START = time.monotonic()
RANK = 0


def log(msg: str) -> None:
    print(f"[rank {RANK} {time.monotonic() - START:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- inputs


def build_experts(dev, static=False) -> FP8Experts:
    """All E experts, seeded per chunk of CHUNK experts; weights ~ N(0, 0.02^2) quantised
    on the device.  Static scales: plausible constants per expert (any value checks
    equality; saturation happens the same way on both sides)."""
    mod = FP8Experts(E, H, I, BLOCK, activation_scheme="static" if static else "dynamic", dispatch="grouped",
                     device=dev)
    for c in range(E // CHUNK):
        gen = torch.Generator(device=dev).manual_seed(c)
        sl = slice(c * CHUNK, (c + 1) * CHUNK)
        for name, shape in (("gate_up_proj", (CHUNK, 2 * I, H)), ("down_proj", (CHUNK, H, I))):
            w = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
            q, s = fp8_moe_ops.quantize_weight(w, BLOCK)
            getattr(mod, name).data[sl] = q
            getattr(mod, name + "_scale_inv").data[sl] = s
    if static:
        gen = torch.Generator(device=dev).manual_seed(E)
        mod.gate_up_proj_activation_scale.data = torch.rand(E, device=dev, generator=gen) * 0.004 + 0.01
        mod.down_proj_activation_scale.data = torch.rand(E, device=dev, generator=gen) * 0.002 + 0.002
    return mod


def with_static_scales(full: FP8Experts) -> FP8Experts:
    """``full``'s weights (shared, not copied) with static activation scales."""
    mod = FP8Experts(E, H, I, BLOCK, activation_scheme="static", dispatch="grouped", device="meta")
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        setattr(mod, name, getattr(full, name))
    dev = full.gate_up_proj.device
    gen = torch.Generator(device=dev).manual_seed(E)
    mod.gate_up_proj_activation_scale = torch.nn.Parameter(
        torch.rand(E, device=dev, generator=gen) * 0.004 + 0.01, requires_grad=False)
    mod.down_proj_activation_scale = torch.nn.Parameter(
        torch.rand(E, device=dev, generator=gen) * 0.002 + 0.002, requires_grad=False)
    return mod


def make_inputs(T, kind, seed, dev, dtype=torch.bfloat16):
    """hidden (T, H), top_k_index (T, K), top_k_weights (T, K) float32.

    uniform: random logits; skewed: Zipf-like hot experts (low ids, so rank 0 serves most);
    sentinel: uniform with some ids replaced by -1 and E + 5 (a caller's own sentinels)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, generator=gen).to(dtype)
    logits = torch.randn(T, E, device=dev, generator=gen)
    if kind == "skewed":
        logits = logits + 2.0 * -torch.log(torch.arange(1, E + 1, device=dev, dtype=torch.float32))
    w, idx = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
    if kind == "sentinel":
        idx[::2, 0] = -1
        idx[1::3, -1] = E + 5
    return x, idx, (w / w.sum(-1, keepdim=True)).float()


# --------------------------------------------------------------------------- check


CHECKS = [  # name, T per rank, dtype, static, routing kind, compiled
    ("decode", (1, 1), torch.bfloat16, False, "uniform", False),
    ("uneven", (37, 300), torch.bfloat16, False, "uniform", False),
    ("rank_without_tokens", (0, 64), torch.bfloat16, False, "uniform", False),
    ("large_uneven", (2048, 1500), torch.bfloat16, False, "uniform", False),
    ("skewed", (512, 512), torch.bfloat16, False, "skewed", False),
    ("caller_sentinels", (100, 64), torch.bfloat16, False, "sentinel", False),
    ("static", (64, 200), torch.bfloat16, True, "uniform", False),
    ("static_skewed", (256, 0), torch.bfloat16, True, "skewed", False),
    ("fp16", (16, 9), torch.float16, False, "uniform", False),
    ("fp32", (33, 17), torch.float32, False, "sentinel", False),
    ("compiled", (128, 96), torch.bfloat16, False, "uniform", True),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    d = b.norm().item()
    return (a - b).norm().item() / d if d else (a - b).norm().item()


def run_checks(dev, world) -> tuple[bool, list[dict]]:
    full = build_experts(dev)
    static_full = with_static_scales(full)
    eps = {False: ExpertParallel(shard_experts(full, RANK, world), E),
           True: ExpertParallel(shard_experts(static_full, RANK, world), E)}
    compiled = torch.compile(eps[False])
    ok, report = True, []
    for i, (name, tokens, dtype, static, kind, comp) in enumerate(CHECKS):
        ref_mod = static_full if static else full
        calls = [0, 1] if comp else [0]  # compiled: a second call with other T
        rows = []
        for c in calls:
            x, idx, w = make_inputs(tokens[RANK] + 3 * c, kind, 100 * i + 10 * RANK + c, dev, dtype)
            out = (compiled if comp else eps[static])(x, idx, w)
            ref = ref_mod(x, idx, w)
            sync()
            good = (out.shape == ref.shape and out.dtype == ref.dtype
                    and torch.equal(torch.isnan(out), torch.isnan(ref)) and rel_err(out, ref) <= AGREE_BOUND[dtype])
            rows.append(dict(T=x.shape[0], rel_err=rel_err(out, ref), bitwise=torch.equal(out, ref), ok=good))
        everyone = [None] * world
        dist.all_gather_object(everyone, rows)
        for r, rr in enumerate(everyone):
            for row in rr:
                ok &= row["ok"]
                report.append(dict(check=name, rank=r, dtype=str(dtype), **row))
                if RANK == 0:
                    log(f"check {name:20s} rank {r} T={row['T']:5d} {str(dtype):15s} rel_err={row['rel_err']:.2e} "
                        f"bitwise={row['bitwise']} {'ok' if row['ok'] else 'MISMATCH'}")
    del eps, compiled, static_full, full
    if CUDA:
        torch.cuda.empty_cache()
    return ok, report


# --------------------------------------------------------------------------- timing


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn, iters, warmup=3) -> float:
    """Median of per-call times: CUDA events (wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mb(fn) -> float:
    """Peak memory allocated during ``fn`` above what was allocated before, MB (0 on CPU)."""
    if not CUDA:
        fn()
        return 0.0
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def layer_parts(ep: ExpertParallel, x, idx, w, iters):
    """(a2a_ms, overhead_ms, expert_ms, rows served) of one EP layer call on this rank.

    a2a_ms: the transport island alone (three all-to-alls, the host sync, unpacking),
    with the local expert op replaced by an identity (same sizes back); overhead_ms: the
    whole call with that identity (everything but the experts); expert_ms: the local op
    alone on the slots this rank received."""
    rec = {}
    remote, serve = ep._remote_experts, ep._serve

    def recording_remote(*a):
        rec["remote"] = a
        return remote(*a)

    def recording_serve(*a):
        rec["serve"] = a
        return serve(*a)

    ep._remote_experts, ep._serve = recording_remote, recording_serve  # instance attributes shadow
    try:
        ep(x, idx, w)
        ep._serve = lambda xs, ids: xs
        del ep._remote_experts
        a2a_ms = time_ms(lambda: remote(*rec["remote"]), iters)
        overhead_ms = time_ms(lambda: ep(x, idx, w), iters)
    finally:
        ep.__dict__.pop("_serve", None)
        ep.__dict__.pop("_remote_experts", None)
    expert_ms = time_ms(lambda: serve(*rec["serve"]), iters)
    return a2a_ms, overhead_ms, expert_ms, rec["serve"][0].shape[0]


def iters_for(T):
    return 30 if T <= 1024 else 10


def stop_now(budget_s) -> bool:
    """The same decision on every rank (rank 0's clock)."""
    flag = torch.tensor([float(time.monotonic() - START > budget_s)], device="cuda" if CUDA else "cpu")
    dist.broadcast(flag, 0)
    return bool(flag.item())


def run_bench(dev, world, tokens, kinds, budget_s, save):
    """The timings; rank 0 calls ``save(partial result)`` after each configuration, so a
    failure or timeout later keeps what was measured."""
    full = build_experts(dev)
    local = shard_experts(full, RANK, world)
    if RANK != 0:
        del full  # rank 0 keeps it for the one-GPU baseline
    if CUDA:
        torch.cuda.empty_cache()
    ep = ExpertParallel(local, E)
    weight_gb = sum(p.numel() * p.element_size() for p in local.parameters()) / 2**30
    results, skipped = [], []
    for kind in kinds:
        for T in tokens:
            if stop_now(budget_s):
                skipped.append((kind, T))
                continue
            x, idx, w = make_inputs(T, kind, 7 + RANK, dev)
            first = time.monotonic()
            ep(x, idx, w)
            sync()
            first_s = time.monotonic() - first
            ep_ms = time_ms(lambda: ep(x, idx, w), iters_for(T))
            mem = peak_mb(lambda: ep(x, idx, w))
            a2a_ms, overhead_ms, expert_ms, served = layer_parts(ep, x, idx, w, iters_for(T))
            row = dict(routing=kind, T=T, rank=RANK, ep_ms=ep_ms, a2a_ms=a2a_ms, overhead_ms=overhead_ms,
                       expert_ms=expert_ms, rows_served=served, peak_mb=mem, first_call_s=first_s)
            everyone = [None] * world
            dist.all_gather_object(everyone, row)
            if RANK == 0:
                results.append(dict(routing=kind, T=T, per_rank=everyone, ep_ms=max(r["ep_ms"] for r in everyone),
                                    a2a_ms=max(r["a2a_ms"] for r in everyone),
                                    overhead_ms=max(r["overhead_ms"] for r in everyone)))
                log(f"{kind:8s} T={T:6d} ep {results[-1]['ep_ms']:.3f} ms  a2a {results[-1]['a2a_ms']:.3f} ms  "
                    f"expert ms {[round(r['expert_ms'], 3) for r in everyone]}  "
                    f"slots {[r['rows_served'] for r in everyone]}  first call {first_s:.1f} s")
                save((results, skipped, weight_gb, None))
    del ep, local
    if CUDA:
        torch.cuda.empty_cache()
    dist.barrier()
    if RANK == 0:  # one GPU holding all 256 experts, rank 0's T tokens
        full_weight_gb = sum(p.numel() * p.element_size() for p in full.parameters()) / 2**30
        for row in results:
            x, idx, w = make_inputs(row["T"], row["routing"], 7, dev)
            row["one_gpu_ms"] = time_ms(lambda: full(x, idx, w), iters_for(row["T"]))
            row["one_gpu_peak_mb"] = peak_mb(lambda: full(x, idx, w))
            row["x_time"] = row["ep_ms"] / row["one_gpu_ms"]
            row["x_tput"] = 2 / row["x_time"]
            log(f"{row['routing']:8s} T={row['T']:6d} one GPU {row['one_gpu_ms']:.3f} ms  x_time {row['x_time']:.3f}")
            save((results, skipped, weight_gb, full_weight_gb))
        del full
    dist.barrier()
    return (results, skipped, weight_gb, full_weight_gb) if RANK == 0 else None


def _fmt(row, key, spec):
    return "—" if key not in row else format(row[key], spec)


def write(out_dir, meta, checks_ok, bench):
    os.makedirs(out_dir, exist_ok=True)
    results, skipped, weight_gb, full_gb = bench if bench else ([], [], None, None)
    with open(os.path.join(out_dir, "bench_parallel.json"), "w") as f:
        json.dump(dict(meta=meta, checks_ok=checks_ok, weights_gb_per_gpu=weight_gb, weights_gb_one_gpu=full_gb,
                       skipped=skipped, results=results), f, indent=1)
    lines = [f"Command: `{meta['command']}`  ({meta['date']}, {meta['device']})", "",
             f"Equality check: {'not run' if checks_ok is None else 'passed' if checks_ok else 'FAILED'}", ""]
    if results:
        full = "not measured yet" if full_gb is None else f"{full_gb:.2f} GiB"
        lines += [f"Weights per GPU: {weight_gb:.2f} GiB (2 GPUs) vs {full} (one GPU).", "",
                  "| routing | T per GPU | 2 GPUs ms | a2a ms | a2a share | all but experts ms | expert ms r0 / r1 "
                  "| slots served r0 / r1 | 1 GPU ms (T) | x time | x throughput | peak MB r0 / r1 | 1 GPU peak MB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            pr = r["per_rank"]
            expert = " / ".join("%.3f" % p["expert_ms"] for p in pr)
            served = " / ".join(str(p["rows_served"]) for p in pr)
            peaks = " / ".join("%.0f" % p["peak_mb"] for p in pr)
            lines.append(
                f"| {r['routing']} | {r['T']} | {r['ep_ms']:.3f} | {r['a2a_ms']:.3f} | {r['a2a_ms'] / r['ep_ms']:.0%} "
                f"| {r['overhead_ms']:.3f} | {expert} | {served} | {_fmt(r, 'one_gpu_ms', '.3f')} "
                f"| {_fmt(r, 'x_time', '.2f')} | {_fmt(r, 'x_tput', '.2f')} | {peaks} | {_fmt(r, 'one_gpu_peak_mb', '.0f')} |")
    if skipped:
        lines += ["", f"Skipped (time budget): {skipped}"]
    with open(os.path.join(out_dir, "bench_parallel.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    global RANK, E, H, I, K, CHUNK, CUDA
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--tokens", default="1,64,1024,8192,16384", help="tokens per GPU, comma separated")
    p.add_argument("--routings", default="uniform,skewed")
    p.add_argument("--check", action="store_true", help="run the equality checks first")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no timing configuration after this")
    p.add_argument("--dims", default=f"{E},{H},{I},{K}", help="E,H,I,top_k (default deepseek_v3)")
    args = p.parse_args()
    E, H, I, K = (int(v) for v in args.dims.split(","))
    CHUNK = min(CHUNK, E)
    CUDA = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=300)
    if CUDA:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    RANK, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        log(f"warning: expected 2 ranks, got {world}")
    meta = dict(command="torchrun --nproc-per-node 2 bench/bench_parallel.py " + " ".join(sys.argv[1:]),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), world=world,
                device=torch.cuda.get_device_name(dev) if CUDA else "cpu", torch=torch.__version__,
                env={k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                "NVSHMEM_DISABLE_NVLS")})
    checks_ok = None
    if args.check:
        checks_ok, meta["checks"] = run_checks(dev, world)
        log(f"equality checks {'passed' if checks_ok else 'FAILED'}")
        if RANK == 0:
            write(args.out_dir, meta, checks_ok, None)
    bench = None
    if not args.no_bench:
        bench = run_bench(dev, world, [int(t) for t in args.tokens.split(",")], args.routings.split(","),
                          args.budget_s, lambda partial: write(args.out_dir, meta, checks_ok, partial))
    if RANK == 0:
        write(args.out_dir, meta, checks_ok, bench)
        log(f"wrote {args.out_dir}/bench_parallel.json and .md")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if checks_ok in (None, True) else 1


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:  # argparse's --help and usage errors: its own exit code, no traceback
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no collective teardown that could wait on a failed peer
    sys.exit(code)
