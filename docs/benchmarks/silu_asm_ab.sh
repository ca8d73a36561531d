#!/bin/bash
# BASE: a checkout of 13ee141 (fp8_moe_ops and bench); run from the repository root with OUT set
# silu in five instructions; kernel alone, layers A/B, GPU tests
export PYTHONPATH=.:bench
timeout 150 python docs/benchmarks/silu_asm_ab.py > $OUT/act_ab.log 2>&1; echo "act_ab rc=$?"; cat $OUT/act_ab.log | cut -c1-600
C="deepseek_v3:8192;qwen3_30b_a3b:16384;mixtral_8x7b:16384"
for i in 1 2; do
  (cd "$BASE" && PYTHONPATH=.:bench timeout 100 python bench/profile_layer.py --out-dir $OUT --cases "$C" --name base_$i > $OUT/base_$i.log 2>&1); echo "base_$i rc=$?"
  timeout 100 python bench/profile_layer.py --out-dir $OUT --cases "$C" --layers 1 --name new_$i > $OUT/new_$i.log 2>&1; echo "new_$i rc=$?"
done
python - <<'PY'
import json, os
O = os.environ["OUT"]
for n in ("base_1", "new_1", "base_2", "new_2"):
    try:
        d = json.load(open(f"{O}/{n}.json"))
    except Exception as e:
        print(n, e); continue
    for r in d["results"]:
        c, m = r["config"], r["metrics"] or {}
        act = [round(t) for k, t in m.get("kernels_us", []) if "gated_act" in k]
        print(n, c["model"], c["tokens"], c["variant"], "graph", round(m.get("graph_us", 0)), "act", act)
PY
timeout 300 python -m pytest -q -x tests/test_gpu_kernels.py -k "experts_match or fused_launches or graph_replay or launch_plan" > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -5 $OUT/tests.log
