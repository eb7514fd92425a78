"""Which prefill rank writes which KV heads into which decode rank, when the two sides' tensor-parallel
degrees differ (a prefill of a ranks, a decode of b).

Each rank's pool holds only its rank's KV heads (shared/model/tensor_parallel.py `kv_heads_of`), so a
request's KV reaches a decode rank from whichever prefill ranks hold its heads. `routes` plans those
writes so that every head of every decode rank is written exactly once:

- each head once: two writers of the same bytes would race for nothing (and double the traffic);
- a replicated head (fewer KV heads than ranks: several ranks hold the same one, identical) is taken
  from the first rank holding it, so the choice is the same on every process that plans it;
- a slot's ring_pos row (the positions of its sliding-window ring) is identical on every rank and
  head-independent: one route per decode rank carries it, the first one for that rank.

Pure Python: the NIXL backend turns each `Route` into descriptors (shared/transfer/nixl.py
`write_descs`, its `heads` and `ring_pos`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Route", "routes"]


@dataclass(frozen=True)
class Route:
    """Source rank `src_rank` writes the model's KV heads `heads` into destination rank `dst_rank`,
    and with `ring_pos` the slot's ring_pos row as well."""

    src_rank: int
    dst_rank: int
    heads: range  # the model's KV head numbers, contiguous
    ring_pos: bool


def _check_ranges(side: str, ranges: Sequence[range]) -> None:
    if not ranges:
        raise ValueError(f"no {side} ranks")
    for rank, r in enumerate(ranges):
        if r.step != 1:
            raise ValueError(f"{side} rank {rank} holds heads {r}: not a contiguous run")


def routes(src: Sequence[range], dst: Sequence[range]) -> list[Route]:
    """The writes that move every KV head of every destination rank from the source ranks: `src[i]`
    and `dst[j]` are the model's KV heads rank i of the source and rank j of the destination hold.

    Each destination head comes from the lowest-numbered source rank holding it; consecutive heads
    from one source into one destination make one Route; the first route into each destination rank
    carries the ring_pos row. Sorted by (src_rank, dst_rank, heads.start). ValueError when a side
    has no ranks, a destination rank holds no heads, or a destination head is held by no source."""
    _check_ranges("source", src)
    _check_ranges("destination", dst)
    out: list[Route] = []
    for j, held in enumerate(dst):
        if not held:
            raise ValueError(f"destination rank {j} holds no KV heads")
        # (source rank, first head, last head + 1) runs, in head order
        runs: list[list[int]] = []
        for h in held:
            owner = next((i for i, r in enumerate(src) if h in r), None)
            if owner is None:
                raise ValueError(f"KV head {h} of destination rank {j} is held by no source rank")
            if runs and runs[-1][0] == owner and runs[-1][2] == h:
                runs[-1][2] = h + 1
            else:
                runs.append([owner, h, h + 1])
        out += [Route(i, j, range(start, stop), k == 0) for k, (i, start, stop) in enumerate(runs)]
    return sorted(out, key=lambda r: (r.src_rank, r.dst_rank, r.heads.start))
