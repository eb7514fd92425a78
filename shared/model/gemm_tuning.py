"""Pick each decode GEMM's cuBLASLt algorithm by timing it on the model's own weights.

For each weight shape of the model's bias-free bf16 or fp16 projections (q/k/v, o, gate/up, down,
the LM head) and each decode batch size whose GEMM goes to cuBLAS (`ModelKernels.takes_cublas`; the
LM head's always does, `ModelKernels.head`), every candidate of `lt_gemm.candidates` and torch's own
GEMM run as one CUDA graph over all the layers' weights of that shape, each read once from HBM as in
a decode step. A candidate that beats torch by `MARGIN` is set on those modules
(`nn.Linear.lt_gemms[rows]`), where `TritonKernels.linear` finds it; else torch's stays. The engine
tunes before it captures its decode graphs (`EngineConfig.tune_gemms`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shared.kernels import ModelKernels, lt_gemm

log = logging.getLogger(__name__)

MARGIN = 0.02  # a candidate must be this much faster than torch's GEMM: below it, timing noise
REPLAYS = 7  # timed graph replays per candidate (the median counts)


@dataclass(frozen=True)
class Tuned:
    """One (rows, N, K) problem's outcome: torch's time, the best candidate's, and which one is set."""

    rows: int
    n: int
    k: int
    modules: int  # linears of that shape (the layers timed in one graph)
    torch_us: float  # per GEMM
    best_us: float
    best: str  # the best candidate's cuBLASLt configuration
    chosen: bool  # set on the modules (beat torch by MARGIN)


def linears(model: nn.Module) -> list[nn.Linear]:
    """The model's projections: what a decode step runs through `ModelKernels.linear`, `linear_add`
    and (the LM head) `head`."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def clear(model: nn.Module) -> None:
    """Forget every tuned algorithm: torch's GEMMs again."""
    for lin in linears(model):
        lin.lt_gemms = {}


def tune(model: nn.Module, rows: Iterable[int], kernels: ModelKernels) -> list[Tuned]:
    """Time and set, for each decode batch size in `rows`, the GEMMs `kernels` hands to cuBLAS.

    Shapes already tuned for a batch size keep their choice (engines that share a model tune once).
    Returns what was timed; [] when cuBLASLt is not available (no nvmath-python, or no CUDA).
    """
    if not lt_gemm.available():
        log.info("GEMM tuning skipped: cuBLASLt is not available (nvmath-python, the gpu extra, and CUDA)")
        return []
    groups: dict[tuple[int, int, torch.dtype, torch.device], list[nn.Linear]] = {}
    for lin in linears(model):
        w = lin.weight
        if lin.bias is None and w.dtype in lt_gemm.HALF_TYPES and w.is_cuda and w.is_contiguous():
            groups.setdefault((w.shape[0], w.shape[1], w.dtype, w.device), []).append(lin)
    head = getattr(model, "lm_head", None)  # `ModelKernels.head`: cuBLAS at every batch size
    started = time.perf_counter()
    done = []
    for (n, k, dtype, device), mods in groups.items():
        for m in sorted(set(rows)):
            cublas = kernels.takes_cublas(m, mods[0]) or any(x is head for x in mods)
            if not cublas or all(m in getattr(x, "lt_gemms", {}) for x in mods):
                continue
            result, gemm = _tune_one(m, n, k, dtype, device, [x.weight for x in mods])
            for lin in mods:
                table = getattr(lin, "lt_gemms", None)
                if table is None:
                    table = lin.lt_gemms = {}
                table[m] = gemm  # None: torch's GEMM (and not tuned again)
            done.append(result)
    if done:
        log.info("tuned %d GEMM problems in %.1f s, cuBLASLt's chosen for %d", len(done),
                 time.perf_counter() - started, sum(r.chosen for r in done))  # fmt: skip
    return done


@torch.no_grad()
def _tune_one(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, weights: list[torch.Tensor]
) -> tuple[Tuned, lt_gemm.LtGemm | None]:
    with torch.cuda.device(device):
        x = torch.randn(m, k, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        want = torch.mm(x, weights[0].t())
        calls = len(weights)
        torch_us = _graph_us(lambda: [torch.mm(x, w.t(), out=out) for w in weights], calls)
        best: tuple[float, lt_gemm.LtGemm] | None = None
        for gemm in lt_gemm.candidates(m, n, k, dtype, device):
            gemm(x, weights[0], out)
            # A candidate must compute the product (half-precision rounding of another summation order aside).
            if not torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2):
                log.warning("cuBLASLt's %s gave a wrong product at %s: skipped", gemm.label, (m, n, k))
                continue
            us = _graph_us(lambda g=gemm: [g(x, w, out) for w in weights], calls)
            if best is None or us < best[0]:
                best = (us, gemm)
    if best is None:
        return Tuned(m, n, k, calls, torch_us, float("nan"), "none", False), None
    chosen = best[0] < (1 - MARGIN) * torch_us
    tuned = Tuned(m, n, k, calls, torch_us, best[0], best[1].label, chosen)
    log.info("GEMM %s: torch %.2f us, cuBLASLt best %.2f us (%s)%s", (m, n, k), torch_us, best[0],
             best[1].label, ", chosen" if chosen else "")  # fmt: skip
    return tuned, best[1] if chosen else None


def _graph_us(fn: Callable[[], object], calls: int) -> float:
    """Median µs per call of `fn` (`calls` GEMMs) replayed as one CUDA graph."""
    fn()  # outside the capture: whatever the first call sets up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
