# Record of a probe (twentieth session), run on the H200 with docs/benchmarks/kmajor_scales.patch applied
# ("new") and on 83343f5 ("old"): PYTHONPATH=<tree> python docs/benchmarks/kmajor_scatter_probe.py,
# alternated new, old, new, old.  Results: docs/benchmarks/kmajor_scatter_probe.json.
# the mixtral_8x7b T=16384 down GEMM alone (M=32768, N=4096, K=14336, E=8, uniform routing),
# rows in place or scattered, with this tree's ws_gemm (K-major scales if it has kmajor)
import json, sys, torch, triton
from fp8_moe_ops.kernels import ws_gemm
kmajor = hasattr(ws_gemm, "kmajor")
g = torch.Generator(device="cuda").manual_seed(0)
E, N, K, M = 8, 4096, 14336, 32768
ids = torch.randint(0, E, (M,), device="cuda", generator=g)
offsets = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)
w = (torch.randn(E, N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05).to(torch.float8_e4m3fn)
ws = torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 1e-2 + 1e-3
a = (torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16) * 32).to(torch.float8_e4m3fn)
sa = torch.rand(M, K // 128, device="cuda", generator=g) * 2e-3 + 1e-3
if kmajor:
    sa = sa.t().contiguous().t()
perm = torch.randperm(M, device="cuda", generator=g).to(torch.int32)
out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
counts = offsets.diff(prepend=offsets.new_zeros(1))
tiles = int(((counts + 127) // 128).sum())
res = {"kmajor": kmajor}
for scatter in (False, True):
    call = ws_gemm.ws_gemm_call(a, sa, w, ws, ws.stride(), (128, 128), out, offsets=offsets, perm=perm if scatter else None,
                                scatter_out=scatter, static=False, e8m0=False, num_pid_m=tiles + E, group_m=8,
                                max_programs=ws_gemm.programs(out.device))
    fn = lambda: call.kernel[call.grid](*call.args, **call.constexprs, **call.options)
    fn(); torch.cuda.synchronize()
    ms_cold = triton.testing.do_bench(fn, warmup=5, rep=40)  # L2 flushed between launches
    torch.cuda.synchronize()
    # warm: back to back, no flush (the layer's down GEMM follows the activation kernel, which wrote the scales)
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(20):
        fn()
    en.record(); torch.cuda.synchronize()
    res[f"scatter={scatter}"] = {"ms_flushed": round(ms_cold, 3), "ms_back_to_back": round(st.elapsed_time(en) / 20, 3),
                                 "checksum": float(out.float().abs().sum())}
print("RESULT", json.dumps(res))
