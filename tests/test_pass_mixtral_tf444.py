"""Form 5: transformers 4.44's own ``MixtralSparseMoeBlock`` (one-hot mask,
``hidden_states[None, top_x].reshape(-1, hidden_dim)``, ``routing_weights[top_x, idx,
None]``, ``index_add_`` of ``.to(hidden_states.dtype)`` into a bf16 accumulator) with
its expert linears converted to ``FP8Linear``: the pass must rewrite the loop.

Runs only with transformers 4.44.x (a test-only environment; the project itself
targets transformers 5):

    python -m venv --system-site-packages /tmp/venv-tf444
    /tmp/venv-tf444/bin/pip install --no-deps transformers==4.44.2 tokenizers==0.19.1 huggingface_hub==0.36.2
    /tmp/venv-tf444/bin/python -m pytest tests/test_pass_mixtral_tf444.py -q

(``--no-deps``: the rest comes from the system site-packages, where pip's resolver
trips over an installed distribution without a version.)
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("4.44."):
    pytest.skip(f"needs transformers 4.44.x, found {transformers.__version__}", allow_module_level=True)

from expecttest import TestCase  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402
from transformers.models.mixtral.configuration_mixtral import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

from fp8_moe_ops import FP8Linear  # noqa: E402
from test_pass_common import BLOCK, E, H, I, K, error_vs, fp8_counters, fresh_counters, ideal_output  # noqa: E402

pytestmark = pytest.mark.slow


def _block() -> MixtralSparseMoeBlock:
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                        hidden_act="silu")
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).to(torch.bfloat16).eval()
    for expert in block.experts:
        for name in ("w1", "w2", "w3"):
            setattr(expert, name, FP8Linear.from_float(getattr(expert, name), BLOCK))
    return block


def _routing(block, x):
    """The block's own routing, eagerly (the same code as its forward)."""
    logits = block.gate(x.view(-1, H))
    w = torch.softmax(logits, dim=1, dtype=torch.float)
    w, idx = torch.topk(w, K, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    return idx, w.to(x.dtype)


class TestTransformers444Mixtral(TestCase):
    def test_mixtral_sparse_moe_block_rewritten(self):
        block = _block()
        x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        torch._dynamo.reset()
        with fresh_counters(), torch.no_grad():  # plain torch.compile: no freezing needed
            (out, logits), code = run_and_get_code(torch.compile(block, fullgraph=True), x)
            eager, eager_logits = block(x)
        code = "\n".join(code)
        self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
        self.assertIn("fp8_moe.grouped_experts_list", code)  # the experts' own tensors, no stacked copy
        self.assertNotIn("nonzero", code)
        self.assertNotIn("fp8_moe.linear", code)
        self.assertEqual(out.shape, (2, 5, H))
        self.assertTrue(torch.equal(logits, eager_logits))
        # bf16 activation and accumulator in the block, float32 in the grouped op: as
        # accurate as the block (error vs the float64 layer at most 1.25x the block's)
        idx, w = _routing(block, x)
        gu = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in block.experts])
        gus = torch.stack([torch.cat([e.w1.weight_scale_inv, e.w3.weight_scale_inv]) for e in block.experts])
        d = torch.stack([e.w2.weight for e in block.experts])
        ds = torch.stack([e.w2.weight_scale_inv for e in block.experts])
        ideal = ideal_output(gu, gus, d, ds, x.view(-1, H), idx, w).view(2, 5, H)
        self.assertLessEqual(error_vs(out, ideal), 1.25 * error_vs(eager, ideal))
