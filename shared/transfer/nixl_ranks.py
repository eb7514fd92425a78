"""The nixl backend over tensor-parallel ranks: each prefill rank WRITEs its KV heads straight into the
decode ranks that hold them, each rank through its own agent, so no byte goes through rank 0.

Decode (`shared/transfer/ranks.py` `export_ranks`): every rank registers its own pool with its own
agent. Rank 0's `NixlPool` names its KV heads and carries the other ranks' pools (`other_ranks`); it
rides on the handshake and on every request as a pool always has. The mirrored engines reserve the same
pages and window slot on every rank, so one target's pages and slot hold for each rank's pool.

Prefill (`start`): `shared/transfer/heads.py` `routes` says which prefill rank writes which heads
into which decode rank: each head once (a replicated head from the first rank holding it), and the
slot's ring_pos row once per decode rank. Rank 0 posts its WRITEs on the scheduler thread, as a
prefill of one rank does; every other rank posts its own when the op reaches it
(`Engine.on_ranks_later`) and answers once they have ended (a `Later`), abandoning one still running
`ABANDON_AFTER_LEASE_S` past the lease as rank 0 does. A request's pages are released, and its
PrefillDone sent, only once every rank's WRITEs have ended (`Send`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from shared.engine.engine import Engine, Later, Pending
from shared.transfer.heads import routes
from shared.transfer.nixl import ABANDON_AFTER_LEASE_S, NixlPool, NixlTarget
from shared.transfer.nixl_writer import Heads, NixlTransfer, NixlWriter
from shared.transfer.ranks import own_heads, rank_half, rank_heads

__all__ = ["Send", "pools_of", "start"]


def pools_of(pool: NixlPool) -> list[NixlPool]:
    """Decode's pools in rank order: rank 0's, then its `other_ranks`."""
    return [pool, *pool.other_ranks]


def _heads_of(pool: NixlPool, num_kv_heads: int) -> range:
    return pool.heads if pool.heads is not None else range(num_kv_heads)


# ---- decode ----


# ---- prefill ----


def _writes(
    engine: Engine, rank: int, target: NixlTarget
) -> list[tuple[NixlTarget, Heads | None]]:  # fmt: skip
    """The WRITEs rank `rank` makes for `target`: a decode pool each, with its share of the heads."""
    pools = pools_of(target.pool)
    whole = engine.runner.model.whole_kv_heads
    if engine.runner.model.tp is None and len(pools) == 1 and target.pool.heads is None:
        return [(target, None)]  # one rank each side: every head, as always
    src = rank_heads(engine)
    dst = [_heads_of(p, whole) for p in pools]
    out = []
    for route in routes(src, dst):
        if route.src_rank == rank:
            heads = Heads(src[rank], dst[route.dst_rank], route.heads, route.ring_pos)
            out.append((dataclasses.replace(target, pool=pools[route.dst_rank]), heads))
    return out


def start(
    engine: Engine, writer: NixlWriter, req: Any, target: NixlTarget, *, history: bool, full_from: int
) -> Send | None:
    """Post one request's WRITEs on every rank (None: rank 0's agent is busy, try again). Raises
    ValueError for a target that does not fit decode's pool, NixlError when NIXL refuses rank 0's
    first WRITE: nothing was posted then."""
    own = writer.start(req.pages, req.slot, len(req.prompt), _writes(engine, 0, target), history=history,
                       full_from=full_from)  # fmt: skip
    if own is None:
        return None
    pending = None
    if engine.runner.model.tp is not None:
        pending = engine.on_ranks_later(_start_rank, req, target, history, full_from)
    return Send(engine, writer, own, pending)


def _start_rank(engine: Engine, req: Any, target: NixlTarget, history: bool, full_from: int) -> Any:
    """On each rank: rank 0 has posted its own already (None); another posts its WRITEs, connecting
    to decode's agents it has not loaded yet, and answers once they have ended. A WRITE reads outside
    the stream order, and this rank's KV of the prompt is complete on its GPU: rank 0 asks only once
    it has the prompt's last step's tokens, which needed every rank's last all-reduce of that step,
    and each rank's stream wrote the step's KV before it."""
    tp = engine.runner.model.tp
    if tp is None or tp.rank == 0:
        return None
    writer = rank_half(engine, NixlWriter, heads=own_heads(engine))
    writes = _writes(engine, tp.rank, target)
    try:
        for t, _ in writes:
            writer.connect(t.pool)
        posted = None
        while posted is None:  # this rank's agent: only this thread uses it
            posted = writer.start(req.pages, req.slot, len(req.prompt), writes, history=history,
                                  full_from=full_from)  # fmt: skip
    except Exception as e:  # answered as this rank's outcome: rank 0 fails the request with it
        return _Outcome("ERR", f"rank {tp.rank}: {e}", 0, 0)
    return _RankWrites(writer, posted or [], target.lease_deadline_ns, tp.rank)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    state: str  # DONE | ERR
    error: str
    full_bytes: int
    window_bytes: int


class _RankWrites(Later):
    """A follower's WRITEs, polled until each has ended; one still running `ABANDON_AFTER_LEASE_S`
    past the lease is cancelled, as rank 0 cancels its own (prefill_service/nixl_sends.py)."""

    def __init__(self, writer: NixlWriter, xfers: list[NixlTransfer], lease_ns: int, rank: int) -> None:
        self.writer, self.xfers, self.lease_ns, self.rank = writer, xfers, lease_ns, rank

    def poll(self) -> tuple[bool, _Outcome | None]:
        state = _poll_all(self.writer, self.xfers)
        if state == "PROC" and time.time_ns() > self.lease_ns + ABANDON_AFTER_LEASE_S * 1e9:
            for x in self.xfers:
                if x.state == "PROC" and self.writer.abandon(x):
                    x.error = "the KV write did not complete within its lease (cancelled)"
            state = _poll_all(self.writer, self.xfers)
        if state is None or state == "PROC":
            return False, None
        errors = "; ".join(x.error for x in self.xfers if x.state == "ERR")
        full, window = sum(x.full_bytes for x in self.xfers), sum(x.window_bytes for x in self.xfers)
        return True, _Outcome(state, f"rank {self.rank}: {errors}" if errors else "", full, window)


def _poll_all(writer: NixlWriter, xfers: list[NixlTransfer]) -> str | None:
    """PROC while a WRITE runs, then ERR if one failed, else DONE; None: the agent is busy."""
    for x in xfers:
        if x.state == "PROC" and writer.poll(x) is None:
            return None
    if any(x.state == "PROC" for x in xfers):
        return "PROC"
    return "ERR" if any(x.state == "ERR" for x in xfers) else "DONE"


class Send:
    """One request's WRITEs on every rank: rank 0's own, and the other ranks' outcomes as they come."""

    def __init__(
        self, engine: Engine, writer: NixlWriter, own: list[NixlTransfer], pending: Pending | None
    ) -> None:
        self.engine, self.writer, self.own, self.pending = engine, writer, own, pending
        self.state, self.error = "PROC", ""
        self.full_bytes = self.window_bytes = 0

    @property
    def agent_name(self) -> str:
        """Decode's agents rank 0 writes to."""
        return ", ".join(dict.fromkeys(x.agent_name for x in self.own)) or "-"

    def poll(self) -> str | None:
        """PROC | DONE | ERR once every rank's WRITEs have ended (None: rank 0's agent is busy)."""
        if self.state != "PROC":
            return self.state
        mine = _poll_all(self.writer, self.own)
        if mine is None:
            return None
        if mine == "PROC" or not self._others_ended():
            return "PROC"
        outcomes = [_Outcome(x.state, x.error, x.full_bytes, x.window_bytes) for x in self.own]
        outcomes += [o for o in (self.pending.results[1:] if self.pending else []) if o is not None]
        errors = [o.error or "NIXL reported the transfer failed" for o in outcomes if o.state == "ERR"]
        self.full_bytes = sum(o.full_bytes for o in outcomes)
        self.window_bytes = sum(o.window_bytes for o in outcomes)
        self.state, self.error = ("ERR", "; ".join(errors)) if errors else ("DONE", "")
        return self.state

    def abandon(self) -> bool:
        """Cancel rank 0's WRITEs still running (its lease is long over); True once NIXL has let them
        go and every other rank has ended its own (each cancels at the same deadline)."""
        let_go = all(x.state != "PROC" or self.writer.abandon(x) for x in self.own)
        return let_go and self._others_ended()

    def _others_ended(self) -> bool:
        return self.pending is None or self.engine.collect(self.pending)
