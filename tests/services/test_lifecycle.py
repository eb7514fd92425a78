"""The process's life: readiness while loading, SIGTERM drain (and its timeout), reflection."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from decode_service.servicer import SERVICE_NAME
from shared.client.client import Client, GenerationError, Stream
from tests.services.service_testutil import (
    ServerProcess,
    health_status,
    random_spec,
    wait_health,
    wait_pool_idle,
)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LONG = {"max_tokens": 500, "temperature": 0.0, "ignore_eos": True}


def _consume(stream: Stream) -> tuple[threading.Thread, list, threading.Event]:
    chunks: list = []
    first = threading.Event()

    def run() -> None:
        for c in stream:
            chunks.append(c)
            first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, chunks, first


def test_readiness_while_loading_then_sigterm_drains() -> None:
    srv = ServerProcess(random_spec(load_delay_s=3.0), "--drain-timeout", "60", wait_ready=False)
    try:
        # Loading: alive, not ready, and Generate is UNAVAILABLE.
        assert health_status(srv.target, "") == SERVING
        assert health_status(srv.target, SERVICE_NAME) == NOT_SERVING
        with Client(srv.target) as c:
            with pytest.raises(GenerationError) as exc:
                c.complete([1, 2], max_tokens=2)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
            wait_health(srv.target, SERVICE_NAME, SERVING, timeout=60)

            stream = c.generate([1, 2, 3], **LONG)
            t, chunks, first = _consume(stream)
            assert first.wait(30)
            srv.terminate()
            # Draining: not ready, new work refused, the running request carries on.
            wait_health(srv.target, SERVICE_NAME, NOT_SERVING, timeout=10)
            assert health_status(srv.target, "") == SERVING
            with pytest.raises(GenerationError) as exc:
                c.complete([4, 5], max_tokens=2)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
            t.join(60)
            assert stream.finish_reason == "length"
            assert sum(len(ch.token_ids) for ch in chunks) == stream.usage.completion_tokens == 500
        assert srv.wait() == 0
        assert srv.lines[-1] == "pdserve decode stopped"
    finally:
        srv.kill()


def test_drain_timeout_aborts_what_is_left() -> None:
    srv = ServerProcess(random_spec(), "--drain-timeout", "0.2")
    try:
        with Client(srv.target) as c:
            stream = c.generate([1, 2, 3], **LONG)
            t, chunks, first = _consume(stream)
            assert first.wait(30)
            srv.terminate()
            t.join(30)
            assert stream.finish_reason == "abort"
            assert sum(len(ch.token_ids) for ch in chunks) == stream.usage.completion_tokens < 500
        assert srv.wait() == 0
        assert "aborting 1 request(s)" in srv.log()
    finally:
        srv.kill()


def _reflect(
    target: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        return next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))


def test_reflection_is_off_unless_asked() -> None:
    srv = ServerProcess(random_spec(), "--no-metrics")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            _reflect(srv.target, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        srv.terminate()
        assert srv.wait() == 0


def test_reflection_lists_the_services(server: ServerProcess) -> None:  # the fixture's --reflection
    resp = _reflect(server.target, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in resp.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    resp = _reflect(
        server.target, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
    )
    assert resp.file_descriptor_response.file_descriptor_proto  # clients like grpcurl can build requests


def test_health_when_ready(server: ServerProcess) -> None:
    assert health_status(server.target, "") == SERVING
    assert health_status(server.target, SERVICE_NAME) == SERVING
    with pytest.raises(grpc.RpcError) as exc:
        health_status(server.target, "no.such.Service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_calls_past_the_cap_are_refused_resource_exhausted() -> None:
    srv = ServerProcess(
        random_spec(), "--no-metrics", "--max-calls", "2", env={"PDSERVE_TEST_FAULTS": "step_delay:0.2"}
    )
    try:
        with Client(srv.target) as c:
            slow = [c.generate([1, 2, 3], max_tokens=40, temperature=0.0) for _ in range(2)]
            firsts = [next(iter(s)) for s in slow]  # both running: the cap is reached
            assert all(f.token_ids for f in firsts)
            with pytest.raises(GenerationError) as exc:
                c.complete([4, 5], max_tokens=2)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            for s in slow:
                s.cancel()
            deadline = time.monotonic() + 10
            while True:  # the cancelled calls end on the server a moment after the client leaves them
                try:
                    done = c.complete([4, 5], max_tokens=2)
                    break
                except GenerationError as e:
                    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.1)
            assert done.finish_reason in ("stop", "length")  # room again
            wait_pool_idle(c)
    finally:
        srv.terminate()
        assert srv.wait() == 0
