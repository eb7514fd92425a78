"""Which prefill replica takes a remote prompt: rendezvous hashing of its leading pages, bounded by load.

Each prefill replica keeps its own prefix cache, so a prompt is cheapest on the replica that computed
its prefix before. Decode cannot ask every replica what it holds; it makes the answer predictable
instead: prompts that start alike go to the same replica, which therefore holds their prefix.

**The key** (`prefix_key`) is a hash of the prompt's first `KEY_PAGES` whole KV pages (decode's page
size, which the handshake makes prefill's too): the prefix cache shares whole pages only, so a key
that cut a page would split prompts the cache treats as one. Four pages (64 tokens at the default 16)
because:
- a long shared system prompt (hundreds of tokens: the case worth routing for, a hit saves computing
  all of it) fills them, so every session that starts with it maps to one replica, which computes it
  once, and so do a session's later turns, which start with it too;
- prompts that share only a chat template's header (tens of tokens) differ within them and spread
  over the replicas, as they should: there is little to reuse;
- it costs the same for any prompt length (64 tokens packed and hashed: microseconds on the event
  loop), where hashing the whole prompt would grow with it and, worse, would make a session's every
  turn a new key.
A prompt shorter than one page cannot hit a page cache at all: its key is the whole prompt, which
spreads such prompts. A prompt shorter than `KEY_PAGES` pages keys on its whole pages: it shares a
replica with prompts that start with exactly those pages and go no further (a rare miss, accepted).

**Rendezvous (highest random weight) hashing** rather than a ring with virtual nodes: each replica
scores the key (a 64-bit mix of the key and the replica's address hash) and the key tries replicas in
descending score. A prefill replica is a GPU or several, so n stays small (tens at most) and n scores
per prompt cost microseconds. In exchange there are no virtual nodes to tune (a ring with v points per
replica is uneven by ~1/sqrt(v)); adding or removing a replica moves exactly the keys that must move
(~1/n); and each key's second choice is independent of its first, so the prompts of a replica that is
down or overloaded spread evenly over all the others instead of piling onto its ring neighbours. Scores
depend only on the key and the addresses, so every decode configured with the same replicas agrees.

**Bounded loads** (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, 2018): a
replica whose load exceeds (1 + `EPSILON`) x the mean load of the usable replicas is passed over, and
the key takes the next in its order. Load is the replica's queued prompt tokens as this decode sees them
(its own remote prompts in flight there plus what the replica last reported: `QueueEstimate`
below), so a hot prefix spills onto its second replica, then its third, only while its first
is busier than the others by a quarter: cache affinity costs at most 25% more queue than an even spread
(a smaller epsilon balances tighter and hits less; a larger one waits longer behind a hot replica). The
least loaded replica is never above the mean, so some replica always qualifies.

The router (decode_service/routing.py) keeps a `Replica` per address: its client, its `QueueEstimate`
(the load above) and its circuit; it also decides what a replica that is down or too deep means.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from decode_service.prefill_client import PrefillClient

__all__ = [
    "EPSILON",
    "KEY_PAGES",
    "Member",
    "QueueEstimate",
    "Replica",
    "address_seed",
    "preference",
    "prefix_key",
    "within_bound",
]

KEY_PAGES = 4
EPSILON = 0.25
_MASK = (1 << 64) - 1
# A report older than this says nothing about the queue now. It must expire: while the estimate is over
# the threshold nothing is sent, so no PrefillDone would ever come to lower it.
REPORT_TTL_S = 2.0


class Member(Protocol):
    """A replica as the policy sees it: its address hash, whether it is up, its load."""

    seed: int
    usable: bool

    def load(self) -> int: ...


M = TypeVar("M", bound=Member)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(prompt: Sequence[int], page_size: int, pages: int = KEY_PAGES) -> int:
    """The routing key of a prompt: a hash of its first `pages` whole pages (all of it if under a page)."""
    n = min(len(prompt) // page_size, pages) * page_size or len(prompt)
    return _hash64(struct.pack(f"<{n}I", *prompt[:n]))


def address_seed(address: str) -> int:
    return _hash64(address.encode())


def _score(key: int, seed: int) -> int:
    # splitmix64's finalizer: a bijection of 64 bits in which every input bit flips half the output
    # bits, so the scores of one key on distinct seeds are as good as independent.
    x = key ^ seed
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def preference(key: int, members: Iterable[M]) -> list[M]:
    """Every member, in the order `key` tries them: the highest score first."""
    return sorted(members, key=lambda m: _score(key, m.seed), reverse=True)


def within_bound(members: Sequence[M], epsilon: float = EPSILON) -> list[tuple[M, int]]:
    """The usable `members` (in their order) whose load is at most (1 + epsilon) x the mean load of
    the usable ones, each with its load."""
    loads = [(m, m.load()) for m in members if m.usable]
    if not loads:
        return []
    bound = (1 + epsilon) * sum(load for _, load in loads) / len(loads)
    return [(m, load) for m, load in loads if load <= bound]


class QueueEstimate:
    """Prompt tokens queued at one prefill replica (waiting + computing), as this decode sees them.

    estimate = max(own, report + own sent since the report arrived), where `own` is this decode's remote
    prefills in flight there (known exactly and at once, so a burst is counted before any reply) and
    `report` the replica's last PrefillDone.queued_prompt_tokens: the only view of what other decodes
    queued there. Own prefills sent before the report are taken as counted in it. The report alone would
    be stale by a whole prefill (it is measured when one finishes) and blind to a burst; own alone is
    blind to other decodes. A remote request counts from its routing decision, while it still waits here
    for pages: it will be sent.
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


class Replica:
    """One prefill replica: its client, queue estimate and circuit (event loop only)."""

    def __init__(self, client: PrefillClient) -> None:
        self.client = client
        self.address = client.target
        self.seed = address_seed(client.target)
        self.queue = QueueEstimate()
        client.queued_tokens = self.queue.value  # its deadlines allow for the queue ahead
        self.usable = True  # False while its circuit is open (mismatch, unavailable)
        self.off_reason = "prefill_mismatch"  # why it is down: the route reason when none is usable
        self.gone = False  # dropped from the replica set: its calls finish, no Handshake asks again
        self.task: asyncio.Task[None] | None = None  # its background re-handshake

    def load(self) -> int:
        return self.queue.value()
