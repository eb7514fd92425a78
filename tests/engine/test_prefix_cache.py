"""The engine's prefix cache on a full-attention model: a prompt that extends one computed before reads
that prefix's KV pages and computes only the rest, with the same greedy tokens as without the cache;
pages are shared by reference, evicted only unreferenced, and an idle engine holds nothing but cached
pages (free + cached = total)."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model

P = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = random_tokens(40, seed=3)


def _engine(cache: bool, num_pages: int = 128, max_batch_tokens: int = 256) -> Engine:
    model = tiny_model(tiny_config("FFFF"))
    kv = KVConfig(page_size=P, num_pages=num_pages, max_requests=8)
    return Engine(model, kv, EngineConfig(prefix_cache=cache, max_batch_tokens=max_batch_tokens))


def _outputs(engine: Engine, prompts: list[list[int]], together: bool) -> list[list[int]]:
    if together:
        return [r.output for r in engine.generate(prompts, GREEDY)]
    return [engine.generate([p], GREEDY)[0].output for p in prompts]


# Prefixes shorter than a page, ending on a page boundary and inside a page, longer than several pages.
PROMPTS = [BASE[:30], [*BASE[:3], 5, 6], [*BASE[:8], 1], [*BASE[:11], 2, 3], [*BASE[:30], 7], BASE[:12]]


@pytest.mark.parametrize("together", [False, True], ids=["one_after_another", "all_at_once"])
def test_greedy_tokens_with_the_cache_equal_those_without(together: bool) -> None:
    plain, cached = _engine(False), _engine(True)
    assert _outputs(cached, PROMPTS, together) == _outputs(plain, PROMPTS, together)
    cached.check_idle_integrity()
    assert len(cached.kv.prefix) > 0  # type: ignore[arg-type]


def test_a_hit_computes_only_the_rest_of_its_prompt() -> None:
    engine = _engine(True)
    engine.generate([BASE[:30]], GREEDY)  # 7 full pages cached
    req = engine.add_request([*BASE[:30], 9, 9], GREEDY)
    engine.step()
    assert len(req.shared) == 7 and req.num_scheduled == 32
    # A prompt equal to the cached one still computes its last token (its logits are the first output).
    again = engine.add_request(BASE[:28], GREEDY)
    engine.step()
    assert len(again.shared) == 6
    while not (req.finished and again.finished) or engine.in_flight:
        engine.step()
    engine.free_finished()
    engine.check_idle_integrity()


def test_a_tiny_pool_evicts_unreferenced_pages_and_stays_correct() -> None:
    prompts = [random_tokens(20, seed=s) for s in range(6)] * 2
    plain, cached = _engine(False, num_pages=16), _engine(True, num_pages=16)
    assert _outputs(cached, prompts, False) == _outputs(plain, prompts, False)
    cached.check_idle_integrity()
    assert cached.cache.pages.num_free + len(cached.kv.prefix) == 16  # type: ignore[arg-type]


def test_an_abort_while_a_sharer_runs_leaves_the_sharer_correct() -> None:
    plain = _engine(False)
    want = plain.generate([[*BASE[:20], 4]], GREEDY)[0].output
    engine = _engine(True)
    engine.generate([BASE[:20]], SamplingParams(temperature=0.0, max_tokens=1))
    first = engine.add_request(
        [*BASE[:20], 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    )
    second = engine.add_request([*BASE[:20], 4], GREEDY)
    engine.step()
    engine.step()
    engine.abort(first)
    while not second.finished or engine.in_flight:
        engine.step()
    engine.free_finished()
    assert second.output == want
    engine.check_idle_integrity()


def test_warm_up_leaves_nothing_cached() -> None:
    engine = _engine(True)
    engine.warm_up(force=True)
    assert len(engine.kv.prefix) == 0  # type: ignore[arg-type]
    engine.check_idle_integrity()
