"""The grouped GEMM on Hopper from 64 rows per expert: warp-specialised, written in Gluon.

Same contract and same arithmetic as :mod:`.grouped_gemm` for the case it takes over
(expert-sorted A rows read in place, one weight scale per 128 x 128 tile and K step),
so its output equals that kernel's bitwise; it only overlaps what that kernel cannot.
Triton 3.6 waits for each K step's MMAs before the float32 rescale
``acc += dot * scale`` (its pipeliner keeps a dot asynchronous only while nothing but
another dot reads the result), so the tensor cores idle while the FMAs run.  Here, in
Gluon (Triton's lower-level dialect, ``triton.experimental.gluon``, in the same wheel):

- a producer warp streams each K step's A (128 x 128) and weight (128 x 128) tiles
  with TMA into a ring of ``STAGES`` shared-memory slots (``ready`` mbarriers);
- where N is a multiple of 256 and K at most ``WIDE_MAX_K`` (or ``WIDE_LONG_MAX_K`` from
  ``WIDE_LONG_MIN_ROWS`` rows per expert), the weight tile is
  256 x 128 (output tiles of 128 x 256: each A tile feeds two MMAs, half the A bytes per
  FLOP), in a ring of ``WIDE_STAGES`` slots, without ``LAG`` (registers);
- two consumer warpgroups take 64 rows of the tile each, so one warpgroup's FMAs can
  run while the other's MMAs do; with ``LAG`` each takes two K steps at a time: it
  issues both steps' MMAs, waits for the first's only, releases its slot (``empty``,
  two arrivals) and rescales it while the second's run, then the second (an odd last
  step alone).  Without, it waits for each step's MMAs before it issues the next;
- the dynamic scheme's per-row activation scales: laid out K-group major (a tile's rows
  of one K group side by side: the gate_up GEMM's at prefill), the producer copies each
  K step's into a shared-memory slot beside its A tile (``cp.async``, completing on the
  same ``ready`` barrier), measured faster where the rows are stored in place;
  row-major (the down GEMM's, whose rows are scattered: the copy measured slower there),
  the consumers load them from global memory before each step's MMAs.

The launch is persistent: one program per SM (fewer where there are fewer tiles), each
taking every grid-th tile in turn through one ring, so the producer loads the next
tile's first K steps while the consumers store the last tile's output.  (One program
per tile, the first form, left each program's ring filling and its output store
exposed: that made it slower than the Triton kernel at K = 768, and at K = 2048 for
deepseek_v3's down GEMM in five of eight measured cases.)  A program finds each tile's
(expert, row tile) from the (E,) ``offsets`` (a scan of tiles per expert).  The tiles
go expert by expert (``BY_EXPERT``), each expert's row tiles in groups of ``GROUP_M``
from its first, each group taking each column tile in turn: the tiles that read one
weight tile are consecutive and run at the same time, and no group holds two experts'
rows.  (The grouped kernel's order, ``GROUP_M`` row tiles whatever their experts, cut
through routed experts of 2-3 row tiles, and their weight tiles were read from DRAM
again: 1.24x the least bytes of deepseek_v3's T=8192 gate_up GEMM on an H100, 1.03x by
expert.)  The producer warp scans once per program and finds each tile's expert, rows
and column tile (reductions over the scan, two offsets read); it leaves them in shared
memory beside the tile's first K step, so between two tiles the consumers read shared
memory, never global memory, before the next MMAs.
Each consumer stores its half of the tile's output by TMA, from shared memory, where
the rows are all the tile's and in place (the gate_up GEMM's): the store runs while the
next tile's MMAs do; scattered rows and a half past its expert's end are stored whole
rows at a time (``EPILOGUE``).  Tiles past the experts' rows (the
tail: sentinel slots) run no K step and store zeros, so every output row is written.
Rows of a tile past its expert's end, and K or N past the matrix, are loaded (TMA fills
past the tensor with zeros; rows of the next expert are read and discarded) but never
stored, so no result depends on them.

Used only where :func:`usable` says so (an sm_90 GPU, a prefill or mid-size entry of
the launch table that chooses it, 128 x 128 blocks or coarser, TMA-aligned K); the
grouped kernel runs everywhere else, and under ``TRITON_INTERPRET=1`` (Gluon has no
interpreter).  ``FP8_MOE_GLUON=0`` in the environment turns it off, ``FP8_MOE_GLUON=1``
on wherever it can run.  The Gluon source is :mod:`.gluon_gemm`, written against the
experimental Gluon API of Triton 3.6 and 3.7 (both run against the CPU reference on an
H200: docs/gpu_check.md): with another Triton (or none of Gluon's Hopper API) the
package still imports and the Triton kernel runs every GEMM.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton

from ..functional import next_power_of_2
from .launch import KernelCall

try:  # the Gluon source, written against the experimental API of Triton 3.6 and 3.7
    from .gluon_gemm import OUT_TYPES, TensorDescriptor, _ws_gemm_kernel, out_layout, shared_layout
except (ImportError, AttributeError) as exc:  # a Triton whose Gluon differs: the Triton kernel runs every GEMM
    _ws_gemm_kernel = None
    logging.getLogger(__name__).info("the Gluon prefill GEMM is unavailable (%s)", exc)

__all__ = ["AVAILABLE", "mode", "usable", "tma_ready", "kmajor", "scales_readable", "ws_gemm_call"]

# Gluon's API is experimental, so the kernel runs only with the Triton releases it is
# built for and has run under on the GPU: 3.6 and 3.7 (where a CTA-wide barrier is
# renamed); with another the Triton kernel runs every GEMM
AVAILABLE = _ws_gemm_kernel is not None and triton.__version__.startswith(("3.6.", "3.7."))

TILE = 128  # BM = BN = BK
STAGES = 4  # ring slots (6 measured no faster on the H200: docs/benchmarks.md)
CONSUMER_REGS = 232  # registers per consumer thread (setmaxnreg)
PRODUCER_REGS = 40  # registers per producer thread (its tile map of up to 256 experts fits;
# 48 left the default consumer warpgroup 224, and it spilled: 232 each, no spill)
LAG = True  # consumers take two K steps at a time (measured faster: docs/benchmarks.md)
# tiles of 128 x 256 output columns (two MMAs per A tile and K step, one in flight at a
# time per warpgroup, so without LAG; a ring of WIDE_STAGES slots) where N is a multiple
# of 256 and K at most WIDE_MAX_K, or at most WIDE_LONG_MAX_K where the GEMM has
# WIDE_LONG_MIN_ROWS rows (out's, unrouted slots included) per expert or more.  On the
# H200 they were faster at K = 768 and 2048 and, the GEMM alone, slower at 7168 and 14336
# (its layers at K = 7168 not measured there); on a power-capped H100, deepseek_v3's
# layers (K = 7168) were 5-6 % faster at 256 rows per expert, 1-5 % at 128 and 512, 5 %
# slower at 64; mixtral_8x7b's at K = 4096 up to 7 % faster dynamic, -2 to +2 % static;
# K = 14336 gained nothing (docs/benchmarks.md)
WIDE = True
WIDE_MAX_K = 2048
WIDE_LONG_MAX_K = 7168
WIDE_LONG_MIN_ROWS = 128
WIDE_STAGES = 3  # 48 KB per slot; with the staging buffers of the output, 208 KB
# the tile order: expert by expert, each expert's row tiles in groups of the launch table's
# GROUP_M (gluon_gemm._expert_coords), else in groups of GROUP_M row tiles whatever their
# experts (gluon_gemm._tile_coords)
BY_EXPERT = True
# the output store (gluon_gemm._store_tile): 0 from the MMA layout, 1 whole rows through
# shared memory, 2 TMA where a tile's rows are its own and in place, else as 1
EPILOGUE = 2


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def programs(device: torch.device) -> int:
    """Programs of a persistent launch on ``device``: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def mode() -> str | None:
    """The ``FP8_MOE_GLUON`` override as set now (``"0"``, ``"1"``, or None: the launch
    table chooses).  Read on every call; the stacked ops' launch plans are kept per
    setting (:class:`.experts.StackedPlans`), as a plan replays the GEMMs chosen when it
    was recorded."""
    return os.environ.get("FP8_MOE_GLUON")


def usable(device: torch.device, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], cfg: dict) -> bool:
    """Whether :func:`ws_gemm_call` takes a GEMM of stacked weights ``w`` whose A rows
    are read in place (no gather) and with nothing fused into its launch.  The launch
    table chooses: K at least its entry's ``ws_min_k`` (set in its prefill entries and
    in its mid-size ones from 64 rows per expert: measured faster there at every K from
    768 to 14336; the kernel then runs its own 128 x 128 tiles, the entry's tiles being
    the Triton kernel's), overridden by
    ``FP8_MOE_GLUON``: ``0`` never, ``1`` wherever it can run.  It can run with Triton
    3.6 or 3.7 (:data:`AVAILABLE`) on an sm_90 GPU (not the
    interpreter) for an entry that names a ``ws_min_k`` or has 128 x 128 tiles, without
    split K, with one weight scale per tile and K step, K a multiple of 16 and ``w``
    contiguous, 16-byte aligned and not empty (TMA; an op of no experts, as an
    expert-parallel rank without local ones, runs the Triton kernel, which stores zeros).
    A must also pass :func:`tma_ready`."""
    K = w.shape[2]
    override = mode()
    chosen = cfg.get("ws_min_k") is not None and K >= cfg["ws_min_k"]
    if not AVAILABLE or override == "0" or not (override == "1" or chosen):
        return False
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if cfg.get("SPLIT", 1) != 1 or (cfg.get("ws_min_k") is None and (cfg["BM"] != TILE or cfg["BN"] != TILE)):
        return False
    bn, bk = block
    return ((bn % TILE == 0 or w_scale.shape[1] == 1) and bk % TILE == 0 and K % 16 == 0 and w.numel() > 0
            and w.is_contiguous() and w.data_ptr() % 16 == 0
            and _sm90(device.index if device.index is not None else torch.cuda.current_device()))


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a matrix (A, or the output) can be read or written through a TMA
    descriptor: unit stride in its last dimension, rows and base 16-byte aligned."""
    return t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def scales_readable(q_scale: torch.Tensor) -> bool:
    """Whether the kernel reads the dynamic scheme's (rows, G) activation scales as laid
    out: K-group major (:func:`kmajor`) or row-major with unit K-group stride (the
    Triton kernel reads any strides)."""
    return kmajor(q_scale) or q_scale.stride(1) == 1 or q_scale.shape[1] == 1


def kmajor(q_scale: torch.Tensor) -> bool:
    """Whether the dynamic scheme's (rows, G) activation scales are laid out K-group
    major (strides (1, at least rows)): the kernel's producer then copies each K step's
    scales of a tile's rows (adjacent there) into shared memory beside its A tile;
    row-major, the consumers read them from global memory."""
    return q_scale.stride(0) == 1 and q_scale.stride(1) >= q_scale.shape[0]


def ws_gemm_call(q, q_scale, w, ws, ws_strides, block, out, *, offsets, perm, scatter_out: bool, static: bool,
                 e8m0: bool, num_pid_m: int, group_m: int, max_programs: int | None) -> KernelCall:
    """The launch of :func:`_ws_gemm_kernel` (``ws``: the scale grid as the kernel reads
    it, float32 or UE8M0 bytes, with its strides): ``num_pid_m`` row tiles (the tile
    map's bound) times the column tiles, run by at most ``max_programs`` programs
    (None: one per tile), each taking every ``grid``-th tile."""
    E, N, K = w.shape
    S = out.shape[0]
    # a wide tile only where its second block of columns is never past N, and its output
    # staging (2 bytes an element) fits beside the ring
    long_k = K <= WIDE_LONG_MAX_K and S >= WIDE_LONG_MIN_ROWS * E
    wn = 2 if WIDE and (K <= WIDE_MAX_K or long_k) and N % (2 * TILE) == 0 and out.element_size() <= 2 else 1
    tile = [TILE, TILE]
    w_tile = [wn * TILE, TILE]
    a_desc = TensorDescriptor.from_tensor(q, tile, shared_layout(tile))
    w_desc = TensorDescriptor(w, [E * N, K], [K, 1], w_tile, shared_layout(w_tile))
    tiles = num_pid_m * triton.cdiv(N, wn * TILE)
    grid = (tiles if max_programs is None else min(tiles, max_programs),)
    epilogue = EPILOGUE
    if epilogue == 2 and (scatter_out or not tma_ready(out) or out.dtype not in OUT_TYPES):
        epilogue = 1  # rows scattered, or an output TMA cannot address
    if not static and not scales_readable(q_scale):
        raise ValueError(f"q_scale: expected (rows, G) activation scales row-major (strides (>= G, 1)) or K-group "
                         f"major (strides (1, >= rows)), got strides {tuple(q_scale.stride())}")
    kmajor_scales = not static and kmajor(q_scale)
    out_desc = None
    if epilogue == 2:
        half = [TILE // 2, TILE]  # each consumer warpgroup stores its half
        out_desc = TensorDescriptor.from_tensor(out, half, out_layout(half, out.dtype))
    return KernelCall(_ws_gemm_kernel, grid, (
        a_desc, q_scale, 0 if static else q_scale.stride(1) if kmajor_scales else q_scale.stride(0),
        w_desc, ws, *ws_strides,
        out, out.stride(0), out_desc,
        perm if perm is not None else out, offsets,
        S, N, E, triton.cdiv(K, TILE), num_pid_m,
    ), dict(BN_SCALE=block[0], BK_SCALE=block[1], STATIC=static, KMAJOR=kmajor_scales, SCATTER_OUT=scatter_out,
            SCALE_E8M0=e8m0, EP=max(2, next_power_of_2(E)), GROUP_M=group_m, STAGES=STAGES if wn == 1 else WIDE_STAGES,
            CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, LAG=LAG and wn == 1, EPILOGUE=epilogue, WN=wn,
            BY_EXPERT=BY_EXPERT),
        dict(num_warps=4))
