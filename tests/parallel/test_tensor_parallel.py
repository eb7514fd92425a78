"""Tensor parallelism on torch.distributed with gloo (real processes, one per rank): a model sharded
over 2 or 4 ranks computes the unsharded model's logits, through the dense reference and through the
engine's runner (each rank's KV cache holding its KV heads, chunked prefill then decode past the
window), for a hybrid model with its KV heads split or replicated, Qwen3's q/k norms with biases, tied
embeddings over a vocabulary the ranks do not divide, and a gpt-oss-like mixture of experts with
attention sinks, its experts sliced or (expert parallel) placed whole."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.engine.batch import Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.model import reference_logits
from shared.model.fingerprint import fingerprint
from shared.model.quant import quantize_head
from shared.model.tensor_parallel import TensorParallel, kv_heads_of, shard
from shared.serving.api.model_source import load_served_model, random_model_config, random_transformer
from shared.serving.config import CommonConfig
from shared.serving.tensor_parallel import load_whole
from tests.engine.engine_testutil import W, random_tokens
from tests.engine.test_engine_parity import PAGE, Seq, run

CPU = torch.device("cpu")
MODELS = {
    "hybrid": ({"layers": "SSFS", "window": W}, {}),
    "qwen3-bias-tied": (
        {"layers": "FSFS", "window": W}, {"qk_norm": True, "qkv_bias": True, "tie_word_embeddings": True},
    ),
    "gpt-oss-moe-sinks": (
        {"layers": "SFSF", "window": W, "experts": 4, "top_k": 2, "expert_intermediate": 48, "sinks": True,
         "gpt_oss_experts": True},
        {},
    ),
}  # fmt: skip


def _model(name: str):  # type: ignore[no-untyped-def]
    opts, extra = MODELS[name]
    cfg = dataclasses.replace(random_model_config(opts), **extra)
    return random_transformer(cfg, seed=5).eval()


def _worker(rank: int, world: int, port: int, names: list[str]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tp = TensorParallel(rank, world)
        for entry in names:
            name, _, how = entry.partition("+")  # "+ep": the experts placed whole, E/N a rank
            full = _model(name)
            local = shard(full, tp, expert_parallel=how == "ep")
            assert local.cfg.num_heads == full.cfg.num_heads // world, name
            seqs = [random_tokens(2 * W + 3, seed=1), random_tokens(5, seed=2)]
            want = reference_logits(full, seqs)
            got = reference_logits(local, seqs)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
            # Through the runner: this rank's KV heads in its cache, paged and ring attention.
            cache = KVCache(local.cfg, KVConfig(page_size=PAGE, num_pages=32, max_requests=2))
            runner = ModelRunner(local, cache)
            seq = Seq(cache, 0, random_tokens(2 * W + 4, seed=3))
            target = reference_logits(full, [seq.tokens])[0]
            logits = run(runner, [seq.chunk(W + 1)], Mode.EXTEND)
            torch.testing.assert_close(logits[0], target[seq.done - 1], rtol=1e-4, atol=1e-4)
            for _ in range(W):
                logits = run(runner, [seq.chunk(1)], Mode.DECODE)
                torch.testing.assert_close(logits[0], target[seq.done - 1], rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("world", "names"),
    [(2, [*MODELS, "gpt-oss-moe-sinks+ep"]), (4, ["hybrid"])],  # 4 ranks: the 2 KV heads replicated
    ids=["tp2", "tp4-replicated-kv"],
)
def test_a_sharded_model_computes_the_whole_models_logits(world: int, names: list[str]) -> None:
    mp.spawn(_worker, args=(world, _free_port(), names), nprocs=world, join=True)


def test_kv_heads_split_or_replicate_and_impossible_splits_are_refused() -> None:
    assert [list(kv_heads_of(8, 4, r, 2)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_heads_of(8, 2, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(ValueError, match="6 attention heads do not split over 4"):
        kv_heads_of(6, 2, 0, 4)
    with pytest.raises(ValueError, match="3 KV heads neither split over 2 ranks"):
        kv_heads_of(6, 3, 0, 2)
    three_ways = random_transformer(random_model_config({"heads": 6, "kv_heads": 3}))  # but 128 columns
    with pytest.raises(ValueError, match="intermediate_size 128 does not split over 3"):
        shard(three_ways, TensorParallel(0, 3))
    six = random_transformer(random_model_config({"experts": 6, "top_k": 2, "expert_intermediate": 48}))
    with pytest.raises(ValueError, match="num_experts 6 does not split over 4"):
        shard(six, TensorParallel(0, 4), expert_parallel=True)
    with pytest.raises(ValueError, match="expert parallel: the model has no experts"):
        shard(_model("hybrid"), TensorParallel(0, 2), expert_parallel=True)


@pytest.mark.parametrize(("quantization", "head"), [("none", False), ("fp8", False), ("fp8-block", True)])
def test_a_service_of_ranks_announces_the_fingerprint_one_rank_would(quantization: str, head: bool) -> None:
    """The KV handshake compares weights by fingerprint. Ranks quantize their own shares (the LM head's
    too, with --quantize-lm-head), so rank 0 takes the fingerprint from the whole model as one rank
    would serve it: services of any degrees, quantized alike, agree; quantized otherwise, they do not."""
    spec = 'random:{"layers": "SSFS", "heads": 4, "kv_heads": 2}'
    one = load_served_model(spec, quantization=quantization)
    if head:
        quantize_head(one.model)
    cfg = CommonConfig(model=spec, dtype="float32", quantization=quantization, tp=2, quantize_lm_head=head)
    whole = load_whole(cfg, CPU)
    assert whole.fingerprint == fingerprint(one.model, one.tokenizer)
    assert whole.model.quantization == "none"  # each rank quantizes its share
    other = dataclasses.replace(
        cfg, quantization="fp8" if quantization == "none" else "none", quantize_lm_head=False
    )
    assert load_whole(other, CPU).fingerprint != whole.fingerprint
    if head:  # the head alone makes them differ
        assert (
            load_whole(dataclasses.replace(cfg, quantize_lm_head=False), CPU).fingerprint != whole.fingerprint
        )
