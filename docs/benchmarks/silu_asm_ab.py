"""Gated activation kernel: BASE (a checkout of 13ee141; env) (IEEE division in silu) against the working tree's, alone,
at the prefill layers' shapes; outputs compared with each other and with torch's reference."""
import importlib.util, json, os, sys, statistics
import torch, triton
sys.path.insert(0, ".")
from fp8_moe_ops.kernels import activation as new_mod
from fp8_moe_ops.kernels.quant import quant_launch_shape
from fp8_moe_ops import reference

spec = importlib.util.spec_from_file_location("fp8_moe_ops.kernels.activation_base", os.environ["BASE"] + "/fp8_moe_ops/kernels/activation.py")
old_mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(old_mod)

def run(mod, h, I, E, offsets, static, act_scale):
    S = h.shape[0]
    q = torch.empty(S, I, dtype=torch.float8_e4m3fn, device="cuda")
    s = act_scale if static else torch.empty(S, I // 128, dtype=torch.float32, device="cuda")
    grid, br, bg = quant_launch_shape(S, I, 128)
    def call():
        mod._gated_act_quant_kernel[grid](h, h.stride(0), q, s, offsets, s, S, I, E, 0.0, ACT=0, HAS_LIMIT=False,
                                          STATIC=static, GROUP=128, BLOCK_R=br, BLOCK_G=bg,
                                          SEARCH_STEPS=E.bit_length(), enable_fp_fusion=False)
    return call, q, s

gen = torch.Generator(device="cuda").manual_seed(0)
res = []
for name, S, I, E in [("deepseek_v3 T=8192", 65536, 2048, 256), ("qwen3_30b_a3b T=16384", 131072, 768, 128),
                      ("mixtral_8x7b T=16384", 32768, 14336, 8)]:
    h = (torch.randn(S, 2 * I, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    counts = torch.full((E,), S // E, dtype=torch.int64, device="cuda")
    offsets = counts.cumsum(0).to(torch.int32)
    for static in (False, True):
        act_scale = torch.rand(E, device="cuda", generator=gen) * 0.05 + 0.01 if static else None
        calls = {}
        outs = {}
        for way, mod in (("base", old_mod), ("new", new_mod)):
            call, q, s = run(mod, h, I, E, offsets, static, act_scale)
            call(); torch.cuda.synchronize()
            calls[way] = call; outs[way] = (q.clone(), s.clone())
        times = {w: [] for w in calls}
        for _ in range(3):
            for w, c in calls.items():
                times[w].append(triton.testing.do_bench(c, warmup=25, rep=100, return_mode="median") * 1e3)
        # reference on the GPU (torch's silu): a = act(gate) * up rounded to bf16, quantised
        a = reference.gated_activation(h, "silu")
        if static:
            sc = act_scale[torch.repeat_interleave(torch.arange(E, device="cuda"), S // E)][:, None]
            rq = (a.float() / sc).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            rq, rs = reference.quantize_act_dynamic(a, 128)
        eq = lambda x, y: (x.view(torch.uint8) == y.view(torch.uint8)).float().mean().item()
        row = {"case": name, "static": static, "base_us": statistics.median(times["base"]),
               "new_us": statistics.median(times["new"]),
               "bytes_floor_us": (S * 2 * I * 2 + S * I) / 4.22e12 * 1e6,
               "q_equal_new_base": eq(outs["new"][0], outs["base"][0]),
               "q_equal_base_ref": eq(outs["base"][0], rq), "q_equal_new_ref": eq(outs["new"][0], rq)}
        if not static:
            row["s_equal_new_base"] = (outs["new"][1] == outs["base"][1]).float().mean().item()
        print(row, flush=True)
        res.append(row)
# extreme gate values: new against base, bytes and scales
vals = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30, 80.0, -80.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0,
                     1e4, -1e4, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 0.5, -0.5, 3.0], device="cuda")
n = vals.numel()
h = torch.ones(n * 16, 2 * 128, device="cuda")
h[:, :128] = vals.repeat_interleave(16)[:, None] * torch.linspace(0.5, 2, 128, device="cuda")[None, :]
h = h.to(torch.bfloat16)
offsets = torch.tensor([h.shape[0]], dtype=torch.int32, device="cuda")
ext = {}
for way, mod in (("base", old_mod), ("new", new_mod)):
    call, q, s = run(mod, h, 128, 1, offsets, False, None)
    call(); torch.cuda.synchronize()
    ext[way] = (q.view(torch.uint8).clone(), s.clone())
qe = ext["new"][0] == ext["base"][0]
se = (ext["new"][1] == ext["base"][1]) | (ext["new"][1].isnan() & ext["base"][1].isnan())
print("extremes: q bytes equal", qe.float().mean().item(), "scales equal", se.float().mean().item())
for i in range(n):
    r = slice(16 * i, 16 * i + 16)
    if not (qe[r].all() and se[r].all()):
        print("  differs at gate", vals[i].item(), "q", ext["base"][0][r][0, :4].tolist(), ext["new"][0][r][0, :4].tolist(),
              "s", ext["base"][1][r][0].item(), ext["new"][1][r][0].item())
res.append({"extremes_q_equal": qe.float().mean().item(), "extremes_s_equal": se.float().mean().item()})
json.dump(res, open(os.environ["OUT"] + "/act_ab.json", "w"), indent=1)
