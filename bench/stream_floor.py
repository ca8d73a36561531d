"""How fast one kernel can read bytes it has not seen before: the practical floor of a
decode GEMM that streams its weights once.

    PYTHONPATH=. python bench/stream_floor.py --out-dir OUT [--mb 12.6,25.2,117.4,234.9] [--layers 6]

A Triton kernel reads a buffer of each size once (int32 loads of ``BLOCK`` elements, a
sum per program: the bytes cross HBM once and nothing else is written) over a sweep of
launch shapes (programs per SM, ``BLOCK``, warps); each shape is timed as a CUDA graph of
``--layers`` launches, each on its own buffer (so none finds its bytes in L2), per
launch, and the fastest shape per size is the floor.  The defaults are the bytes a T=1
layer's GEMMs read with 128 x 128 blocks: qwen3_30b_a3b's down (12.6 MB) and gate_up
(25.2 MB) weights of 8 experts, deepseek_v3's down (117.4 MB) and gate_up (234.9 MB).
Writes ``OUT/stream_floor.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from common import ExperimentConfig, Runner, graph_ms, log, results_table

SHAPES = [(per_sm, block, warps) for per_sm in (1, 2, 4, 8) for block in (1024, 4096) for warps in (4, 8)]
# (programs per SM, BLOCK, warps): within 0.1 µs of the fastest of SHAPES at 12.6-50 MB on an H100
FAST = (8, 1024, 8)


@triton.jit
def chunk_sum(x_ptr, n, chunk_id, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The sum of chunk ``chunk_id`` (CHUNK int32s, BLOCK a load) of x's n."""
    base = chunk_id.to(tl.int64) * CHUNK
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = base + off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0)
    return tl.sum(acc, 0)


@triton.jit
def read_kernel(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0), chunk_sum(x_ptr, n, tl.program_id(0), CHUNK, BLOCK))


def read_shape(n: int, programs: int, block: int) -> tuple[int, int]:
    """(CHUNK, programs) of :func:`read_kernel` over n int32s: chunks of whole blocks,
    about ``programs`` of them."""
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    return chunk, triton.cdiv(n, chunk)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--mb", default="12.6,25.2,117.4,234.9", help="buffer sizes, MB (1e6 bytes)")
    p.add_argument("--layers", type=int, default=6, help="buffers: the launches of each graph")
    args = p.parse_args()
    runner = Runner("stream_floor", args.out_dir)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for mb in (float(m) for m in args.mb.split(",")):
        n = int(mb * 1e6) // 4
        bufs = [torch.randint(0, 7, (n,), dtype=torch.int32, device="cuda", generator=gen) for _ in range(args.layers)]
        for per_sm, block, warps in SHAPES:
            chunk, programs = read_shape(n, per_sm * sms, block)
            grid = (programs,)
            out = torch.empty(grid[0], dtype=torch.int32, device="cuda")

            def reads():
                for b in bufs:
                    read_kernel[grid](b, out, n, CHUNK=chunk, BLOCK=block, num_warps=warps)

            def measure():
                per_launch = graph_ms(reads) * 1e3 / len(bufs)
                return {"us": per_launch, "tb_per_s": n * 4 / per_launch / 1e6, "programs": grid[0]}

            runner.run(ExperimentConfig("stream_floor", f"{mb:g} MB", 0, f"{per_sm}/SM",
                                        params=(("block", block), ("warps", warps))), measure)
        bufs.clear()
        torch.cuda.empty_cache()
    best = {}
    for r in runner.results:
        if r.ok and (r.config.model not in best or r.metrics["us"] < best[r.config.model].metrics["us"]):
            best[r.config.model] = r
    md = results_table(runner.results, [("size", "model", ""), ("programs per SM", "variant", ""),
                                        ("BLOCK", "block", ""), ("warps", "warps", ""), ("µs", "us", ".1f"),
                                        ("TB/s", "tb_per_s", ".2f")])
    md += "\n\nFastest per size:\n\n" + results_table(list(best.values()), [
        ("size", "model", ""), ("programs per SM", "variant", ""), ("BLOCK", "block", ""), ("warps", "warps", ""),
        ("µs", "us", ".1f"), ("TB/s", "tb_per_s", ".2f")])
    runner.save(md)
    log(md)
    return runner.exit_code()


if __name__ == "__main__":
    sys.exit(main())
