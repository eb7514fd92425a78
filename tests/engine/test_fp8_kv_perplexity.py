"""Accuracy on real weights: the embedded SmolLM2-135M's perplexity on a fixed English text
(tests/model/data/perplexity.txt) with its KV cache in FP8 (scales 1.0: the GGUF ships none) is within
2% of its perplexity with a bfloat16 cache. On the CPU the torch path (dequantize, then attend); on a
GPU (`gpu`) the Triton kernels. The prompt goes through the engine's own attention (`BatchAttention`:
RoPE's quantizing store, paged attention over FP8 pages) in one chunk, every position scored.

Measured on the CPU: 17.76 with a bfloat16 cache, 17.91 with FP8 (+0.85%); float32 model and cache
17.79, FP8 17.90 (+0.62%).

FP8 weights (per channel) and the FP8 cache together cost more than 2% on this 135M model: their
errors add (the mean KL divergence of the next-token distributions from the bfloat16 model's: 0.021
for the weights, 0.006 for the cache, 0.025 together), and the perplexity of ~500 tokens moves by
+-0.4% under perturbations as small as a power of two in the cache's scales (+1.4% to +2.2%
together). Measured on the CPU: +2.2% with the bfloat16 model, +2.3% with the float32 one; held
within 3%.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.window import RequestWindow
from shared.engine.runner import BatchAttention
from shared.kernels.attention import ops_for
from shared.kernels.kv_quant import FP8_KV_DTYPE

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[1] / "model" / "data" / "perplexity.txt"


@torch.inference_mode()
def perplexity(loaded, kv_dtype: torch.dtype, device: str, model=None) -> float:  # type: ignore[no-untyped-def]
    """`model` (default: the loaded one) over the text, its KV cache in `kv_dtype`."""
    ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    assert len(ids) > 300
    model = model or loaded.model
    kv = KVConfig(
        page_size=16, num_pages=-(-len(ids) // 16) + 1, max_requests=1, dtype=kv_dtype, device=device
    )
    cache = KVCache(loaded.config, kv)
    window = RequestWindow(cache, 0)
    pages = cache.pages.alloc(0, cache.pages_needed(len(ids)))
    batch = ForwardBatch.build([ChunkItem(window.slot, 0, ids, pages)], Mode.EXTEND, cache)
    attn = BatchAttention(cache, batch, ops_for(cache.device), loaded.config.head_dim**-0.5)
    logits = model.compute_logits(model(batch.input_ids, batch.positions, attn))
    targets = torch.tensor(ids[1:], device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), targets).item())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_kv_perplexity_is_within_2_percent_of_bf16(device: str) -> None:
    from shared.model import load_model

    loaded = load_model(dtype=torch.bfloat16, device=device)
    base = perplexity(loaded, torch.bfloat16, device)
    fp8 = perplexity(loaded, FP8_KV_DTYPE, device)
    assert 5 < base < 40, base  # the model reads the text as English
    assert abs(fp8 / base - 1) < 0.02, (base, fp8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_weights_and_kv_together_are_within_3_percent_of_bf16(device: str) -> None:
    from shared.model import load_model
    from shared.model.quant import quantize_model

    loaded = load_model(dtype=torch.bfloat16, device=device)
    base = perplexity(loaded, torch.bfloat16, device)
    fp8_model = quantize_model(copy.deepcopy(loaded.model), "fp8")
    both = perplexity(loaded, FP8_KV_DTYPE, device, fp8_model)
    assert abs(both / base - 1) < 0.03, (base, both)
