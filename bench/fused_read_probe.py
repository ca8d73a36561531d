"""Two dependent reads in one launch against two launches: what one launch for both
decode GEMMs could save, with the down GEMM's programs waiting for the gate_up GEMM's.

    PYTHONPATH=. python bench/fused_read_probe.py --out-dir OUT [--pairs "25.2+12.6,234.9+117.4"] [--layers 6]

Each pair (MB of a first and a second buffer: a T=1 layer's gate_up and down weights) is
read, in a CUDA graph of ``--layers`` pairs on their own buffers (cold), four ways:

- ``two launches``: the first buffer by one launch, then the second by another (what the
  forward does today, without the GEMMs' work);
- ``one launch, no wait``: one launch reads both, its programs taking a role from an atomic
  ticket (the first ``A`` tickets read the first buffer, the rest the second): the bound;
- ``one launch, wait after``: as that, but each second-buffer program, after it has read its
  chunk (a down GEMM program holding its weights), waits until every first-buffer program has
  counted itself done (release / acquire) before it stores its result;
- ``one launch, wait before``: the second-buffer programs wait before they read.

Tickets in launch order keep a waiting program from holding a slot that a first-buffer
program needs: every first-buffer ticket is taken by a running program.  Each launch of
the one-launch ways follows a memset of its ticket and counter (as the sort zeroes the
forward's counters), and every way's figure is less a graph of those memsets alone: µs
per pair.  Every way checks its sums against torch's.  Writes ``OUT/fused_read_probe.json``
/ ``.md``; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from common import ExperimentConfig, Runner, graph_ms, log, results_table
from stream_floor import FAST, chunk_sum, read_kernel, read_shape

WAYS = ("two launches", "one launch, no wait", "one launch, wait after", "one launch, wait before")
PER_SM, BLOCK, WARPS = FAST


@triton.jit
def _pair_kernel(a_ptr, na, b_ptr, nb, out_ptr, sync_ptr, A_PROGRAMS,
                 CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    # sync_ptr: [ticket, first-buffer programs done]; WAIT 0: none, 1: after the read, 2: before
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    if t < A_PROGRAMS:
        tl.store(out_ptr + t, chunk_sum(a_ptr, na, t, CHUNK_A, BLOCK))
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        if WAIT == 2:
            while tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu") < A_PROGRAMS:
                pass
        s = chunk_sum(b_ptr, nb, t - A_PROGRAMS, CHUNK_B, BLOCK)
        if WAIT == 1:
            while tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu") < A_PROGRAMS:
                pass
        tl.store(out_ptr + t, s)


def chunk_sums(x: torch.Tensor, chunk: int, programs: int) -> torch.Tensor:
    padded = torch.zeros(chunk * programs, dtype=x.dtype, device=x.device)
    padded[:x.numel()] = x
    return padded.view(programs, chunk).sum(1).to(torch.int32)


def pair_calls(a: torch.Tensor, b: torch.Tensor, way: str, sms: int):
    """(the way's launches for one pair as a function, the sums it writes, the sync words
    or None, the expected sums)."""
    (ca, pa), (cb, pb) = (read_shape(x.numel(), PER_SM * sms, BLOCK) for x in (a, b))
    out = torch.empty(pa + pb, dtype=torch.int32, device=a.device)
    expected = torch.cat([chunk_sums(a, ca, pa), chunk_sums(b, cb, pb)])
    if way == "two launches":
        def run():
            read_kernel[(pa,)](a, out, a.numel(), CHUNK=ca, BLOCK=BLOCK, num_warps=WARPS)
            read_kernel[(pb,)](b, out[pa:], b.numel(), CHUNK=cb, BLOCK=BLOCK, num_warps=WARPS)
        return run, out, None, expected
    sync = torch.zeros(2, dtype=torch.int32, device=a.device)
    wait = WAYS.index(way) - 1

    def run():
        sync.zero_()
        _pair_kernel[(pa + pb,)](a, a.numel(), b, b.numel(), out, sync, pa, CHUNK_A=ca, CHUNK_B=cb, BLOCK=BLOCK,
                                 WAIT=wait, num_warps=WARPS)
    return run, out, sync, expected


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--pairs", default="25.2+12.6,234.9+117.4", help="MB+MB,...")
    p.add_argument("--layers", type=int, default=6, help="pairs of buffers: the pairs of each graph")
    args = p.parse_args()
    runner = Runner("fused_read_probe", args.out_dir)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for pair in args.pairs.split(","):
        sizes = [int(float(mb) * 1e6) // 4 for mb in pair.split("+")]
        bufs = [[torch.randint(0, 7, (n,), dtype=torch.int32, device="cuda", generator=gen) for n in sizes]
                for _ in range(args.layers)]
        for way in WAYS:
            def measure(way=way):
                layers = [pair_calls(a, b, way, sms) for a, b in bufs]
                for run, out, _, expected in layers:
                    run()
                    if not torch.equal(out, expected):
                        raise RuntimeError(f"{way}: the sums differ from torch's")
                syncs = [s for _, _, s, _ in layers if s is not None]
                memsets = graph_ms(lambda: [s.zero_() for s in syncs]) if syncs else 0.0
                per_pair = (graph_ms(lambda: [run() for run, *_ in layers]) - memsets) * 1e3 / len(layers)
                return {"us": per_pair, "tb_per_s": sum(sizes) * 4 / per_pair / 1e6}

            runner.run(ExperimentConfig("fused_read_probe", f"{pair} MB", 0, way), measure)
        bufs.clear()
        torch.cuda.empty_cache()
    md = results_table(runner.results, [("MB", "model", ""), ("way", "variant", ""), ("µs per pair", "us", ".1f"),
                                        ("TB/s", "tb_per_s", ".2f")])
    runner.save(md)
    log(md)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
