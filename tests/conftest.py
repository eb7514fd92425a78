"""Suite-wide set-up: GPU tests skip without CUDA; Triton kernels run in the interpreter on CPU."""

from __future__ import annotations

import os

import pytest

# What `make test` exports; set here too so a bare `pytest` also fails on a broken invariant.
os.environ.setdefault("PDSERVE_INVARIANT_CHECK", "strict")
# Service processes the tests start bind /metrics on a free port, never the fixed defaults.
os.environ.setdefault("PDSERVE_METRICS_PORT", "0")

# Under xdist (`make test`: one worker per core), each worker's share of the cores for its torch and BLAS
# threads (numpy's too: the Triton interpreter computes with it), and for the service processes it starts
# (they inherit it, as `pdserve up`'s children get theirs). Left at their default, a thread per core in
# every worker, the workers' threads contend for each core and spin-wait on one another: on 2 cores the
# suite took 1.4-1.8x the CPU time for the same computations. Must precede `import torch` (and numpy).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must precede any `import triton`: the interpreter is chosen when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
