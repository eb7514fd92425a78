"""On a CUDA device: a mixture-of-experts model with attention sinks (gpt-oss-like, random weights)
through the compiled Triton kernels, the fused MoE op and the sink-aware attention, with CUDA graphs:
teacher-forced logits equal the dense reference's, graphs and eager decode generate the same tokens,
and a decode step makes no host sync."""

from __future__ import annotations

import pytest
import torch

from invariants.testing import no_host_sync
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.kernels.moe import reference
from shared.kernels.moe.fused_moe import fused_moe
from shared.serving.api.model_source import random_model_config, random_transformer
from tests.engine.engine_testutil import W, build_batch, random_tokens
from tests.engine.test_engine_moe import MODELS
from tests.engine.test_engine_parity import Seq

pytestmark = pytest.mark.gpu


def _model(name: str, device: str):  # type: ignore[no-untyped-def]
    cfg = random_model_config({"window": W, **MODELS[name]})
    return cfg, random_transformer(cfg, seed=3).eval().to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_on_cuda_is_the_reference_and_replays_from_a_graph(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, t, k = 8, 256, 384, 64, 2
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * 0.05).to(dtype)
    logits = torch.randn(t, e, device="cuda", generator=g)
    for activation in ("silu", "swiglu_oai"):
        weights, ids = reference.route(logits, k)
        want = reference.fused_moe(x, w1, w2, weights, ids, activation=activation).float()
        fused_moe(x, w1, w2, weights, ids, activation=activation)  # compiles
        with no_host_sync():
            got = fused_moe(x, w1, w2, weights, ids, activation=activation).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fused_moe(x, w1, w2, weights, ids, activation=activation)
        graph.replay()
        torch.testing.assert_close(static.float(), got, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_triton_path_matches_the_reference_teacher_forced(name: str) -> None:
    from shared.model import reference_logits

    cfg, cpu = _model(name, "cpu")
    _, model = _model(name, "cuda")
    cache = KVCache(cfg, KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda"))
    runner = ModelRunner(model, cache)
    seqs = [Seq(cache, i, random_tokens(2 * W + 6, seed=30 + i)) for i in range(2)]
    wants = [reference_logits(cpu, [s.tokens])[0] for s in seqs]
    out = runner.forward(ForwardBatch.build([s.chunk(W + 3) for s in seqs], Mode.EXTEND, cache), None,
                         return_logits=True).logits  # fmt: skip
    for row, s, want in zip(out, seqs, wants, strict=True):
        torch.testing.assert_close(row.cpu(), want[s.done - 1], rtol=1e-3, atol=1e-3)
    for _ in range(W):  # decode past the window
        out = runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None,
                             return_logits=True).logits  # fmt: skip
        for row, s, want in zip(out, seqs, wants, strict=True):
            torch.testing.assert_close(row.cpu(), want[s.done - 1], rtol=1e-3, atol=1e-3)


def test_graphs_decode_as_eager_and_never_sync() -> None:
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 40, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for sizes in ((), (1, 2, 4)):
        _, model = _model("gpt-oss", "cuda")
        kv = KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda")
        engine = Engine(model, kv, EngineConfig(max_batch_tokens=64, cuda_graph_sizes=sizes))
        outs.append([r.output for r in engine.generate(prompts, sp)])
    assert outs[0] == outs[1]
    cfg, model = _model("gpt-oss", "cuda")
    cache = KVCache(cfg, KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda"))
    runner = ModelRunner(model, cache)
    runner.capture_decode_graphs([4], max_pages=8)
    seqs = [Seq(cache, i, random_tokens(30, seed=i)) for i in range(3)]
    runner.forward(ForwardBatch.build([s.chunk(20) for s in seqs], Mode.EXTEND, cache), None)
    runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
    torch.cuda.synchronize()
    with no_host_sync():
        runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
