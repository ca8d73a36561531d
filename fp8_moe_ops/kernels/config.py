"""Checked-in launch configs for the grouped GEMM (no autotuning on a user's call).

``configs/<device>.json`` holds, per bucket of mean rows per active expert, the tile
sizes, warps and pipeline stages; entries under ``"shapes"`` (key ``"N,K"``) override
the default list for one weight shape.  An entry's optional ``min_programs`` halves
``BN`` (not below 32) while fewer (expert, N tile) programs than that would run: at
decode a layer's few active experts otherwise stream their weights through a fraction
of the SMs (264 in the table: two per SM of the H200's 132; a GPU with many more SMs
would want its own table).  For the down GEMM with the combine in its launch
(``split_k``) such an entry splits K into up to ``K / 1024`` ranges (``SPLIT``) where
narrowing alone would go to 32-column tiles: programs of the full ``BN`` stream wider
weight tiles.  ``BN`` then narrows if that is not enough.  An entry's optional
``maxnreg`` caps a program's registers, so that enough programs fit an SM (dropped for
a split-K launch).  An entry's optional ``dense`` holds another form of it (say
narrower tiles capped at fewer registers, so more programs per SM): the call takes that
form where its programs fill their last wave over the GPU's SMs (the table's ``sms``
where the caller gives none) better than the entry's own (``per_sm``: programs of each
form that fit an SM), except for a split-K launch.  An entry's optional ``ws_min_k``
hands its GEMMs with K at least that to the Gluon kernel on an sm_90 GPU
(:mod:`.ws_gemm`), which runs its own 128 x 128 tiles where it can take the GEMM; the
entry's tiles are the Triton kernel's, for the GEMMs it cannot (gathered rows, fused
launches) and for other GPUs.  The table was written from
the sweep of ``bench/tune.py`` on an H200 (winners per bucket, by hand: see
docs/benchmarks.md); other GPUs use the same table.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

from ..functional import cdiv, next_power_of_2


@functools.cache
def _table() -> dict:
    text = resources.files(__package__).joinpath("configs", "h200.json").read_text()
    return json.loads(text)


def block_k(bk: int) -> int:
    """The GEMM's K step: the largest power of two <= 128 dividing ``bk`` (one act and
    one weight scale per step).  Must be >= 16 (the smallest ``tl.dot`` K)."""
    step = bk & -bk
    return min(step, 128)


MIN_SPLIT_K = 1024  # K per range of a split-K launch, at least


def gemm_config(S: int, E: int, N: int, K: int, split_k: bool = False, sms: int | None = None) -> dict:
    """Launch config for S sorted rows over E experts and an (N, K) weight; with
    ``split_k`` it may hold ``SPLIT`` > 1 (K ranges; absent means 1, and never depends
    on ``sms``).  ``sms``: the GPU's SM count, for the choice of a ``dense`` form
    (default: the table's)."""
    rows = S / max(1, min(E, S))
    table = _table()
    entries = table["shapes"].get(f"{N},{K}", table["default"])
    entry = next(e for e in entries if e["max_rows"] is None or rows <= e["max_rows"])
    cfg = _sized(entry, S, E, N, K, split_k)
    dense = entry.get("dense")
    if dense is not None and cfg.get("SPLIT", 1) == 1:
        other = _sized({**entry, **dense}, S, E, N, K, split_k)
        # the experts with rows, estimated as under uniform routing (S slots over E experts)
        active = E * (1 - (1 - 1 / E) ** S) if E else 0.0
        sm_count = sms or table["sms"]
        if other.get("SPLIT", 1) == 1 and \
                _wave_use(active * cdiv(N, other["BN"]), sm_count * dense["per_sm"]) > \
                _wave_use(active * cdiv(N, cfg["BN"]), sm_count * entry["per_sm"]):
            cfg = other
    return cfg


def _wave_use(programs: float, slots: int) -> float:
    """The share of a launch's program slots (``slots`` per wave) that its ``programs``
    fill over its waves: 1 when the last wave is full, about a half when a second wave
    holds a few programs."""
    programs = max(1.0, programs)
    return programs / (slots * math.ceil(programs / slots))


def _sized(entry: dict, S: int, E: int, N: int, K: int, split_k: bool) -> dict:
    """``entry``'s launch config for the problem: tiles no wider than it, narrowed or K
    split until ``min_programs`` (expert, N tile, K range) programs could have work."""
    cfg = {key: v for key, v in entry.items() if key not in ("max_rows", "min_programs", "per_sm", "dense")}
    min_programs = entry.get("min_programs")
    # tiny problems (tests, T=1): no tile wider than the problem
    cfg["BM"] = max(16, min(cfg["BM"], next_power_of_2(max(S, 1))))
    cfg["BN"] = max(16, min(cfg["BN"], next_power_of_2(N)))
    if min_programs is not None:
        groups = max(1, min(E, S))  # at most this many experts have rows
        split = 1
        if split_k:
            if groups * cdiv(N, 64) < min_programs:
                # narrowing would go to 32-column tiles, which stream their 4 KB per K step
                # at about half the rate of 128-wide ones (mixtral_8x7b's down GEMM at T=1)
                split = max(1, min(cdiv(min_programs, groups * cdiv(N, cfg["BN"])), K // MIN_SPLIT_K))
            cfg["SPLIT"] = split
            if split > 1:
                # sized to about one wave already: the register cap (the table's maxnreg, for
                # the programs per SM) only slowed it (mixtral_8x7b T=1 / 2: +2 / +8 us)
                cfg.pop("maxnreg", None)
        while cfg["BN"] > 32 and groups * cdiv(N, cfg["BN"]) * split < min_programs:
            cfg["BN"] //= 2
    return cfg
