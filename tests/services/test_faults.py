"""Faults against a real server: cancel, deadlines, Abort, duplicate ids, a full queue. After each,
the KV pool must be back at its idle baseline (read through GetModelInfo's kv_pool)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from shared.client.client import Client, GenerationError, Stream
from tests.services.service_testutil import ServerProcess, random_spec, wait_pool_idle

LONG = {"max_tokens": 500, "temperature": 0.0, "ignore_eos": True}  # outlasts the 0.3 s timeouts below


def _wait_for(pred, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _started(stream: Stream) -> Iterator:
    it = iter(stream)
    next(it)  # the request is running: it has produced a token
    return it


def test_client_cancel_mid_stream_frees_the_pool(client: Client) -> None:
    stream = client.generate([1, 2, 3], **LONG)
    it = _started(stream)
    next(it)
    stream.cancel()
    assert list(it) == [] or stream.finish_reason is None  # ends quietly: no Complete
    assert stream.finish_reason is None
    wait_pool_idle(client)


def test_deadline_mid_stream_frees_the_pool(client: Client) -> None:
    with pytest.raises(GenerationError) as exc:
        list(client.generate([4, 5, 6], timeout=0.3, **LONG))
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_pool_idle(client)


def test_deadline_while_queued_frees_the_pool(client: Client) -> None:
    """Four long requests fill --max-running 4; a fifth waits in the queue until its deadline."""
    streams = [client.generate([i + 1], **LONG) for i in range(4)]
    iters = [_started(s) for s in streams]
    with pytest.raises(GenerationError) as exc:
        list(client.generate([9], timeout=0.3, **LONG))
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: client.model_info().kv_pool.waiting == 0)
    assert client.model_info().kv_pool.running == 4
    for s in streams:
        s.cancel()
    del iters
    wait_pool_idle(client)


def test_abort_rpc_ends_the_stream(client: Client) -> None:
    stream = client.generate([7, 8, 9], request_id="abort-me", **LONG)
    it = iter(stream)
    first = next(it)
    assert client.abort("abort-me") is True
    rest = [first, *it]
    assert stream.finish_reason == "abort"
    assert stream.request_id == "abort-me"
    assert 1 <= stream.usage.completion_tokens < 500
    assert stream.usage.completion_tokens == sum(len(c.token_ids) for c in rest)
    assert client.abort("abort-me") is False
    assert client.abort("never-seen") is False
    wait_pool_idle(client)


def test_duplicate_request_id_is_already_exists(client: Client) -> None:
    stream = client.generate([1, 1], request_id="dup", **LONG)
    _started(stream)
    with pytest.raises(GenerationError) as exc:
        client.complete([2, 2], request_id="dup", max_tokens=2)
    assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    wait_pool_idle(client)
    # Once the first is gone the id is free again.
    assert client.complete([2, 2], request_id="dup", max_tokens=2).finish_reason == "length"


def test_a_request_id_is_free_again_as_soon_as_a_stop_string_ends_it(client: Client) -> None:
    probe = client.complete("hello", max_tokens=8, temperature=0.0, ignore_eos=True)
    stop = probe.text[2:4]  # what the model writes third and fourth: the stream stops there
    assert stop, probe
    for _ in range(5):
        done = client.complete("hello", request_id="again", stop=[stop], max_tokens=50, temperature=0.0)
        assert done.finish_reason == "stop"  # the next one, same id at once, is not ALREADY_EXISTS
    wait_pool_idle(client)


def test_server_assigns_request_ids(client: Client) -> None:
    a, b = client.generate([1], max_tokens=2), client.generate([1], max_tokens=2)
    list(a), list(b)
    assert a.request_id and b.request_id and a.request_id != b.request_id


def test_queue_full_is_resource_exhausted() -> None:
    srv = ServerProcess(random_spec(), "--max-running", "1", "--max-queue", "1")
    try:
        with Client(srv.target) as c:
            running = c.generate([1, 2], **LONG)
            it = _started(running)
            queued = c.generate([3, 4], max_tokens=8)
            got: list = []
            t = threading.Thread(target=lambda: got.extend(queued), daemon=True)
            t.start()
            _wait_for(lambda: c.model_info().kv_pool.waiting == 1)
            with pytest.raises(GenerationError) as exc:
                c.complete([5], max_tokens=2)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            del it
            t.join(60)
            assert queued.finish_reason == "length" and queued.usage.completion_tokens == 8
            wait_pool_idle(c)
            assert c.complete([5], max_tokens=2).finish_reason == "length"
    finally:
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()
