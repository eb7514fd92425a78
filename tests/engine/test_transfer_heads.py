"""KV heads across tensor-parallel degrees: a prefill of a ranks writes into a decode of b, each side's
pools holding only their rank's KV heads.

`routes` names the writes: every head of every decode rank exactly once, a replicated head from the
first prefill rank holding it, the slot's ring_pos row once per decode rank. `write_descs` with head
ranges, carried out by memmove between caches of this process (as UCX would between two), lands in
each decode rank's reservation exactly its heads of a whole-heads prefill's KV, and nothing anywhere
else; copies of whole rows are the descriptors they were before heads existed.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

from shared.engine.kv.cache import KVCache, KVConfig
from shared.model.config import ModelConfig
from shared.model.tensor_parallel import kv_heads_of
from shared.transfer.heads import Route, routes
from shared.transfer.nixl import PROBE, NixlPool, NixlTensor, WritePlan, check_compatible, write_descs
from tests.engine.engine_testutil import W, tiny_config

NAMES = ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")
PAGE = 4
# The prompt's pages and slot in prefill's pools, and decode's reservation: scattered on purpose.
SRC_PAGES, SRC_SLOT = [3, 0, 6, 1, 5, 2, 7, 4], 1
DST_PAGES, DST_SLOT = [9, 2, 14, 5, 11, 0, 7, 3], 2
POISON = -7.0  # what a rank holding a replicated head second holds: read, it would show


def _ranks(kv_heads: int, world: int, num_heads: int = 8) -> list[range]:
    return [kv_heads_of(num_heads, kv_heads, r, world) for r in range(world)]


# ---- routes ----


def test_two_prefill_ranks_into_one_decode_rank_each_write_their_heads():
    assert routes(_ranks(2, 2), _ranks(2, 1)) == [
        Route(0, 0, range(0, 1), ring_pos=True),
        Route(1, 0, range(1, 2), ring_pos=False),
    ]


def test_one_prefill_rank_writes_each_decode_rank_its_heads_and_ring_pos():
    assert routes(_ranks(2, 1), _ranks(2, 2)) == [
        Route(0, 0, range(0, 1), ring_pos=True),
        Route(0, 1, range(1, 2), ring_pos=True),
    ]


def test_a_head_replicated_on_decode_is_written_into_every_rank_holding_it():
    # 2 KV heads over 4 decode ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1.
    assert _ranks(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert routes(_ranks(2, 2), _ranks(2, 4)) == [
        Route(0, 0, range(0, 1), ring_pos=True),
        Route(0, 1, range(0, 1), ring_pos=True),
        Route(1, 2, range(1, 2), ring_pos=True),
        Route(1, 3, range(1, 2), ring_pos=True),
    ]


def test_a_head_replicated_on_prefill_is_taken_from_its_first_holder():
    # 2 KV heads over 4 prefill ranks: ranks 1 and 3 hold copies and write nothing.
    assert routes(_ranks(2, 4), _ranks(2, 2)) == [
        Route(0, 0, range(0, 1), ring_pos=True),
        Route(2, 1, range(1, 2), ring_pos=True),
    ]
    # Overlapping holders: the lowest-numbered rank holding a head writes it.
    assert routes([range(0, 3), range(2, 4)], [range(0, 4)]) == [
        Route(0, 0, range(0, 3), ring_pos=True),
        Route(1, 0, range(3, 4), ring_pos=False),
    ]


def test_equal_degrees_write_each_rank_to_its_peer_and_nothing_crosses():
    assert routes(_ranks(8, 2), _ranks(8, 2)) == [
        Route(0, 0, range(0, 4), ring_pos=True),
        Route(1, 1, range(4, 8), ring_pos=True),
    ]


def test_consecutive_heads_from_one_source_make_one_route():
    assert routes(_ranks(8, 4), _ranks(8, 2)) == [
        Route(0, 0, range(0, 2), ring_pos=True),
        Route(1, 0, range(2, 4), ring_pos=False),
        Route(2, 1, range(4, 6), ring_pos=True),
        Route(3, 1, range(6, 8), ring_pos=False),
    ]


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("a", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_every_decode_head_is_written_exactly_once_from_its_first_holder(kv_heads, a, b):
    src, dst = _ranks(kv_heads, a), _ranks(kv_heads, b)
    got = routes(src, dst)
    assert got == sorted(got, key=lambda r: (r.src_rank, r.dst_rank, r.heads.start))
    for j, held in enumerate(dst):
        into = [r for r in got if r.dst_rank == j]
        written = sorted(h for r in into for h in r.heads)
        assert written == list(held)  # each head once, nothing it does not hold
        for r in into:
            assert r.heads.step == 1 and all(h in src[r.src_rank] for h in r.heads)
            assert all(not any(h in src[i] for i in range(r.src_rank)) for h in r.heads)
        ring = [r for r in into if r.ring_pos]
        assert len(ring) == 1 and ring[0].heads.start == held.start  # the first route into the rank


def test_a_head_no_source_holds_is_named():
    with pytest.raises(ValueError, match="KV head 1 of destination rank 0"):
        routes([range(0, 1)], [range(0, 2)])
    with pytest.raises(ValueError, match="KV head 2 of destination rank 1"):
        routes([range(0, 2), range(4, 6)], [range(0, 2), range(2, 4)])
    with pytest.raises(ValueError, match="no source ranks"):
        routes([], [range(0, 2)])
    with pytest.raises(ValueError, match="no destination ranks"):
        routes([range(0, 2)], [])


# ---- write_descs between per-rank caches ----


def _config(kv_heads: int) -> ModelConfig:
    return dataclasses.replace(tiny_config("SSFS"), num_heads=8, num_kv_heads=kv_heads)


def _cache(cfg: ModelConfig, heads: range | None = None) -> KVCache:
    """A pool of `cfg`'s KV heads `heads` (None: all), as a tensor-parallel rank's."""
    if heads is not None:
        cfg = dataclasses.replace(cfg, num_kv_heads=len(heads))
    return KVCache(cfg, KVConfig(page_size=PAGE, num_pages=16, max_requests=4))


def _randomized(cache: KVCache, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    for name in NAMES[:4]:
        t = getattr(cache, name)
        t.copy_(torch.randn(t.shape, generator=g))
    cache.ring_pos.copy_(torch.randint(0, 1000, cache.ring_pos.shape, generator=g))
    return cache


def _split(whole: KVCache, src: list[range]) -> list[KVCache]:
    """Per-rank prefill caches holding `src[i]` of `whole`'s heads. A head an earlier rank holds too
    (replicated) is poisoned here: a write taken from anywhere but its first holder shows."""
    out = []
    for i, held in enumerate(src):
        rank = _cache(whole.model, held)
        for name in NAMES[:4]:
            getattr(rank, name).copy_(getattr(whole, name)[:, :, :, held.start : held.stop])
            for k, h in enumerate(held):
                if any(h in src[e] for e in range(i)):
                    getattr(rank, name)[:, :, :, k].fill_(POISON)
        rank.ring_pos.copy_(whole.ring_pos)
        out.append(rank)
    return out


def _described(cache: KVCache) -> dict[str, NixlTensor]:
    probe = torch.zeros(64, dtype=torch.uint8)  # described only: nothing here writes it
    tensors = [NixlTensor.of(n, getattr(cache, n)) for n in NAMES] + [NixlTensor.of(PROBE, probe)]
    return {t.name: t for t in tensors}


def _pool(cache: KVCache, heads: range | None = None) -> NixlPool:
    return NixlPool("decode", b"md", "DRAM", tuple(_described(cache).values()), heads=heads)


def _carry_out(plan: WritePlan) -> None:
    for (src, size, _), (dst, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        ctypes.memmove(dst, src, size)  # what UCX does between the two processes


def _expected(
    before: KVCache, whole: KVCache, held: range, n: int, full_from: int
) -> dict[str, torch.Tensor]:
    """`before` with the reservation holding heads `held` of `whole`'s prompt: whole pages from
    `full_from` on, the ring's first min(n, W) entries, the slot's ring_pos row."""
    skip, need = full_from // PAGE, -(-n // PAGE) - full_from // PAGE
    out = {name: getattr(before, name).clone() for name in NAMES}
    hs = slice(held.start, held.stop)
    for name in ("k_pages", "v_pages"):
        out[name][:, DST_PAGES[:need]] = getattr(whole, name)[:, SRC_PAGES[skip : skip + need], :, hs]
    filled = min(n, W)
    for name in ("k_ring", "v_ring"):
        out[name][:, DST_SLOT, :filled] = getattr(whole, name)[:, SRC_SLOT, :filled, hs]
    out["ring_pos"][:, DST_SLOT] = whole.ring_pos[:, SRC_SLOT]
    return out


def _disjoint(descs: list[np.ndarray]) -> bool:
    rows = np.concatenate(descs)
    rows = rows[np.argsort(rows[:, 0])]
    return bool(np.all(rows[:-1, 0] + rows[:-1, 1] <= rows[1:, 0]))


@pytest.mark.parametrize(
    ("kv_heads", "a", "b"),
    [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 2, 4), (2, 4, 2), (4, 2, 1), (4, 1, 2), (4, 4, 2), (4, 2, 4)],
)
@pytest.mark.parametrize(("n", "full_from"), [(5, 0), (3 * W + 5, 0), (3 * W + 5, 2 * PAGE)])
def test_each_decode_rank_gets_its_heads_of_the_prompt_and_nothing_else_changes(kv_heads, a, b, n, full_from):
    cfg = _config(kv_heads)
    whole = _randomized(_cache(cfg), seed=0)  # the prompt's KV, as a prefill of one rank holds it
    src, dst = _ranks(kv_heads, a), _ranks(kv_heads, b)
    prefill = _split(whole, src)
    decode = [_randomized(_cache(cfg, held), seed=100 + j) for j, held in enumerate(dst)]
    before = [_randomized(_cache(cfg, held), seed=100 + j) for j, held in enumerate(dst)]
    mine = [_described(c) for c in prefill]
    pools = [_pool(c, held) for c, held in zip(decode, dst, strict=True)]
    written: list[list[np.ndarray]] = [[] for _ in dst]
    moved = [[0, 0] for _ in dst]
    for route in routes(src, dst):
        i, j = route.src_rank, route.dst_rank
        check_compatible(mine[i], pools[j], mine_heads=src[i])
        plan = write_descs(
            mine[i], pools[j], PAGE, W, SRC_PAGES, SRC_SLOT, n, DST_PAGES, DST_SLOT, history=True,
            full_from=full_from, src_heads=src[i], heads=route.heads, ring_pos=route.ring_pos,
        )  # fmt: skip
        _carry_out(plan)
        written[j].append(plan.remote)
        moved[j][0] += plan.full_bytes
        moved[j][1] += plan.window_bytes
    for j, held in enumerate(dst):
        ref = _expected(before[j], whole, held, n, full_from)
        for name in NAMES:
            assert torch.equal(getattr(decode[j], name), ref[name]), (j, name)
        assert _disjoint(written[j]), f"decode rank {j}: some bytes written twice"
        # K and V of one token of one layer of the rank's heads (16 wide, fp32); SSFS: 1 full layer, 3 sliding
        row = 2 * len(held) * 16 * 4
        need = -(-n // PAGE) - full_from // PAGE
        assert moved[j] == [need * PAGE * row, 3 * min(n, W) * row]


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("n", [5, 3 * W + 5])
def test_whole_rows_give_the_descriptors_they_gave_before_heads(n, history):
    cfg = _config(4)
    args = (PAGE, W, SRC_PAGES, SRC_SLOT, n, DST_PAGES, DST_SLOT)
    # One rank each side holding every head, said or not.
    mine, decode = _described(_cache(cfg)), _cache(cfg)
    before = write_descs(mine, _pool(decode), *args, history=history)
    said = write_descs(
        mine, _pool(decode, range(4)), *args, history=history, src_heads=range(4), heads=range(4)
    )
    # Peers of equal degree: rank 1 of 2 into rank 1 of 2, heads 2 and 3 numbered as the model's.
    peer_mine, peer = _described(_cache(cfg, range(2, 4))), _cache(cfg, range(2, 4))
    peer_before = write_descs(peer_mine, _pool(peer), *args, history=history)
    peer_said = write_descs(
        peer_mine, _pool(peer, range(2, 4)), *args, history=history, src_heads=range(2, 4),
        dst_heads=range(2, 4), heads=range(2, 4),
    )  # fmt: skip
    for old, new in ((before, said), (peer_before, peer_said)):
        assert np.array_equal(old.local, new.local) and np.array_equal(old.remote, new.remote)
        assert (old.full_bytes, old.window_bytes) == (new.full_bytes, new.window_bytes)
    # Whole pages, consecutive ones merged: no more descriptors than pages a layer and tensor.
    assert len(before.local) <= 2 * -(-n // PAGE) + (3 * 3 if history else 0)


def test_without_ring_pos_the_row_is_left_to_another_route():
    cfg = _config(2)
    whole = _randomized(_cache(cfg), seed=0)
    decode = _randomized(_cache(cfg), seed=1)
    ring_pos = decode.ring_pos.clone()
    plan = write_descs(
        _described(whole), _pool(decode), PAGE, W, SRC_PAGES, SRC_SLOT, 9, DST_PAGES, DST_SLOT,
        history=True, heads=range(0, 1), ring_pos=False,
    )  # fmt: skip
    _carry_out(plan)
    assert torch.equal(decode.ring_pos, ring_pos)
    assert torch.equal(decode.k_ring[:, DST_SLOT, :W, 0], whole.k_ring[:, SRC_SLOT, :W, 0])


def test_heads_outside_a_pool_are_refused():
    cfg = _config(4)
    mine = _described(_cache(cfg, range(0, 2)))
    pool = _pool(_cache(cfg, range(2, 4)), range(2, 4))
    args = (PAGE, W, SRC_PAGES, SRC_SLOT, 9, DST_PAGES, DST_SLOT)
    with pytest.raises(ValueError, match=r"KV heads range\(0, 2\) are not all in decode's pool"):
        write_descs(mine, pool, *args, history=True, src_heads=range(0, 2))
    with pytest.raises(ValueError, match=r"KV heads range\(2, 4\) are not all in our pool"):
        write_descs(mine, pool, *args, history=True, src_heads=range(0, 2), heads=range(2, 4))
    with pytest.raises(ValueError, match=r"KV heads range\(1, 3\) are not all in decode's pool"):
        write_descs(_described(_cache(cfg)), pool, *args, history=True, heads=range(1, 3))
    with pytest.raises(ValueError, match=r"our pool holds 2 KV heads a row, not heads range\(0, 4\)"):
        write_descs(mine, pool, *args, history=True, src_heads=range(0, 4))
    with pytest.raises(ValueError, match=r"decode's pool holds 2 KV heads a row, not heads range\(0, 1\)"):
        write_descs(mine, pool, *args, history=True, src_heads=range(0, 2), dst_heads=range(0, 1))
    with pytest.raises(ValueError, match="not a contiguous run"):
        write_descs(mine, pool, *args, history=True, heads=range(0, 0))


def test_pools_of_other_heads_are_compatible_only_as_they_say():
    cfg = _config(4)
    mine = _described(_cache(cfg))  # all four heads
    check_compatible(mine, _pool(_cache(cfg, range(2, 4)), range(2, 4)))  # a decode rank's two
    check_compatible(_described(_cache(cfg, range(0, 2))), _pool(_cache(cfg)), mine_heads=range(0, 2))
    with pytest.raises(ValueError, match="rows differ"):  # neither says: rows must match whole
        check_compatible(mine, _pool(_cache(cfg, range(2, 4))))
    with pytest.raises(ValueError, match="decode's pool holds 2 KV heads a row"):
        check_compatible(mine, _pool(_cache(cfg, range(2, 4)), range(0, 3)))
    with pytest.raises(ValueError, match="not in decode's pool of all 2"):  # decode: a 2-head model's
        check_compatible(
            _described(_cache(cfg, range(2, 4))), _pool(_cache(_config(2))), mine_heads=range(2, 4)
        )
    other = dataclasses.replace(cfg, sliding_window=2 * W)
    with pytest.raises(ValueError, match="rows differ"):  # heads said: the rest must still match
        check_compatible(mine, _pool(_cache(other, range(2, 4)), range(2, 4)))
