"""Test-only fault injection, so the invariant containment path can be shown end to end.

Off unless `PDSERVE_TEST_FAULTS` names a fault; nothing in the public API reaches it.

    PDSERVE_TEST_FAULTS=drop_swa_history        drop the SWA history of every request whose prompt
    PDSERVE_TEST_FAULTS=drop_swa_history:5      starts with the marker token (default 3, or the given id)
    PDSERVE_TEST_FAULTS=step_delay:0.2          sleep this many seconds after every engine step (a slow
                                                service: its queue builds up under a burst)
    PDSERVE_TEST_FAULTS=short_kv_chunk          the prefill service sends the second inline KV chunk of
    PDSERVE_TEST_FAULTS=short_kv_chunk:5        a request whose prompt starts with the marker one byte
                                                short (what decode does with a bad chunk)

Faults combine with commas (`drop_swa_history,step_delay:0.1`).

The history is dropped (`ring_pos[:, slot] = -1`) when the request's first token is emitted, after its
prompt's K/V went into the rings: its next decode step reads a window that is not there, and
`swa.history_present` fires for its slot only (WARN: counted and contained; STRICT: the process stops).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.engine import Engine
    from shared.engine.request import Request
    from shared.transfer.base import Chunk

__all__ = ["ENV_VAR", "Faults", "from_env"]

ENV_VAR = "PDSERVE_TEST_FAULTS"
DEFAULT_MARKER = 3
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    drop_swa_history_marker: int | None = None
    step_delay_s: float = 0.0
    short_kv_chunk_marker: int | None = None

    def after_step(self) -> None:
        """Scheduler thread, after every engine step."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)

    def first_token(self, engine: Engine, prompt: list[int], req: Request) -> None:
        """Scheduler thread, once per request (its first emitted token)."""
        marker = self.drop_swa_history_marker
        if marker is not None and prompt and prompt[0] == marker and req.window is not None:
            log.warning("test fault: dropping the SWA history of slot %d", req.window.slot)
            engine.cache.ring_pos[:, req.window.slot] = -1

    def sent_chunk(self, prompt: list[int], index: int, chunk: Chunk) -> Chunk:
        """Prefill's servicer, for each inline chunk it sends (`index` from 0)."""
        marker = self.short_kv_chunk_marker
        if marker is None or index != 1 or not prompt or prompt[0] != marker:
            return chunk
        log.warning("test fault: sending chunk %d of layer %d one byte short", index, chunk.layer)
        return dataclasses.replace(chunk, k=chunk.k[:-1])


def from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    spec = (os.environ if env is None else env).get(ENV_VAR, "")
    if not spec:
        return None
    marker: int | None = None
    short: int | None = None
    delay = 0.0
    for item in spec.split(","):
        name, _, arg = item.strip().partition(":")
        if name == "drop_swa_history":
            marker = int(arg) if arg else DEFAULT_MARKER
        elif name == "step_delay":
            delay = float(arg)
        elif name == "short_kv_chunk":
            short = int(arg) if arg else DEFAULT_MARKER
        else:
            known = "drop_swa_history[:TOKEN], step_delay:SECONDS, short_kv_chunk[:TOKEN]"
            raise ValueError(f"{ENV_VAR}: unknown fault {name!r} (known: {known})")
    log.warning("%s=%s: test faults are enabled", ENV_VAR, spec)
    return Faults(drop_swa_history_marker=marker, step_delay_s=delay, short_kv_chunk_marker=short)
