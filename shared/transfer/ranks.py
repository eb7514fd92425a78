"""The inline backend over a tensor-parallel engine's ranks: the wire carries every KV head, whatever
either side's degree, and each rank reads or writes the heads it holds.

A prefill of a ranks stages each rank's heads (`stage` on every rank, `Engine.on_ranks_later`) and joins
them head by head, each KV head once (replicated heads, where there are fewer KV heads than ranks,
come from the first rank holding them). A decode of b ranks hands every batch to each rank, which
writes its own heads. So a = 2 ships to b = 1 or 4 as a = 1 does: the handshake's layout names the
model's KV heads, not a rank's, and carries each side's degree for the record.

An engine that is not tensor parallel takes the plain functions of `shared/transfer/inline.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

from shared.engine.engine import Engine, Later, Pending
from shared.engine.request import Request
from shared.model.tensor_parallel import kv_heads_of
from shared.transfer.base import KVLayout
from shared.transfer.inline import KVBatch, StagedKV, apply_batch, begin_receive, stage

__all__ = [
    "apply_batch_all", "begin_receive_all", "export_ranks", "own_heads", "rank_half", "rank_heads",
    "stage_all", "wire_kv_heads", "wire_layout",
]  # fmt: skip


def wire_kv_heads(engine: Engine) -> int:
    """The KV heads a row of the wire carries: the model's, on every rank count."""
    return engine.runner.model.whole_kv_heads


def wire_layout(engine: Engine, model_name: str, weights: str) -> KVLayout:
    """The layout the handshake announces for `engine`: its cache's, with the model's KV heads and the
    engine's tensor-parallel degree."""
    tp = engine.runner.model.tp
    return KVLayout.of(
        engine.cache, model_name, weights, num_kv_heads=wire_kv_heads(engine),
        tensor_parallel=tp.world if tp is not None else 1,
    )  # fmt: skip


def own_heads(engine: Engine) -> range | None:
    """The KV heads this rank's pool holds, where it holds a share of them (None: all)."""
    return engine.runner.model.kv_heads if engine.runner.model.tp is not None else None


def rank_heads(engine: Engine) -> list[range]:
    """Every rank's KV heads, in rank order (one rank: all of them)."""
    model = engine.runner.model
    if model.tp is None:
        return [range(engine.model_cfg.num_kv_heads)]
    world, heads = model.tp.world, engine.model_cfg.num_heads * model.tp.world
    return [kv_heads_of(heads, model.whole_kv_heads, r, world) for r in range(world)]


T = TypeVar("T")

# A zero-copy backend's halves of this process (a decode's receiver, a prefill's writer), one of each kind
# a rank's engine, as long as the process lives: rank 0 registers the service's own, a follower makes
# its own when the first op that needs it reaches it.
_HALVES: dict[tuple[type, int], Any] = {}


def rank_half(engine: Engine, kind: type[T], **kwargs: Any) -> T:
    """This process's `kind` for `engine`: the one registered or made before, else
    `kind(engine.cache, **kwargs)`."""
    half = _HALVES.get((kind, id(engine)))
    if half is None:
        half = _HALVES[(kind, id(engine))] = kind(engine.cache, **kwargs)
    return half  # type: ignore[no-any-return]


def export_ranks(engine: Engine, receiver: Any) -> Any:
    """Rank 0's pool export (`receiver.export`) for the handshake: with ranks, every rank's, each
    naming its KV heads, in its `other_ranks` (one receiver of `receiver`'s kind a process)."""
    if not _tensor_parallel(engine):
        return receiver.export
    _HALVES[(type(receiver), id(engine))] = receiver
    exports = engine.on_ranks(_export_rank, type(receiver))
    return dataclasses.replace(exports[0], other_ranks=tuple(exports[1:]))


def _export_rank(engine: Engine, kind: type) -> Any:
    return dataclasses.replace(rank_half(engine, kind).export, heads=engine.runner.model.kv_heads)


def _tensor_parallel(engine: Engine) -> bool:
    return engine.runner.model.tp is not None


def stage_all(
    engine: Engine, req: Request, num_tokens: int, *, window: bool = True, full_from: int = 0
) -> StagedKV:
    """`stage` of `req`'s prompt KV, every head of it. With ranks, it is ready once every rank's copy
    is in (`ready()` never waits: each follower's heads arrive as a message of its own)."""
    if not _tensor_parallel(engine):
        return stage(engine.cache, req.pages, req.slot, num_tokens, window=window, full_from=full_from)
    pending = engine.on_ranks_later(_stage_rank, req, num_tokens, window, full_from)
    _, mine = pending.results[0]
    return _JoinedKV(**{f.name: getattr(mine, f.name) for f in dataclasses.fields(StagedKV)},
                     engine=engine, pending=pending)  # fmt: skip


@dataclasses.dataclass
class _JoinedKV(StagedKV):
    """Rank 0's staged heads, then every rank's joined, once the followers' have come."""

    engine: Engine | None = None
    pending: Pending | None = None
    joined: bool = False

    def ready(self) -> bool:
        assert self.engine is not None and self.pending is not None
        if not self.joined and self.engine.collect(self.pending) and super().ready():
            self._join()
        return self.joined

    def wait(self) -> None:
        assert self.engine is not None and self.pending is not None
        self.engine.collect(self.pending, block=True)
        super().wait()
        if not self.joined:
            self._join()

    def _join(self) -> None:
        assert self.pending is not None
        parts = self.pending.results
        heads = [p[0] for p in parts]
        self.full = _join(heads, [p[1].full for p in parts])
        self.window = _join(heads, [p[1].window for p in parts])
        self.joined = True


def _stage_rank(engine: Engine, req: Request, num_tokens: int, window: bool, full_from: int) -> tuple:  # type: ignore[type-arg]
    """(this rank's KV heads, its StagedKV): rank 0's copy still on its way; a follower's on the host,
    without its event (it crosses to rank 0 as a message)."""
    staged = stage(engine.cache, req.pages, req.slot, num_tokens, window=window, full_from=full_from)
    if engine.runner.model.tp is not None and engine.runner.model.tp.rank > 0:
        staged.wait()
        staged = dataclasses.replace(staged, event=None)
    return engine.runner.model.kv_heads, staged


def _join(
    heads: list[range], parts: list[tuple[torch.Tensor, torch.Tensor] | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V [layers, tokens, Hkv, D] from each rank's [layers, tokens, its heads, D], each head once."""
    if parts[0] is None:
        return None
    taken: set[int] = set()
    ks, vs = [], []
    for rank_heads, part in zip(heads, parts, strict=True):
        if rank_heads.start in taken:  # a replicated head: the first rank's copy is the one
            continue
        taken.update(rank_heads)
        assert part is not None
        ks.append(part[0])
        vs.append(part[1])
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def begin_receive_all(engine: Engine, req: Request) -> Pending:
    """`begin_receive` on every rank: the reservation's window slot emptied. Done (`Engine.collect`)
    once every other rank's emptying has run on its GPU, not only been queued: a NIXL WRITE lands
    outside the stream order, so it must not be sent before then (rank 0's own: the caller's event)."""
    return engine.on_ranks_later(_begin_receive_rank, req)


class _Emptied(Later):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def poll(self) -> tuple[bool, None]:
        return self.event.query(), None


def _begin_receive_rank(engine: Engine, req: Request) -> Later | None:
    begin_receive(engine.cache, req.slot)
    tp = engine.runner.model.tp
    if tp is None or tp.rank == 0 or engine.cache.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(engine.cache.device))
    return _Emptied(event)


def apply_batch_all(engine: Engine, req: Request, batch: KVBatch) -> None:
    """`apply_batch` of a batch of every head into `req`'s reservation: each rank writes its heads."""
    if not _tensor_parallel(engine):
        apply_batch(engine.cache, req.pages, req.slot, batch, full_from=req.cached_tokens)
        return
    expected = wire_kv_heads(engine)
    if batch.k.shape[1] != expected:
        raise ValueError(f"KV batch of {batch.k.shape[1]} heads; this model has {expected}")
    engine.on_ranks(_apply_rank, req, batch)


def _apply_rank(engine: Engine, req: Request, batch: KVBatch) -> None:
    heads = engine.runner.model.kv_heads
    mine = dataclasses.replace(
        batch,
        k=batch.k[:, heads.start : heads.stop].contiguous(),
        v=batch.v[:, heads.start : heads.stop].contiguous(),
    )
    apply_batch(engine.cache, req.pages, req.slot, mine, full_from=req.cached_tokens)
