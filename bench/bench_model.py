"""Model-level benchmark: transformers' Qwen3-MoE with our experts against its own bf16 experts.

    PYTHONPATH=. python bench/bench_model.py --out-dir OUT [--layers 4] [--prefill 512,1024,2048,4096]
        [--decode-batch 1,8] [--context 512]

A ``transformers.Qwen3MoeForCausalLM`` at Qwen3-30B-A3B's dimensions (hidden 2048, 128
experts of intermediate size 768, top-8, 32 query / 4 key-value heads of 128) with
``--layers`` decoder layers, a small vocabulary and random weights (bf16, on the GPU).
Two experts implementations, one model (measured bf16 first, then quantised in place):

* ``bf16 grouped_mm``: transformers' own experts (``experts_implementation="grouped_mm"``);
* ``fp8_moe grouped``: ``fp8_moe_ops.integrations.transformers.quantize_experts`` (fp8
  128x128 block weights, dynamic activation scales, ``torch.ops.fp8_moe.grouped_experts``).

Phases, each timed eagerly (CUDA events around back-to-back calls) and as the replay
of a CUDA graph of the call:

* ``prefill``: one sequence of T tokens, no cache;
* ``decode``: one step of B sequences (B tokens) on a ``StaticCache`` holding
  ``--context`` tokens; every call writes the same cache position, so repeated calls
  are identical.

Also reported: ``logits_rel_err``, the relative error of the fp8 model's prefill logits
against the bf16 model's (the integration is wired right), the experts implementation
transformers reports, and the transformers version.  A case that fails (e.g. a graph
capture refused by a host sync) is recorded with its error; the script exits 1.
Writes ``OUT/bench_model.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import MODELS, ExperimentConfig, Runner, capture_graph, log, results_table, time_ms

QWEN3 = MODELS["qwen3_30b_a3b"]


def build_model(layers: int, vocab: int, shape=QWEN3, heads=(32, 4, 128), device: str = "cuda"):
    """A random bf16 ``Qwen3MoeForCausalLM`` of ``shape``'s MoE dimensions; ``heads`` =
    (query heads, key-value heads, head dim)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=shape.H, moe_intermediate_size=shape.I, intermediate_size=3 * shape.H,
        num_experts=shape.E, num_experts_per_tok=shape.top_k, num_hidden_layers=layers, num_attention_heads=heads[0],
        num_key_value_heads=heads[1], head_dim=heads[2], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=8192)
    torch.manual_seed(0)  # transformers' weight init draws from the global generator
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm")
    return model


def experts_implementation(model) -> str:
    return str(getattr(model.config, "_experts_implementation", "unknown"))


def _timings(fn, timing: str) -> dict:
    if timing == "eager":
        return {"ms": time_ms(fn, rep_ms=100, warmup_ms=25)}
    return {"ms": time_ms(capture_graph(fn).replay, rep_ms=100, warmup_ms=25)}


def static_cache(model, max_len: int, batch: int, device: str = "cuda"):
    """A transformers ``StaticCache`` (its constructor changed across 5.x: config +
    max_cache_len, earlier also batch size, device and dtype)."""
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=device,
                           dtype=torch.bfloat16)


def cache_kwarg(model) -> str:
    """The name under which the model's forward takes the KV cache (``cache`` from
    transformers 5.2x, ``past_key_values`` before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_step(model, batch: int, context: int, gen, device: str = "cuda"):
    """A decode step of ``batch`` sequences after ``context`` prompt tokens, as a closure."""
    vocab = model.config.vocab_size
    cache = static_cache(model, context + 8, batch, device)
    prompt = torch.randint(0, vocab, (batch, context), device=device, generator=gen)
    kw = cache_kwarg(model)
    model(prompt, **{kw: cache}, cache_position=torch.arange(context, device=device), use_cache=True)
    step_ids = torch.randint(0, vocab, (batch, 1), device=device, generator=gen)
    position = torch.tensor([context], device=device)  # where the step's token goes (older transformers)
    position_ids = torch.full((batch, 1), context, device=device)
    # Recent caches count the tokens they hold in a device tensor per layer (each call
    # appends at that count); older ones write at ``cache_position``.  Rewinding the
    # count to ``context`` (a device op, captured with the graph) makes every call write
    # the same slot either way, so repeated calls are identical and never overflow.
    counters = [layer.cumulative_length for layer in getattr(cache, "layers", ())
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def step():
        for c in counters:
            c.fill_(context)
        return model(step_ids, **{kw: cache}, cache_position=position, position_ids=position_ids,
                     use_cache=True).logits

    return step


def run_variant(runner: Runner, model, variant: str, prefill: list[int], batches: list[int], context: int,
                extra: dict) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = model.config.vocab_size
    info = {"experts_implementation": experts_implementation(model), **extra}  # extra may override it
    for T in prefill:
        ids = torch.randint(0, vocab, (1, T), device="cuda", generator=gen)
        fn = lambda ids=ids: model(ids, use_cache=False).logits  # noqa: E731
        for timing in ("eager", "cuda_graph"):
            runner.run(ExperimentConfig("model", "qwen3_30b_a3b", T, variant, params=(("phase", "prefill"),
                                                                                    ("timing", timing))),
                       lambda: {**_timings(fn, timing), **info})
    for B in batches:
        for timing in ("eager", "cuda_graph"):
            # a fresh cache per case: a failed capture must not leave a half-written one behind
            runner.run(ExperimentConfig("model", "qwen3_30b_a3b", B, variant, params=(("phase", "decode"),
                                                                                    ("timing", timing))),
                       lambda: {**_timings(decode_step(model, B, context, gen), timing), **info})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prefill", default="512,1024,2048,4096", help="prompt lengths T")
    p.add_argument("--decode-batch", default="1,8", help="sequences per decode step")
    p.add_argument("--context", type=int, default=512, help="cached tokens before the decode step")
    args = p.parse_args()
    prefill = [int(t) for t in args.prefill.split(",") if t]
    batches = [int(b) for b in args.decode_batch.split(",") if b]
    runner = Runner("bench_model", args.out_dir)
    import transformers

    runner.meta["transformers"] = transformers.__version__
    runner.meta["model"] = (f"Qwen3MoeForCausalLM, {args.layers} layers, hidden {QWEN3.H}, {QWEN3.E} experts x "
                            f"{QWEN3.I}, top-{QWEN3.top_k}, vocab {args.vocab}, random bf16 weights")
    with torch.no_grad():
        model = build_model(args.layers, args.vocab)
        probe = torch.randint(0, args.vocab, (1, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        ref_logits = model(probe, use_cache=False).logits.float()
        run_variant(runner, model, "bf16 grouped_mm", prefill, batches, args.context, {})
        runner.save(table(runner))

        from fp8_moe_ops.integrations.transformers import quantize_experts

        quantize_experts(model)
        torch.cuda.empty_cache()
        logits = model(probe, use_cache=False).logits.float()
        err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        log(f"fp8 experts: prefill logits rel err vs bf16 {err:.3e}")
        run_variant(runner, model, "fp8_moe grouped", prefill, batches, args.context,
                    {"logits_rel_err": err, "experts_implementation": "FP8Experts from quantize_experts (grouped)"})
    runner.save(table(runner))
    log(table(runner))
    return runner.exit_code()


def table(runner: Runner) -> str:
    return results_table(runner.results, [
        ("phase", "phase", ""), ("T or batch", "tokens", ""), ("experts", "variant", ""), ("timing", "timing", ""),
        ("ms per forward", "ms", ".3f"), ("logits rel err vs bf16", "logits_rel_err", ".2e"),
        ("transformers experts impl", "experts_implementation", "")])


if __name__ == "__main__":
    sys.exit(main())
