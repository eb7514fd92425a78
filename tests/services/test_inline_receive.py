"""Decode's receive path for inline KV. End to end with real processes: a bad chunk from the prefill
service cancels its call at once and the request is prefilled by decode instead (the client sees a
normal completion, its tokens those the same prompt gets again), both pools come back to idle and the
next request succeeds. On a real DecodeScheduler: a request aborted with part of its KV applied
releases its reservation once; the others sharing the scheduler run to the end."""

from __future__ import annotations

import queue

import pytest

from decode_service.scheduler import DecodeScheduler, Finished, RemoteOpts, Reserved, SchedulerConfig
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.transfer.base import KVLayout
from shared.transfer.inline import ChunkAssembler, extract_chunks
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model
from tests.services.service_testutil import remote_pair, wait_pool_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1)
MARKER = 5  # prompts starting with it get a short chunk from the faulty prefill service


@pytest.fixture
def sched():  # type: ignore[no-untyped-def]
    kv = KVConfig(page_size=4, num_pages=64, max_requests=4)
    s = DecodeScheduler(Engine(tiny_model(tiny_config()), kv, EngineConfig()), SchedulerConfig(max_queue=4))
    s.start()
    yield s
    s.shutdown()


def _chunks(prompt: list[int]):  # type: ignore[no-untyped-def]
    prefill = Engine(
        tiny_model(tiny_config()), KVConfig(page_size=4, num_pages=64, max_requests=4), EngineConfig()
    )
    p = prefill.add_request(prompt, ONE, hold_kv=True)
    while not p.finished:
        prefill.step()
    prefill.flush()
    return p.output[0], list(extract_chunks(prefill.cache, p.pages, p.slot, len(prompt), max_chunk_bytes=700))


def _finished(events: queue.Queue) -> Finished:
    while True:
        ev = events.get(timeout=30)
        if isinstance(ev, Finished):
            return ev


def test_a_request_aborted_half_received_frees_its_reservation_and_not_the_others(sched):
    prompt = random_tokens(20)
    first, chunks = _chunks(prompt)
    layout = KVLayout.of(sched._engine.cache, "m", "w")
    streams = {}
    for rid in ("good", "cut"):
        events: queue.Queue = queue.Queue()
        sched.submit(rid, prompt, GREEDY, events.put, RemoteOpts())
        assert isinstance(events.get(timeout=10), Reserved)
        streams[rid] = events
    for rid in streams:  # what decode's prefill client does with each stream
        kv = ChunkAssembler(layout, len(prompt), window=True, max_batch_bytes=700)
        sent = chunks if rid == "good" else chunks[: len(chunks) // 2]
        for c in sent:
            sched.deliver(rid, kv.add(c.layer, c.window, c.token_start, c.token_count, c.k, c.v))
        if rid == "good":
            sched.deliver(rid, kv.finish())
            sched.prefilled(rid, first, history=True)
        else:  # the stream failed: the servicer aborts the request
            assert sched.abort(rid)
    cut, good = _finished(streams["cut"]), _finished(streams["good"])
    assert cut.reason == "abort"
    assert good.error is None and good.completion_tokens == GREEDY.max_tokens
    assert sched.wait_idle(10)
    assert sched.pool_state().pages_free == 64


def test_a_bad_chunk_from_prefill_has_decode_prefill_the_request_and_both_pools_end_idle():
    env = {"PDSERVE_TEST_FAULTS": f"short_kv_chunk:{MARKER}"}
    with remote_pair("--page-size", "4", "--max-running", "4", prefill_env=env) as (c, info):
        prompt = [MARKER, *range(10, 70)]
        first = c.complete(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert first.finish_reason == "length" and len(first.token_ids) == 4
        wait_pool_idle(c)
        again = c.complete(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert again.token_ids == first.token_ids
        wait_pool_idle(c)
        wait_pool_idle(info)  # type: ignore[arg-type]
        done = c.complete([6, *range(10, 70)], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        wait_pool_idle(c)
