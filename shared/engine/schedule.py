"""The Engine's scheduling decisions: which requests run this step, and what each one computes.

Plain functions over the engine's queues. Nothing here touches the device, reads a token back or
frees anything, so the policy can be read and changed apart from the loop that runs it
(`shared/engine/engine.py`) and from who owns the KV (`shared/engine/kv_ownership.py`, whose
`allocate` admission takes as an argument).

- Admission: waiting requests take a window slot and pages for prompt + max_tokens, all or nothing,
  strictly in arrival order (when the head does not fit, everyone behind it waits too).
- Prefill first (the default): prompts are computed in chunks under the step's token budget; when no
  prompt work is left, every running request that still owes tokens decodes one. Fast decode steps
  (CUDA graphs), but a burst of long prompts stalls every stream for as many steps as it takes.
- A chunk ends where the prefix cache snapshots a request's sliding-layer rings (`snapshot_at`,
  shared/engine/kv/snapshot.py): at most two such positions a prompt.
- Mixed steps (`EngineConfig.mixed`): every running request that owes a token decodes one in every
  step, and prompts fill the rest of the budget. A decode then waits at most one step, a longer one
  (a mixed step runs without a graph). Decode tokens come first in a mixed step: row i is token i,
  so an input still in flight is gathered by row as in a pure decode step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.batch import ChunkItem, Mode
from shared.engine.request import Phase, Request

__all__ = ["Plan", "admit", "schedule"]


@dataclass
class Plan:
    """One step. Rows line up across the lists."""

    mode: Mode
    reqs: list[Request]
    emits: list[bool]  # whether row i's token is an output token (a decode, or a prompt's last chunk)
    # EXTEND: the prompt chunks. DECODE: empty; one token per request, at its `num_scheduled`, which
    # the decode builder reads from the requests themselves (shared/engine/decode_batch.py).
    items: list[ChunkItem]


def admit(
    waiting: deque[Request], running: list[Request], max_running: int, allocate: Callable[[Request], bool]
) -> None:
    """Move requests from `waiting` to `running` while there is room and `allocate` gives them KV."""
    while waiting and len(running) < max_running:
        req = waiting[0]
        if not allocate(req):
            return
        waiting.popleft()
        req.phase = Phase.PREFILL
        req.admitted_ns = time.time_ns()  # once per request, not per step
        running.append(req)


def schedule(running: list[Request], budget: int, mixed: bool = False) -> Plan:
    """Prompt chunks under `budget` tokens while any prompt has work, else one decode token for each
    request that owes one. `mixed`: the decode tokens in every step, prompt chunks in what is left."""
    decoding = [
        req for req in running
        if req.num_scheduled >= len(req.prompt) and len(req.output) + req.pending < req.params.max_tokens
    ]  # fmt: skip
    items: list[ChunkItem] = []
    reqs: list[Request] = []
    emits: list[bool] = []
    if mixed:
        budget -= len(decoding)
    for req in running:
        if req.num_scheduled < len(req.prompt) and budget > 0:
            start = req.num_scheduled
            n = min(len(req.prompt) - start, budget)
            for at in req.snapshot_at:  # a chunk ends where the prefix cache snapshots its rings
                if start < at < start + n:
                    n = at - start
                    break
            items.append(ChunkItem(req.slot, start, req.prompt[start : start + n], req.pages))
            reqs.append(req)
            emits.append(start + n == len(req.prompt))
            budget -= n
    if not items:
        return Plan(Mode.DECODE, decoding, [True] * len(decoding), items)
    if not mixed or not decoding:
        return Plan(Mode.EXTEND, reqs, emits, items)
    # -1: an input token the step in flight is still producing (the engine gathers it on the device).
    first = [
        ChunkItem(r.slot, r.num_scheduled, [r.output[-1] if r.output and not r.pending else -1], r.pages)
        for r in decoding
    ]
    return Plan(Mode.EXTEND, decoding + reqs, [True] * len(decoding) + emits, first + items)
