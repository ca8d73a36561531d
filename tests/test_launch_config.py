"""The checked-in launch-config table (fp8_moe_ops/kernels/configs/h200.json) and the
experts forward's launches by slot count: pure Python, no GPU."""

from __future__ import annotations

import pytest

from fp8_moe_ops.kernels.config import block_k, gemm_config

from helpers import MODELS



# (model, T) -> (BM, BN) of the gate_up and of the down GEMM: the shipped table's
# choices, frozen.  Decode (at most 8 rows per expert) narrows N tiles so that enough
# (expert, N tile) programs fill the H200's 132 SMs, and takes 64-column tiles at 7
# programs per SM where those fill their last wave better; prefill takes the tuned
# tiles.  A table change updates these deliberately (and re-runs the GPU tests).
EXPECTED = {
    ("deepseek_v3", 1): [(16, 64), (16, 64)],
    ("deepseek_v3", 8): [(16, 64), (16, 64)],
    ("deepseek_v3", 64): [(16, 128), (16, 64)],
    ("deepseek_v3", 4096): [(64, 128), (64, 128)],
    ("qwen3_30b_a3b", 1): [(16, 32), (16, 32)],
    ("qwen3_30b_a3b", 8): [(16, 64), (16, 64)],
    ("qwen3_30b_a3b", 64): [(16, 128), (16, 128)],
    ("qwen3_30b_a3b", 4096): [(64, 128), (64, 128)],
    ("mixtral_8x7b", 1): [(16, 64), (16, 32)],
    ("mixtral_8x7b", 8): [(16, 128), (16, 64)],
    ("mixtral_8x7b", 64): [(64, 128), (64, 128)],
    ("mixtral_8x7b", 4096): [(128, 128), (128, 128)],
}


@pytest.mark.parametrize("model,T", list(EXPECTED))
def test_shipped_configs(model, T):
    E, H, I, k = MODELS[model]
    got = [gemm_config(T * k, E, N, K) for N, K in ((2 * I, H), (H, I))]
    assert [(c["BM"], c["BN"]) for c in got] == EXPECTED[model, T]
    assert all(c["num_warps"] in (4, 8) and c["num_stages"] >= 2 for c in got)


def test_qwen_decode_narrows_both_gemms():
    # qwen3 T=1: 8 experts x 12 (gate_up) / 16 (down) N tiles of 128 would use < 132 SMs
    assert gemm_config(8, 128, 1536, 2048)["BN"] == 32
    assert gemm_config(8, 128, 2048, 768)["BN"] == 32
    assert gemm_config(8 * 4096, 128, 1536, 2048)["BN"] == 128  # prefill: unchanged


def test_decode_down_with_fused_combine_splits_k_before_narrowing():
    # mixtral T=1: 2 experts x 32 N tiles of 128; split K (14336) into 5 ranges -> 320 programs
    cfg = gemm_config(2, 8, 4096, 14336, True)
    assert (cfg["BN"], cfg["SPLIT"]) == (128, 5)
    assert gemm_config(2, 8, 4096, 14336)["BN"] == 32 and "SPLIT" not in gemm_config(2, 8, 4096, 14336)
    # qwen3 T=1: K = 768 is below one range of 1024: narrow as before
    cfg = gemm_config(8, 128, 2048, 768, True)
    assert (cfg["BN"], cfg["SPLIT"]) == (32, 1)
    # deepseek_v3 T=1: 8 x 56 tiles are enough
    assert gemm_config(8, 256, 7168, 2048, True)["SPLIT"] == 1
    assert "SPLIT" not in gemm_config(8 * 4096, 8, 4096, 14336, True)  # prefill: no decode entry


def test_decode_programs_are_register_capped_except_split_k():
    # 4 programs of 4 warps per SM at decode (128 registers), or 7 of the dense form (72):
    # mixtral_8x7b's gate_up at T=1 takes 896 64-column programs, one wave of 7 x 132,
    # not 448 of 128 columns (3.4 per SM: some SMs busy with 4 while others idle); a
    # split-K launch is sized to one wave of 128-column tiles and ran slower capped
    from fp8_moe_ops.kernels import experts

    E, H, I, k = MODELS["mixtral_8x7b"]
    gate_up, down = experts.shape_calls(1, k, E, H, I, (128, 128))[1:]
    assert (gate_up.options["maxnreg"], gate_up.constexprs["BN"]) == (72, 64)
    assert down.constexprs["SPLIT"] > 1 and "maxnreg" not in down.options and down.constexprs["BN"] == 128
    assert gemm_config(2, E, 4096, 14336)["maxnreg"] == 128  # the same shape unsplit: 32-column tiles
    assert "maxnreg" not in experts.shape_calls(4096, k, E, H, I, (128, 128))[1].options  # prefill


@pytest.mark.parametrize("S,E,N,dense", [
    (8, 256, 7168, True),    # deepseek_v3 T=1 down: 448 programs = 3.4 per SM -> 896 = 6.8 of 7
    (16, 256, 4096, False),  # deepseek_v3 T=2 gate_up: ~496 programs fit one wave; 992 would need two
    (64, 8, 4096, False),    # mixtral_8x7b T=32 down: 8 x 64 tiles, as even in one wave either way: 128 registers
    (64, 128, 1536, True),   # qwen3_30b_a3b T=8 gate_up: 1.15 waves of 4 per SM -> 1.31 of 7
])
def test_decode_takes_the_dense_form_where_its_waves_are_fuller(S, E, N, dense):
    cfg = gemm_config(S, E, N, 2048)
    assert (cfg["BN"], cfg["maxnreg"]) == ((64, 72) if dense else (cfg["BN"], 128))
    assert "per_sm" not in cfg and "dense" not in cfg  # table keys, not launch options


def test_dense_form_follows_the_gpus_sm_count():
    # deepseek_v3 T=1 down: ~442 programs of 128 columns fill 84 % of 4 per SM over 132
    # SMs, ~884 of 64 columns 96 % of 7 per SM; over 112 SMs the 442 fill 99 % of one wave
    # of 4, while 884 would need a second wave of 7
    assert gemm_config(8, 256, 7168, 2048)["BN"] == gemm_config(8, 256, 7168, 2048, sms=132)["BN"] == 64
    assert gemm_config(8, 256, 7168, 2048, sms=112)["BN"] == 128
    assert gemm_config(2, 8, 4096, 14336, True, sms=112)["SPLIT"] == 5  # split K as ever


def test_tiny_problems_get_no_tile_wider_than_the_problem():
    cfg = gemm_config(3, 2, 24, 40)
    assert cfg["BM"] == 16 and cfg["BN"] == 32


@pytest.mark.parametrize("bk,step", [(128, 128), (256, 128), (48, 16), (32, 32)])
def test_block_k(bk, step):
    assert block_k(bk) == step


# T * k slots -> the experts forward's launches (dynamic and static alike): the sort and
# the activation quantisation share one up to MAX_SLOTS, the sort takes three beyond; the
# combine runs in the down GEMM's launch up to COMBINE_SLOTS and the activation in the
# gate_up GEMM's up to ACT_SLOTS
LAUNCHES = {
    4: ["sort+quant", "gate_up+act", "down+combine"],
    8: ["sort+quant", "gate_up+act", "down+combine"],
    16: ["sort+quant", "gate_up+act", "down+combine"],
    20: ["sort+quant", "gate_up", "act", "down+combine"],
    64: ["sort+quant", "gate_up", "act", "down+combine"],
    68: ["sort+quant", "gate_up", "act", "down", "combine"],
    2048: ["sort+quant", "gate_up", "act", "down", "combine"],
    2052: ["sort histograms", "sort scan", "sort scatter", "quant", "gate_up", "act", "down", "combine"],
}


def _launch_names(calls) -> list[str]:
    names = {"_sort_quant_kernel": "sort+quant", "_sort_hist_kernel": "sort histograms",
             "_sort_scan_kernel": "sort scan", "_sort_scatter_kernel": "sort scatter", "_quant_kernel": "quant", "_gated_act_quant_kernel": "act",
             "_combine_kernel": "combine"}
    out = []
    for call in calls:
        name = call.kernel.fn.__name__
        if name == "_grouped_gemm_kernel":
            c = call.constexprs
            fused = "+act" if c["GATED"] else "+combine" if c["COMBINE"] else ""
            name = ("gate_up" if c["GATHER_A"] else "down") + fused
        else:
            name = names[name]
        out.append(name)
    return out


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("slots", list(LAUNCHES))
def test_experts_launches_by_slot_count(slots, static):
    # the launch list as the forward builds it, on placeholders (no kernel runs)
    from fp8_moe_ops.kernels import experts

    assert experts.ACT_SLOTS <= experts.COMBINE_SLOTS  # the activation's counters exist only there
    assert experts.COMBINE_SLOTS <= experts.MAX_SLOTS  # the one-launch sort zeroes the counters
    calls = experts.shape_calls(slots // 4, 4, 8, 64, 32, (16, 16), static)
    assert _launch_names(calls) == LAUNCHES[slots]


@pytest.mark.parametrize("T,k,static,block_r,gpp", [
    (1, 8, True, 1, 1),      # decode: one token a program (4, three masked, cost 2 us a call on the H200)
    (3, 8, True, 4, 1),
    (8192, 8, True, 4, 16),  # 4 tokens x 8 slots x 128 columns: 4096 outputs per K group; 16 of the 56
    (8192, 2, True, 16, 4),  # groups a program (2048 row blocks x 4 >= 4096 programs), 4 (512 x 14)
    (1, 8, False, 1, 1),     # dynamic: one output per element of x, one group a program
    (8192, 8, False, 16, 1),
])
def test_quantisation_programs_take_whole_tokens_and_no_more_rows_than_there_are(T, k, static, block_r, gpp):
    # the first launch of the forward quantises x: static, every token into its k slots
    from fp8_moe_ops.kernels import experts

    quant = next(c for c in experts.shape_calls(T, k, 256, 7168, 2048, (128, 128), static)
                 if "quant" in c.kernel.fn.__name__)  # past the one-launch sort, after the sort's two
    c = quant.constexprs
    assert c["BLOCK_R"] == block_r and c["BLOCK_G"] == 128
    assert c["TOPK"] == k or not static  # dynamic quantises x's rows, whatever the slots
    if quant.kernel.fn.__name__ == "_sort_quant_kernel":
        sort_programs = dict(zip(quant.kernel.arg_names, quant.args))["sort_programs"]
        row_programs = quant.grid[0] - sort_programs  # the quantisation's come after the sort's
    else:
        row_programs = quant.grid[0] * quant.grid[1]
    # a static launch of its own loops each program over K groups (quant.groups_per_program)
    assert c.get("GPP", 1) == gpp
    assert row_programs == -(-T // block_r) * -(-(7168 // 128) // gpp)
