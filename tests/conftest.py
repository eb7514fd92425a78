"""Suite-wide set-up: GPU tests skip without CUDA; Triton kernels run in the interpreter on CPU."""

from __future__ import annotations

import os

import torch

# What `make test` exports; set here too so a bare `pytest` also fails on a broken invariant.
os.environ.setdefault("PDSERVE_INVARIANT_CHECK", "strict")
# Service processes the tests start bind /metrics on a free port, never the fixed defaults.
os.environ.setdefault("PDSERVE_METRICS_PORT", "0")

if not torch.cuda.is_available():
    # Must precede any `import triton`: the interpreter is chosen when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
