"""What the scheduler and its callers exchange: events, submit errors, configuration, pool state.

Plain data, apart from the scheduler (shared/serving/scheduler_base.py), so servicers, metrics and tests can
name them without the engine's imports.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AlreadyExists",
    "Event",
    "Finished",
    "NotAccepting",
    "PoolState",
    "QueueFull",
    "SchedulerConfig",
    "SubmitError",
    "Tokens",
]


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    admitted_ns: int = 0  # on a request's first Tokens only: when it left the queue (telemetry)


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # the engine failed: the request ends with an error, not a reason
    cached_tokens: int = 0  # prompt tokens read from the prefix cache


Event = Tokens | Finished


class SubmitError(Exception):
    """The request was not taken; nothing of it reached the engine."""


class QueueFull(SubmitError):
    pass


class AlreadyExists(SubmitError):
    pass


class NotAccepting(SubmitError):
    """Draining, stopped, or failed."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_queue: int = 128  # requests that may wait beyond those that can run; past it submit refuses


@dataclass(frozen=True)
class PoolState:
    pages_total: int
    pages_free: int
    slots_total: int
    slots_free: int
    running: int
    waiting: int  # not yet running: in the inbox or the engine's waiting queue
    pages_cached: int = 0  # kept by the prefix cache: reused by later prompts, evicted when short
    # The prefix cache since start: prompt tokens looked up, found there (not computed), pages evicted.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_pages: int = 0
