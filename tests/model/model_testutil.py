"""Tiny random Hugging Face checkpoints for the model tests (a uniquely named module, importable from
test files; conftest.py holds only fixtures)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# The hub is unreachable from CI: transformers must never try it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WINDOW = 6
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    # Large weights give peaked attention, so dropping one key from a window moves the logits well
    # above the parity tolerance: the window tests would notice an off-by-one.
    initializer_range=0.2,
)


def randomize(model: torch.nn.Module, std: float) -> None:
    """Random values for every parameter, norms and biases included (HF initializes those to 1 and 0,
    which would hide a norm or bias that we failed to load)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(std * noise)


def save_hf_model(path: Path, config_cls: str, **overrides: object) -> torch.nn.Module:
    """Build a random float32 eager-attention HF causal LM, save it as safetensors to `path`, return it."""
    import transformers

    cfg = getattr(transformers, config_cls)(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, cfg.initializer_range)
    model.eval()
    model.save_pretrained(path)
    return model
