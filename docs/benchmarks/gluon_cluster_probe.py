"""What Triton 3.7's Gluon lowers for a cluster of two CTAs on sm_90a (no GPU needed).

    python docs/benchmarks/gluon_cluster_probe.py      # with triton 3.7.x installed

Compiles, for ``GPUTarget("cuda", 90, 32)`` with ``num_ctas=2``:
1. a K loop whose 128 x 128 A tile is replicated over the cluster (``cga_layout``
   ``[[0, 0]]``) and loaded with ``multicast=True``, and whose 256 x 128 weight tile is
   split between the two CTAs (``[[1, 0]]``), each CTA's MMA on its own 128 columns:
   prints the PTX's multicast TMA and cluster lines and ptxas' register count;
2. an mbarrier ring split over the CTAs (``MBarrierLayout`` ``[[1]]``) and one
   replicated over them (``[[0]]``), each arrived on once: prints their arrive lines
   (``shared::cta`` for both: a CTA arrives on its own barrier only; the replicated one's
   wait is made by CTA 0 alone, behind ``%cluster_ctarank``).
"""

import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import cluster, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

TARGET = GPUTarget("cuda", 90, 32)
# layouts made outside the kernel: a cga_layout written inside it becomes a tuple of
# Triton values, and comparing two such layouts then fails ("'list' object has no attribute 'type'")
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32],
                                             cga_layout=[[0, 1]]))
OUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0], cga_layout=[[0, 1]]))
A_LAYOUT = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv, cga_layout=[[0, 0]])
W_LAYOUT = gl.NVMMASharedLayout.get_default_for([256, 128], gl.float8e4nv, cga_layout=[[1, 0]])


@gluon.jit
def _multicast_gemm(a_desc, w_desc, out_ptr, N, KT, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]  # the cluster's columns, half per CTA
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    mbarrier.sync_cluster_init()
    row0 = gl.program_id(0) * BM
    acc = gl.zeros((BM, BN), gl.float32, MMA)
    for i in range(KT):
        s = i % STAGES
        # each CTA's barrier: the whole A tile (multicast) and its half of the weight tile
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes // 2)
        tma.async_copy_global_to_shared(a_desc, [row0, i * BK], ready.index(s), a_smem.index(s), multicast=True)
        tma.async_copy_global_to_shared(w_desc, [0, i * BK], ready.index(s), w_smem.index(s))
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        t = warpgroup_mma(a_smem.index(s), w_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
        # no arrive reaches the other CTA's barriers: the whole cluster syncs before a slot is reused
        cluster.arrive()
        cluster.wait()
    v = gl.convert_layout(acc, OUT)
    r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, OUT))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, OUT))
    gl.store(out_ptr + gl.expand_dims(r, 1) * N + gl.expand_dims(c, 0), v)


SPLIT = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[1]]))
REPLICATED = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[0]]))


@gluon.jit
def _arrive(x, LAYOUT: gl.constexpr, W: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [2, W], LAYOUT)
    for j in gl.static_range(2):
        mbarrier.init(bar.index(j), count=2)
    mbarrier.sync_cluster_init()
    mbarrier.arrive(bar.index(x % 2), count=1)
    mbarrier.wait(bar.index(x % 2), 0)


def _lines(ptx: str, words) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if any(w in line for w in words) and not line.strip().startswith(".loc")]


def main() -> None:
    print("triton", triton.__version__)
    sig = {"a_desc": f"tensordesc<fp8e4nv[128, 128],{A_LAYOUT!r}>", "w_desc": f"tensordesc<fp8e4nv[256, 128],{W_LAYOUT!r}>",
           "out_ptr": "*fp32", "N": "i32", "KT": "i32", "STAGES": "constexpr"}
    gemm = triton.compile(GluonASTSource(_multicast_gemm, sig, {"STAGES": 3}, {}), target=TARGET,
                          options=dict(num_warps=4, num_ctas=2))
    ptx = gemm.asm["ptx"]
    print("1. multicast GEMM:", *_lines(ptx, ("multicast::cluster", "barrier.cluster", "fence.mbarrier_init", "ctarank", "reqnctapercluster")), sep="\n   ")
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        report = subprocess.run([triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o",
                                 f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stderr
    print("  ", [line for line in report.splitlines() if "registers" in line][0].strip())
    for name, layout in (("split [[1]]", SPLIT), ("replicated [[0]]", REPLICATED)):
        k = triton.compile(GluonASTSource(_arrive, {"x": "i32", "LAYOUT": "constexpr", "W": "constexpr"},
                                          {"LAYOUT": layout, "W": 2 if name.startswith("split") else 1}, {}),
                           target=TARGET, options=dict(num_warps=4, num_ctas=2))
        print(f"2. mbarrier {name}:", *_lines(k.asm["ptx"], ("mbarrier.arrive", "mapa", "ctarank")), sep="\n   ")


if __name__ == "__main__":
    main()
