"""The cuda_ipc backend over tensor-parallel ranks: each prefill rank writes its KV heads straight into
the decode ranks that hold them, on its own GPU's stream, so no byte goes through rank 0.

Decode (`shared/transfer/ranks.py` `export_ranks`): every rank exports its own pool (its IPC handles
and GPU), naming its KV heads; rank 0's export carries the other ranks' (`PoolExport.other_ranks`) and
rides on the handshake and on every request as a pool always has. The mirrored engines reserve the same
pages and window slot on every rank, so one target's pages and slot hold for each rank's pool. A target
goes out only once every rank's emptying of the reservation has run on its GPU
(decode_service/scheduler.py `_Settled`, as for nixl): a prefill rank's writes into rank j then need no
event of rank j's.

Prefill (`write_all`): `shared/transfer/heads.py` `routes` says which prefill rank writes which heads
into which decode rank: each head once (a replicated head from the first rank holding it), and the
slot's ring_pos row once per decode rank. Rank 0 enqueues its writes on the scheduler thread; every
other rank enqueues its own when the op reaches it, behind the prompt's forward on its stream, and
answers with the interprocess event it records after them: rank 0 waits for those answers (a message
each, not the GPU's work), as the events must ride on PrefillDone. PrefillDone carries every rank's event,
and every decode rank's stream waits on all of them before its first step that reads the pages
(`wait_all`): no host waits on either side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shared.engine.engine import Engine
from shared.transfer.cuda_ipc import HeadRun, IpcReceiver, IpcTarget, IpcWriter, PoolExport
from shared.transfer.heads import routes
from shared.transfer.ipc_memory import IpcUnavailable
from shared.transfer.ranks import rank_half, rank_heads

__all__ = ["map_own", "mapped_own", "rank_writes", "wait_all", "write_all"]


def _tp(engine: Engine) -> bool:
    return engine.runner.model.tp is not None


# ---- decode ----


def wait_all(engine: Engine, receiver: IpcReceiver, events: Sequence[bytes]) -> None:
    """Every rank's stream ordered after prefill's writes: each of `events` (one a prefill rank).
    RuntimeError when one does not open on some rank (the request cannot run then)."""
    if not _tp(engine):
        for handle in events:
            receiver.wait(handle)
        return
    errors = [e for e in engine.on_ranks(_wait_rank, tuple(events)) if e]
    if errors:
        raise RuntimeError("; ".join(errors))


def _wait_rank(engine: Engine, events: tuple[bytes, ...]) -> str:
    try:
        for handle in events:
            rank_half(engine, IpcReceiver).wait(handle)
    except RuntimeError as e:
        tp = engine.runner.model.tp
        return f"rank {tp.rank if tp is not None else 0}: {e}"
    return ""


# ---- prefill ----


def rank_writes(
    src: Sequence[range], rank: int, export: PoolExport, whole_kv_heads: int
) -> list[tuple[PoolExport, HeadRun | None]]:  # fmt: skip
    """The writes prefill rank `rank` (of ranks holding heads `src`) makes into decode's pools
    (`export.ranks()`): a pool each, with the run of heads it takes there. One rank each side, neither
    naming heads: the whole rows (None)."""
    pools = export.ranks()
    if len(src) == 1 and len(pools) == 1 and export.heads is None:
        return [(export, None)]
    dst = [p.heads if p.heads is not None else range(whole_kv_heads) for p in pools]
    out: list[tuple[PoolExport, HeadRun | None]] = []
    for route in routes(src, dst):
        if route.src_rank == rank:
            first = route.heads.start
            run = HeadRun(first - src[rank].start, first - dst[route.dst_rank].start, len(route.heads),
                          route.ring_pos)  # fmt: skip
            out.append((pools[route.dst_rank], run))
    return out


def _writes(engine: Engine, rank: int, export: PoolExport) -> list[tuple[PoolExport, HeadRun | None]]:
    return rank_writes(rank_heads(engine), rank, export, engine.runner.model.whole_kv_heads)


def map_own(engine: Engine, writer: IpcWriter, export: PoolExport) -> None:
    """Map the decode pools this service's rank 0 writes into (a handshake, or a request that brings
    a pool first): one it cannot reach fails there rather than in a write. The other ranks map theirs
    when their first write reaches them (their engine's own thread is the one that may call them)."""
    for pool, _ in _writes(engine, 0, export):
        writer.map(pool)


def mapped_own(engine: Engine, writer: IpcWriter, export: PoolExport) -> bool:
    """Whether every pool rank 0 writes into is mapped already."""
    return all(writer.mapped(pool.pool_id) for pool, _ in _writes(engine, 0, export))


def write_all(
    engine: Engine, writer: IpcWriter, req: Any, target: IpcTarget, *, window: bool, full_from: int
) -> tuple[int, int, bytes, tuple[bytes, ...]]:  # fmt: skip
    """Enqueue one request's writes on every rank; (full bytes, window bytes, rank 0's done event,
    the other ranks' done events). Raises IpcUnavailable (a pool a rank cannot map) or ValueError (a
    target that does not fit decode's pool), naming the rank; a follower's writes may then have been
    enqueued already, into the reservation only, which decode frees once the lease has passed."""
    full, window_bytes, event = writer.write(
        req.pages, req.slot, len(req.prompt), target, window=window, full_from=full_from,
        writes=_writes(engine, 0, target.pool),
    )  # fmt: skip
    if not _tp(engine):
        return full, window_bytes, event, ()
    others = engine.on_ranks(_write_rank, req, target, window, full_from)[1:]
    errors = [o for o in others if isinstance(o, _RankError)]
    if errors:
        unavailable = any(e.unavailable for e in errors)
        raise (IpcUnavailable if unavailable else ValueError)("; ".join(e.message for e in errors))
    for f, w, _ in others:
        full, window_bytes = full + f, window_bytes + w
    return full, window_bytes, event, tuple(e for _, _, e in others)


def _write_rank(engine: Engine, req: Any, target: IpcTarget, window: bool, full_from: int) -> Any:
    """On each rank: rank 0 has enqueued its own already (None); another enqueues its writes behind
    the prompt's forward on its stream and answers (full, window bytes, its done event), or why not.
    A decode pool it has not seen is mapped here first (a driver call per pool tensor, once)."""
    tp = engine.runner.model.tp
    if tp is None or tp.rank == 0:
        return None
    try:
        return rank_half(engine, IpcWriter).write(
            req.pages, req.slot, len(req.prompt), target, window=window, full_from=full_from,
            writes=_writes(engine, tp.rank, target.pool),
        )  # fmt: skip
    except (IpcUnavailable, ValueError) as e:
        return _RankError(isinstance(e, IpcUnavailable), f"rank {tp.rank}: {e}")


@dataclasses.dataclass(frozen=True)
class _RankError:
    """A follower's writes that could not be enqueued: rank 0 raises it as its own would be."""

    unavailable: bool  # IpcUnavailable (a pool it cannot map), else ValueError (a target that does not fit)
    message: str
