"""The checked-in launch-config table (fp8_moe_ops/kernels/configs/h200.json): pure
Python, no GPU."""

from __future__ import annotations

import pytest
import triton

from fp8_moe_ops.kernels.config import _table, block_k, gemm_config

MODELS = {  # name: (E, H, I, top_k): the benchmark models of bench/
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "mixtral_8x7b": (8, 4096, 14336, 2),
}


def _programs(S, E, N, cfg):
    return min(E, S) * triton.cdiv(N, cfg["BN"])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", [1, 2, 8, 64, 4096])
def test_decode_tiles_spread_over_the_sms(model, T):
    # each GEMM of the layer gets at least min_programs (expert, N tile) programs,
    # or its BN is already at the floor of 32
    E, H, I, k = MODELS[model]
    S = T * k
    for N, K in ((2 * I, H), (H, I)):
        cfg = gemm_config(S, E, N, K)
        entries = _table()["shapes"].get(f"{N},{K}", _table()["default"])
        rows = S / min(E, S)
        entry = next(e for e in entries if e["max_rows"] is None or rows <= e["max_rows"])
        assert cfg["BN"] <= entry["BN"] and cfg["BM"] == max(16, min(entry["BM"], triton.next_power_of_2(S)))
        if "min_programs" in entry:
            assert cfg["BN"] == 32 or _programs(S, E, N, cfg) >= entry["min_programs"]
            if cfg["BN"] < entry["BN"]:  # narrowed no further than needed
                assert _programs(S, E, N, dict(BN=2 * cfg["BN"])) < entry["min_programs"]
        else:
            assert cfg["BN"] == entry["BN"]


def test_qwen_decode_narrows_both_gemms():
    # qwen3 T=1: 8 experts x 12 (gate_up) / 16 (down) N tiles of 128 would use < 132 SMs
    assert gemm_config(8, 128, 1536, 2048)["BN"] == 32
    assert gemm_config(8, 128, 2048, 768)["BN"] == 32
    assert gemm_config(8 * 4096, 128, 1536, 2048)["BN"] == 128  # prefill: unchanged


def test_tiny_problems_get_no_tile_wider_than_the_problem():
    cfg = gemm_config(3, 2, 24, 40)
    assert cfg["BM"] == 16 and cfg["BN"] == 32


@pytest.mark.parametrize("bk,step", [(128, 128), (256, 128), (48, 16), (32, 32)])
def test_block_k(bk, step):
    assert block_k(bk) == step
