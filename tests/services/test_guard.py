"""What a call must look like before any work is done for it, end to end on a real decode process: a
malformed message is INVALID_ARGUMENT without internals and one log line however many come, a call that
never sends its request ends after --first-message-timeout, a message over --max-request-bytes is
refused naming the flag, and fuzzed bytes on every method never answer UNKNOWN or INTERNAL."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_service.servicer import SERVICE_NAME
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.pb.pdserve.v1 import generation_pb2 as pb
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    random_spec,
    stop_all,
    wait_pool_idle,
)

pytestmark = pytest.mark.slow
GENERATE = f"/{SERVICE_NAME}/Generate"
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    prefill = ServerProcess(
        random_spec(), "--no-metrics", "--first-message-timeout", "0.5", module="prefill_service",
        service=PREFILL,
    )  # fmt: skip
    decode = ServerProcess(
        random_spec(), "--no-metrics", "--first-message-timeout", "0.5", "--prefill-target", prefill.target,
        "--local-prefill-max-tokens", "0", "--max-request-bytes", "65536",
    )  # fmt: skip
    try:
        yield decode, prefill
    finally:
        stop_all(decode, prefill)


def _raw(target: str, method: str, payload: bytes, streaming: bool, timeout: float = 5) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as ch:
        try:
            if streaming:
                for _ in ch.unary_stream(method)(payload, timeout=timeout):
                    pass
            else:
                ch.unary_unary(method)(payload, timeout=timeout)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_malformed_message_is_invalid_argument_without_internals_and_logged_once(pair) -> None:
    decode, _ = pair
    for _ in range(20):
        with grpc.insecure_channel(decode.target) as ch, pytest.raises(grpc.RpcError) as exc:
            list(ch.unary_stream(GENERATE)(b"\xff\xff\xff\xff", timeout=5))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = exc.value.details()
        assert "pdserve.v1.Generation/Generate" in details
        assert "Error" not in details and "class" not in details and "Traceback" not in details
    with Client(decode.target) as c:
        assert len(c.complete([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2  # still healthy
    log = decode.log()
    assert log.count("malformed request refused") == 1, log[-2000:]
    assert "Traceback" not in log


def test_a_call_that_never_sends_its_request_ends_after_the_first_message_timeout(pair) -> None:
    decode, _ = pair

    async def silent() -> tuple[grpc.StatusCode, str, float]:
        async with grpc.aio.insecure_channel(decode.target) as ch:
            call = ch.stream_stream(GENERATE)()  # opened, nothing written
            loop = asyncio.get_running_loop()
            start = loop.time()
            code = await asyncio.wait_for(call.code(), 10)
            return code, await call.details(), loop.time() - start

    code, details, took = asyncio.run(silent())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--first-message-timeout" in details
    assert took < 5


def test_a_message_over_the_size_limit_is_refused_naming_it(pair) -> None:
    decode, _ = pair
    big = pb.GenerateRequest(text="x" * 100_000).SerializeToString()
    with grpc.insecure_channel(decode.target) as ch, pytest.raises(grpc.RpcError) as exc:
        list(ch.unary_stream(GENERATE)(big, timeout=5))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-request-bytes" in exc.value.details() and "65536" in exc.value.details()


def _valid(rng: random.Random) -> bytes:
    """A well-formed request, to mutate: fuzzing mostly garbage would only test the parser."""
    req = pb.GenerateRequest(
        request_id=f"fuzz-{rng.randrange(1 << 30)}",
        token_ids=pb.TokenIds(ids=[rng.randrange(200) for _ in range(rng.randrange(1, 12))]),
        sampling=pb.SamplingParams(max_tokens=rng.randrange(0, 6), temperature=rng.choice([0.0, 0.7, -1.0])),
    )
    return req.SerializeToString()


METHODS = [
    ("decode", GENERATE, True),
    ("decode", f"/{SERVICE_NAME}/Abort", False),
    ("decode", f"/{SERVICE_NAME}/GetModelInfo", False),
    ("prefill", f"/{PREFILL}/Prefill", True),
    ("prefill", f"/{PREFILL}/Handshake", False),
    ("prefill", f"/{PREFILL}/GetModelInfo", False),
    ("decode", "/grpc.health.v1.Health/Check", False),
]


@st.composite
def _payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "mutated", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=256))
    base = bytearray(_valid(random.Random(draw(st.integers(0, 1 << 20)))))
    if kind == "truncated":
        return bytes(base[: draw(st.integers(0, len(base)))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(base) - 1))
        base[at] = draw(st.integers(0, 255))
    return bytes(base)


def test_fuzzed_bytes_never_answer_unknown_or_internal_and_the_pools_end_idle(pair) -> None:
    decode, prefill = pair
    targets = {"decode": decode.target, "prefill": prefill.target}
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(method=st.sampled_from(METHODS), payload=_payloads())
    def one(method: tuple[str, str, bool], payload: bytes) -> None:
        role, name, streaming = method
        code = _raw(targets[role], name, payload, streaming)
        seen[code] = seen.get(code, 0) + 1
        assert code not in NEVER, (name, payload)

    one()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen and grpc.StatusCode.OK in seen, seen
    with Client(decode.target) as c:
        wait_pool_idle(c, timeout=30)
    info = PrefillInfo(prefill.target)
    try:
        wait_pool_idle(info, timeout=30)  # type: ignore[arg-type]
    finally:
        info.close()
