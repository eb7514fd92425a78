"""KV memory: pages owned exactly once, windows bounded by W, history checked before it is read."""

from __future__ import annotations

import pytest
import torch

from invariants import InvariantViolation, levels
from shared.engine.kv.allocator import IntegrityError, OutOfCapacity, UnitAllocator
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.window import RequestWindow, free_windows, replay_start, ring_store_index
from tests.engine.engine_testutil import W, tiny_config


def test_units_are_owned_exactly_once():
    pool = UnitAllocator(8)
    a = pool.alloc(owner=1, n=3)
    b = pool.alloc(owner=2, n=5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    with pytest.raises(OutOfCapacity):
        pool.alloc(owner=3, n=1)
    with pytest.raises(IntegrityError, match="held by 1"):
        pool.free(owner=2, units=a)  # not the owner
    pool.free(owner=1, units=a)
    with pytest.raises(IntegrityError, match="freed by 1"):
        pool.free(owner=1, units=a)  # twice
    pool.check_integrity()
    assert pool.owned_by(2) == sorted(b)


def test_a_unit_listed_twice_in_one_free_is_refused_and_nothing_is_freed():
    pool = UnitAllocator(4)
    a = pool.alloc(owner=1, n=2)
    with pytest.raises(IntegrityError, match="freed twice in one call by 1"):
        pool.free(owner=1, units=[a[0], a[1], a[0]])
    assert pool.num_free == 2 and pool.owned_by(1) == sorted(a)
    pool.check_integrity()


def test_a_failed_allocation_takes_nothing():
    pool = UnitAllocator(4)
    pool.alloc(owner=0, n=3)
    with pytest.raises(OutOfCapacity):
        pool.alloc(owner=1, n=2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_sliding_memory_per_request_does_not_grow_with_the_sequence():
    cfg = tiny_config("SSFS")
    cache = KVCache(cfg, KVConfig(page_size=4, num_pages=64, max_requests=4))
    ring_bytes = cache.window_bytes_per_request()
    # A request of any length holds one ring per sliding layer: W tokens each.
    assert ring_bytes == 3 * W * (2 * cfg.num_kv_heads * cfg.head_dim * 4 + 4)
    short, long = RequestWindow(cache, owner=1), RequestWindow(cache, owner=2)
    k_short, _ = short.buffer(0, context_len=0)
    k_long, _ = long.buffer(0, context_len=0)
    assert k_short.shape == k_long.shape == (W, cfg.num_kv_heads, cfg.head_dim)
    # Full layers page their whole sequence; an all-sliding model owns no page memory at all.
    all_sliding = KVCache(tiny_config("SSSS"), KVConfig(page_size=4, num_pages=64, max_requests=4))
    assert all_sliding.k_pages.numel() == 0 and all_sliding.page_bytes() == 0


def test_a_chunk_stores_only_its_last_w_tokens_in_the_ring():
    offsets, flat = ring_store_index(slot=2, start=5, count=12, window=W)
    assert offsets == list(range(4, 12))
    assert flat == [2 * W + p % W for p in range(9, 17)]
    assert ring_store_index(slot=0, start=0, count=3, window=W) == ([0, 1, 2], [0, 1, 2])


def test_reading_a_missing_history_trips_swa_history_present():
    cache = KVCache(tiny_config("SSFS"), KVConfig(page_size=4, num_pages=16, max_requests=2))
    window = RequestWindow(cache, owner=7)
    with levels("strict"):
        window.buffer(0, context_len=0)  # nothing stored, nothing expected
        with pytest.raises(InvariantViolation, match=r"invariant-check FAILED \[swa.history_present\]"):
            window.buffer(0, context_len=3)  # three tokens should be there, none are
        cache.ring_pos[0, window.slot, :3] = torch.arange(3, dtype=torch.int32)
        window.buffer(0, context_len=3)
        with pytest.raises(InvariantViolation):
            window.buffer(1, context_len=3)  # layer 1 of the same request is still empty


def test_freeing_a_window_clears_it_and_returns_the_slot():
    cache = KVCache(tiny_config("SSFS"), KVConfig(page_size=4, num_pages=16, max_requests=1))
    window = RequestWindow(cache, owner=1)
    cache.ring_pos[:, window.slot] = 3
    window.free()
    window.free()  # idempotent: freed exactly once
    assert cache.slots.num_free == 1 and bool((cache.ring_pos == -1).all())


def test_freeing_many_windows_at_once_clears_exactly_those_slots():
    cache = KVCache(tiny_config("SSFS"), KVConfig(page_size=4, num_pages=16, max_requests=4))
    windows = [RequestWindow(cache, owner=i) for i in range(4)]
    cache.ring_pos.fill_(5)
    gone = [windows[0], windows[2], windows[3]]
    free_windows(cache, [*gone, windows[0]])  # listed twice: freed once
    for slot in range(cache.ring_pos.shape[1]):
        want = -1 if slot in [w.slot for w in gone] else 5
        assert bool((cache.ring_pos[:, slot] == want).all()), slot
    assert cache.slots.num_free == 3
    free_windows(cache, gone)  # already freed: nothing changes
    free_windows(cache, [])
    assert cache.slots.num_free == 3 and bool((cache.ring_pos[:, windows[1].slot] == 5).all())
    cache.slots.check_integrity()


def test_freeing_many_owners_at_once_is_checked_whole_before_anything_changes():
    pool = UnitAllocator(10)
    a, b, c = pool.alloc(owner=1, n=3), pool.alloc(owner=2, n=3), pool.alloc(owner=3, n=2)
    with pytest.raises(IntegrityError, match=f"{b[0]} freed by 1 but held by 2"):
        pool.free_many([(1, a), (1, [b[0]])])
    with pytest.raises(IntegrityError, match=f"{a[1]} freed twice in one call by 1"):
        pool.free_many([(1, a), (2, b), (1, [a[1]])])
    with pytest.raises(IntegrityError, match="10 freed by 3 but held by out of range"):
        pool.free_many([(3, [*c, 10])])
    assert pool.num_free == 2 and pool.owned_by(1) == sorted(a), "a refused free changes nothing"
    pool.free_many([(1, a), (3, c), (2, [])])
    assert pool.num_free == 7 and pool.owned_by(2) == sorted(b)
    again = pool.alloc(owner=4, n=7)
    assert sorted(again) == sorted(set(range(10)) - set(b)), "each freed unit is free exactly once"
    pool.check_integrity()


@pytest.mark.parametrize(
    "types,ctx,expected",
    [
        ("SFFF", 100, 100 - W),  # one sliding layer: exactly the last W tokens
        ("SSFS", 100, 100 - W - 2 * (W - 1)),  # two sliding layers below the topmost widen it
        ("FFFF", 100, 100),  # nothing to rebuild
        ("SSSS", 10, 0),  # short context: replay from the start
    ],
)
def test_bounded_replay_span_depends_on_the_layout_not_the_prompt(types, ctx, expected):
    layer_types = tiny_config(types).layer_types
    assert replay_start(ctx, layer_types, W) == expected
    # A prompt 1000 tokens longer replays no more tokens (once both exceed the span).
    longer = ctx + 1000 - replay_start(ctx + 1000, layer_types, W)
    assert ctx - replay_start(ctx, layer_types, W) == min(ctx, longer)


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_step_checks_every_sliding_layers_history_and_contains_the_request_that_lost_one(use_triton):
    # One check a step covers the rings of all sliding layers (layers 0, 1 and 3 here). Losing only
    # the last layer's history of one request, mid-decode, aborts that request at WARN, by name,
    # and leaves the other to finish. use_triton: the fused check kernel (on a GPU if there is one,
    # else interpreted on the CPU).
    import invariants
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams
    from tests.engine.engine_testutil import tiny_model

    device = "cuda" if use_triton and torch.cuda.is_available() else "cpu"
    invariants.reset_checkers()
    invariants.checker(device, use_triton=use_triton)
    try:
        with levels("warn"):
            eng = Engine(
                tiny_model(tiny_config("SSFS")).to(device),
                KVConfig(page_size=4, num_pages=32, max_requests=2, device=device),
                EngineConfig(max_batch_tokens=32),
            )
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            keep, lose = eng.add_request([1, 2, 3, 4, 5], params), eng.add_request([6, 7, 8], params)
            while len(lose.output) < 3:
                eng.step()
            eng.flush()
            eng.cache.ring_pos[2, lose.window.slot] = -1  # the third sliding layer = model layer 3
            while not eng.idle:
                eng.step()
    finally:
        invariants.reset_checkers()
    assert lose.finish_reason == "abort" and "swa.history_present" in lose.error
    assert keep.finish_reason == "length" and len(keep.output) == 8
