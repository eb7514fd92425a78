"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch
from model_testutil import TINY, WINDOW


@pytest.fixture
def prompts() -> dict[str, list[int]]:
    """Token sequences around the window size: W-1, W, W+1, and long enough to slide a few times."""
    gen = torch.Generator().manual_seed(1)
    lengths = {"W-1": WINDOW - 1, "W": WINDOW, "W+1": WINDOW + 1, "3W+2": 3 * WINDOW + 2}
    return {k: torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for k, n in lengths.items()}
