"""Small random-weight hybrid models and ground truth for the engine tests."""

from __future__ import annotations

import torch

from shared.model.config import FULL, SLIDING, ModelConfig
from shared.model.reference import reference_logits
from shared.model.transformer import Transformer

W = 8


def tiny_config(layer_types: str = "SSFS", window: int = W, vocab: int = 97) -> ModelConfig:
    kinds = {"S": SLIDING, "F": FULL}
    types = tuple(kinds[c] for c in layer_types)
    return ModelConfig(
        architecture="test-hybrid", vocab_size=vocab, hidden_size=64, num_layers=len(types), num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, layer_types=types,
        sliding_window=window if SLIDING in types else None, eos_token_ids=(),
    )  # fmt: skip


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Weights large enough that windows W and W+1 give visibly different logits."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    return model.eval()


def reference(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Logits [len, V] of the whole sequence in one dense pass."""
    with torch.inference_mode():
        return reference_logits(model, [tokens])[0]


def random_tokens(n: int, vocab: int = 97, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
