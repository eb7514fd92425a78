"""GetModelInfo's answer, which both services give (prefill's kv_pool is its own pool)."""

from __future__ import annotations

from shared.model import LoadedModel
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.serving.scheduler_base import PoolState

__all__ = ["model_info"]


def model_info(
    loaded: LoadedModel, max_context: int, page_size: int, dtype: str, pool: PoolState
) -> pb.ModelInfo:
    cfg = loaded.config
    return pb.ModelInfo(
        model_name=loaded.name,
        vocab_size=cfg.vocab_size,
        max_context=max_context,
        layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window or 0,
        page_size=page_size,
        dtype=dtype,
        eos_token_ids=list(cfg.eos_token_ids),
        has_tokenizer=loaded.tokenizer is not None,
        has_chat_template=loaded.tokenizer is not None and loaded.tokenizer.chat_template is not None,
        quantization=loaded.model.quantization,
        architecture=cfg.architecture,
        num_experts=0 if cfg.moe is None else cfg.moe.num_experts,
        experts_per_token=0 if cfg.moe is None else cfg.moe.top_k,
        moe_layers=[] if cfg.moe is None else list(cfg.moe.layers),
        attention_sinks=cfg.attention_sinks,
        kv_pool=pb.KVPoolState(
            pages_total=pool.pages_total,
            pages_free=pool.pages_free,
            window_slots_total=pool.slots_total,
            window_slots_free=pool.slots_free,
            running=pool.running,
            waiting=pool.waiting,
            pages_cached=pool.pages_cached,
        ),
    )
