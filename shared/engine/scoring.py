"""A prompt's next-token log-probabilities at every position, through the engine's own attention.

What perplexity is computed from: the whole prompt goes through the model as one prefill chunk
over a fresh cache (pages and rings in the cache's dtype, so an FP8 cache quantizes what attention
reads as serving would), and every position's logits are kept rather than the last one's. For
evaluation (tests, bench/fp8_accuracy.py), not for serving: it allocates its own cache per call.
"""

from __future__ import annotations

import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.window import RequestWindow
from shared.engine.runner import BatchAttention
from shared.kernels.attention import ops_for
from shared.model.config import ModelConfig
from shared.model.transformer import Transformer

PAGE_SIZE = 16


@torch.inference_mode()
def prompt_log_probs(
    config: ModelConfig, model: Transformer, ids: list[int], kv_dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """float32 [len(ids), vocab]: row i is the log-distribution of the token after ids[:i + 1]."""
    if len(ids) < 1:
        raise ValueError("prompt_log_probs: ids must hold at least one token")
    kv = KVConfig(
        page_size=PAGE_SIZE, num_pages=-(-len(ids) // PAGE_SIZE) + 1, max_requests=1, dtype=kv_dtype,
        device=device,
    )  # fmt: skip
    cache = KVCache(config, kv)
    window = RequestWindow(cache, 0)
    pages = cache.pages.alloc(0, cache.pages_needed(len(ids)))
    batch = ForwardBatch.build([ChunkItem(window.slot, 0, ids, pages)], Mode.EXTEND, cache)
    attn = BatchAttention(cache, batch, ops_for(cache.device), config.head_dim**-0.5)
    return model.compute_logits(model(batch.input_ids, batch.positions, attn)).float().log_softmax(-1)
