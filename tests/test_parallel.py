"""Expert parallelism (fp8_moe_ops.parallel) on CPU: two processes over gloo against one
process holding all experts, plus shard_experts and bad input.

The two workers run every case once (one spawn for the module: starting a process and
importing torch costs seconds) and save their outputs; each test compares one case's
outputs with the single-process ``FP8Experts`` (grouped dispatch) on the same tokens.
"""

import os
import subprocess
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

from fp8_moe_ops import FP8Experts
from fp8_moe_ops.parallel import ExpertParallel, shard_experts

from helpers import assert_agree, make_expert_weights, make_routing

E, H, I, K = 8, 64, 32, 3
BLOCK = (32, 32)
WORLD = 2
TIMEOUT_S = 240

# name: (tokens per rank, dtype, static scheme, routing kind per rank, compiled)
CASES = {
    "uneven": ((7, 3), torch.bfloat16, False, ("uniform", "uniform"), False),  # T differs per rank
    "rank_without_tokens": ((0, 5), torch.bfloat16, False, ("uniform", "uniform"), False),  # T_r = 0
    "static": ((6, 4), torch.bfloat16, True, ("uniform", "uniform"), False),  # per-expert act scales
    "caller_sentinels": ((9, 6), torch.bfloat16, False, ("sentinel", "sentinel"), False),  # ids -1, E+3
    "one_rank_all_sentinels": ((4, 5), torch.bfloat16, False, ("uniform", "all_sentinel"), False),
    "all_on_expert_0": ((5, 4), torch.float16, False, ("one", "one"), False),  # rank 1 serves nothing
    "fp32": ((5, 8), torch.float32, False, ("uniform", "uniform"), False),
    "fp16_static": ((3, 7), torch.float16, True, ("sentinel", "uniform"), False),
    "compiled": ((6, 2), torch.bfloat16, False, ("sentinel", "uniform"), True),
    "top1_rank_without_tokens": ((0, 5), torch.bfloat16, False, ("uniform", "uniform"), False),  # k = 1
    # H odd: a row's bf16 bytes end off 4-byte alignment; every slot on expert E - 1, so
    # rank 0 receives no row
    "odd_hidden_rank_serves_nothing": ((1, 4), torch.bfloat16, False, ("one", "one"), False),
}
# the cases of another top_k or hidden size than K and H
OTHER_K = {"top1_rank_without_tokens": 1}
OTHER_H = {"odd_hidden_rank_serves_nothing": 63}


def full_experts(static: bool, hidden: int = H) -> FP8Experts:
    """The same E experts in every process (seeded): the single-process reference."""
    gen = torch.Generator().manual_seed(0)
    mod = FP8Experts(E, hidden, I, BLOCK, activation_scheme="static" if static else "dynamic", dispatch="grouped")
    mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data = make_expert_weights(E, 2 * I, hidden, BLOCK, gen=gen)
    mod.down_proj.data, mod.down_proj_scale_inv.data = make_expert_weights(E, hidden, I, BLOCK, gen=gen)
    if static:
        mod.gate_up_proj_activation_scale.data = torch.rand(E, generator=gen) * 0.01 + 0.005
        mod.down_proj_activation_scale.data = torch.rand(E, generator=gen) * 0.002 + 0.0005
    return mod


def rank_inputs(case: str, rank: int, calls: int = 0):
    """(hidden (T_r, H), top_k_index (T_r, K), top_k_weights) of one rank in one case."""
    tokens, dtype, _, kinds, _ = CASES[case]
    T = tokens[rank] + calls  # a compiled module is also called with other T
    gen = torch.Generator().manual_seed(1000 * list(CASES).index(case) + 10 * rank + calls)
    kind = kinds[rank]
    idx, weights = make_routing(T, OTHER_K.get(case, K), E, "uniform" if kind == "all_sentinel" else kind, gen=gen)
    if kind == "all_sentinel":
        idx = torch.where(idx % 2 == 0, -5, E + idx)
    return torch.randn(T, OTHER_H.get(case, H), generator=gen).to(dtype), idx, weights


# calibration over two ranks: per scenario, the experts each rank's tokens are routed to
# (every token to all K of them): "some_unseen" leaves experts 3, 4, 6, 7 without a token
# (4, 6 and 7 on rank 1, which serves expert 5 for both ranks), "rank_1_unseen" every
# expert of rank 1
CALIBRATION = {"some_unseen": ([0, 1, 5], [5, 2, 0]), "rank_1_unseen": ([2, 0, 1], [1, 3, 0])}


def calibration_batches(scenario: str, rank: int, nan: bool = False) -> list:
    """Two batches of one rank (seeded); ``nan``: a NaN in rank 0's token 1, routed to
    expert 5 alone (served by rank 1, where it is local expert 1) and sentinels."""
    gen = torch.Generator().manual_seed(77 + 10 * rank + list(CALIBRATION).index(scenario))
    batches = []
    for T in (3 + rank, 2):
        idx = torch.tensor(CALIBRATION[scenario][rank]).roll(T).repeat(T, 1)
        hidden = torch.randn(T, H, generator=gen).bfloat16()
        if nan and rank == 0:
            hidden[1, 3] = float("nan")
            idx[1] = torch.tensor([5, -1, E])
        batches.append((hidden, idx, torch.rand(T, K, generator=gen)))
    return batches


def _calibrate(rank: int) -> dict:
    """This rank's calibrated local scales per scenario, and the NaN's refusal."""
    from fp8_moe_ops import calibrate_static_scales

    results = {}
    for scenario in CALIBRATION:
        ep = ExpertParallel(shard_experts(full_experts(False), rank, WORLD), E)
        calibrate_static_scales(ep, calibration_batches(scenario, rank))
        local = ep.local_experts
        results[scenario] = (local.activation_scheme, local.gate_up_proj_activation_scale,
                             local.down_proj_activation_scale)
    ep = ExpertParallel(shard_experts(full_experts(False), rank, WORLD), E)
    try:
        calibrate_static_scales(ep, calibration_batches("some_unseen", rank, nan=True))
    except ValueError as e:
        results["nan"] = (str(e), ep.local_experts.activation_scheme)
    # an Inf that reaches a linear of rank 0 alone (after the experts): both ranks refuse
    model = _WithHead(ExpertParallel(shard_experts(full_experts(False), rank, WORLD), E))
    batches = [(*b, torch.full((b[0].shape[0], H), float("inf") if rank == 0 else 0.0))
               for b in calibration_batches("some_unseen", rank)]
    try:
        calibrate_static_scales(model, batches)
    except ValueError as e:
        results["head_inf"] = (str(e), model.ep.local_experts.activation_scheme, model.head.activation_scheme)
    return results


class _WithHead(torch.nn.Module):
    """Experts over ranks, then a linear of each rank's own (its input ``extra`` added)."""

    def __init__(self, ep):
        super().__init__()
        from fp8_moe_ops import FP8Linear

        self.ep = ep
        gen = torch.Generator().manual_seed(5)
        self.head = FP8Linear.from_float(torch.nn.Linear(H, H, bias=False).requires_grad_(False), block_size=BLOCK)
        self.head.weight.data = (torch.randn(H, H, generator=gen) * 0.1).to(self.head.weight.dtype)

    def forward(self, hidden, idx, weights, extra):
        return self.head(self.ep(hidden, idx, weights) + extra.to(hidden.dtype))


def _in_rank(work, rank: int, world: int, store_path: str, out_dir: str) -> None:
    """A spawned rank of a gloo group of ``world``: ``work(rank, out_dir)``, its error (if
    any) written to ``out_dir`` for the test to show."""
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        torch.set_num_threads(1)
        work(rank, out_dir)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run_ranks(work, world: int, tmp) -> None:
    """``work`` (a module-level function: spawned) in ``world`` gloo processes; fails with
    their errors if any rank raised or did not end within ``TIMEOUT_S``."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_in_rank, args=(work, r, world, str(tmp / "store"), str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(tmp.glob("error_*.txt"))]
    assert not errors and all(p.exitcode == 0 for p in procs), (
        [p.exitcode for p in procs], "\n".join(errors))


def _worker(rank: int, out_dir: str) -> None:
    """Every case of CASES on one of the WORLD ranks, then the refusals."""
    for case, (_, _, static, _, compiled) in CASES.items():
        ep = ExpertParallel(shard_experts(full_experts(static, OTHER_H.get(case, H)), rank, WORLD), E)
        run = torch.compile(ep) if compiled else ep
        outs = [run(*rank_inputs(case, rank, calls)) for calls in range(2 if compiled else 1)]
        if compiled:  # which graph breaks dynamo took, by reason
            outs.append(list(counters["graph_break"]))
        torch.save(outs, os.path.join(out_dir, f"{case}_{rank}.pt"))
    torch.save(_calibrate(rank), os.path.join(out_dir, f"calibration_{rank}.pt"))
    refusals = []
    # another rank's shard: refused on the rank it is not for
    try:
        ExpertParallel(shard_experts(full_experts(False), 0, WORLD), E)
    except ValueError as e:
        refusals.append(str(e))
    # local_experts replaced after a call by a layer of another hidden size on rank 1 only:
    # refused on both ranks by the layout check (a layout row cached before the swap
    # carried the old size, and the rows were read at the wrong width: an abort)
    ep = ExpertParallel(shard_experts(full_experts(False), rank, WORLD), E)
    ep(*rank_inputs("uneven", rank))
    hidden, idx, weights = rank_inputs("uneven", rank)
    if rank == 1:
        ep.local_experts = shard_experts(full_experts(False, 96), rank, WORLD)
        hidden = torch.randn(hidden.shape[0], 96, generator=torch.Generator().manual_seed(96)).to(hidden.dtype)
    try:
        ep(hidden, idx, weights)
    except ValueError as e:
        refusals.append(str(e))
    # ranks that disagree on top_k: each raises, naming it (none waits in a collective);
    # their rows used to be read with the other rank's width (an abort, or wrong values)
    ep = ExpertParallel(shard_experts(full_experts(False), rank, WORLD), E)
    hidden, idx, weights = rank_inputs("uneven", rank)
    k = K - rank
    try:
        ep(hidden, idx[:, :k], weights[:, :k])
    except ValueError as e:
        refusals.append(str(e))
    assert torch.equal(ep(hidden, idx, weights), full_experts(False)(hidden, idx, weights))  # usable after
    # a group this process is not in
    group = dist.new_group([0])
    try:
        ExpertParallel(shard_experts(full_experts(False), 0, 1), E, group=group)
    except ValueError as e:
        refusals.append(str(e))
    torch.save(refusals, os.path.join(out_dir, f"refusals_{rank}.pt"))


@pytest.fixture(scope="module")
def ep_outputs(tmp_path_factory):
    """{(case, rank): [outputs]} from two gloo processes."""
    tmp = tmp_path_factory.mktemp("ep")
    _run_ranks(_worker, WORLD, tmp)
    outputs = {(case, r): torch.load(tmp / f"{case}_{r}.pt") for case in CASES for r in range(WORLD)}
    outputs.update({("refusals", r): torch.load(tmp / f"refusals_{r}.pt") for r in range(WORLD)})
    outputs.update({("calibration", r): torch.load(tmp / f"calibration_{r}.pt") for r in range(WORLD)})
    return outputs


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(ep_outputs, case):
    tokens, dtype, static, _, compiled = CASES[case]
    full = full_experts(static, OTHER_H.get(case, H))
    for rank in range(WORLD):
        outs = ep_outputs[case, rank]
        if compiled:
            # the transport is the one graph break; routing and combine are compiled
            breaks = outs.pop()
            assert len(breaks) == 1 and "_remote_experts" in breaks[0], breaks
        for calls, out in enumerate(outs):
            hidden, idx, weights = rank_inputs(case, rank, calls)
            ref = full(hidden, idx, weights)
            assert out.shape == (tokens[rank] + calls, OTHER_H.get(case, H)) and out.dtype == dtype
            assert_agree(out, ref)
            if dtype != torch.float32:
                # The same roundings in the same order give the same 16-bit result here; a
                # second rounding (e.g. of a partial sum) would fit the bound above but not
                # this.  float32 keeps the last-bit position effect of CPU SIMD exp
                # (tests/helpers.py, AGREE_BOUND), so only the bound holds there.
                assert torch.equal(out, ref), (case, rank, calls)
        assert len(outs) == (2 if compiled else 1)


def test_one_rank_all_sentinels_gives_zeros(ep_outputs):
    out = ep_outputs["one_rank_all_sentinels", 1][0]
    assert out.abs().sum() == 0


def test_ranks_that_disagree_raise_naming_the_argument(ep_outputs):
    assert ep_outputs["refusals", 0] == [
        "local_experts: expected the hidden_size of every rank's call, 64 on rank 0 (this one), got 96 on rank 1",
        f"top_k_index: expected the top_k of every rank's call, {K} on rank 0 (this one), got {K - 1} on rank 1"]
    assert ep_outputs["refusals", 1] == [
        "local_experts: expected this rank's shard, shard_experts(experts, 1, 2), got shard_experts(experts, 0, 2)",
        "local_experts: expected the hidden_size of every rank's call, 96 on rank 1 (this one), got 64 on rank 0",
        f"top_k_index: expected the top_k of every rank's call, {K - 1} on rank 1 (this one), got {K} on rank 0",
        "group: expected a process group this process belongs to, got one without it (global rank 1)"]


@pytest.mark.parametrize("scenario", list(CALIBRATION))
def test_calibration_over_ranks_equals_one_process(ep_outputs, scenario):
    """Each rank calibrates the experts it serves, on every rank's rows routed to them; an
    expert no rank's token reached takes the largest scale of the whole layer: the scales
    of one process holding every expert, calibrated on both ranks' batches."""
    from fp8_moe_ops import calibrate_static_scales

    full = calibrate_static_scales(full_experts(False), [b for r in range(WORLD)
                                                         for b in calibration_batches(scenario, r)])
    for i, name in enumerate(("gate_up_proj_activation_scale", "down_proj_activation_scale")):
        got = torch.cat([ep_outputs["calibration", r][scenario][1 + i] for r in range(WORLD)])
        assert torch.equal(got, getattr(full, name)), name
    assert all(ep_outputs["calibration", r][scenario][0] == "static" for r in range(WORLD))


def test_calibration_over_ranks_refuses_a_nan_on_every_rank(ep_outputs):
    """Rank 0's NaN reaches expert 5 on rank 1: both ranks raise, naming the global expert,
    and stay dynamic."""
    for r in range(WORLD):
        message, scheme = ep_outputs["calibration", r]["nan"]
        assert "the gate_up input of expert 5" in message and "model.local_experts" in message, message
        assert scheme == "dynamic"


def test_calibration_over_ranks_refused_on_one_rank_is_refused_on_every_rank(ep_outputs):
    """An Inf reaching rank 0's own linear: rank 0 names it, rank 1 says another rank
    refused; every module stays dynamic on both (before, rank 1 went static alone and a
    retry there refused at once while rank 0 waited in the forward's collectives)."""
    message, experts, head = ep_outputs["calibration", 0]["head_inf"]
    assert "NaN or Inf in model.head (FP8Linear)" in message, message
    message, experts_1, head_1 = ep_outputs["calibration", 1]["head_inf"]
    assert "got a NaN or Inf on another rank of the expert-parallel group" in message, message
    assert (experts, head, experts_1, head_1) == ("dynamic",) * 4


def _refusal_worker(rank: int, out_dir: str) -> None:
    """Four ranks, two layers' groups: pairs {0, 1}, {2, 3}, then cross pairs {0, 2},
    {1, 3}; a refusal on rank 0 only, and on none."""
    from types import SimpleNamespace

    groups = {}
    for members in ([0, 1], [2, 3], [0, 2], [1, 3]):  # (every rank makes every group, in order)
        groups[tuple(members)] = dist.new_group(members)
    layers = [SimpleNamespace(group=groups[g], local_experts=SimpleNamespace(gate_up_proj=torch.zeros(1)))
              for g in ((0, 1) if rank < 2 else (2, 3), (0, 2) if rank % 2 == 0 else (1, 3))]
    heard = [ExpertParallel._any_rank_failed(layers, rank == 0), ExpertParallel._any_rank_failed(layers, False)]
    torch.save(heard, os.path.join(out_dir, f"heard_{rank}.pt"))


def test_a_refusal_reaches_every_rank_through_overlapping_groups(tmp_path):
    # each all-reduce used to hand on the rank's own flag: rank 3, whose groups hold no
    # refusing rank, went on alone (and a retry there refused while the others waited)
    _run_ranks(_refusal_worker, 4, tmp_path)
    assert [torch.load(tmp_path / f"heard_{r}.pt") for r in range(4)] == [[True, False]] * 4


def test_single_process_group(tmp_path):
    """World size 1 (in this process): every expert is local; also the constructor's checks."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        full = full_experts(False)
        ep = ExpertParallel(shard_experts(full, 0, 1), E)
        hidden, idx, weights = rank_inputs("caller_sentinels", 0)
        assert torch.equal(ep(hidden, idx, weights), full(hidden, idx, weights))
        # each token travels once per rank (here: once if any of its ids is valid), not once per slot
        seen = []
        remote = ep._remote_experts
        ep._remote_experts = lambda payload, counts, *a: seen.append(counts) or remote(payload, counts, *a)
        ep(hidden, idx, weights)
        del ep._remote_experts
        valid = (idx >= 0) & (idx < E)
        assert seen[0][:, :2].tolist() == [[int(valid.any(1).sum()), int(valid.sum())]]
        assert int(valid.any(1).sum()) < int(valid.sum())  # the case has tokens with several slots
        # a column-major top_k_index (as FP8Experts takes it)
        assert torch.equal(ep(hidden, idx.t().contiguous().t(), weights), full(hidden, idx, weights))
        # inference-only, as the single-process ops: with inputs that require grad the output
        # does too, and a backward through it raises (the transport carries no autograd graph)
        for needs in ((True, False), (False, True)):
            h, w = hidden.clone().requires_grad_(needs[0]), weights.clone().requires_grad_(needs[1])
            out = ep(h, idx, w)
            assert out.requires_grad and torch.equal(out.detach(), full(hidden, idx, weights))
            with pytest.raises(RuntimeError, match="ExpertParallel has no autograd formula"):
                out.float().sum().backward()
            with torch.no_grad():
                assert not ep(h, idx, w).requires_grad
        # calibration reaches the local experts (the transport calls no module forward):
        # the scales of the single-process module calibrated on the same tokens
        from fp8_moe_ops import calibrate_static_scales

        batches = [rank_inputs("uneven", 0), rank_inputs("caller_sentinels", 0)]
        calibrated_ep = calibrate_static_scales(ExpertParallel(shard_experts(full_experts(False), 0, 1), E), batches)
        calibrated = calibrate_static_scales(full_experts(False), batches)
        for name in ("gate_up_proj_activation_scale", "down_proj_activation_scale"):
            assert torch.equal(getattr(calibrated_ep.local_experts, name), getattr(calibrated, name))
        assert torch.equal(calibrated_ep(hidden, idx, weights), calibrated(hidden, idx, weights))
        with pytest.raises(ValueError, match="num_experts"):
            ExpertParallel(shard_experts(full, 0, 1), E + 1)
        with pytest.raises(TypeError, match=r"num_experts: expected an int, got float 8.0"):
            ExpertParallel(shard_experts(full, 0, 1), float(E))
        with pytest.raises(TypeError, match=r"group: expected a torch.distributed.ProcessGroup or None, got list"):
            ExpertParallel(shard_experts(full, 0, 1), E, group=[0])
        # numpy's integers are integers
        assert torch.equal(ExpertParallel(shard_experts(full, np.int64(0), np.int64(1)), np.int64(E))(
            hidden, idx, weights), full(hidden, idx, weights))
        # local_experts replaced after construction by experts that are not this rank's
        # whole share: refused at the call (ids no rank serves were read as empty rows)
        replaced = ExpertParallel(shard_experts(full, 0, 1), E)
        replaced.local_experts = FP8Experts(E // 2, H, I, BLOCK, dispatch="grouped")
        with pytest.raises(ValueError, match=r"num_experts: expected local_experts.num_experts \* world_size = "
                                             r"4 \* 1, got 8"):
            replaced(hidden, idx, weights)
        replaced.local_experts = torch.nn.Identity()
        with pytest.raises(TypeError, match="local_experts: expected an FP8Experts, got Identity"):
            replaced(hidden, idx, weights)
        with pytest.raises(TypeError, match="local_experts"):
            ExpertParallel(torch.nn.Linear(2, 2), E)
        with pytest.raises(ValueError, match="hidden_states"):
            ep(hidden[:, :-1], idx, weights)
        with pytest.raises(ValueError, match="top_k_index"):
            ep(hidden, idx[:-1], weights)
        with pytest.raises(TypeError, match="top_k_index"):
            ep(hidden, idx.float(), weights)
        with pytest.raises(ValueError, match="top_k_weights"):
            ep(hidden, idx, weights[:, :-1])
        with pytest.raises(TypeError, match="top_k_weights"):
            ep(hidden, idx, idx)
        with pytest.raises(TypeError, match="hidden_states"):
            ep(hidden.long(), idx, weights)
        # as FP8Experts.forward: int32 / int64 ids, float routing weights, top_k >= 1
        with pytest.raises(TypeError, match=r"top_k_index: expected dtype torch.int32 or torch.int64 .*int16"):
            ep(hidden, idx.to(torch.int16), weights)
        with pytest.raises(TypeError, match="top_k_weights: expected dtype bfloat16, float16 or float32"):
            ep(hidden, idx, weights.double())
        with pytest.raises(ValueError, match=r"top_k_index: expected shape .* top_k >= 1"):
            ep(hidden, idx[:, :0], weights[:, :0])
        with pytest.raises(ValueError, match="hidden_states: expected a 2-D"):
            ep(hidden[None], idx[None], weights[None])
    finally:
        dist.destroy_process_group()


def test_expert_parallel_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group"):
        ExpertParallel(shard_experts(full_experts(False), 0, 2), E)


@pytest.mark.parametrize("static", [False, True])
def test_shard_experts_slices_every_tensor(static):
    full = full_experts(static)
    shards = [shard_experts(full, r, 4) for r in range(4)]
    for name, p in full.named_parameters():
        parts = [getattr(s, name) for s in shards]
        assert all(q.shape[0] == E // 4 and q.dtype == p.dtype and not q.requires_grad for q in parts)
        assert torch.equal(torch.cat([q.view(torch.uint8) if q.element_size() == 1 else q for q in parts]),
                           p.view(torch.uint8) if p.element_size() == 1 else p), name
        assert parts[1].data_ptr() != p.data_ptr()  # copies: the full module can be freed
    s = shards[2]
    assert (s.num_experts, s.hidden_size, s.intermediate_size) == (E // 4, H, I)
    assert (s.block_size, s.activation_scheme, s.dispatch) == (list(BLOCK), full.activation_scheme, "grouped")
    assert (s.gate_up_proj_activation_scale is None) == (not static)


def test_shard_experts_bad_input():
    full = full_experts(False)
    with pytest.raises(TypeError, match="experts"):
        shard_experts(torch.nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match=r"world_size: expected a divisor of num_experts=8, got 3"):
        shard_experts(full, 0, 3)
    with pytest.raises(ValueError, match="world_size"):
        shard_experts(full, 0, 0)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\), got 2"):
        shard_experts(full, 2, 2)
    with pytest.raises(ValueError, match="rank"):
        shard_experts(full, -1, 2)
    with pytest.raises(TypeError, match="rank: expected an int, got bool True"):
        shard_experts(full, True, 2)
    with pytest.raises(TypeError, match="world_size: expected an int, got str '2'"):
        shard_experts(full, 0, "2")
    with pytest.raises(TypeError, match="rank: expected an int, got Tensor"):
        shard_experts(full, torch.tensor(True), 2)
    assert shard_experts(full, np.int32(1), np.int64(2))._shard == (1, 2)


def test_package_import_leaves_parallel_out():
    """``import fp8_moe_ops`` stays light: the parallel module (and torch._dynamo, which
    its compile boundary imports) load only when asked for."""
    code = ("import sys, torch; before = 'torch._dynamo' in sys.modules; import fp8_moe_ops; "
            "print('fp8_moe_ops.parallel' in sys.modules, before == ('torch._dynamo' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
