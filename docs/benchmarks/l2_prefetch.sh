#!/bin/bash
# The L2-prefetch experiment of the fifty-sixth session (docs/benchmarks.md, "Decode weights
# asked of the L2 a launch ahead ..."): one bench/profile_layer.py process per way, main
# first and last.  Run from a checkout of c58ae15 with docs/benchmarks/l2_prefetch.patch
# applied, with OUT set, on a GPU.
set -u
export PYTHONPATH=.:bench
C="qwen3_30b_a3b:1,2;deepseek_v3:1"
prof() { # name, the sort's prefetch lines per program (0: none), then profile_layer's options
  local w=$1 lines=$2; shift 2
  python -c "import sys, runpy; from fp8_moe_ops.kernels import experts; experts.SORT_PREFETCH_LINES = $lines; sys.argv = ['profile_layer.py', *sys.argv[1:]]; runpy.run_path('bench/profile_layer.py', run_name='__main__')" \
    --out-dir "$OUT" --name "prof_$w" --cases "$C" "$@"
}
prof base 0
prof g2 0 --table l2_prefetch=2
prof s2048g2 2048 --table l2_prefetch=2
prof g1 0 --table l2_prefetch=1
prof s2048 2048
prof s4096g2 4096 --table l2_prefetch=2
prof base2 0
