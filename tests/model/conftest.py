"""Fixtures of the model tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from model_testutil import TINY, WINDOW, transformers_reads_gguf


@pytest.fixture
def prompts() -> dict[str, list[int]]:
    """Token sequences around the window size: W-1, W, W+1, and long enough to slide a few times."""
    gen = torch.Generator().manual_seed(1)
    lengths = {"W-1": WINDOW - 1, "W": WINDOW, "W+1": WINDOW + 1, "3W+2": 3 * WINDOW + 2}
    return {k: torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for k, n in lengths.items()}


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF), loaded once per test run."""
    from shared.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def hf_gguf_dir(tmp_path_factory: pytest.TempPathFactory):
    """A directory holding (a link to) the embedded GGUF, as transformers' from_pretrained wants it."""
    from shared.model import default_gguf_path

    path = tmp_path_factory.mktemp("gguf")
    (path / "model.gguf").symlink_to(default_gguf_path())
    return path


@pytest.fixture(scope="session")
def hf_reads_smollm() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context in which transformers reads the embedded GGUF through one parse of it per test run
    (`transformers_reads_gguf`): its model (test_model_embedded_default.py) opens the file twice, for
    the config and the weights, and its tokenizer (test_model_tokenizer.py) once, each open a parse of
    ~3 s on a 2-core host otherwise."""
    from shared.model import default_gguf_path, gguf_loader

    path = default_gguf_path()
    reader = gguf_loader._reader(path)
    return lambda: transformers_reads_gguf(path, reader)
