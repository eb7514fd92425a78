"""Disaggregation with real processes: a prefill service and decode services on loopback, the same tiny
random model on each. Greedy tokens equal the colocated Engine's on the remote path (with and without
window history) and the local one; window bytes are bounded; layout mismatch, a dead or hung prefill,
a client cancel mid-transfer and a decode killed mid-prefill all leave both pools at their idle
baseline."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client, GenerationError
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.serving.api.model_source import load_served_model
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    health_status,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
W = 8  # the random model's window (service_testutil.TINY)
LENGTHS = [3, W - 1, W, W + 1, 2 * W + 3, 5 * W]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
COMMON = ("--page-size", "4", "--max-running", "4")


def _prompt(n: int) -> list[int]:
    return [(7 * i + n) % 97 for i in range(n)]


def _prefill(*args: str, port: int = 0) -> ServerProcess:
    return ServerProcess(random_spec(), *COMMON, *args, module="prefill_service", service=PREFILL, port=port)


@pytest.fixture(scope="module")
def prefill() -> Iterator[ServerProcess]:
    p = _prefill()
    yield p
    stop_all(p)


@pytest.fixture(scope="module")
def expected() -> dict[int, list[int]]:
    loaded = load_served_model(random_spec())
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    reqs = engine.generate([_prompt(n) for n in LENGTHS], SamplingParams(**GREEDY))
    return {n: r.output for n, r in zip(LENGTHS, reqs, strict=True)}


@pytest.mark.parametrize(
    "flags",
    [
        ("--local-prefill-max-tokens", "0"),  # every prompt remote, window history shipped
        ("--local-prefill-max-tokens", "0", "--no-window-history"),  # remote, rings rebuilt by replay
        ("--local-prefill-max-tokens", "1000"),  # every prompt local
        ("--local-prefill-max-tokens", str(W)),  # conditional: short local, long remote
    ],
    ids=["remote", "remote-replay", "local", "conditional"],
)
def test_greedy_tokens_equal_the_colocated_engine(prefill, expected, flags):
    decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", prefill.target, *flags)
    info = PrefillInfo(prefill.target)
    try:
        with Client(decode.target) as c:
            for n in LENGTHS:
                got = c.complete(_prompt(n), **GREEDY)
                assert list(got.token_ids) == expected[n], f"prompt of {n} tokens"
            wait_pool_idle(c)
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(decode)


def _transfer(stub: pb_grpc.PrefillStub, n: int, **kw) -> tuple[list[pb.KVChunk], pb.PrefillDone]:  # type: ignore[no-untyped-def]
    req = pb.PrefillRequest(
        request_id=f"bytes-{n}", prompt=_prompt(n), send_window_history=True, layout=kv_layout(4), **kw
    )
    msgs = list(stub.Prefill(req, timeout=30))
    assert msgs[-1].HasField("done") and all(m.HasField("chunk") for m in msgs[:-1])
    return [m.chunk for m in msgs[:-1]], msgs[-1].done


def test_window_bytes_do_not_grow_with_the_prompt(prefill):
    info = PrefillInfo(prefill.target)
    try:
        (c2, d2), (c8, d8) = _transfer(info.stub, 2 * W), _transfer(info.stub, 8 * W)
        win = [sum(len(c.k) + len(c.v) for c in cs if c.window) for cs in (c2, c8)]
        assert win[0] == win[1] == d2.window_bytes == d8.window_bytes > 0
        assert d8.full_bytes == 4 * d2.full_bytes
        small, _ = _transfer(info.stub, 5 * W, max_chunk_bytes=1000)
        assert all(len(c.k) + len(c.v) <= 1000 for c in small)
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()


def test_handshake_mismatch_exits_naming_the_fields(prefill):
    decode = ServerProcess(
        random_spec(), "--page-size", "8", "--prefill-target", prefill.target, wait_ready=False
    )
    try:
        assert decode.wait(60) == 1
        log = decode.log()
        assert "refused the handshake" in log and "page_size: 8 != 4" in log, log[-2000:]
    finally:
        decode.kill()


def test_a_prefill_with_the_same_layout_but_other_weights_is_refused(prefill):
    # Same architecture, shapes, dtype and page size: only the random weights' seed differs. Its KV
    # would decode as garbage, so the handshake must tell them apart by the weights themselves.
    decode = ServerProcess(random_spec(seed=1), *COMMON, "--prefill-target", prefill.target, wait_ready=False)
    try:
        assert decode.wait(60) == 1
        log = decode.log()
        assert "refused the handshake" in log and "weights: '" in log, log[-2000:]
        assert "page_size" not in log.split("refused the handshake", 1)[1]
    finally:
        decode.kill()


def test_dead_or_hung_prefill_is_bypassed_and_the_pool_freed():
    """A prefill that does not answer within --prefill-timeout: decode computes the prompt itself (the
    client still gets its tokens), and keeps prefilling locally, without waiting on prefill again, until
    a Handshake answers."""
    pf = _prefill()
    port = int(pf.target.rsplit(":", 1)[1])
    decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", pf.target, "--prefill-timeout", "1.5")
    loaded = load_served_model(random_spec())
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    want = [r.output for r in engine.generate([_prompt(n) for n in (20, 21, 22)], SamplingParams(**GREEDY))]
    try:
        with Client(decode.target) as c:
            assert c.complete(_prompt(20), **GREEDY).finish_reason == "length"
            os.kill(pf.proc.pid, signal.SIGSTOP)  # hung mid-request: the decode must not wait forever
            assert list(c.complete(_prompt(20), **GREEDY).token_ids) == want[0]  # after 1.5 s, prefilled here
            wait_pool_idle(c)
            start = time.monotonic()  # remote prefill is off now: no 1.5 s wait
            assert list(c.complete(_prompt(20), **GREEDY).token_ids) == want[0]
            assert time.monotonic() - start < 1.5
            os.kill(pf.proc.pid, signal.SIGKILL)  # dead
            pf.wait(10)
            assert list(c.complete(_prompt(21), **GREEDY).token_ids) == want[1]
            wait_pool_idle(c)
            pf.kill()
            pf = _prefill(port=port)  # restarted on the same address: remote prefill resumes
            assert list(c.complete(_prompt(22), **GREEDY).token_ids) == want[2]
            wait_pool_idle(c)
        assert "re-handshaking" in decode.log()
    finally:
        stop_all(decode, pf)


def test_client_cancel_during_transfer_frees_both_pools():
    pf = _prefill()
    decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", pf.target, "--prefill-timeout", "20")
    info = PrefillInfo(pf.target)
    try:
        with Client(decode.target) as c:
            os.kill(pf.proc.pid, signal.SIGSTOP)  # the transfer cannot finish while we cancel
            stream = c.generate(_prompt(30), **GREEDY)
            got: list = []
            t = threading.Thread(target=lambda: got.extend(_safe(stream)), daemon=True)
            t.start()
            _until(lambda: c.model_info().kv_pool.pages_free < c.model_info().kv_pool.pages_total)
            stream.cancel()
            t.join(10)
            wait_pool_idle(c)  # the reservation is released at once
            os.kill(pf.proc.pid, signal.SIGCONT)
            wait_pool_idle(info)  # type: ignore[arg-type]
            assert c.complete(_prompt(30), **GREEDY).finish_reason == "length"
    finally:
        info.close()
        os.kill(pf.proc.pid, signal.SIGCONT)
        stop_all(decode, pf)


def test_a_decode_killed_mid_prefill_leaves_the_prefill_pool_idle():
    # Slow prefill steps (chunked at 4 tokens), so the request is still computing when decode dies.
    pf = ServerProcess(
        random_spec(), *COMMON, "--max-batch-tokens", "4", module="prefill_service", service=PREFILL,
        env={"PDSERVE_TEST_FAULTS": "step_delay:0.1"},
    )  # fmt: skip
    info = PrefillInfo(pf.target)
    decode = ServerProcess(
        random_spec(), *COMMON, "--prefill-target", pf.target, "--local-prefill-max-tokens", "0"
    )
    try:
        with Client(decode.target) as c:
            stream = c.generate(_prompt(400), **GREEDY)  # 100 steps of 0.1 s if nobody stopped it
            threading.Thread(target=lambda: _safe(stream), daemon=True).start()
            _until(lambda: info.model_info().kv_pool.pages_free < info.model_info().kv_pool.pages_total)
            os.kill(decode.proc.pid, signal.SIGKILL)  # its Prefill call dies with its connection
            decode.wait(10)
        wait_pool_idle(info, timeout=5)  # type: ignore[arg-type]  # freed on the cancel, not at the end
        decode.kill()
        decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", pf.target)
        with Client(decode.target) as c:  # the prefill service is as good as before
            assert c.complete(_prompt(12), **GREEDY).finish_reason == "length"
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(decode, pf)


def _safe(stream) -> list:  # type: ignore[no-untyped-def]
    try:
        return list(stream)
    except GenerationError:
        return []


def _until(pred, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_prefill_health_and_a_decode_that_waits_for_it_to_load():
    pf = ServerProcess(
        random_spec(load_delay_s=2), *COMMON, module="prefill_service", service=PREFILL, wait_ready=False
    )
    decode = None
    try:
        assert health_status(pf.target, "") == SERVING
        assert health_status(pf.target, PREFILL) == NOT_SERVING  # loading
        # The decode's start-up handshake waits for the prefill service to finish loading.
        decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", pf.target)
        assert health_status(pf.target, PREFILL) == SERVING
        with Client(decode.target) as c:
            assert c.complete(_prompt(20), **GREEDY).finish_reason == "length"
    finally:
        stop_all(*(p for p in (decode, pf) if p is not None))
    assert pf.proc.returncode == 0 and "pdserve prefill stopped" in pf.lines
