#!/bin/bash
# PDL + L2 prefetch of the down GEMM's weights at decode: correctness then profile variants.
# As it ran on the H200, from a checkout of 57a117d with docs/benchmarks/pdl_prefetch.patch
# applied (git apply), OUT set to an empty folder.
cd "$(dirname "$0")/../.."
export PYTHONPATH=.:bench
start=$(date +%s)
python - <<'PY'
import json
p = "fp8_moe_ops/kernels/configs/h200.json"
t = json.load(open(p))
for entries in [t["default"], *t["shapes"].values()]:
    for e in entries:
        if e["max_rows"] == 8:
            e.update(pdl=1, prefetch=8)
json.dump(t, open(p, "w"), indent=1)
PY
timeout 200 python -m pytest -q -m gpu -x tests/test_gpu_kernels.py tests/test_gpu.py tests/test_gpu_modlist.py \
  -k "experts_match or fused_launches or graph_replay or launch_plan or deterministic or list_op_equals or capture_after" \
  > $OUT/tests_pdl.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; tail -3 $OUT/tests_pdl.log
git checkout fp8_moe_ops/kernels/configs/h200.json
CASES="deepseek_v3:1,8;qwen3_30b_a3b:1,2,8;mixtral_8x7b:1,8"
for v in "base:" "pdl:pdl=1,prefetch=0" "pf8:pdl=1,prefetch=8" "pf16:pdl=1,prefetch=16" "pf4:pdl=1,prefetch=4" "base2:"; do
  name=${v%%:*}; tab=${v#*:}
  now=$(date +%s); if (( now - start > 530 )); then echo "skip $name (time)"; continue; fi
  if [ -z "$tab" ]; then
    timeout 120 python bench/profile_layer.py --out-dir $OUT --cases "$CASES" --name pdl_$name > $OUT/pdl_$name.log 2>&1
  else
    timeout 120 python bench/profile_layer.py --out-dir $OUT --cases "$CASES" --table "$tab" --name pdl_$name > $OUT/pdl_$name.log 2>&1
  fi
  echo "$name rc=$? $(( $(date +%s) - now )) s"
done
python - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/pdl_*.json")):
    d = json.load(open(f))
    for r in d["results"]:
        c, m = r["config"], r["metrics"] or {}
        print(os.path.basename(f)[4:-5], c["model"][:8], c["tokens"], c["variant"][:3], round(m.get("graph_us", 0), 1),
              [round(v, 1) for k, v in m.get("kernels_us", [])], r.get("error"))
PY
