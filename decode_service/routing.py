"""Where decode prefills each prompt: here, or on the prefill service (conditional disaggregation).

`PrefillRouter.route` decides once per request, on the event loop, and says why. The reason goes on
the request span (`pdserve.prefill` = local | remote, `pdserve.prefill.reason`) and into the counter
`pdserve_prefill_route_total`:

    no_prefill        no --prefill-target: every prompt prefills here
    short_prompt      the prompt has at most --local-prefill-max-tokens tokens
    prefill_mismatch  a prefill service refused decode's KV layout (FAILED_PRECONDITION): remote prefill
                      is off until a background Handshake succeeds again (every few seconds)
    prefill_unavailable  a remote prefill ran out of its time, could not reach the prefill service or
                      broke off (it is dead, hung, far slower than measured or restarting): that request
                      and the next ones prefill here until a background Handshake succeeds again (a
                      circuit breaker)
    prefill_busy      the prefill service's queue was full (RESOURCE_EXHAUSTED): this request prefills here
    prefill_rejected  the prefill service refused this prompt (INVALID_ARGUMENT: longer than its context,
                      say): this request prefills here
    queue_deep        the prefill queue estimate + this prompt exceed the queue limit
    remote            the prefill service computes it

A request whose remote prefill failed in any of these ways is prefilled here (its route becomes local
and the reason one of prefill_mismatch, prefill_unavailable, prefill_busy, prefill_rejected): the
client sees a normal completion, never an error caused by the prefill service.

The queue limit (`queue_limit`) is --remote-prefill-max-queued-tokens, by default `auto`: what the
prefill service drains in half the prefill timeout, at the rate decode measured on its own calls
(decode_service/prefill_client.py `DrainRate`), so that a prompt sent there is expected back well within
the time decode gives it. Until a first call has completed the rate is unknown and the limit is 1: one
prompt at a time (a GPU measures its rate within milliseconds; a CPU that would take minutes to drain a
burst must not be sent one). An empty queue takes any prompt, whatever the limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_service.prefill_client import PrefillClient, PrefillFailed, PrefillRefused

__all__ = ["PrefillRouter", "QueueEstimate", "Route"]

log = logging.getLogger("decode_service")

REHANDSHAKE_S = 2.0  # while remote prefill is off: how often a Handshake asks whether it can resume
# A report older than this says nothing about the queue now. It must expire: while the estimate is over
# the threshold nothing is sent, so no PrefillDone would ever come to lower it.
REPORT_TTL_S = 2.0


@dataclass(frozen=True)
class Route:
    remote: bool
    reason: str  # one of the reasons above
    ticket: int = 0  # a remote route's place in the queue estimate (QueueEstimate.add)

    @property
    def where(self) -> str:
        return "remote" if self.remote else "local"


class QueueEstimate:
    """Prompt tokens queued at the prefill service (waiting + computing), as this decode sees them.

    estimate = max(own, report + own sent since the report arrived), where `own` is this decode's remote
    prefills in flight (known exactly and at once, so a burst is counted before any reply) and `report`
    the last PrefillDone.queued_prompt_tokens: the only view of what other decodes queued there. Own
    prefills sent before the report are taken as counted in it. The report alone would be stale by a
    whole prefill (it is measured when one finishes) and blind to a burst; own alone is blind to other
    decodes. With several prefill pods the report is the pod that answered last, a fair sample under
    round_robin. A remote request counts from its routing decision, while it still waits here for pages:
    it will be sent.
    """

    def __init__(self, ttl_s: float = REPORT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._seq = 0
        self._inflight: dict[int, int] = {}  # ticket (send order) -> prompt tokens
        self._report = 0
        self._report_seq = 0  # tickets above this were routed after the report arrived
        self._report_at = -math.inf

    def add(self, tokens: int) -> int:
        """A remote prefill of `tokens` prompt tokens was routed; returns its ticket."""
        self._seq += 1
        self._inflight[self._seq] = tokens
        return self._seq

    def done(self, ticket: int, reported: int | None = None) -> None:
        """The prefill ended (idempotent); `reported`: its PrefillDone.queued_prompt_tokens."""
        self._inflight.pop(ticket, None)
        if reported is not None:
            self._report, self._report_seq, self._report_at = reported, self._seq, self._clock()

    def value(self) -> int:
        # A snapshot: /metrics reads this from its own thread while the event loop adds and removes.
        inflight = tuple(self._inflight.items())
        own = sum(n for _, n in inflight)
        if self._clock() - self._report_at > self._ttl_s:
            return own
        since = sum(n for t, n in inflight if t > self._report_seq)
        return max(own, self._report + since)


class PrefillRouter:
    """The routing decision, the queue estimate and the remote-prefill-off state (event loop only)."""

    def __init__(
        self, client: PrefillClient | None, local_max_tokens: int = 0, max_queued_tokens: int | None = 0,
        queue: QueueEstimate | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.local_max_tokens = local_max_tokens
        self.max_queued_tokens = max_queued_tokens  # 0: no limit; None: auto (queue_limit)
        self.queue = queue or QueueEstimate()
        self.usable = client is not None  # False while remote prefill is off (mismatch, unavailable)
        self.off_reason = "prefill_mismatch"  # why it is off: the route reason meanwhile
        if client is not None:
            client.queued_tokens = self.queue.value  # its deadlines allow for the queue ahead
        self._logged: set[str] = set()
        self._task: asyncio.Task[None] | None = None  # the background re-handshake

    def queue_limit(self) -> int:
        """Queued prompt tokens (this prompt included) beyond which prompts prefill here; 0: no limit."""
        if self.max_queued_tokens is not None or self.client is None:
            return self.max_queued_tokens or 0
        # Unknown rate: 1, so that only an empty queue takes a prompt (one at a time).
        return max(int(self.client.rate.tokens_per_s * self.client.timeout / 2), 1)

    def route(self, prompt_tokens: int) -> Route:
        if self.client is None:
            return Route(False, "no_prefill")
        if prompt_tokens <= self.local_max_tokens:
            return Route(False, "short_prompt")
        if not self.usable:
            return Route(False, self.off_reason)
        limit = self.queue_limit()
        if limit:
            queued = self.queue.value()
            # An empty queue takes any prompt: a long prompt alone is what disaggregation is for.
            if queued and queued + prompt_tokens > limit:
                return Route(False, "queue_deep")
        return Route(True, "remote", self.queue.add(prompt_tokens))

    def done(self, route: Route, reported: int | None = None) -> None:
        """The route's remote prefill ended (idempotent; a no-op for a local route)."""
        if route.ticket:
            self.queue.done(route.ticket, reported)

    def refused(self, details: str) -> None:
        """A prefill service refused decode's layout: prefill here until a Handshake succeeds again."""
        assert self.client is not None
        self._log_mismatch(details)
        self._off("prefill_mismatch")

    def unavailable(self, details: str) -> None:
        """A remote prefill timed out: prefill here until a Handshake succeeds again (a prefill that is
        merely busy answers one at once; a dead or hung one does not)."""
        assert self.client is not None
        if self.usable:
            log.warning(
                "prefill service %s: %s. Prompts are prefilled locally; re-handshaking every %.0fs.",
                self.client.target, details, REHANDSHAKE_S,
            )  # fmt: skip
        self._off("prefill_unavailable")

    def _off(self, reason: str) -> None:
        self.off_reason = reason
        if not self.usable:
            return
        self.usable = False
        self._task = asyncio.get_running_loop().create_task(self._rehandshake())

    def _log_mismatch(self, details: str) -> None:
        if details in self._logged:  # once per distinct mismatch: many requests see the same one
            return
        self._logged.add(details)
        assert self.client is not None
        log.error(
            "prefill service %s refused this decode's KV layout: %s. Prompts are prefilled locally; "
            "re-handshaking every %.0fs until it matches again.", self.client.target, details, REHANDSHAKE_S,
        )  # fmt: skip

    async def _rehandshake(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(REHANDSHAKE_S)
            try:
                await self.client.handshake()
            except PrefillRefused as e:
                self._log_mismatch(str(e))
                self.off_reason = "prefill_mismatch"
                continue
            except PrefillFailed:
                continue  # unreachable or loading: keep prefilling here and ask again
            self.usable = True
            target = self.client.target
            log.info(
                "prefill service %s answers and accepts this decode's KV layout: remote prefill resumes",
                target,
            )
            return
