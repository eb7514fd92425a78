"""When the FP8 decode kernels launch as programmatic dependents (`shared/kernels/_pdl.py`): on a
Hopper GPU, at the decode batches where it measured faster, unless `PDSERVE_PDL=0`; never on a CPU
or in the interpreter. (That the launches keep the plain launches' bits is a GPU test:
tests/model/test_fp8_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from shared.kernels import _pdl
from shared.kernels._pdl import pdl_launch

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A CUDA device of compute capability 9.0, compiled for rather than interpreted."""
    monkeypatch.setattr(_pdl, "interpreting", lambda: False)
    monkeypatch.setattr(_pdl, "_hopper", lambda index: True)
    monkeypatch.delenv("PDSERVE_PDL", raising=False)
    return torch.device("cuda", 0)


def test_decode_batches_of_one_or_two_rows_and_33_to_64_launch_as_dependents(hopper: torch.device) -> None:
    assert [rows for rows in range(1, 130) if pdl_launch(hopper, rows) == ON] == [1, 2, *range(33, 65)]
    assert pdl_launch(hopper, 16) == OFF, "8 to 32 rows measured slower"
    assert pdl_launch(hopper, 4096) == OFF, "prefill launches plainly"


def test_a_caller_that_does_not_want_it_and_the_switch_launch_plainly(
    hopper: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pdl_launch(hopper, 64, wanted=False) == OFF  # a bf16 GEMM, a prefill attention call
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert pdl_launch(hopper, 64) == OFF
    monkeypatch.setenv("PDSERVE_PDL", "1")
    assert pdl_launch(hopper, 64) == ON


def test_an_older_gpu_a_cpu_and_the_interpreter_launch_plainly(
    hopper: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pdl_launch(torch.device("cpu"), 64) == OFF
    monkeypatch.setattr(_pdl, "_hopper", lambda index: False)
    assert pdl_launch(hopper, 64) == OFF
    monkeypatch.setattr(_pdl, "_hopper", lambda index: True)
    monkeypatch.setattr(_pdl, "interpreting", lambda: True)
    assert pdl_launch(hopper, 64) == OFF
