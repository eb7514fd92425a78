"""Small random-weight hybrid models and ground truth for the engine tests."""

from __future__ import annotations

import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.runner import ModelRunner
from shared.model.config import ModelConfig
from shared.model.reference import reference_logits
from shared.model.transformer import Transformer
from shared.serving.api.model_source import random_model_config, random_transformer

W = 8


# Half tiny_config's hidden and MLP widths (`tiny_config(..., **NARROW)`), for tests that interpret the
# Triton kernels: a GEMM's programs are its output column blocks. Heads, window and vocabulary stay,
# and every row or half-row of activations stays a multiple of 16 bytes: the same kernels, views and
# launch variants, fewer programs to interpret.
NARROW = {"hidden": 32, "intermediate": 64}


def tiny_config(layer_types: str = "SSFS", window: int = W, vocab: int = 97, **dims: int) -> ModelConfig:
    """hidden 64, 4/2 heads x 16, intermediate 128 (unless `dims`, more of `random:<json>`'s keys:
    "hidden", "intermediate", "heads", "kv_heads"): what `random:<json>` serves, built in-process."""
    return random_model_config({"layers": layer_types, "window": window, "vocab": vocab, **dims})


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return random_transformer(cfg, seed).eval()


def reference(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Logits [len, V] of the whole sequence in one dense pass."""
    with torch.inference_mode():
        return reference_logits(model, [tokens])[0]


def random_tokens(n: int, vocab: int = 97, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def build_batch(runner: ModelRunner, items: list[ChunkItem], mode: Mode) -> ForwardBatch:
    """A batch for `runner.forward`: a decode batch straight into a captured graph's static buffers
    when one fits (as the engine's decode batches go), anything else packed on its own."""
    graphs = runner.graphs
    if mode is Mode.DECODE and graphs is not None:
        size = graphs.size_for(len(items), max((len(it.pages) for it in items), default=0))
        if size is not None:
            graphs.resident[size] = None  # the whole buffer is rewritten, by no decode batch builder
            return ForwardBatch.build(
                items, mode, runner.cache, pad_to=size, table_width=graphs.max_pages,
                into=graphs.static[size].buffers,
            )  # fmt: skip
    return ForwardBatch.build(items, mode, runner.cache)
