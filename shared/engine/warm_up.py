"""Compiling, before any traffic, what the first requests would otherwise compile mid-step.

Triton compiles a kernel on its first launch with each set of launch constants: the query tile a
chunk's length picks, decode's tiles or prefill's, a mode flag. Each compile stalls every request in
flight for as long as it takes. `warm_up` runs throwaway greedy requests that reach each of them:
each query-tile length alone, all of them together, and a prompt that arrives while another decodes
(a mixed step, if the engine mixes); and one seeded sampled request, for the sampler's kernels.
Everything they held is freed after, and the pools are checked back at their idle baseline.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from shared.engine.request import Request
from shared.engine.sampling import SamplingParams

__all__ = ["WARM_UP_LENGTHS", "warm_up"]


class _Engine(Protocol):
    """What warm-up uses of the Engine (which calls it)."""

    @property
    def idle(self) -> bool: ...
    @property
    def in_flight(self) -> bool: ...
    @property
    def max_running(self) -> int: ...
    def max_context(self) -> int: ...
    def add_request(self, prompt: list[int], params: SamplingParams) -> Request: ...
    def step(self) -> list[tuple[Request, int]]: ...
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]: ...
    def free_finished(self) -> None: ...
    def check_idle_integrity(self) -> None: ...


# Prompt lengths warm-up runs: one in each power-of-two bucket of a chunk's query tile (tiles cap at
# 64 query rows), and one of several key tiles.
WARM_UP_LENGTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 1000)


def warm_up(engine: _Engine) -> float:
    """Run the warm-up requests on an idle engine; returns the seconds it took."""
    if not engine.idle:
        raise RuntimeError("warm up an engine before its first request")
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    room = engine.max_context() - params.max_tokens
    lengths = [n for n in WARM_UP_LENGTHS if n <= room]
    for n in lengths:
        engine.generate([[0] * n], params)
    engine.generate([[0] * n for n in lengths[: engine.max_running]], params)
    # A sampled row: the sampler's argmax over float32 scores is a kernel variant of its own on CUDA
    # (greedy rows take it over the model's dtype). Seeded: the engine's generator is not drawn from.
    engine.generate([[0] * lengths[0]], dataclasses.replace(params, temperature=1.0, seed=0))
    longer = dataclasses.replace(params, max_tokens=8)
    fits = [n for n in lengths if n + longer.max_tokens <= engine.max_context()]
    if fits:
        first = engine.add_request([0] * fits[len(fits) // 2], longer)
        while not first.output and not first.finished:  # an abort (a contained violation) ends it
            engine.step()
        engine.generate([[0] * lengths[-1]], params)
        while not first.finished or engine.in_flight:
            engine.step()
    engine.free_finished()
    engine.check_idle_integrity()
    return time.perf_counter() - start
