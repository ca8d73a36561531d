"""bench/ws_gemm_ab.py with one more way, ``before``: the layer as shipped, with the Gluon
kernel taken from another copy of ``fp8_moe_ops/kernels/gluon_gemm.py`` (the file named
by ``GLUON_BEFORE``).  Kept as it ran for docs/benchmarks.md (the tile map section):

    git show 1b2bbb3:fp8_moe_ops/kernels/gluon_gemm.py > /tmp/gluon_before.py
    GLUON_BEFORE=/tmp/gluon_before.py PYTHONPATH=.:bench python docs/benchmarks/tile_map_ab.py \
        --out-dir OUT --ways before,shipped --cases "qwen3_30b_a3b:16384;deepseek_v3:8192;mixtral_8x7b:4096"
"""
import contextlib, importlib.util, os, sys
import ws_gemm_ab as ab
from fp8_moe_ops.kernels import ws_gemm
spec = importlib.util.spec_from_file_location("gluon_before", os.environ["GLUON_BEFORE"])
before = importlib.util.module_from_spec(spec); spec.loader.exec_module(before)
real_way = ab._way
real_kernel = ws_gemm._ws_gemm_kernel

@contextlib.contextmanager
def way(w):
    if w == "before":
        with real_way("shipped"):
            ws_gemm._ws_gemm_kernel = before._ws_gemm_kernel
            try:
                yield
            finally:
                ws_gemm._ws_gemm_kernel = real_kernel
    else:
        with real_way(w):
            yield

ab._way = way
sys.exit(ab.main())
