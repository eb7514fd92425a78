"""Where decode prefills each prompt: here, or on a prefill replica (conditional disaggregation).

`PrefillRouter.route` decides once per request, on the event loop, and says why. The reason goes on
the request span (`pdserve.prefill` = local | remote, `pdserve.prefill.reason`, and for a remote route
`pdserve.prefill.replica`, the replica's address) and into the counter `pdserve_prefill_route_total`:

    no_prefill        no --prefill-target: every prompt prefills here
    short_prompt      the prompt has at most --local-prefill-max-tokens tokens
    prefill_mismatch  the chosen replica refused decode's KV layout (FAILED_PRECONDITION): this request
                      prefills here, and the replica is skipped until a background Handshake succeeds
                      again (every few seconds); also every prompt's reason while no replica is usable
                      and its first-choice replica is down for this
    prefill_unavailable  a remote prefill ran out of its time, could not reach the replica or broke off
                      (dead, hung, far slower than measured or restarting): this request prefills here,
                      and the replica is skipped until a background Handshake answers (a circuit breaker
                      per replica); also every prompt's reason while no replica is usable and its
                      first-choice replica is down for this
    prefill_busy      the replica's queue was full (RESOURCE_EXHAUSTED): this request prefills here
    prefill_rejected  the replica refused this prompt (INVALID_ARGUMENT: longer than its context, say):
                      this request prefills here
    prefix_mismatch   the replica shipped full-layer KV from another position than decode's prefix-cache
                      hit (PrefillDone.full_from != PrefillRequest.cached_tokens, or a chunk before it:
                      an older prefill that ignores the field): this request prefills here
    queue_deep        every usable replica within the load bound has a queue estimate that, with this
                      prompt, exceeds its queue limit
    remote            a prefill replica computes it

Which replica: decode_service/replicas.py (rendezvous hashing of the prompt's leading pages, bounded by
load). The key's replicas are tried in order; one that is down (its circuit open: mismatch, unavailable)
is skipped, so the next in the key's order takes its prompts until it answers again; so is one loaded
above the bound or whose queue is too deep. Only when no replica is usable do prompts prefill here for
being down. A request whose remote prefill failed in any way is prefilled here (its route becomes local
and the reason one of prefill_mismatch, prefill_unavailable, prefill_busy, prefill_rejected,
prefix_mismatch; the span keeps the replica that failed): the client sees a normal completion, never an
error caused by the prefill service; a mismatch or an unavailable replica also opens that replica's
circuit, and only its.

Each replica has its own queue estimate (`QueueEstimate`), drain rate and queue limit (`replica_limit`):
--remote-prefill-max-queued-tokens, by default `auto`: what the replica drains in half the prefill
timeout, at the rate decode measured on its own calls there (decode_service/prefill_client.py
`DrainRate`), so that a prompt sent there is expected back well within the time decode gives it. Until a
first call has completed the rate is unknown and the limit is 1: one prompt at a time (a GPU measures
its rate within milliseconds; a CPU that would take minutes to drain a burst must not be sent one). An
empty queue takes any prompt, whatever the limit.

The replica set: the addresses --prefill-target names (decode_service/prefill_targets.py); with a
dns:/// entry it is resolved again every few seconds, and the router adds a replica that appeared
(down until its first Handshake answers) and drops one that is gone (its calls in flight finish).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from decode_service.prefill_client import PrefillClient, PrefillFailed, PrefillRefused
from decode_service.prefill_targets import RESOLVE_EVERY_S, Address
from decode_service.replicas import QueueEstimate, Replica, preference, prefix_key, within_bound

__all__ = ["Membership", "PrefillRouter", "QueueEstimate", "Replica", "Route"]

log = logging.getLogger("decode_service")

REHANDSHAKE_S = 2.0  # while a replica is down: how often a Handshake asks whether it can resume


@dataclass(frozen=True)
class Route:
    remote: bool
    reason: str  # one of the reasons above
    ticket: int = 0  # a remote route's place in its replica's queue estimate (QueueEstimate.add)
    replica: Replica | None = None  # a remote route's replica

    @property
    def where(self) -> str:
        return "remote" if self.remote else "local"


@dataclass(frozen=True)
class Membership:
    """How the replica set follows DNS: `resolve` names the replicas now (None: keep those there are),
    `make_client` makes a new one's client."""

    resolve: Callable[[], Awaitable[list[Address] | None]]
    make_client: Callable[[Address], PrefillClient]
    every_s: float = RESOLVE_EVERY_S


class PrefillRouter:
    """The routing decision and the replicas' state: queue estimates, circuits (event loop only; /metrics
    reads `usable`, `queue_estimate` and `queue_limit` from its own thread)."""

    def __init__(
        self, clients: PrefillClient | Sequence[PrefillClient] | None, local_max_tokens: int = 0,
        max_queued_tokens: int | None = 0, *, down: Collection[str] = (),
        membership: Membership | None = None,
    ) -> None:  # fmt: skip
        """`down`: addresses that did not answer the start-up Handshake: they start with their circuit
        open and are re-handshaked once the router runs on the loop."""
        if isinstance(clients, PrefillClient):
            clients = [clients]
        clients = list(clients or ())
        # Replaced whole on a change, never mutated: /metrics iterates it from its own thread.
        self.replicas: dict[str, Replica] = {c.target: Replica(c) for c in clients}
        self.page_size = clients[0].layout.page_size if clients else 1  # the handshake makes it prefill's
        self.local_max_tokens = local_max_tokens
        self.max_queued_tokens = max_queued_tokens  # 0: no limit; None: auto (replica_limit)
        self._membership = membership
        for address in down:
            r = self.replicas[address]
            r.usable, r.off_reason = False, "prefill_unavailable"
        self._started = False
        self._logged: set[tuple[str, str]] = set()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def usable(self) -> bool:
        """Some replica is usable: remote prefill is on."""
        return any(r.usable for r in tuple(self.replicas.values()))

    @usable.setter
    def usable(self, value: bool) -> None:  # every replica at once
        for r in self.replicas.values():
            r.usable = value

    def queue_estimate(self) -> int:
        """Prompt tokens queued at the replicas, all together."""
        return sum(r.load() for r in tuple(self.replicas.values()))

    def replica_limit(self, replica: Replica) -> int:
        """Queued prompt tokens at `replica` (this prompt included) beyond which it takes no prompt;
        0: no limit."""
        if self.max_queued_tokens is not None:
            return self.max_queued_tokens
        # Unknown rate: 1, so that only an empty queue takes a prompt (one at a time).
        client = replica.client
        return max(int(client.rate.tokens_per_s * client.timeout / 2), 1)

    def queue_limit(self) -> int:
        """The replicas' queue limits, all together; 0: no limit."""
        limits = [self.replica_limit(r) for r in tuple(self.replicas.values())]
        return 0 if 0 in limits else sum(limits)

    def route(self, prompt_tokens: int, prompt: Sequence[int] = ()) -> Route:
        """Where the prompt (`prompt_tokens` long; `prompt`: its tokens, the key's source) prefills."""
        if not self.replicas:
            return Route(False, "no_prefill")
        if prompt_tokens <= self.local_max_tokens:
            return Route(False, "short_prompt")
        self.start()
        ranked = preference(prefix_key(prompt, self.page_size), self.replicas.values())
        if not any(r.usable for r in ranked):
            return Route(False, ranked[0].off_reason)
        for replica, queued in within_bound(ranked):
            limit = self.replica_limit(replica)
            # An empty queue takes any prompt: a long prompt alone is what disaggregation is for.
            if limit and queued and queued + prompt_tokens > limit:
                continue
            return Route(True, "remote", replica.queue.add(prompt_tokens), replica)
        return Route(False, "queue_deep")

    def done(self, route: Route, reported: int | None = None) -> None:
        """The route's remote prefill ended (idempotent; a no-op for a local route)."""
        if route.ticket and route.replica is not None:
            route.replica.queue.done(route.ticket, reported)

    def refused(self, route: Route, details: str) -> None:
        """The route's replica refused decode's layout: skip it until a Handshake succeeds again."""
        assert route.replica is not None
        self._log_mismatch(route.replica, details)
        self._off(route.replica, "prefill_mismatch")

    def unavailable(self, route: Route, details: str) -> None:
        """A remote prefill timed out, could not reach the route's replica or broke off: skip it until a
        Handshake answers (a replica that is merely busy answers one at once; a dead or hung one does
        not)."""
        r = route.replica
        assert r is not None
        if r.usable and not r.gone:
            log.warning(
                "prefill replica %s: %s. Its prompts go to the other replicas (prefilled here while none "
                "is usable); re-handshaking every %.0fs.", r.address, details, REHANDSHAKE_S,
            )  # fmt: skip
        self._off(r, "prefill_unavailable")

    def start(self) -> None:
        """Begin the background work, on the running loop (idempotent): re-handshake the replicas that
        were down at start-up, and follow DNS."""
        if self._started:
            return
        self._started = True
        for r in self.replicas.values():
            if not r.usable:
                self._rehandshake_soon(r, REHANDSHAKE_S)
        if self._membership is not None:
            self._spawn(self._follow(self._membership))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # a reference, so it is not collected mid-flight
        task.add_done_callback(self._background.discard)
        return task

    def _off(self, replica: Replica, reason: str) -> None:
        replica.off_reason = reason
        if not replica.usable or replica.gone:
            return
        replica.usable = False
        self._rehandshake_soon(replica, REHANDSHAKE_S)

    def _rehandshake_soon(self, replica: Replica, delay: float) -> None:
        replica.task = self._spawn(self._rehandshake(replica, delay))

    def _log_mismatch(self, replica: Replica, details: str) -> None:
        if (replica.address, details) in self._logged:  # once per replica and distinct mismatch
            return
        self._logged.add((replica.address, details))
        log.error(
            "prefill replica %s refused this decode's KV layout: %s. Its prompts go to the other replicas "
            "(prefilled here while none is usable); re-handshaking every %.0fs until it matches again.",
            replica.address, details, REHANDSHAKE_S,
        )  # fmt: skip

    async def _rehandshake(self, replica: Replica, delay: float) -> None:
        while not replica.gone:
            await asyncio.sleep(delay)
            delay = REHANDSHAKE_S
            try:
                await replica.client.handshake()
            except PrefillRefused as e:
                self._log_mismatch(replica, str(e))
                replica.off_reason = "prefill_mismatch"
                continue
            except PrefillFailed:
                continue  # unreachable or loading: keep skipping it and ask again
            if replica.gone:
                return
            replica.usable = True
            log.info(
                "prefill replica %s answers and accepts this decode's KV layout: it takes prompts again",
                replica.address,
            )
            return

    async def _follow(self, membership: Membership) -> None:
        """Resolve the replica set every `every_s`; add the replicas that appeared, drop those gone."""
        while True:
            await asyncio.sleep(membership.every_s)
            try:
                addresses = await membership.resolve()
                if addresses is not None:
                    self.update(addresses, membership.make_client)
            except Exception:  # never stop following: the next lookup may do
                log.exception("updating the prefill replicas failed")

    def update(self, addresses: Sequence[Address], make_client: Callable[[Address], PrefillClient]) -> None:
        """The replica set is now `addresses`: a new one starts down and is handshaked at once; one
        that is gone takes no new prompt, and its channel closes once its calls can have ended."""
        now = {a.target: a for a in addresses}
        if now.keys() == self.replicas.keys():
            return
        replicas = {t: r for t, r in self.replicas.items() if t in now}
        for target, address in now.items():
            if target not in replicas:
                r = replicas[target] = Replica(make_client(address))
                r.usable, r.off_reason = False, "prefill_unavailable"
                self._rehandshake_soon(r, 0.0)
        for target, r in self.replicas.items():
            if target not in now:
                r.gone, r.usable = True, False
                if r.task is not None:
                    r.task.cancel()
                self._spawn(r.client.close(grace=r.client.own_timeout()))
        added, dropped = now.keys() - self.replicas.keys(), self.replicas.keys() - now.keys()
        self.replicas = replicas
        log.info(
            "prefill replicas: %s (added %s, dropped %s)", ", ".join(sorted(replicas)) or "none",
            ", ".join(sorted(added)) or "none", ", ".join(sorted(dropped)) or "none",
        )  # fmt: skip
