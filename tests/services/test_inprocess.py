"""An in-process grpc.aio server on port 0: the asyncio client, and checks that look inside the
scheduler's engine (pool integrity after faults, waiting for pages, an engine that fails)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from decode_service.config import ServiceConfig
from decode_service.scheduler import DecodeScheduler as Scheduler
from shared.client.client import AsyncClient, Client, GenerationError
from tests.services.service_testutil import InProcessServer, random_spec, wait_pool_idle

LONG = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    # 16 pages of 16 tokens: the pool, not the model (512), bounds the context (256 tokens).
    s = InProcessServer(
        ServiceConfig(model=random_spec(), device="cpu", page_size=16, num_pages=16, max_running=2)
    )
    yield s
    s.close()


def _assert_idle(s: Scheduler) -> None:
    assert s.wait_idle(10)
    # An id leaves the live set before the engine has freed what a step in flight still used: wait
    # for the pool state the scheduler thread publishes after those frees, then read the engine.
    deadline = time.monotonic() + 10
    while (
        st := s.pool_state()
    ).pages_free + st.pages_cached < st.pages_total or st.slots_free < st.slots_total:
        assert time.monotonic() < deadline, f"pool not back at idle: {st}"
        time.sleep(0.01)
    s._engine.check_idle_integrity()  # the scheduler thread is asleep once idle: safe to read


def test_max_context_follows_the_pool(srv: InProcessServer) -> None:
    with Client(srv.target) as c:
        assert c.model_info().max_context == 256
        with pytest.raises(GenerationError) as exc:
            c.complete([1] * 250, max_tokens=7)
        assert [v.field for v in exc.value.violations] == ["sampling.max_tokens"]


def test_async_client(srv: InProcessServer) -> None:
    async def main() -> None:
        async with AsyncClient(srv.target) as c:
            info = await c.model_info()
            assert info.vocab_size == 97
            done = await c.complete("abc", max_tokens=6, temperature=0)
            assert (done.finish_reason, done.usage.prompt_tokens, done.usage.completion_tokens) == (
                "length",
                3,
                6,
            )
            # Streaming, then an Abort by id from the same client.
            stream = c.generate([1, 2, 3], request_id="a1", max_tokens=40, temperature=0, ignore_eos=True)
            got = []
            async for chunk in stream:
                got.append(chunk)
                if len(got) == 1:
                    assert await c.abort("a1")
            assert stream.finish_reason == "abort"
            # Cancel mid-stream.
            stream = c.generate([4, 5], max_tokens=40, temperature=0, ignore_eos=True)
            async for _ in stream:
                stream.cancel()
            with pytest.raises(GenerationError) as exc:
                await c.complete([1] * 300)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
    _assert_idle(srv.serving.scheduler)


def test_deadline_while_waiting_for_pages(srv: InProcessServer) -> None:
    """The first request holds all 16 pages; the second waits for pages in the engine until its deadline."""
    with Client(srv.target) as c:
        first = c.generate([1] * 20, max_tokens=236, temperature=0, ignore_eos=True)
        it = iter(first)
        next(it)
        with pytest.raises(GenerationError) as exc:
            c.complete([2] * 8, max_tokens=8, timeout=0.3)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert sum(len(ch.token_ids) for ch in it) >= 0 and first.finish_reason == "length"
        wait_pool_idle(c)
    _assert_idle(srv.serving.scheduler)


def test_engine_failure_fails_streams_and_refuses_new_work() -> None:
    s = InProcessServer(
        ServiceConfig(model=random_spec(), device="cpu", page_size=4, num_pages=64, max_running=2)
    )
    try:
        engine = s.serving.scheduler._engine
        step = engine.step
        calls = 0

        def failing_step():  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("injected fault")
            return step()

        engine.step = failing_step  # type: ignore[method-assign]
        with Client(s.target) as c:
            with pytest.raises(GenerationError) as exc:
                c.complete([1, 2], **LONG)
            assert exc.value.code == grpc.StatusCode.INTERNAL and "injected fault" in exc.value.details
            with pytest.raises(GenerationError) as exc:
                c.complete([1, 2], max_tokens=2)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()
