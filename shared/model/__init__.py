"""The model: config, decoder, dense reference attention, checkpoint loading and tokenizer."""

from __future__ import annotations

from shared.model.config import (
    FULL,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    config_from_hf,
    parse_layer_pattern,
    with_layout,
)
from shared.model.loader import DEFAULT_MODEL_NAME, LoadedModel, default_gguf_path, load_model
from shared.model.reference import DenseAttention, build_masks, pack, reference_logits
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.model.transformer import AttentionFn, Transformer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FULL",
    "SLIDING",
    "SUPPORTED_ARCHITECTURES",
    "AttentionFn",
    "DenseAttention",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "Transformer",
    "build_masks",
    "config_from_hf",
    "default_gguf_path",
    "load_model",
    "pack",
    "parse_layer_pattern",
    "reference_logits",
    "with_layout",
]
