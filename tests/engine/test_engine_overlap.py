"""Overlap scheduling: step N+1 is launched before step N is read, and nothing changes but timing."""

from __future__ import annotations

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model


def engine(overlap: bool, max_requests: int = 4) -> Engine:
    kv = KVConfig(page_size=4, num_pages=128, max_requests=max_requests)
    return Engine(tiny_model(tiny_config("SSFS")), kv, EngineConfig(max_batch_tokens=12, overlap=overlap))


PROMPTS = [random_tokens(n, seed=n) for n in (3, W + 1, 2 * W + 5, 9, 30)]


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(5, 17, 33, 64, 80)),
        SamplingParams(temperature=1.0, top_k=4, seed=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def test_overlapped_and_serial_engines_produce_the_same_tokens():
    serial = engine(overlap=False).generate(PROMPTS, params())
    overlapped_engine = engine(overlap=True)
    overlapped = overlapped_engine.generate(PROMPTS, params())
    for a, b in zip(serial, overlapped, strict=True):
        assert (a.output, a.finish_reason) == (b.output, b.finish_reason)
    overlapped_engine.check_idle_integrity()


def test_a_finished_requests_pages_stay_owned_until_the_step_writing_them_completes():
    eng = engine(overlap=True)
    # Every token is a stop token: it stops at its first, which the host reads only after the next
    # step (decoding its second token) has been launched.
    stop_all = tuple(range(97))
    short = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=stop_all))
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not short.finished:
        eng.step()
    assert short.finish_reason == "stop" and len(short.output) == 1
    assert eng.cache.pages.owned_by(short.rid), "pages freed under a step in flight"
    eng.step()  # completes the step that wrote them; they go back once its tokens are out
    eng.free_finished()
    assert not eng.cache.pages.owned_by(short.rid)
    while not eng.idle:
        eng.step()
    eng.check_idle_integrity()


def test_a_batch_gets_its_last_tokens_before_its_kv_is_freed():
    eng = engine(overlap=True)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reqs = [eng.add_request(p, sp) for p in PROMPTS[:3]]
    while not all(r.finished for r in reqs):
        produced = eng.step()
    # The call that finished them returned their last tokens with their KV still owned ...
    assert {r for r, _ in produced} == set(reqs) and all(len(r.output) == 5 for r in reqs)
    assert all(eng.cache.pages.owned_by(r.rid) for r in reqs)
    assert not eng.idle and not eng.in_flight
    # ... given back by the next call (or free_finished, or any allocation), after which it is idle.
    assert eng.step() == []
    assert not any(eng.cache.pages.owned_by(r.rid) for r in reqs) and eng.idle
    eng.check_idle_integrity()


def test_the_kv_a_finished_batch_left_behind_is_there_for_the_next_allocation():
    eng = engine(overlap=True, max_requests=2)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = [eng.add_request(p, sp) for p in PROMPTS[:2]]
    while not all(r.finished for r in first):
        eng.step()
    assert eng.cache.slots.num_free == 0  # both window slots still held: their frees follow the return
    held = eng.reserve(PROMPTS[2], sp)  # a transfer's reservation (the decode service) frees them first
    assert held is not None and eng.cache.slots.num_free == 1
    eng.release(held)
    assert eng.idle
    eng.check_idle_integrity()


def test_abort_in_flight_frees_once_the_step_completes():
    eng = engine(overlap=True)
    victim = eng.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    other = eng.add_request(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.abort(victim)
    assert victim.finish_reason == "abort"
    while not eng.idle:
        eng.step()
    assert len(other.output) == 10 and other.finish_reason == "length"
    eng.check_idle_integrity()


def test_requests_finishing_in_one_step_forget_their_windows_before_their_slots_return():
    eng = engine(overlap=True, max_requests=3)
    same = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    batch = [eng.add_request(PROMPTS[i], same) for i in (1, 2, 4)]
    slots = set()
    while not eng.idle:
        slots |= {r.window.slot for r in batch if r.window is not None}
        eng.step()
    assert len(slots) == 3 and all(r.finish_reason == "length" for r in batch)
    assert bool((eng.cache.ring_pos == -1).all()), "a freed slot kept its history"
    # A request in a recycled slot reads none of the old history: as on an engine of its own.
    again = eng.generate([PROMPTS[3]], same)[0]
    fresh = engine(overlap=True, max_requests=3).generate([PROMPTS[3]], same)[0]
    assert again.output == fresh.output
    eng.check_idle_integrity()
