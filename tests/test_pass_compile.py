"""The pass under the other ways of compiling: dynamic token counts, the FX graph
cache, and torch.export + AOTInductor."""

from __future__ import annotations

import json
import tempfile
import zipfile

import pytest
import torch
import torch._inductor.config as inductor_config
from expecttest import TestCase
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code

import fp8_moe_ops.passes as passes
from test_pass_common import (
    BLOCK, Loop, MixtralLoop, error_vs, experts, fp8_counters, fresh_counters, ideal_output, inputs,
    stacked_from_mixtral,
)

pytestmark = pytest.mark.slow


def _rewritten_output(m, args) -> torch.Tensor:
    """What a rewritten loop computes: for ``MixtralLoop`` (rewritten into the list op)
    the stacked op's numbers, for the others the loop's own arithmetic."""
    if isinstance(m, MixtralLoop):
        return torch.ops.fp8_moe.grouped_experts(*args, *stacked_from_mixtral(m), BLOCK)
    return m(*args)


class TestDynamic(TestCase):
    def test_dynamic_token_count(self):
        m = experts()
        with fresh_counters(), torch.no_grad():
            c = torch.compile(m, dynamic=True)  # not fullgraph: install() makes where() capturable
            outs = [(c(*inputs(T, seed=T)), m(*inputs(T, seed=T))) for T in (5, 9, 17)]
            self.assertEqual(counters["stats"]["unique_graphs"], 1)  # one graph, no break, no recompile
            self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
            # Dynamo specialises T = 1 and T = 0 (no tokens): one more graph each, rewritten too
            outs += [(c(*inputs(T, seed=T)), m(*inputs(T, seed=T))) for T in (1, 0)]
            self.assertEqual(counters["stats"]["unique_graphs"], 3)
        self.assertEqual(fp8_counters(), {"loops_rewritten": 3})
        for got, want in outs:
            self.assertTrue(torch.equal(got, want))


    def test_dynamic_shapes_with_a_constant_width(self):
        # dynamic=True makes the hidden width a symbol too; the Mixtral gather
        # hidden[None, tok].reshape(-1, H) and its accumulator zeros(T, H) use the model's
        # constant H: rewritten, the width guarded equal to it
        for m in (MixtralLoop(), Loop(experts(), gather="none_reshape")):
            with self.subTest(model=type(m).__name__), fresh_counters(), torch.no_grad():
                c = torch.compile(m, fullgraph=True, dynamic=True)
                for T in (5, 9, 17):
                    args = inputs(T, seed=50 + T)
                    self.assertTrue(torch.equal(c(*args), _rewritten_output(m, args)))
                self.assertEqual(counters["stats"]["unique_graphs"], 1)
                self.assertEqual(fp8_counters(), {"loops_rewritten": 1})


    def test_automatic_dynamic_token_count(self):
        # how a served model meets dynamic shapes: compiled with defaults, a second batch
        # size recompiles with dynamic token counts, each input's count its own symbol
        for m in (experts(), MixtralLoop()):
            with self.subTest(model=type(m).__name__), fresh_counters(), torch.no_grad():
                c = torch.compile(m, fullgraph=True)
                for T in (6, 11, 3):
                    args = inputs(T, seed=40 + T)
                    self.assertTrue(torch.equal(c(*args), _rewritten_output(m, args)))
                self.assertEqual(counters["stats"]["unique_graphs"], 2)  # T = 6, then any T
                self.assertEqual(fp8_counters(), {"loops_rewritten": 2})


    def test_token_counts_of_separate_symbols(self):
        # under torch.compile an equality of the example becomes a guard; ahead of time
        # (no guards at run time) only a proven one counts
        from torch._dynamo.source import ConstantSource
        from torch._inductor.virtualized import V
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        from passes.matching import same_or_guarded

        env = ShapeEnv(duck_shape=False)  # each input's count its own symbol, as automatic dynamic gives

        def count(name, hint):
            return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)

        index_rows, weight_rows, other_rows = count("index", 6), count("weights", 6), count("other", 7)
        with V.set_aot_compilation(True):
            self.assertFalse(same_or_guarded((index_rows, 2), (weight_rows, 2)))
        self.assertEqual(env.guards, [])
        self.assertTrue(same_or_guarded((index_rows, 2), (weight_rows, 2)))
        self.assertEqual(len(env.guards), 1)  # the equality, to be checked on every call
        self.assertFalse(same_or_guarded((index_rows, 2), (other_rows, 2)))
        self.assertTrue(same_or_guarded((index_rows, 2), (index_rows, 2)))
        # the hidden width, a symbol under dynamic=True, against a model's constant H
        width = count("width", 32)
        symbol = width.node.expr
        with V.set_aot_compilation(True):
            self.assertFalse(same_or_guarded((width,), (32,)))
        self.assertTrue(same_or_guarded((width,), (32,)))
        self.assertEqual(str(env.guards[-1].expr), f"Eq({symbol}, 32)")
        self.assertFalse(same_or_guarded((width,), (16,)))


class TestFxGraphCache(TestCase):
    def _compile(self, m, args):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(m, fullgraph=True), *args)
        return "\n".join(code)

    def test_no_stale_hit_across_pass_state(self):
        m, args = experts(), inputs(6, seed=21)
        with fresh_cache(), inductor_config.patch(force_disable_caches=False, fx_graph_cache=True):
            counters.clear()
            with passes.enabled():
                on = self._compile(m, args)
            off = self._compile(m, args)  # pass off: must not be served the rewritten graph
            with passes.enabled():
                again = self._compile(m, args)  # pass on again: the first entry may serve it
            stats = dict(counters["inductor"])
        self.assertIn("fp8_moe.grouped_experts", on)
        self.assertNotIn("fp8_moe.grouped_experts", off)
        self.assertIn("fp8_moe.linear", off)
        self.assertIn("fp8_moe.grouped_experts", again)
        self.assertEqual(stats.get("fxgraph_cache_miss"), 2)
        self.assertEqual(stats.get("fxgraph_cache_hit"), 1)
        # the hit ran no pass: only the first compile counted a rewrite
        self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
        torch._dynamo.reset()


class TestAOTInductor(TestCase):
    def test_export_package_load(self):
        m = MixtralLoop()  # ModuleList experts: the per-expert weights go into the package as they are
        T = torch.export.Dim("T", min=1, max=4096)
        with fresh_counters(), tempfile.TemporaryDirectory() as d:
            ep = torch.export.export(m, inputs(8, seed=31), dynamic_shapes=({0: T}, {0: T}, {0: T}))
            path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/moe.pt2")
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                sources = "\n".join(z.read(n).decode() for n in names if n.endswith(".cpp"))
                # the ops the package calls through the proxy executor
                (extern,) = [json.loads(z.read(n)) for n in names if n.endswith("wrapper.json")]
            loaded = torch._inductor.aoti_load_package(path)
            self.assertEqual(fp8_counters(), {"loops_rewritten": 1})
            self.assertEqual([n["node"]["target"] for n in extern["nodes"]], ["fp8_moe::grouped_experts_list"])
            # the op reads the model's own per-expert constants (w1 list, then w3), no stacked copy
            lists = {a["name"]: [t["name"] for t in a["arg"]["as_tensors"]]
                     for a in extern["nodes"][0]["node"]["inputs"] if "as_tensors" in a["arg"]}
            self.assertEqual(lists["gate_up_proj"], [f"experts_{e}_w{i}_weight" for i in (1, 3) for e in range(4)])
            self.assertEqual(lists["down_scale_inv"], [f"experts_{e}_w2_weight_scale_inv" for e in range(4)])
            self.assertFalse("nonzero" in sources, "the package still computes a nonzero")
            for t in (5, 23):
                x, idx, w = inputs(t, seed=t)
                got = loaded(x, idx, w)
                with torch.no_grad():
                    eager = m(x, idx, w)
                # the op on the stacked weights, bitwise; as accurate as the loop (see
                # test_form3_modulelist_frozen for the bound)
                ops = stacked_from_mixtral(m)
                self.assertTrue(torch.equal(got, torch.ops.fp8_moe.grouped_experts(x, idx, w, *ops, list(BLOCK))))
                ideal = ideal_output(*ops, x, idx, w)
                self.assertLessEqual(error_vs(got, ideal), 1.25 * error_vs(eager, ideal))
