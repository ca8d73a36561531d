"""One tree's run: per case (model, T, scheme) and ACT_SLOTS in (16, 64): graph µs (3
interleaved rounds) and the output, saved for a cross-tree bitwise check (the driver as it
ran in the twelfth session, beside act_per_tile_ab.sh, which ran it on a copy of main before
the change and on the change, twice, then compared the saved outputs).
usage: PYTHONPATH=TREE:TREE/bench python act_per_tile_ab.py TAG OUTFILE"""
import json, statistics, sys
import torch
import fp8_moe_ops  # noqa
from common import BLOCK, each_scheme_case, graph_ms, parse_sweep
from fp8_moe_ops.kernels import experts as kx

tag, outfile = sys.argv[1], sys.argv[2]
CASES = "deepseek_v3:1,2,8;qwen3_30b_a3b:1,2,8;mixtral_8x7b:1,2,8,32"
gen = torch.Generator(device="cuda").manual_seed(5)
res, outs = [], {}
shipped = kx.ACT_SLOTS

def run(name, T, w, inputs, scheme, scales):
    fn = lambda: kx.grouped_experts(*inputs, *w, BLOCK, "silu", *scales)
    row = {"model": name, "T": T, "scheme": scheme}
    times = {16: [], 64: []}
    for t in (16, 64):
        kx.ACT_SLOTS = t
        o = fn().clone()
        outs[f"{name}:{T}:{scheme}:{t}"] = o.cpu()
    for _ in range(3):
        for t in (16, 64):
            kx.ACT_SLOTS = t
            times[t].append(graph_ms(fn, rep_ms=100) * 1e3)
    kx.ACT_SLOTS = shipped
    for t in (16, 64):
        row[f"us_{t}"] = statistics.median(times[t]); row[f"all_{t}"] = times[t]
    row["eq_16_64"] = torch.equal(outs[f"{name}:{T}:{scheme}:16"].view(torch.int16), outs[f"{name}:{T}:{scheme}:64"].view(torch.int16))
    print(tag, row, flush=True)
    res.append(row)

each_scheme_case(parse_sweep(CASES), gen, run)
torch.save(outs, f"/tmp/outs_{tag}.pt")
json.dump(res, open(outfile, "w"), indent=1)
