"""Near misses: loops that look like an expert loop but are not equivalent to the
grouped op.  Each must be left exactly as it was (every graph the pass sees is the graph
it leaves), counted in ``loops_skipped_unsupported`` and logged with its reason.  Plus
spellings that *are* equivalent up to rounding."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch._inductor.config as inductor_config
from expecttest import TestCase
from torch import nn
from torch.nn import functional as F

from fp8_moe_ops import FP8Experts, FP8Linear, reference
from fp8_moe_ops.passes import MoELoopPass
from fp8_moe_ops.passes.activations import _gelu_tanh_formula
from test_pass_common import (
    BLOCK, H, I, Loop, MixtralLoop, count_linear, error_vs, experts, fp8_counters, fresh_counters, ideal_output,
    inputs, post_grad, post_grad_only_backend, static_experts,
)

pytestmark = pytest.mark.slow


def _gelu_tanh_wrong_constant(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.0447 * torch.pow(x, 3.0))))


# (name, Loop knobs, a fragment of the logged reason)
NEAR_MISSES = [
    # a subset of experts: tokens routed to expert 3 contribute nothing in the loop
    ("subset", dict(experts=[0, 1, 2]), "covers 3 of the 4 experts"),
    ("skips_one", dict(experts=[0, 1, 3]), "does not visit experts 0..E-1 once each"),
    ("twice", dict(experts=[0, 1, 2, 3, 3]), "does not visit experts 0..E-1 once each"),
    ("weights_of_next_expert", dict(shift=1), "not their own"),
    ("bias", dict(bias=True), "is not down_proj(...) * routing_weight"),
    ("extra_op", dict(extra=True), "is not down_proj(...) * routing_weight"),
    ("accumulator_ones", dict(acc="ones"), "does not start as a zero tensor"),
    ("float32_accumulator_returned", dict(acc="float32_out"), "used in float32"),
    ("gate_up_swapped", dict(split="swapped"), "halves swapped"),
    ("routing_weight_of_slot0", dict(routing="pos0"), "[tok, pos]"),
    ("intermediate_escapes", dict(aux=True), "an intermediate result of an expert is used outside the loop"),
    ("partial_sum_escapes", dict(peek=True), "a partial sum of the loop is used outside the loop"),
    # out[tok] += v keeps one of two sums where top_k_index names an expert twice in a row
    ("plus_equals_combine", dict(combine="plus_equals"), "it combines with out[tok] += v"),
    # a real loop in a spelling the pass does not prove: counted and logged, not silent
    ("token_index_cast", dict(tok_int=True), "cast torch.where coordinate"),
    # a step of the same accumulation whose rows no torch.where selects (it was left eager uncounted)
    ("stray_step", dict(stray=True), "a loop over 4 experts was left eager because 1 of the 5 steps of its "
     "accumulation adds rows that no torch.where"),
    ("activation_tanh", dict(split="slice", act_fn=torch.tanh), "not a supported gated activation"),
    ("gelu_tanh_other_constant", dict(split="slice", act_fn=_gelu_tanh_wrong_constant),
     "not a supported gated activation"),
]


# loops in spellings the pass does not read as one (no accumulation of torch.where rows it
# knows): not rewritten, but counted and logged, never silent
UNREAD = [
    ("scatter_add_of_a_view", dict(combine="scatter_add_view")),
    ("scatter_reduce_sum", dict(combine="scatter_reduce")),
    ("nonzero_transposed", dict(mask="nonzero_t")),
]

# static loops in spellings that are skipped for other reasons too: counted as static
STATIC_SPELLINGS = [
    ("index_add", dict()),
    ("plus_equals", dict(combine="plus_equals")),
    ("token_index_cast", dict(tok_int=True)),
    ("scatter_add_of_a_view", dict(combine="scatter_add_view")),
]


class _Spelled(nn.Module):
    """A loop whose accumulation the pass does not read (scatter_reduce_ "sum"), its
    experts' tokens selected in one of the spellings models use."""

    def __init__(self, spelling):
        super().__init__()
        self.ex, self.spelling = experts(), spelling

    def forward(self, hidden, top_k_index, w):
        ex, sp = self.ex, self.spelling
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        em = F.one_hot(top_k_index, num_classes=ex.num_experts).permute(2, 1, 0)
        for e in range(ex.num_experts):
            hit = (top_k_index == e)
            if sp == "one_hot_where":  # transformers 4.x's Mixtral
                pos, tok = torch.where(em[e])
                r = w[tok, pos, None]
            elif sp == "any_mask":
                tok = hit.any(-1).nonzero().squeeze(-1)
                r = (w * hit).sum(-1, keepdim=True)[tok]
            elif sp == "or_mask":  # top-2 spelled per slot
                tok = torch.where((top_k_index[:, 0] == e) | (top_k_index[:, 1] == e))[0]
                r = (w * hit).sum(-1, keepdim=True)[tok]
            elif sp == "flat_slots":  # a view made inside the loop, slots // k
                flat = (top_k_index.reshape(-1) == e).nonzero().squeeze(-1)
                tok, r = flat // top_k_index.shape[1], w.reshape(-1)[flat][:, None]
            else:  # "one_hot_sum": a one-hot made per expert, summed over the slots
                tok = torch.where(F.one_hot(top_k_index, num_classes=ex.num_experts).sum(1)[:, e] > 0)[0]
                r = (w * hit).sum(-1, keepdim=True)[tok]
            h = torch.ops.fp8_moe.linear(hidden[tok], ex.gate_up_proj[e], ex.gate_up_proj_scale_inv[e], ex.block_size)
            g, u = h.float().chunk(2, -1)
            a = (F.silu(g) * u).to(h.dtype)
            y = torch.ops.fp8_moe.linear(a, ex.down_proj[e], ex.down_proj_scale_inv[e], ex.block_size)
            out.scatter_reduce_(0, tok[:, None].expand(-1, H), y.float() * r.float(), "sum")
        return out.to(hidden.dtype)


class TestNearMisses(TestCase):
    def _assert_untouched(self, model, args, reason, **patches):
        # one compile with the pass on: each graph the pass sees is the one it leaves
        # (the post-grad graph with the pass off, as Inductor's own passes are the same)
        seen = []
        run_pass = MoELoopPass.__call__

        def spy(self_, graph):
            before = str(graph)
            run_pass(self_, graph)
            seen.append((before, str(graph)))

        with fresh_counters(), inductor_config.patch(**patches), mock.patch.object(MoELoopPass, "__call__", spy), \
                self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
            _, on = post_grad(model, *args)
        self.assertEqual(fp8_counters(), {"loops_skipped_unsupported": 1})
        self.assertEqual(len(logs.output), 1)
        self.assertIn("left eager because", logs.output[0])
        self.assertIn(reason, logs.output[0])
        self.assertTrue(seen)
        for before, after in seen:
            self.assertEqual(after, before)
        self.assertGreater(count_linear(on), 0)

    def test_near_misses(self):
        args = inputs(8, seed=11)
        base = experts()
        for name, knobs, reason in NEAR_MISSES:
            with self.subTest(name):
                self._assert_untouched(Loop(base, **knobs), args, reason)

    def test_loops_not_read_are_counted(self):
        args = inputs(8, seed=21)
        for name, knobs in UNREAD:
            with self.subTest(name):
                m = Loop(experts(), **knobs)
                self._assert_untouched(m, args, "its experts' fp8_moe::linear calls take rows selected by")
                torch.testing.assert_close(post_grad(m, *args)[0], m(*args), rtol=0, atol=0)

    def test_loops_not_read_are_counted_whatever_their_token_spelling(self):
        args = inputs(8, seed=27)
        for spelling in ("one_hot_where", "any_mask", "or_mask", "flat_slots", "one_hot_sum"):
            with self.subTest(spelling):
                self._assert_untouched(_Spelled(spelling), args, "its experts' fp8_moe::linear calls take rows")

    def test_static_loops_are_counted_as_static_whatever_else_they_miss(self):
        args = inputs(8, seed=22)
        for name, knobs in STATIC_SPELLINGS:
            with self.subTest(name), fresh_counters(), \
                    self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
                _, gm = post_grad(Loop(static_experts(), static=True, **knobs), *args)
                self.assertEqual(fp8_counters(), {"loops_skipped_static": 1})
                self.assertIn("activation scheme is static", logs.output[0])
                self.assertEqual(count_linear(gm), 2 * 4)

    def test_frozen_weights_of_other_experts_are_skipped_as_unfrozen(self):
        # frozen, the weights are views of one stacked tensor: experts sharing its rows (4
        # experts on 2 rows) made the pass index a row past its end and fail the compile;
        # the next expert's rows were rewritten frozen and skipped unfrozen
        class SharedRows(Loop):
            def __init__(self, ex):
                super().__init__(ex, experts=[0, 1, 2, 3])  # weights ex[e % 2]

        two = FP8Experts(2, H, I, BLOCK)
        two.load_state_dict({k: v[:2] for k, v in experts().state_dict().items()})
        args = inputs(8, seed=23)
        for m, reason in ((SharedRows(two), "use gate_up weights [0, 1, 0, 1] of the stacked tensor, not their own"),
                          (Loop(experts(), shift=1), "use gate_up weights [1, 2, 3, 0] of the stacked tensor")):
            for freezing in (False, True):
                with self.subTest(reason=reason, freezing=freezing):
                    self._assert_untouched(m, args, reason, freezing=freezing)

    def test_an_error_of_the_pass_leaves_the_loop_eager_and_warns(self):
        m, args = Loop(experts()), inputs(8, seed=24)
        for where in ("collect_chain", "prove"):  # reading a loop: counted
            with self.subTest(where), fresh_counters(), \
                    mock.patch(f"fp8_moe_ops.passes.rewrite.{where}", side_effect=IndexError("boom")), \
                    self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
                out, gm = post_grad(m, *args)
                self.assertEqual(fp8_counters(), {"loops_skipped_unsupported": 1})
                self.assertIn("fp8_moe_ops.passes: the pass failed while reading a loop; left eager\nTraceback",
                              logs.output[0])
                self.assertIn("the pass failed on it (IndexError: boom; a bug of fp8_moe_ops)", logs.output[1])
                self.assertEqual(count_linear(gm), 2 * 4)
                torch.testing.assert_close(out, m(*args), rtol=0, atol=0)
        # a search of the whole graph fails: what it would have found is uncounted (with
        # the chains' search failing, the last one still counts this unread loop)
        for where, counted in (("chain_heads", {"loops_skipped_unsupported": 1}), ("_unread_loops", {})):
            with self.subTest(where), fresh_counters(), \
                    mock.patch(f"fp8_moe_ops.passes.rewrite.{where}", side_effect=IndexError("boom")), \
                    self.assertLogs("fp8_moe_ops.passes", level="WARNING") as logs:
                out, gm = post_grad(Loop(experts(), combine="scatter_reduce"), *args)
                self.assertIn("the pass failed while searching the graph", logs.output[0])
                self.assertEqual(fp8_counters(), counted)
                self.assertEqual(count_linear(gm), 2 * 4)

    def test_dense_layers_on_masked_rows_are_no_expert_loop(self):
        # unpadding (hidden[mask]), a label mask: one selection, no comparison with expert
        # ids; the fallback count of unread loops used to take them for one
        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                gen = torch.Generator().manual_seed(25)
                self.q, self.k = (FP8Linear.from_float(nn.Linear(H, H, bias=False).requires_grad_(False),
                                                       block_size=BLOCK) for _ in range(2))
                for lin in (self.q, self.k):
                    lin.weight.data = lin.weight.data.view(torch.uint8).random_(0, 120, generator=gen).view(
                        lin.weight.dtype)

            def forward(self, x, keep, labels):
                rows = x[torch.where(keep)[0]]
                return self.q(x[keep]) + self.k(rows), self.q(x[labels != -100])

        class PerLayerUnpad(nn.Module):  # each layer unpads with its own attention_mask == 1
            def __init__(self, layers):
                super().__init__()
                self.layers = nn.ModuleList(layers)

            def forward(self, x, attention_mask):
                for layer in self.layers:
                    keep = attention_mask == 1
                    x = x.index_put((keep,), layer(x[keep]))
                return x

        class PerSequence(nn.Module):  # a packed batch: each sequence's rows of a mask given as input
            def __init__(self, q):
                super().__init__()
                self.q = q

            def forward(self, x, mask):
                return [self.q(x[b][mask[b]]) for b in range(mask.shape[0])]

        x = inputs(8, seed=26)[0]
        keep = torch.arange(8) % 3 != 0
        labels = torch.where(keep, torch.arange(8), -100)
        masked = Masked()
        for m, args, linears in ((masked, (x, keep, labels), 3),
                                 (PerLayerUnpad([masked.q, masked.k]), (x, keep.long()), 2),
                                 (PerSequence(masked.q), (x.view(2, 4, H), keep.view(2, 4)), 2)):
            with self.subTest(type(m).__name__), fresh_counters():
                out, gm = post_grad(m, *args)
                self.assertEqual(fp8_counters(), {})
                self.assertEqual(count_linear(gm), linears)

    def test_mixed_block_sizes(self):
        m = MixtralLoop(block_sizes=[(16, 16), (16, 16), (32, 32), (16, 16)])
        self._assert_untouched(m, inputs(8, seed=12), "mixed block sizes", freezing=True)

    def test_another_where_in_the_graph_is_kept(self):
        class Aux(Loop):
            def forward(self, hidden, top_k_index, top_k_weights):
                out = super().forward(hidden, top_k_index, top_k_weights)
                tok, _ = torch.where(top_k_index == 3)
                return out, tok.sum()

        # the extra where() is its own nonzero; the loop's own nonzeros stay private,
        # so this loop is still rewritten and the aux output still computed
        m, args = Aux(experts()), inputs(8, seed=13)
        with fresh_counters():
            (out, aux), gm = post_grad(m, *args)
        self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
        ref_out, ref_aux = m(*args)
        self.assertTrue(torch.equal(out, ref_out))
        self.assertEqual(aux, ref_aux)

    def test_a_forward_whose_input_requires_grad_compiles_keeps_its_loop_and_refuses_backward(self):
        # outside torch.no_grad(), compiling traces the backward too: the ops' backward
        # formulas trace (their refusal runs where the backward does), and the loop,
        # whose intermediates the forward now returns for the backward, is left eager,
        # the log saying what would avoid that
        m, (x, idx, w) = Loop(experts()), inputs(8, seed=18)
        x = x.clone().requires_grad_()
        torch._dynamo.reset()
        with fresh_counters(), self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
            out = torch.compile(m, fullgraph=True, backend=post_grad_only_backend([]))(x, idx, w)
        self.assertEqual(fp8_counters(), {"loops_skipped_unsupported": 1})
        self.assertIn("saved for the backward where an input requires grad, which torch.no_grad()", logs.output[0])
        self.assertTrue(out.requires_grad)
        torch.testing.assert_close(out, m(x, idx, w), rtol=0, atol=0)
        with self.assertRaisesRegex(RuntimeError, "fp8_moe::linear has no autograd formula"):
            out.float().sum().backward()

    def test_scatter_add_over_some_columns_is_no_accumulation_and_left_as_it_is(self):
        # an index over half the columns adds half of each row: not the grouped op's sum;
        # its experts still take rows torch.where selects: counted as a loop not read
        m, args = Loop(experts(), combine="scatter_add_half"), inputs(8, seed=19)
        with fresh_counters(), self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
            out, gm = post_grad(m, *args)
        self.assertEqual(fp8_counters(), {"loops_skipped_unsupported": 1})
        self.assertIn("a loop over 4 experts was left eager because its experts' fp8_moe::linear calls take rows "
                      "selected by torch.where", logs.output[0])
        self.assertGreater(count_linear(gm), 0)
        self.assertIn("scatter_add", str(gm.graph))
        torch.testing.assert_close(out, m(*args), rtol=0, atol=0)

    def test_experts_with_different_swiglu_limits_say_so(self):
        class PerExpertLimit(Loop):  # expert 1 clamps at 0.5, the others at 0.25
            def forward(self, *args):
                self.calls = 0
                return super().forward(*args)

            def _act(self, h):
                self.calls += 1
                return reference.gated_activation(h, "silu", 0.5 if self.calls == 2 else 0.25)

        # the reason read "different activations: silu and silu"
        self._assert_untouched(PerExpertLimit(experts()), inputs(8, seed=15),
                               "silu (swiglu_limit 0.25) and silu (swiglu_limit 0.5)")

    def test_operands_the_op_rejects_leave_no_error_in_torchs_log(self):
        # the op's checks ran inside its fake kernel, where torch logs a TypeError as an
        # error with its traceback before the pass could catch it
        m = MixtralLoop()
        m.experts[1].w1 = FP8Linear.from_float(nn.Linear(H, I, bias=False), BLOCK, scale_dtype=torch.float8_e8m0fnu)
        with self.assertNoLogs("torch._subclasses.fake_tensor", level="ERROR"):
            self._assert_untouched(m, inputs(8, seed=16), "rejects the loop's operands")


class TestEquivalentSpellings(TestCase):
    def test_silu_as_x_sigmoid_x(self):
        self._rewritten_close(dict(split="slice", act_fn=lambda g: g * torch.sigmoid(g)), "silu")

    def test_experts_in_another_order_rewritten_and_not_called_bitwise(self):
        args = inputs(8, seed=17, dtype=torch.float32)
        for order, numerics in (([0, 1, 2, 3], "bitwise equal to eager"),
                                ([3, 2, 1, 0], "equal to eager up to the order of each token's float32 sum")):
            m = Loop(experts(), experts=order)
            with self.subTest(order), fresh_counters(), \
                    self.assertLogs("fp8_moe_ops.passes", level="INFO") as logs:
                out, _ = post_grad(m, *args)
            self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
            self.assertIn(numerics, logs.output[0])
            torch.testing.assert_close(out, m(*args), rtol=1e-6, atol=1e-6)

    def test_gelu_new_formula(self):
        self._rewritten_close(dict(split="slice", act_fn=_gelu_tanh_formula), "gelu_tanh")

    def _rewritten_close(self, knobs, activation):
        # The same function as the op's activation, computed in another float32 order:
        # act(gate) * up may round to a neighbouring bf16 value, which fp8 quantisation
        # of the down projection's input can amplify.  The rewrite must be as accurate
        # as the loop: error against the float64 layer at most 1.25x the loop's.
        ex = experts(activation)
        m, args = Loop(ex, **knobs), inputs(8, seed=14)
        with fresh_counters():
            out, gm = post_grad(m, *args)
        self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
        (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.fp8_moe.grouped_experts.default]
        self.assertEqual(node.args[8], activation)
        ideal = ideal_output(ex.gate_up_proj, ex.gate_up_proj_scale_inv, ex.down_proj, ex.down_proj_scale_inv,
                             *args, activation)
        self.assertLessEqual(error_vs(out, ideal), 1.25 * error_vs(m(*args), ideal))
