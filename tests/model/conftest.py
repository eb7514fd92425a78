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


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF), loaded once for the session."""
    from shared.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def hf_gguf_dir(tmp_path_factory: pytest.TempPathFactory):
    """A directory holding (a link to) the embedded GGUF, as transformers' from_pretrained wants it."""
    from shared.model import default_gguf_path

    path = tmp_path_factory.mktemp("gguf")
    (path / "model.gguf").symlink_to(default_gguf_path())
    return path
