"""transformers 5.x integration: the FP8 experts interface, quantize_experts, convert_linears
on transformers' own FP8Linear.  Tiny Qwen3-MoE models from the real config class, random
weights quantised by this package; no network, no hub.  Skipped without transformers 5.x."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from helpers import REL_BOUND, rel_err

transformers = pytest.importorskip("transformers")
_tf_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
if not hasattr(_tf_fp8, "ALL_FP8_EXPERTS_FUNCTIONS"):
    pytest.skip(f"transformers {transformers.__version__} has no FP8 experts interface", allow_module_level=True)

from transformers import FineGrainedFP8Config, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, replace_with_fp8_linear  # noqa: E402
from transformers.integrations.finegrained_fp8 import FP8Experts as TfFP8Experts  # noqa: E402
from transformers.integrations.finegrained_fp8 import FP8Linear as TfFP8Linear  # noqa: E402

import fp8_moe_ops  # noqa: E402
from fp8_moe_ops import FP8Experts, FP8Linear, calibrate_static_scales, reference  # noqa: E402
from fp8_moe_ops.integrations import transformers as integration  # noqa: E402
from fp8_moe_ops.integrations.convert import convert_linears  # noqa: E402

H, I, E, TOPK, VOCAB = 64, 64, 4, 2, 128
# fp8 e4m3 keeps 3 mantissa bits: one expert layer (weights and activations quantised, two
# GEMMs) measures 0.06 relative error against bf16, 2-layer logits 0.05-0.16 (seeds 0-2,
# routing flips amplify it).  A wrong activation measures 0.16 at the layer, dropping the
# experts 0.9 on the logits; exactness is checked against the ops elsewhere.
EXPERTS_BOUND, LOGITS_BOUND = 0.1, 0.25


def tiny_config(**overrides) -> Qwen3MoeConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=E, num_experts_per_tok=TOPK,
              decoder_sparse_step=1, max_position_embeddings=64, norm_topk_prob=True)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def bf16_model(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**overrides)).to(torch.bfloat16).eval()
    # Larger weights than the 0.02 init, so that quantisation and routing matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.15)
    return model


def batches(n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(n)]


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model(ids).logits.float()


def ours_model(ref, scheme: str, block_size) -> Qwen3MoeForCausalLM:
    """bf16 model -> this package's FP8 (attention FP8Linear, experts FP8Experts), the source
    of truth from which the transformers-layout model below is filled."""
    model = copy.deepcopy(ref)
    # the fused experts are no linear layers: convert_linears says what quantises them
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.experts \(Qwen3MoeExperts\): gate_up_proj, "
                                         r"down_proj.*quantize_experts"):
        convert_linears(model, block_size=block_size)
    integration.quantize_experts(model, block_size=block_size)
    if scheme == "static":
        calibrate_static_scales(model, batches())
    return model


def transformers_fp8_model(ours, scheme: str, block_size) -> Qwen3MoeForCausalLM:
    """The model transformers builds for a FineGrainedFP8 checkpoint (its own FP8Linear and
    FP8Experts, from ``replace_with_fp8_linear``), holding the same tensors as ``ours``."""
    model = copy.deepcopy(ours)
    qc = FineGrainedFP8Config(activation_scheme=scheme, weight_block_size=block_size, modules_to_not_convert=["lm_head"])
    # Start from plain modules, as transformers does before loading the checkpoint.
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FP8Linear):
                setattr(parent, name, torch.nn.Linear(child.in_features, child.out_features, bias=False))
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qc)
    src = dict(ours.named_modules())
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, (TfFP8Linear, TfFP8Experts)):
                mod.to_empty(device="cpu")
                for pname, p in mod.named_parameters(recurse=False):
                    p.copy_(getattr(src[name], pname).reshape(p.shape))
    return model


def run_as_transformers(model, ids, impl: str) -> torch.Tensor:
    """transformers' FP8Linear needs hub kernels (GPU); converting it shares its tensors."""
    model = convert_linears(copy.deepcopy(model))
    model.set_experts_implementation(impl)
    return logits(model, ids)


def test_fast_attribute_reads_agree_with_getattr():
    # the experts forward's attribute reads (integration._attr) return what getattr does,
    # for every kind of attribute a transformers experts module has, and raise as it does
    class Experts(torch.nn.Module):
        flag_on_class = True

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2), requires_grad=False)
            self.register_buffer("scale", torch.ones(1))
            self.act_fn = torch.nn.SiLU()
            self.has_gate, self.block_size, self.limit = False, None, 7.0

        @property
        def computed(self):
            return "from a property"

    class WithGetattr(Experts):
        def __getattr__(self, name):
            if name == "forwarded":
                return "from __getattr__"
            return super().__getattr__(name)

    for module in (Experts(), WithGetattr()):
        names = ["weight", "scale", "act_fn", "has_gate", "block_size", "limit", "flag_on_class", "computed",
                 "missing", "training"] + (["forwarded"] if isinstance(module, WithGetattr) else [])
        for name in names:
            assert integration._attr(module, name, "default") is getattr(module, name, "default"), name
        with pytest.raises(AttributeError, match="missing"):
            integration._attr(module, "missing")


def test_import_does_not_import_transformers():
    code = "import sys, fp8_moe_ops; from fp8_moe_ops.integrations import convert; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_names_registered_and_accepted(tmp_path):
    assert {integration.GROUPED, integration.BATCHED} <= set(ALL_FP8_EXPERTS_FUNCTIONS.keys())
    model = bf16_model()
    model.save_pretrained(tmp_path)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation=integration.BATCHED)
    assert loaded.config._experts_implementation == integration.BATCHED
    model.set_experts_implementation(integration.GROUPED)
    assert model.config._experts_implementation == integration.GROUPED
    # bf16 experts (not quantised) say what to do instead of running.
    with pytest.raises(TypeError, match="quantize_experts"):
        logits(model, batches(1)[0])
    # the package's own module runs the ops itself (this function read transformers' act_fn of it)
    ours = FP8Experts.from_float(torch.randn(4, 16, 32), torch.randn(4, 32, 8), block_size=(16, 16))
    with pytest.raises(TypeError, match="self: expected a transformers experts module, got fp8_moe_ops.FP8Experts"):
        integration.fp8_moe_grouped_forward(ours, torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.long),
                                            torch.ones(2, 1))


def test_fixed_name_list_validator_is_handled(monkeypatch):
    # transformers 5.0 checked names against ["eager", "grouped_mm", "batched_mm"].
    def fixed_list(self, requested_experts):
        applicable = "grouped_mm" if requested_experts is None else requested_experts
        if applicable not in ["eager", "grouped_mm", "batched_mm"]:
            raise ValueError(f'Specified `experts_implementation="{applicable}"` is not supported.')
        return applicable

    cls = transformers.modeling_utils.PreTrainedModel
    monkeypatch.setattr(cls, "get_correct_experts_implementation", fixed_list)
    model = bf16_model()
    with pytest.raises(ValueError, match="not supported"):
        model.set_experts_implementation(integration.GROUPED)
    integration.register()
    model.set_experts_implementation(integration.BATCHED)
    assert model.config._experts_implementation == integration.BATCHED
    with pytest.raises(ValueError, match="not supported"):
        model.set_experts_implementation("not_a_name")


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_finegrained_fp8_model_runs_through_fp8_moe_ops(scheme):
    block = (32, 32)  # I = 64: two scale rows per half, the usual aligned layout
    ref = bf16_model()
    ours = ours_model(ref, scheme, block)
    tf_model = transformers_fp8_model(ours, scheme, block)
    experts = [m for m in tf_model.modules() if isinstance(m, TfFP8Experts)]
    assert len(experts) == 2 and all(m.activation_scheme == scheme for m in experts)
    ids = batches(1, seed=7)[0]
    expected = logits(ours, ids)
    # Same tensors, same ops, same activation scales: identical logits.
    assert torch.equal(run_as_transformers(tf_model, ids, integration.GROUPED), expected)
    batched = run_as_transformers(tf_model, ids, integration.BATCHED)
    assert rel_err(batched, expected) < 1e-2
    assert rel_err(expected, logits(ref, ids)) < LOGITS_BOUND


def _experts_module(block_size, scheme="dynamic", **config):
    cfg = tiny_config(**config)
    cls = transformers.integrations.moe.use_experts_implementation(
        experts_class=TfFP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    mod = cls(cfg, block_size=block_size, activation_scheme=scheme)
    return mod, cfg


def _fill_like_checkpoint(mod, gate, up, down, block_size):
    """Quantises gate, up (E, I, H) and down (E, H, I) separately, as a checkpoint stores them,
    and concatenates gate and up with their scale grids, as transformers' loader does."""
    def q(w):
        if block_size is None:
            s = w.abs().amax(dim=(1, 2), keepdim=True) / reference.FP8_MAX
            return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn), s
        return fp8_moe_ops.quantize_weight(w, block_size)

    (gq, gs), (uq, us), (dq, ds) = q(gate), q(up), q(down)
    with torch.no_grad():
        mod.gate_up_proj.data = torch.cat([gq, uq], dim=1)
        mod.gate_up_proj_scale_inv.data = torch.cat([gs, us], dim=1)
        mod.down_proj.data, mod.down_proj_scale_inv.data = dq, ds
    return (gq.float() * _expand(gs, gq.shape), uq.float() * _expand(us, uq.shape), dq.float() * _expand(ds, dq.shape))


def _expand(s, shape):
    _, n, k = shape
    return s.repeat_interleave(-(-n // s.shape[1]), 1)[:, :n].repeat_interleave(-(-k // s.shape[2]), 2)[:, :, :k]


@pytest.mark.parametrize("block_size", [(128, 128), None], ids=["padded_block_grid", "per_tensor"])
@pytest.mark.parametrize("impl", [integration.GROUPED, integration.BATCHED])
def test_gate_and_up_scales_of_a_padded_grid_are_both_used(block_size, impl):
    # I = 32 < 128: transformers allocates gate_up_proj_scale_inv with max(ceil(2I/128), 2) = 2
    # rows (min_sf_out=2); a checkpoint fills them with the gate's and the up's own scales.
    # The up half is made 64x larger than the gate half, so using the gate's scale for it
    # (slicing the grid to 1 row) would be wrong by orders of magnitude.
    i = 32
    mod, cfg = _experts_module(block_size, moe_intermediate_size=i)
    gen = torch.Generator().manual_seed(3)
    gate = torch.randn(E, i, H, generator=gen) * 0.1
    up = torch.randn(E, i, H, generator=gen) * 6.4
    down = torch.randn(E, H, i, generator=gen) * 0.1
    assert mod.gate_up_proj_scale_inv.shape[1] == 2
    g, u, d = _fill_like_checkpoint(mod, gate, up, down, block_size)
    cfg._experts_implementation = impl
    x = torch.randn(16, H, generator=gen).to(torch.bfloat16)
    idx = torch.topk(torch.rand(16, E, generator=gen), TOPK).indices
    w = torch.rand(16, TOPK, generator=gen)
    out = mod(x, idx, w)
    # float64 on the dequantised weights (bf16 input, no activation quantisation): the
    # error bound covers fp8 activations and bf16 rounding, not a wrong scale.
    xd = x.double()
    expected = torch.zeros(16, H, dtype=torch.float64)
    for t in range(16):
        for j in range(TOPK):
            e = idx[t, j]
            h = torch.nn.functional.silu(xd[t] @ g[e].double().T) * (xd[t] @ u[e].double().T)
            expected[t] += w[t, j].double() * (h @ d[e].double().T)
    assert rel_err(out, expected) < 0.08


def test_static_scales_reach_the_ops():
    mod, cfg = _experts_module((32, 32), scheme="static")
    gen = torch.Generator().manual_seed(4)
    _fill_like_checkpoint(mod, torch.randn(E, I, H, generator=gen) * 0.1, torch.randn(E, I, H, generator=gen) * 0.1,
                          torch.randn(E, H, I, generator=gen) * 0.1, (32, 32))
    x = torch.randn(8, H, generator=gen).to(torch.bfloat16) * 8  # saturates a static scale of 1/448
    idx = torch.topk(torch.rand(8, E, generator=gen), TOPK).indices
    w = torch.rand(8, TOPK, generator=gen)
    with torch.no_grad():
        mod.gate_up_proj_activation_scale.fill_(1 / 448)
        mod.down_proj_activation_scale.fill_(1 / 448)
    cfg._experts_implementation = integration.GROUPED
    out = mod(x, idx, w)
    args = (x, idx, w, mod.gate_up_proj, mod.gate_up_proj_scale_inv, mod.down_proj, mod.down_proj_scale_inv, [32, 32])
    static = torch.ops.fp8_moe.grouped_experts(*args, "silu", mod.gate_up_proj_activation_scale,
                                               mod.down_proj_activation_scale)
    assert torch.equal(out, static)
    assert not torch.equal(out, torch.ops.fp8_moe.grouped_experts(*args, "silu"))


@pytest.mark.parametrize("impl, op", [(integration.GROUPED, "grouped_experts"), (integration.BATCHED, "batched_experts")])
def test_the_plug_in_calls_the_kernel_directly_in_plain_eager_calls(monkeypatch, impl, op):
    # as FP8Experts: without the dispatcher where nothing between would act (here: no
    # grad to record), through it otherwise; the same output either way
    from fp8_moe_ops import ops

    mod, cfg = _experts_module((32, 32))
    gen = torch.Generator().manual_seed(5)
    _fill_like_checkpoint(mod, torch.randn(E, I, H, generator=gen) * 0.1, torch.randn(E, I, H, generator=gen) * 0.1,
                          torch.randn(E, H, I, generator=gen) * 0.1, (32, 32))
    x = torch.randn(8, H, generator=gen).to(torch.bfloat16).requires_grad_()
    idx = torch.topk(torch.rand(8, E, generator=gen), TOPK).indices
    w = torch.rand(8, TOPK, generator=gen)
    cfg._experts_implementation = impl
    kernel, calls = ops._KERNELS[op]["cpu"], []
    monkeypatch.setitem(ops._KERNELS[op], "cpu", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        direct = mod(x, idx, w)
    assert len(calls) == 1
    dispatched = mod(x, idx, w)  # x requires grad: the op's autograd kernel
    assert len(calls) == 1 and dispatched.requires_grad
    assert torch.equal(direct, dispatched.detach())


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(swiglu_alpha=1.702, swiglu_limit=7.0), "swiglu_alpha"),
        (dict(hidden_act="gelu_fast"), "act_fn"),
    ],
    ids=["gpt_oss_gate", "activation"],
)
def test_unsupported_gates_raise(config, match):
    mod, cfg = _experts_module((32, 32), **config)
    mod.to_empty(device="cpu")
    cfg._experts_implementation = integration.GROUPED
    x = torch.randn(4, H, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=match):
        mod(x, torch.zeros(4, TOPK, dtype=torch.long), torch.ones(4, TOPK))


def test_ungated_and_fp4_experts_raise():
    x = torch.randn(4, H, dtype=torch.bfloat16)
    routing = (torch.zeros(4, TOPK, dtype=torch.long), torch.ones(4, TOPK))
    mod, _ = _experts_module((32, 32))
    mod.has_gate = False
    with pytest.raises(NotImplementedError, match="has_gate=False"):
        integration.fp8_moe_grouped_forward(mod, x, *routing)
    mod, _ = _experts_module((32, 32))
    mod.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * I, H // 2, dtype=torch.int8), requires_grad=False)
    with pytest.raises(NotImplementedError, match="fp4"):
        integration.fp8_moe_batched_forward(mod, x, *routing)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_quantize_experts_close_to_bf16(scheme):
    ref = bf16_model()
    calibration = batches()
    model = integration.quantize_experts(copy.deepcopy(ref), scheme, calibration if scheme == "static" else None,
                                        block_size=(32, 32))
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    assert len(experts) == 2 and all(m.activation_scheme == scheme and m.dispatch == "grouped" for m in experts)
    if scheme == "static":
        assert all(bool((m.gate_up_proj_activation_scale > 0).all()) for m in experts)
    # Only the experts change: attention and head stay bf16 nn.Linear.
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == sum(
        isinstance(m, torch.nn.Linear) for m in ref.modules())
    # The first experts layer on the inputs the bf16 model gives it (a calibration batch,
    # so static scales see no value beyond their range).
    seen = {}
    bf16_experts = ref.model.layers[0].mlp.experts
    hook = bf16_experts.register_forward_hook(lambda mod, args, out: seen.update(args=args, out=out))
    logits(ref, calibration[0])
    hook.remove()
    with torch.no_grad():
        out = model.model.layers[0].mlp.experts(*seen["args"])
    assert rel_err(out, seen["out"]) < EXPERTS_BOUND
    ids = batches(1, seed=9)[0]
    assert rel_err(logits(model, ids), logits(ref, ids)) < LOGITS_BOUND


def test_quantize_experts_calibrates_on_mapping_and_tuple_batches():
    # a tokenizer's BatchEncoding (a mapping) runs as model(**batch), (input_ids,
    # attention_mask) as model(*batch): the same scales as the bare input_ids
    ref = bf16_model()
    ids = batches(1)[0]
    mask = torch.ones_like(ids)
    want = integration.quantize_experts(copy.deepcopy(ref), "static", [ids], block_size=(32, 32))
    for batch in ({"input_ids": ids, "attention_mask": mask}, (ids, mask)):
        model = integration.quantize_experts(copy.deepcopy(ref), "static", [batch], block_size=(32, 32))
        got, expected = model.model.layers[0].mlp.experts, want.model.layers[0].mlp.experts
        assert torch.equal(got.gate_up_proj_activation_scale, expected.gate_up_proj_activation_scale)
        assert torch.equal(got.down_proj_activation_scale, expected.down_proj_activation_scale)


def test_quantize_experts_compiles_fullgraph():
    ref = bf16_model()
    model = integration.quantize_experts(copy.deepcopy(ref), "static", batches(), block_size=(32, 32))
    ids = batches(1, seed=5)[0]
    eager = logits(model, ids)
    torch._dynamo.reset()
    # The captured graph (no Inductor codegen) computes exactly what eager does.
    assert torch.equal(logits(torch.compile(model, fullgraph=True, backend="aot_eager"), ids), eager)
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        out = logits(torch.compile(model, fullgraph=True), ids)
    if torch.__version__ >= (2, 13):
        # with emulate_precision_casts Inductor rounds every bf16 intermediate as eager does
        assert torch.equal(out, eager)
    else:
        # older Inductor rounds some bf16 intermediates differently (0.07 measured on
        # 2.11): fp8 rounding boundaries and routing flips turn last-bit differences
        # into a few percent, so the bound is the fp8 one
        assert rel_err(out, eager) < LOGITS_BOUND
    assert rel_err(out, logits(ref, ids)) < LOGITS_BOUND


def test_quantize_experts_compiles_outside_no_grad_and_refuses_backward():
    # a model called without torch.no_grad(): its hidden states require grad (the
    # embedding's weights do), so torch.compile also traces a backward through the experts
    # op; the forward compiles and matches eager, and a backward raises when it runs
    ref = bf16_model()
    model = integration.quantize_experts(copy.deepcopy(ref), "dynamic", block_size=(32, 32))
    ids = batches(1, seed=6)[0]
    eager = logits(model, ids)
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert out.requires_grad
    assert torch.equal(out.detach().float(), eager)
    with pytest.raises(RuntimeError, match="fp8_moe::grouped_experts has no autograd formula"):
        out.float().sum().backward()


def test_quantize_experts_keeps_shared_experts_shared():
    # one experts module in two layers and under two names of one parent: one FP8Experts in all
    # three places (named_children() lists a module held twice by one parent once)
    ref = bf16_model()
    shared = ref.model.layers[0].mlp.experts
    ref.model.layers[1].mlp.experts = shared
    ref.model.layers[0].mlp.register_module("experts_alias", shared)
    model = integration.quantize_experts(copy.deepcopy(ref), "static", batches(1))
    new = model.model.layers[0].mlp.experts
    assert isinstance(new, FP8Experts) and new.activation_scheme == "static"
    assert model.model.layers[1].mlp.experts is new and model.model.layers[0].mlp.experts_alias is new


class _SeparateGateUpExperts(torch.nn.Module):
    """A family's shared experts with 3-D gate_proj / up_proj / down_proj and a forward of
    their own (Inkling's, say): not the experts interface's fused layout."""

    def __init__(self, E=2, H=64, I=32):
        super().__init__()
        gen = torch.Generator().manual_seed(E)
        self.gate_proj = torch.nn.Parameter(torch.randn(E, I, H, generator=gen))
        self.up_proj = torch.nn.Parameter(torch.randn(E, I, H, generator=gen))
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=gen))


def test_quantize_experts_leaves_experts_without_a_fused_gate_up_with_a_warning():
    # one such module beside the routed experts used to refuse the whole model
    model = bf16_model()
    other = _SeparateGateUpExperts()
    model.model.layers[0].mlp.register_module("shared_experts_3d", other)
    model.model.layers[1].mlp.register_module("shared_experts_3d", other)  # named once
    with pytest.warns(UserWarning, match=r"left \w+\.shared_experts_3d \(_SeparateGateUpExperts\) in their own "
                                         r"dtype: a 3-D"):
        integration.quantize_experts(model)
    assert isinstance(model.model.layers[0].mlp.experts, FP8Experts)
    assert model.model.layers[0].mlp.shared_experts_3d is other
    holder = torch.nn.Module()
    holder.only = _SeparateGateUpExperts()
    with pytest.raises(ValueError, match=r"found none \(0 already quantised; without a fused gate_up_proj: 1\)"):
        integration.quantize_experts(holder)
    with pytest.raises(ValueError, match=r"found none \(0 already quantised\)"):  # not "itself": no such experts
        integration.quantize_experts(holder.only)


def test_quantized_model_refuses_save_pretrained_and_round_trips_through_its_state_dict(tmp_path):
    # save_pretrained wrote fp8 weights under the bf16 names, which from_pretrained loaded as
    # bf16 values without their scales (garbage logits, no error)
    ref = bf16_model()
    model = integration.quantize_experts(copy.deepcopy(ref), "static", batches(1))
    with pytest.raises(NotImplementedError, match=r"save_pretrained: .* save model.state_dict\(\) with torch.save"):
        model.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="save_pretrained"):
        copy.deepcopy(model).save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh = integration.quantize_experts(bf16_model(seed=1), "static", batches(1))
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    ids = batches()[0]
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    ref.save_pretrained(tmp_path / "bf16")  # the unquantised model is untouched


def test_quantize_experts_rejects_bad_arguments():
    ref = bf16_model()
    with pytest.raises(ValueError, match="calibration_batches"):
        integration.quantize_experts(copy.deepcopy(ref), "static")
    with pytest.raises(ValueError, match="calibration_batches"):
        integration.quantize_experts(copy.deepcopy(ref), "dynamic", batches())
    with pytest.raises(ValueError, match="activation_scheme"):
        integration.quantize_experts(copy.deepcopy(ref), "per_tensor")
    with pytest.raises(ValueError, match="found none"):
        integration.quantize_experts(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"found none \(2 already quantised\)"):
        integration.quantize_experts(integration.quantize_experts(copy.deepcopy(ref)))
    # the experts module itself: replaced where it is held, so its parent is what to pass
    with pytest.raises(ValueError, match=r"model: expected a module containing the experts .* got the experts "
                                         r"module \w+ itself"):
        integration.quantize_experts(copy.deepcopy(ref).model.layers[0].mlp.experts)
    ids = batches()[0]
    # one batch, not a list of batches: its rows would have been fed as batches
    with pytest.raises(TypeError, match=r"calibration_batches: expected an iterable of batches .*, got Tensor"):
        integration.quantize_experts(copy.deepcopy(ref), "static", ids)
    # one (input_ids, attention_mask) batch alone: the mask would have run as token ids, silently
    with pytest.raises(TypeError, match=r"calibration_batches: expected an iterable of batches, not a tuple of "
                                        r"tensors, .*got a tuple of 2 tensors"):
        integration.quantize_experts(copy.deepcopy(ref), "static", (ids, torch.ones_like(ids)))
    # a NaN reaching the experts in calibration: the error names them by their path in the
    # model, and the model gets its experts back (the call can be retried)
    nan_model = copy.deepcopy(ref)
    original = nan_model.model.layers[0].mlp.experts
    with torch.no_grad():
        nan_model.model.embed_tokens.weight[ids[0, 0]] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf in model\.model\.layers\.0\.mlp\.experts \(FP8Experts\)"):
        integration.quantize_experts(nan_model, "static", [ids])
    assert nan_model.model.layers[0].mlp.experts is original
    assert not any(isinstance(m, FP8Experts) for m in nan_model.modules())
    with pytest.raises(NotImplementedError, match="act_fn"):
        integration.quantize_experts(bf16_model(hidden_act="gelu_fast"))
    with pytest.raises(TypeError, match=r"block_size: expected a pair \(bn, bk\) of positive ints, got 128"):
        integration.quantize_experts(copy.deepcopy(ref), block_size=128)
    with pytest.raises(ValueError, match="dispatch: expected one of"):
        integration.quantize_experts(copy.deepcopy(ref), dispatch="group")
    with pytest.raises(TypeError, match="scale_dtype: expected"):
        integration.quantize_experts(copy.deepcopy(ref), scale_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        integration.quantize_experts("Qwen/Qwen3-30B-A3B")


def test_convert_linears_shares_transformers_fp8_weights():
    ref = bf16_model()
    ours = ours_model(ref, "static", (32, 32))
    tf_model = transformers_fp8_model(ours, "static", (32, 32))
    tf_linears = {n: m for n, m in tf_model.named_modules() if isinstance(m, TfFP8Linear)}
    assert tf_linears
    convert_linears(tf_model)
    converted = dict(tf_model.named_modules())
    for name, tf in tf_linears.items():
        new = converted[name]
        assert isinstance(new, FP8Linear) and new.activation_scheme == "static"
        assert new.weight.data_ptr() == tf.weight.data_ptr()
        assert new.weight_scale_inv.data_ptr() == tf.weight_scale_inv.data_ptr()
        assert new.activation_scale.data_ptr() == tf.activation_scale.data_ptr()
        assert new.block_size == [32, 32]
    assert isinstance(converted["lm_head"], torch.nn.Linear)


def test_convert_linears_per_tensor_transformers_fp8():
    tf = TfFP8Linear(64, 48, block_size=None)
    w = torch.randn(48, 64) * 0.1
    s = w.abs().amax() / reference.FP8_MAX
    with torch.no_grad():
        tf.weight.data = (w / s).to(torch.float8_e4m3fn)
        tf.weight_scale_inv.data = s.reshape(())
    new = convert_linears(tf)
    assert isinstance(new, FP8Linear) and new.weight_scale_inv.shape == (1, 1)
    assert new.weight_scale_inv.data_ptr() == tf.weight_scale_inv.data_ptr()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert rel_err(new(x), x.double() @ (tf.weight.double() * s.double()).T) < 0.08


@pytest.mark.skipif(not hasattr(_tf_fp8, "FP8GroupedLinear"), reason="no FP8GroupedLinear in this transformers")
def test_convert_linears_leaves_a_subclass_of_transformers_fp8_linear_alone():
    # DeepSeek-V4's block-diagonal FP8GroupedLinear: as a plain FP8Linear its groups would be dropped
    grouped = _tf_fp8.FP8GroupedLinear(32, 64, n_groups=4, block_size=(16, 32))
    model = torch.nn.Sequential(grouped, TfFP8Linear(64, 32, block_size=(16, 32)))
    with torch.no_grad():  # transformers allocates them empty: the shared scales must be valid ones
        model[1].weight_scale_inv.fill_(1.0)
    convert_linears(model)
    assert model[0] is grouped and isinstance(model[1], FP8Linear)


def _experts_container(experts: torch.nn.Module) -> torch.nn.Module:
    container = torch.nn.Module()
    container.experts = experts
    return container


def _routing(T: int = 24, seed: int = 6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.topk(torch.rand(T, E, generator=gen), TOPK).indices
    return x, idx, torch.rand(T, TOPK, generator=gen).to(torch.bfloat16)


@transformers.integrations.moe.use_experts_implementation(is_transposed=True)
class TransposedExperts(torch.nn.Module):
    """Experts stored (E, H, 2I) / (E, I, H) for ``x @ w``, as Aria's (transformers 5.24)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, H, 2 * I) * 0.15)
        self.down_proj = torch.nn.Parameter(torch.randn(E, I, H) * 0.15)
        self.act_fn = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            gate, up = (hidden_states[tok] @ self.gate_up_proj[e]).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e]
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


def test_quantize_experts_transposed_layout():
    torch.manual_seed(0)
    config = tiny_config()
    config._experts_implementation = "eager"
    experts = TransposedExperts(config).to(torch.bfloat16)
    assert experts.is_transposed
    container = integration.quantize_experts(_experts_container(copy.deepcopy(experts)), block_size=(32, 32))
    assert container.experts.gate_up_proj.shape == (E, 2 * I, H)
    x, idx, w = _routing()
    with torch.no_grad():
        assert rel_err(container.experts(x, idx, w), experts(x, idx, w)) < EXPERTS_BOUND


def test_quantize_experts_refuses_what_the_ops_cannot_express():
    def experts_class(**flags):
        @transformers.integrations.moe.use_experts_implementation(**flags)
        class Experts(torch.nn.Module):
            def __init__(self, config):
                super().__init__()
                self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H))
                self.up_proj = torch.nn.Parameter(torch.randn(E, I, H))
                self.down_proj = torch.nn.Parameter(torch.randn(E, H, I))
                self.act_fn = torch.nn.SiLU()

        return Experts

    class CustomGate(experts_class()):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * (up + 1)

    cases = [(experts_class(has_gate=False), "has_gate=False"), (experts_class(has_bias=True), "has_bias"),
             (experts_class(is_concatenated=False), "is_concatenated=False"), (CustomGate, "_apply_gate")]
    for cls, match in cases:
        model = _experts_container(cls(tiny_config()))
        with pytest.raises(NotImplementedError, match=match):
            integration.quantize_experts(model)
        assert not any(isinstance(m, FP8Experts) for m in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@pytest.mark.parametrize("impl", [integration.GROUPED, integration.BATCHED])
@pytest.mark.parametrize("i", [128, 32], ids=["fused_op", "padded_grid"])
def test_cuda_kernels_match_cpu(scheme, impl, i):
    mod, cfg = _experts_module((128, 128), scheme, moe_intermediate_size=i, hidden_size=256)
    gen = torch.Generator().manual_seed(8)
    _fill_like_checkpoint(mod, torch.randn(E, i, 256, generator=gen) * 0.1, torch.randn(E, i, 256, generator=gen),
                          torch.randn(E, 256, i, generator=gen) * 0.1, (128, 128))
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16)
    idx = torch.topk(torch.rand(40, E, generator=gen), TOPK).indices
    w = torch.rand(40, TOPK, generator=gen)
    if scheme == "static":
        with torch.no_grad():
            mod.gate_up_proj_activation_scale.fill_(x.float().abs().amax().item() / 448)
            mod.down_proj_activation_scale.fill_(0.01)
    cfg._experts_implementation = impl
    with torch.no_grad():
        expected = mod(x, idx, w)
        out = mod.cuda()(x.cuda(), idx.cuda(), w.cuda()).cpu()
    assert rel_err(out, expected) < REL_BOUND[torch.bfloat16]
