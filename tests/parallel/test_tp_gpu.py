"""Tensor parallelism's CUDA path on one GPU: a group of one NCCL rank. The share's all-reduces, its
vocabulary all-gather and rank 0's token broadcast are NCCL collectives, captured in the decode CUDA
graphs; rank 0's LeaderEngine (no followers here) decodes what the engine without ranks decodes, and
a decode step replayed from a graph, its broadcast included, makes no host sync. (Two ranks need two
GPUs: the multi-GPU machines run those.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from invariants.testing import no_host_sync
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.mirror import LeaderEngine
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.model.tensor_parallel import TensorParallel, shard
from shared.serving.api.model_source import random_model_config, random_transformer
from shared.serving.tensor_parallel import join_group
from tests.engine.engine_testutil import W, build_batch, random_tokens
from tests.engine.test_engine_parity import Seq

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorParallel]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tmp_path_factory.mktemp("tp") / "rendezvous"
    tp = join_group(str(path), 0, 1, torch.device("cuda", 0))
    yield tp
    dist.destroy_process_group()


def _models(tp: TensorParallel):  # type: ignore[no-untyped-def]
    cfg = dataclasses.replace(random_model_config({"layers": "SSFS", "window": W}), qk_norm=True)
    whole = random_transformer(cfg, seed=5).eval().to("cuda")
    return whole, shard(whole, tp)


def test_one_nccl_rank_decodes_as_the_engine_with_graphs(nccl: TensorParallel) -> None:
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 40, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kv = KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda")
    cfg = EngineConfig(max_batch_tokens=64, cuda_graph_sizes=(1, 2, 4), tune_gemms=False)
    whole, local = _models(nccl)
    assert local.tp is nccl
    want = [r.output for r in Engine(whole, kv, cfg).generate(prompts, sp)]
    leader = LeaderEngine(local, kv, cfg, links=[])
    assert leader.runner.graphs is not None  # the collectives were captured
    assert [r.output for r in leader.generate(prompts, sp)] == want


def test_a_graph_replayed_decode_step_with_its_broadcast_never_syncs(nccl: TensorParallel) -> None:
    _, local = _models(nccl)
    cache = KVCache(local.cfg, KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda"))
    runner = ModelRunner(local, cache)
    runner.capture_decode_graphs([4], max_pages=8)
    seqs = [Seq(cache, i, random_tokens(30, seed=i)) for i in range(3)]
    runner.forward(ForwardBatch.build([s.chunk(20) for s in seqs], Mode.EXTEND, cache), None)
    runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
    torch.cuda.synchronize()
    with no_host_sync():
        out = runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
    assert out.ready is not None
    out.ready.synchronize()
    assert out.host_tokens is not None and out.host_tokens.shape == (3,)
