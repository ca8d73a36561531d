import hashlib, json, sys
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch
import fp8_moe_ops
from fp8_moe_ops.kernels import config
from common import make_weights, MODELS
from gemm_ceiling import gemm_kernel_ms
g = int(sys.argv[1])
tab = config._table()
for entries in [tab["default"], *tab["shapes"].values()]:
    for en in entries:
        if en["max_rows"] is None or en["max_rows"] >= 256:
            en["GROUP_M"] = g
gen = torch.Generator(device="cuda").manual_seed(0)
res = {"GROUP_M": g}
for name, T, proj in [("deepseek_v3", 8192, "down"), ("deepseek_v3", 8192, "gate_up"), ("qwen3_30b_a3b", 16384, "down"), ("qwen3_30b_a3b", 16384, "gate_up"), ("mixtral_8x7b", 16384, "gate_up"), ("mixtral_8x7b", 16384, "down")]:
    m = MODELS[name]
    N, K = (m.H, m.I) if proj == "down" else (2 * m.I, m.H)
    M = T * m.top_k; rows = M // m.E
    w, ws = make_weights(m.E, N, K, gen)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    offsets = torch.arange(1, m.E + 1, device="cuda", dtype=torch.int32) * rows
    fn = lambda: torch.ops.fp8_moe.grouped_mm(x, w, ws, offsets, [128, 128])
    out = fn()
    ms = gemm_kernel_ms(fn, calls=20)
    res[f"{name}:{proj}"] = (round(2 * M * N * K / ms / 1e9), hashlib.md5(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:8])
    del w, ws, x, out; torch.cuda.empty_cache()
print(json.dumps(res), flush=True)
