# Record of the twenty-first session's Nsight Compute runs (docs/benchmarks/kmajor_scatter_ncu.json): one form
# of the mixtral_8x7b T=16384 down GEMM of kmajor_scatter_probe.py (rows in place or scattered, argv[1]
# "inplace" / "scatter"), launched twice, the second profiled:
#   PYTHONPATH=<tree> ncu --clock-control none -k regex:ws_gemm --launch-skip 1 --launch-count 1 --set full \
#       --import-source yes -o REP python docs/benchmarks/kmajor_scatter_ncu.py scatter
# on a tree with docs/benchmarks/kmajor_scales.patch applied to 83343f5 (both forms) and on 83343f5 (scatter).
import sys, torch
from fp8_moe_ops.kernels import ws_gemm
scatter = sys.argv[1] == "scatter"
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
call = ws_gemm.ws_gemm_call(a, sa, w, ws, ws.stride(), (128, 128), out, offsets=offsets, perm=perm if scatter else None,
                            scatter_out=scatter, static=False, e8m0=False, num_pid_m=tiles + E, group_m=8,
                            max_programs=ws_gemm.programs(out.device))
for _ in range(2):
    call.kernel[call.grid](*call.args, **call.constexprs, **call.options)
torch.cuda.synchronize()
print("done", sys.argv[1], kmajor, float(out.float().abs().sum()))
