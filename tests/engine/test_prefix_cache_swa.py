"""The prefix cache on models with sliding layers (shared/engine/kv_ownership.py, snapshot.py).

A hit reuses the full layers' pages of its prefix; each sliding layer also needs its last W tokens at
the hit's boundary, from a window snapshot kept in pool pages or by a bounded replay. Whatever the path,
greedy tokens equal those without the cache and those of the dense reference, the pools return to
free + cached = total, and the cache's named invariants catch a corrupted page or snapshot.
"""

from __future__ import annotations

import pytest
import torch

import invariants
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import W, random_tokens, reference, tiny_config, tiny_model

P = 4
N_OUT = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)
BASE = random_tokens(64, seed=5)


def _engine(layout: str, cache: bool, num_pages: int = 256, budget: int = 256, **kw: object) -> Engine:
    kv = KVConfig(page_size=P, num_pages=num_pages, max_requests=8)
    cfg = EngineConfig(prefix_cache=cache, max_batch_tokens=budget, **kw)  # type: ignore[arg-type]
    return Engine(tiny_model(tiny_config(layout)), kv, cfg)


def _greedy_reference(engine: Engine, prompt: list[int]) -> list[int]:
    model, tokens = engine.runner.model, list(prompt)
    for _ in range(N_OUT):
        tokens.append(int(reference(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _one_by_one(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out = [engine.generate([p], GREEDY)[0].output for p in prompts]
    engine.check_idle_integrity()
    return out


# The shared prefix: shorter than W, equal to W, longer than W; ending on a page boundary or inside one.
PREFIXES = [3, 4, W, W + 2, 12, 20, 33]


@pytest.mark.parametrize("layout", ["SSFS", "SFSF"])
@pytest.mark.parametrize("shared", PREFIXES)
def test_prompts_sharing_a_prefix_decode_as_without_the_cache_and_as_the_reference(
    layout: str, shared: int
) -> None:
    tails = [[1, 2, 3], [7, 8], [9], [7, 8, 4]]
    prompts = [[*BASE[:shared], *tail] for tail in tails]
    cached = _engine(layout, True)
    got = _one_by_one(cached, prompts)
    assert got == _one_by_one(_engine(layout, False), prompts)
    assert got[1] == _greedy_reference(cached, prompts[1])
    assert got[3] == _greedy_reference(cached, prompts[3])


def test_a_second_turn_reads_the_first_turns_prefix_and_its_window_from_a_snapshot() -> None:
    engine = _engine("SSFS", True)
    first = [*BASE[:24]]
    engine.generate([first], GREEDY)
    assert engine.kv.prefix.num_snapshots == 1  # type: ignore[union-attr]  # at 24, the prompt's end
    turn = engine.add_request([*first, 5, 6, 7], GREEDY)
    engine.step()
    assert turn.cached_tokens == 24 and turn.num_scheduled == 27  # only the new tokens were computed
    while not turn.finished or engine.in_flight:
        engine.step()
    engine.free_finished()
    assert turn.output == _greedy_reference(engine, [*first, 5, 6, 7])
    engine.check_idle_integrity()


def test_requests_that_diverge_inside_a_prefix_leave_a_snapshot_where_they_diverge() -> None:
    engine = _engine("SSFS", True)
    engine.generate([[*BASE[:16], 1, 1, 1, 1, 1]], GREEDY)  # snapshot at 20 only
    second = engine.generate([[*BASE[:16], 2, 2]], GREEDY)[0]
    assert second.cached_tokens == 0  # no window at 16 yet (replaying it would save nothing)
    third = engine.generate([[*BASE[:16], 3, 3, 3]], GREEDY)[0]
    assert third.cached_tokens == 16  # the second left its window at 16
    assert third.output == _greedy_reference(engine, [*BASE[:16], 3, 3, 3])
    engine.check_idle_integrity()


def test_a_hit_without_a_snapshot_rebuilds_the_window_by_bounded_replay_when_that_saves_tokens() -> None:
    engine = _engine("FFFS", True)  # one sliding layer, on top: its rings need only the last W tokens
    engine.generate([[*BASE[:40], 1]], GREEDY)  # a snapshot at 40, none at 36
    req = engine.generate([[*BASE[:36], 2, 2]], GREEDY)[0]
    assert req.cached_tokens == 36  # replayed [28, 36) into its rings, computed from 36
    assert req.output == _greedy_reference(engine, [*BASE[:36], 2, 2])
    engine.check_idle_integrity()


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed_steps"])
def test_many_requests_sharing_one_prefix_at_once(mixed: bool) -> None:
    prompts = [[*BASE[:30], i, i + 1] for i in range(8)]
    engine = _engine("SSFS", True, mixed=mixed, budget=16)
    engine.generate([[*BASE[:30], 90]], GREEDY)
    got = [r.output for r in engine.generate(prompts, GREEDY)]
    engine.check_idle_integrity()
    assert got == [r.output for r in _engine("SSFS", False, budget=16).generate(prompts, GREEDY)]


def test_a_tiny_pool_evicts_snapshots_and_pages_and_stays_correct() -> None:
    prompts = [[*random_tokens(12, seed=s % 3), s] for s in range(9)] + [[*BASE[:24], s] for s in range(3)]
    cached = _engine("SSFS", True, num_pages=24)
    assert _one_by_one(cached, prompts) == _one_by_one(_engine("SSFS", False, num_pages=24), prompts)
    assert cached.kv.evicted_pages > 0
    assert cached.cache.pages.num_free + len(cached.kv.prefix) == 24  # type: ignore[arg-type]


def test_an_abort_while_a_sharer_runs_leaves_the_sharer_correct() -> None:
    engine = _engine("SSFS", True)
    engine.generate([BASE[:24]], SamplingParams(temperature=0.0, max_tokens=1))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = engine.add_request([*BASE[:24], 8], long)
    second = engine.add_request([*BASE[:24], 4], GREEDY)
    engine.step()
    engine.step()
    engine.abort(first)
    while not second.finished or engine.in_flight:
        engine.step()
    engine.free_finished()
    assert second.cached_tokens == 24
    assert second.output == _greedy_reference(engine, [*BASE[:24], 4])
    engine.check_idle_integrity()


def test_a_cached_page_rewritten_behind_the_cache_is_caught_by_prefix_pages_intact() -> None:
    engine = _engine("SSFS", True)
    engine.generate([BASE[:24]], GREEDY)
    page = engine.kv.prefix.match(BASE[:24])[2]  # type: ignore[union-attr]
    engine.cache.k_pages[:, page] += 1.0  # as a freed-and-reused page would be
    with pytest.raises(invariants.InvariantViolation, match=r"prefix\.pages_intact"):
        engine.generate([[*BASE[:24], 1]], GREEDY)


def test_a_snapshot_of_the_wrong_positions_is_caught_by_prefix_window_restored() -> None:
    engine = _engine("SSFS", True)
    engine.generate([BASE[:24]], GREEDY)
    pages = engine.kv.prefix.match(BASE[:24])  # type: ignore[union-attr]
    snap = engine.kv.prefix.snapshot(pages[-1])  # type: ignore[union-attr]
    assert snap is not None
    positions = snap.payload
    assert isinstance(positions, torch.Tensor)
    positions += 1  # a window one token later than its boundary
    with pytest.raises(invariants.InvariantViolation, match=r"prefix\.window_restored"):
        engine.generate([[*BASE[:24], 1]], GREEDY)
