# run from a checkout of 1a90d35 (the change, "after"); "before" is main at 33cb576

set -x
rm -rf .gpurun/before && mkdir -p .gpurun/before && git archive 33cb576 | tar -x -C .gpurun/before
nvidia-smi --query-gpu=name,clocks.sm --format=csv
for i in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then R=.gpurun/before; else R=.; fi
    PYTHONPATH=$R:$R/bench timeout 200 python docs/benchmarks/act_per_tile_ab.py ${tree}_$i /tmp/ab_${tree}_$i.json 2>&1 | tail -3
  done
done
python - <<'PY'
import json, torch, glob, os
out = {}
for f in sorted(glob.glob("/tmp/ab_*.json")):
    out[os.path.basename(f)[3:-5]] = json.load(open(f))
eq = {}
for i in (1, 2):
    try:
        a, b = torch.load(f"/tmp/outs_before_{i}.pt"), torch.load(f"/tmp/outs_after_{i}.pt")
        eq[i] = {k: torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a}
    except Exception as e:
        eq[i] = repr(e)
out["before_vs_after_bitwise"] = eq
json.dump(out, open(os.environ["OUT"] + "/ab.json", "w"), indent=1)
PY
