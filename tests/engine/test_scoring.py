"""Prompt scoring (`shared.engine.scoring.prompt_log_probs`): every position's next-token
log-distribution of a prompt, through the engine's attention, is the dense model's."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import random_tokens, reference, tiny_config, tiny_model

from shared.engine.scoring import prompt_log_probs


def test_every_row_is_the_dense_models_next_token_distribution() -> None:
    """A hybrid model (sliding and full layers) over a prompt longer than its window."""
    cfg = tiny_config("SSFS")
    model = tiny_model(cfg)
    ids = random_tokens(40)
    got = prompt_log_probs(cfg, model, ids, torch.float32, "cpu")
    assert got.shape == (40, cfg.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(model, ids).float().log_softmax(-1), atol=1e-4, rtol=1e-4)


def test_a_row_depends_only_on_the_tokens_up_to_it() -> None:
    cfg = tiny_config("SF")
    model = tiny_model(cfg)
    ids = random_tokens(30)
    whole = prompt_log_probs(cfg, model, ids, torch.float32, "cpu")
    prefix = prompt_log_probs(cfg, model, ids[:17], torch.float32, "cpu")
    torch.testing.assert_close(whole[:17], prefix, atol=1e-5, rtol=1e-5)


def test_an_empty_prompt_is_refused() -> None:
    cfg = tiny_config("SF")
    with pytest.raises(ValueError, match="ids must hold at least one token"):
        prompt_log_probs(cfg, tiny_model(cfg), [], torch.float32, "cpu")
