"""bench/ws_gemm_ab.py with one more way, ``before``: the layer as shipped, with the Gluon
kernel taken from another copy of ``fp8_moe_ops/kernels/gluon_gemm.py`` (the file named
by ``GLUON_BEFORE``), one written before ``A_PARTS`` (its A tiles loaded whole, every
consumer warpgroup multiplying).  Kept as it ran for docs/benchmarks.md (the section on
tiles whose rows end in their first half, tried and not kept): it runs on 5bc7b16 with
``half_tiles.patch`` (beside this file) applied, which adds ``A_PARTS`` and the
``ws_a_whole`` way:

    git show 5bc7b16:fp8_moe_ops/kernels/gluon_gemm.py > /tmp/gluon_before.py
    git apply docs/benchmarks/half_tiles.patch
    GLUON_BEFORE=/tmp/gluon_before.py PYTHONPATH=.:bench python docs/benchmarks/half_tiles_ab.py \
        --out-dir OUT --ways before,ws_a_whole,shipped \
        --cases "deepseek_v3:8192,16384;qwen3_30b_a3b:16384;mixtral_8x7b:4096"
"""
import contextlib, importlib.util, os, sys
import ws_gemm_ab as ab
from fp8_moe_ops.kernels import ws_gemm
spec = importlib.util.spec_from_file_location("gluon_before", os.environ["GLUON_BEFORE"])
before = importlib.util.module_from_spec(spec); spec.loader.exec_module(before)
real_way, real_kernel, real_call, real_parts = ab._way, ws_gemm._ws_gemm_kernel, ws_gemm.ws_gemm_call, ws_gemm.A_PARTS


def call_before(*a, **kw):  # whole A tiles, and no A_PARTS for a kernel without it
    call = real_call(*a, **kw)
    return call._replace(constexprs={k: v for k, v in call.constexprs.items() if k != "A_PARTS"})


@contextlib.contextmanager
def way(w):
    if w == "before":
        with real_way("shipped"):
            ws_gemm._ws_gemm_kernel, ws_gemm.ws_gemm_call, ws_gemm.A_PARTS = before._ws_gemm_kernel, call_before, 1
            try:
                yield
            finally:
                ws_gemm._ws_gemm_kernel, ws_gemm.ws_gemm_call, ws_gemm.A_PARTS = real_kernel, real_call, real_parts
    else:
        with real_way(w):
            yield


ab._way = way
sys.exit(ab.main())
