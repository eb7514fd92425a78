"""Mixture-of-experts models and attention sinks through the engine: the runner's paged and ring
attention (with gpt-oss's per-head sinks), its experts op and the KV cache compute what one dense pass
of the model computes, on the torch kernels and on the Triton ones (interpreted), chunked prefill and
decode past the window; and an Engine serves such a model greedily as the reference decodes it."""

from __future__ import annotations

import pytest
import torch

from shared.engine.batch import Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import random_model_config, random_transformer
from tests.engine.engine_testutil import W, random_tokens, reference
from tests.engine.test_engine_parity import PAGE, Seq, greedy_reference, run

MODELS = {
    # every layer's MLP: 4 experts, 2 a token (Mixtral / Qwen3-MoE-like)
    "moe": {"layers": "SSFS", "experts": 4, "top_k": 2, "expert_intermediate": 48},
    # gpt-oss-like: sinks on every layer, biased q/k/v/o, experts with biases and the clamped SwiGLU
    "gpt-oss": {"layers": "SFSF", "experts": 4, "top_k": 2, "expert_intermediate": 48, "sinks": True,
                "gpt_oss_experts": True},
}  # fmt: skip


def _model(name: str):  # type: ignore[no-untyped-def]
    cfg = random_model_config({"window": W, **MODELS[name]})
    return cfg, random_transformer(cfg, seed=3).eval()


def test_the_sinks_and_the_experts_change_the_logits() -> None:
    # Guard: a runner that dropped the sinks or routed wrongly would not pass for these weights.
    _, model = _model("gpt-oss")
    tokens = random_tokens(2 * W)
    want = reference(model, tokens)
    for layer in model.layers:
        layer.self_attn.sinks.fill_(-1e4)  # no sink at all
    no_sinks = reference(model, tokens)
    assert (want - no_sinks).abs().max() > 1e-2 * want.abs().max()


# The Triton kernels (interpreted) on the gpt-oss-like model, whose sinks, biases and clamped SwiGLU
# cover what the plain MoE runs: the interpreter's fused MoE is the suite's slow part.
@pytest.mark.parametrize(("name", "kernels"), [("moe", "torch"), ("gpt-oss", "torch"), ("gpt-oss", "triton")])
def test_chunked_prefill_then_decode_past_the_window_matches_one_dense_pass(name: str, kernels: str) -> None:
    from shared.kernels.attention import ops_for

    cfg, model = _model(name)
    cache = KVCache(cfg, KVConfig(page_size=PAGE, num_pages=32, max_requests=2))
    if kernels == "triton":
        model.kernel_backend = "triton"
    runner = ModelRunner(model, cache, ops_for(cache.device, backend=kernels))
    seqs = [Seq(cache, 0, random_tokens(2 * W + 4, seed=8)), Seq(cache, 1, random_tokens(2 * W + 4, seed=9))]
    wants = [reference(model, s.tokens) for s in seqs]
    logits = run(runner, [seqs[0].chunk(W + 1), seqs[1].chunk(3)], Mode.EXTEND)
    for row, s, want in zip(logits, seqs, wants, strict=True):
        torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)
    logits = run(runner, [seqs[1].chunk(W - 2)], Mode.EXTEND)
    torch.testing.assert_close(logits[0], wants[1][seqs[1].done - 1], rtol=1e-4, atol=1e-4)
    for _ in range(3):  # both rings hold more than W tokens' turns by now: they have wrapped
        logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)


def test_an_engine_serves_a_gpt_oss_like_model_as_the_reference_decodes_it() -> None:
    _, model = _model("gpt-oss")
    engine = Engine(
        model, KVConfig(page_size=PAGE, num_pages=64, max_requests=4), EngineConfig(max_batch_tokens=12)
    )
    prompts = [random_tokens(n, seed=20 + n) for n in (3, W + 3, 2 * W + 1)]
    reqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, req in zip(prompts, reqs, strict=True):
        assert req.output == greedy_reference(model, prompt, 6)
