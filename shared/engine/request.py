"""A request as the schedulers see it: plain data with an explicit phase."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.engine.kv.window import RequestWindow
from shared.engine.sampling import SamplingParams

__all__ = ["Phase", "Request"]


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, owns nothing
    RESERVED = "reserved"  # owns pages and a window its prompt's KV is being transferred into
    PREFILL = "prefill"  # owns pages and a window, prompt partly computed
    DECODE = "decode"
    FINISHED = "finished"  # owns nothing again


@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    pages: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)  # its pages the prefix cache holds (referenced there)
    cached_tokens: int = 0  # prompt tokens it read from the prefix cache (not computed)
    # Sliding layers with the prefix cache: prompt positions where a chunk must end, so that its rings
    # are snapshotted there (`snapshots`: boundary -> its pages and ring positions, until the prompt is
    # cached); and where a bounded replay of its rings starts (its hit needs one), until it has run.
    snapshot_at: list[int] = field(default_factory=list)
    snapshots: dict[int, tuple[list[int], object]] = field(default_factory=dict)
    replay_from: int | None = None
    window: RequestWindow | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_scheduled: int = 0  # tokens whose K/V are in the cache or being computed by a step in flight
    pending: int = 0  # output tokens launched but not read back yet (overlap scheduling)
    finish_reason: str | None = None  # stop | length | abort
    hold_kv: bool = False  # keep pages and window after finishing, until Engine.release (prefill side)
    admitted_ns: int = 0  # epoch ns when it got its pages and window (queue time ends): telemetry
    error: str | None = None  # why the engine aborted it (a contained invariant violation)
    # Tokens that end it: its stop_token_ids, and the model's EOS unless ignore_eos. Set once by the
    # engine, so the per-token check of a decode step is one set lookup.
    stop_ids: frozenset[int] = frozenset()

    @property
    def slot(self) -> int:
        assert self.window is not None, "slot of a request that owns no window"
        return self.window.slot

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED
