"""convert_linears on Mixtral-style ``nn.ModuleList`` experts, the MoE block of transformers 4.x.

The block below is written as transformers 4.44 wrote ``MixtralSparseMoeBlock`` (w1/w3/w2
experts, a one-hot expert mask, ``for expert_idx in range(num_experts)``), so these tests
run without transformers.  The ``transformers_4x`` cases use transformers' own 4.x classes
and run only where transformers 4.x is installed (CI: a venv with transformers 4.44.2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import REL_BOUND, rel_err
from torch import nn

import fp8_moe_ops
from fp8_moe_ops import FP8Linear
from fp8_moe_ops.integrations.convert import convert_linears

H, FFN, E, TOPK = 64, 96, 5, 2  # prime E; FFN not a multiple of the 64 block
BLOCK = (64, 64)
# One expert layer with fp8 weights and activations (3 mantissa bits, two GEMMs) measures
# ~0.06 relative error against its float weights; a wrong expert, scale or activation
# gives errors of order 0.2-1.
EXPERTS_BOUND = 0.1


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class MixtralSparseMoeBlock(nn.Module):
    """transformers 4.44's loop, line for line (jitter noise left out: eval only)."""

    def __init__(self):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = H, E, TOPK
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP() for _ in range(E)])

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


def _transformers_4x():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip(f"needs transformers 4.x (its ModuleList Mixtral), got {transformers.__version__}")
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral

    config = MixtralConfig(vocab_size=128, hidden_size=H, intermediate_size=FFN, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                           num_experts_per_tok=TOPK, max_position_embeddings=64)
    return config, modeling_mixtral


def make_block(source: str) -> nn.Module:
    torch.manual_seed(0)
    if source == "handwritten":
        block = MixtralSparseMoeBlock()
    else:
        config, modeling_mixtral = _transformers_4x()
        block = modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block.to(torch.bfloat16).eval()


def hidden(T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


SOURCES = ["handwritten", "transformers_4x"]


@pytest.mark.parametrize("source", SOURCES)
def test_convert_linears_quantises_experts_and_keeps_router(source):
    block = make_block(source)
    float_block = make_block(source)
    convert_linears(block, block_size=BLOCK)
    assert isinstance(block.gate, nn.Linear) and not isinstance(block.gate, FP8Linear)
    for expert in block.experts:
        for name in ("w1", "w2", "w3"):
            lin = getattr(expert, name)
            assert isinstance(lin, FP8Linear) and lin.weight.dtype == torch.float8_e4m3fn
    q, s = fp8_moe_ops.quantize_weight(float_block.experts[3].w2.weight, BLOCK)
    assert torch.equal(block.experts[3].w2.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(block.experts[3].w2.weight_scale_inv, s)
    x = hidden()
    with torch.no_grad():
        out, logits = block(x)
        ref_out, ref_logits = float_block(x)
    assert torch.equal(logits, ref_logits)  # the router stayed bf16: same routing
    assert rel_err(out, ref_out) < EXPERTS_BOUND


def test_skip_matches_the_attribute_name_exactly_and_keeps_what_is_inside():
    model = nn.Module()
    for name in ("gate", "gate_proj", "router", "lm_head", "head", "up"):
        setattr(model, name, nn.Linear(32, 16))
    model.inner = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
    model.inner.lm_head = nn.Linear(32, 8)
    # routers holding their linear layer under another name (SwitchTransformers' router.classifier,
    # HunYuan's gate.wg): quantised, they route tokens to other experts
    model.block = nn.Module()
    model.block.router, model.block.gate = nn.Module(), nn.Module()
    model.block.router.classifier, model.block.gate.wg = nn.Linear(32, 8), nn.Linear(32, 8)
    model.block.gate_proj = nn.Sequential(nn.Linear(32, 32))
    convert_linears(model, block_size=(16, 16))
    kept = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert kept == {"gate", "router", "lm_head", "inner.lm_head", "block.router.classifier", "block.gate.wg"}
    assert isinstance(model.block.gate_proj[0], FP8Linear)
    assert isinstance(model.gate_proj, FP8Linear) and isinstance(model.inner[0], FP8Linear)
    convert_linears(model, skip=(), block_size=(16, 16))
    assert not any(type(m) is nn.Linear for m in model.modules())
    with pytest.raises(TypeError, match="skip"):
        convert_linears(model, skip="gate")


def test_bias_and_root_linear():
    torch.manual_seed(2)
    lin = nn.Linear(40, 24, bias=True)
    new = convert_linears(lin, block_size=(16, 16))
    assert isinstance(new, FP8Linear) and new.bias is not None
    x = torch.randn(7, 40)
    assert rel_err(new(x), lin(x)) < EXPERTS_BOUND
    seq = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert convert_linears(seq, block_size=(8, 8)) is seq


def test_transformers_4x_mixtral_model_end_to_end():
    config, modeling_mixtral = _transformers_4x()
    torch.manual_seed(0)
    ref = modeling_mixtral.MixtralForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.1)
    model = modeling_mixtral.MixtralForCausalLM(config).to(torch.bfloat16).eval()
    model.load_state_dict(ref.state_dict())
    convert_linears(model, block_size=BLOCK)
    kept = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is nn.Linear}
    assert kept == {"gate", "lm_head"}
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 2 * (4 + 3 * E)  # q, k, v, o and w1, w2, w3 of every expert, per layer
    # Each converted MoE block against the bf16 block on the inputs it saw in the fp8 model
    # (whole-model logits of a 2-layer toy amplify attention rounding through softmax).
    seen = []
    hooks = [layer.block_sparse_moe.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
             for layer in model.model.layers]
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        for hook in hooks:
            hook.remove()
        assert len(seen) == 2
        for layer, (args, (out, router_logits)) in zip(ref.model.layers, seen):
            expected, expected_logits = layer.block_sparse_moe(*args)
            assert torch.equal(router_logits, expected_logits)
            assert rel_err(out, expected) < EXPERTS_BOUND


def _pass_module():
    passes = pytest.importorskip("fp8_moe_ops.passes")
    if not hasattr(passes, "enabled"):
        pytest.skip("fp8_moe_ops.passes.enabled() is not available yet")
    return passes


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(
    "block_size",
    # FFN = 96: 64-row gate and up scale blocks could not be stacked into one (2I, H) grid;
    # the list op reads gate and up as separate matrices, so both are rewritten
    [(32, 32), (64, 64)], ids=["I_multiple_of_block", "I_not_multiple_of_block"],
)
def test_compile_with_pass_rewrites_the_converted_loop(source, block_size):
    passes = _pass_module()
    block = convert_linears(make_block(source), block_size=block_size)
    x = hidden()
    with torch.no_grad():
        eager, _ = block(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # ModuleList experts under plain torch.compile (no freezing): the weights are graph inputs.
    # Counters are only bumped when the pass runs: no FX graph cache hit (the two sources
    # give the same graph; the environment variable would be read only at import).
    with passes.enabled(), torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        compiled, _ = torch.compile(block, fullgraph=True)(x)
    counters = dict(torch._dynamo.utils.counters["fp8_moe"])
    assert counters == {"loops_rewritten": 1}
    # The grouped op accumulates in float32 where the loop adds bf16: a few bf16 units.
    assert rel_err(compiled, eager) < REL_BOUND[torch.bfloat16]
