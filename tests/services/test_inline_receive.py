"""Decode's receive path for inline KV, on a real DecodeScheduler and Engine: a bad chunk, refused where
the stream is read, costs its own request only; the others sharing the scheduler run to the end."""

from __future__ import annotations

import queue

import pytest

from decode_service.scheduler import DecodeScheduler, Finished, RemoteOpts, Reserved, SchedulerConfig
from shared.engine import Engine, EngineConfig
from shared.kv.cache import KVConfig
from shared.sampling import SamplingParams
from shared.transfer.base import KVLayout
from shared.transfer.inline import ChunkAssembler, extract_chunks
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


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


def test_a_bad_chunk_fails_its_request_only(sched):
    prompt = random_tokens(20)
    first, chunks = _chunks(prompt)
    layout = KVLayout.of(sched._engine.cache, "m")
    streams = {}
    for rid in ("good", "bad"):
        events: queue.Queue = queue.Queue()
        sched.submit(rid, prompt, GREEDY, events.put, RemoteOpts())
        assert isinstance(events.get(timeout=10), Reserved)
        streams[rid] = events
    for rid in streams:  # what decode's prefill client does with each stream
        kv = ChunkAssembler(layout, len(prompt))
        for i, c in enumerate(chunks):
            k = c.k[:-2] if rid == "bad" and i == 3 else c.k
            try:
                batches = kv.add(c.layer, c.window, c.token_start, c.token_count, k, c.v)
            except ValueError as exc:
                sched.deliver(rid, [exc])
                break
            if batches:
                sched.deliver(rid, batches)
        sched.deliver(rid, kv.finish())
        sched.prefilled(rid, first, history=True)
    bad, good = _finished(streams["bad"]), _finished(streams["good"])
    assert bad.reason == "abort" and bad.error is not None and "bad KV chunk" in bad.error
    assert good.error is None and good.completion_tokens == GREEDY.max_tokens
    assert sched.wait_idle(10)
    assert sched.pool_state().pages_free == 64
