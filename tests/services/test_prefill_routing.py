"""Where decode prefills a prompt, with real processes: every Prefill carries decode's KV layout and a
prefill service with another layout refuses it before any work; decode then prefills that request
locally (same greedy tokens), stays local while the layouts differ and goes remote again once a
matching prefill is back. A deep prefill queue sends prompts to local prefill (reason queue_deep). The
route and its reason are on the request span and in pdserve_prefill_route_total; both pools end idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from decode_service.prefill_client import PrefillClient
from decode_service.routing import PrefillRouter, QueueEstimate
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.serving.api.model_source import load_served_model
from shared.transfer.base import KVLayout
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)
from tests.telemetry.telemetry_testutil import Span, metrics_url, sample, scrape, wait_spans

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
COMMON = ("--page-size", "4", "--max-running", "8")
GENERATE = "pdserve.v1.Generation/Generate"
SLOW = {"PDSERVE_TEST_FAULTS": "step_delay:0.3"}  # every prefill engine step takes 0.3 s more


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + n + salt) % 97 for i in range(n)]


def _expected(prompts: list[list[int]]) -> list[list[int]]:
    loaded = load_served_model(random_spec())
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=8), EngineConfig())
    return [r.output for r in engine.generate(prompts, SamplingParams(**GREEDY))]


def _prefill(*args: str, port: int = 0, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        random_spec(), *COMMON, *args, module="prefill_service", service=PREFILL, port=port, env=env
    )


def _decode(prefill: ServerProcess, spans: Path, *args: str) -> ServerProcess:
    env = {"PDSERVE_TEST_SPAN_FILE": str(spans)}
    return ServerProcess(random_spec(), *COMMON, "--prefill-target", prefill.target, *args, env=env)


def _route(spans: Path, rid: str) -> tuple[str, str]:
    """(pdserve.prefill, pdserve.prefill.reason) of request `rid`'s Generate span."""

    def find(all_spans: list[Span]) -> Span | None:
        return next(
            (s for s in all_spans if s["name"] == GENERATE and s["attributes"]["gen_ai.response.id"] == rid),
            None,
        )

    span = find(wait_spans(spans, lambda ss: find(ss) is not None))
    assert span is not None, f"no Generate span for {rid}"
    return span["attributes"]["pdserve.prefill"], span["attributes"]["pdserve.prefill.reason"]


def _until(pred: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_a_prefill_with_another_layout_refuses_before_any_work() -> None:
    pf = _prefill()
    info = PrefillInfo(pf.target)
    try:
        for layout, want in ((kv_layout(8), "page_size: 8 != 4"), (None, "layout: missing")):
            req = pb.PrefillRequest(request_id="x", prompt=_prompt(9), layout=layout)
            with pytest.raises(grpc.RpcError) as exc:
                list(info.stub.Prefill(req, timeout=10))
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert want in exc.value.details()
        assert info.model_info().kv_pool.running == 0  # nothing was submitted
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(pf)


def test_a_prefill_restarted_with_another_layout_is_bypassed_until_one_matches_again(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    prompts = [_prompt(20, salt) for salt in range(4)]
    expected = _expected(prompts)
    pf = _prefill()
    port = pf.target.rsplit(":", 1)[1]
    decode = _decode(pf, spans)
    url = metrics_url(decode)
    try:
        with Client(decode.target) as c:

            def run(i: int) -> tuple[str, str]:
                got = c.complete(prompts[i], request_id=f"r{i}", **GREEDY)
                assert list(got.token_ids) == expected[i], f"request {i}"
                return _route(spans, f"r{i}")

            assert run(0) == ("remote", "remote")
            stop_all(pf)
            pf = _prefill("--page-size", "8", port=int(port))  # another layout on the same address
            # Refused before any work: prefilled here, same tokens, and the client never knew.
            assert run(1) == ("local", "prefill_mismatch")
            m = scrape(url)
            assert sample(m, "pdserve_prefill_layout_refusals_total") == 1
            assert sample(m, "pdserve_remote_prefill_usable") == 0
            # While the layouts differ the prefill service is not asked at all.
            assert run(2) == ("local", "prefill_mismatch")
            assert sample(scrape(url), "pdserve_prefill_layout_refusals_total") == 1
            assert decode.log().count("refused this decode's KV layout") == 1  # logged once, in clear
            assert "page_size: 4 != 8" in decode.log()
            stop_all(pf)
            pf = _prefill(port=int(port))  # a matching prefill again
            _until(lambda: sample(scrape(url), "pdserve_remote_prefill_usable") == 1)
            assert run(3) == ("remote", "remote")
            m = scrape(url)
            assert sample(m, "pdserve_prefill_route_total", prefill="local", reason="prefill_mismatch") == 2
            assert sample(m, "pdserve_prefill_route_total", prefill="remote", reason="remote") == 2
            wait_pool_idle(c)
        info = PrefillInfo(pf.target)
        wait_pool_idle(info)  # type: ignore[arg-type]
        info.close()
    finally:
        stop_all(decode, pf)


def test_prefill_done_reports_the_prompt_tokens_still_queued() -> None:
    pf = _prefill("--max-batch-tokens", "16", env=SLOW)  # 40-token prompts take several steps each
    info = PrefillInfo(pf.target)
    dones: list[tuple[float, int]] = []
    layout = kv_layout(4)  # once: random weights drawn in three threads at once would differ

    def call(i: int) -> None:
        req = pb.PrefillRequest(request_id=f"q{i}", prompt=_prompt(40, i), layout=layout)
        *_, last = info.stub.Prefill(req, timeout=60)
        dones.append((time.monotonic(), last.done.queued_prompt_tokens))

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        reports = [q for _, q in sorted(dones)]
        assert len(reports) == 3 and reports[0] > 0 and reports[-1] == 0, reports
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(pf)


def test_a_deep_prefill_queue_sends_prompts_to_local_prefill(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    n, burst = 20, 6
    prompts = [_prompt(n, salt) for salt in range(burst)]
    expected = _expected(prompts)
    pf = _prefill("--max-batch-tokens", "16", env=SLOW)
    decode = _decode(pf, spans, "--remote-prefill-max-queued-tokens", str(2 * n))
    got: dict[int, list[int]] = {}
    try:
        with Client(decode.target) as c:

            def call(i: int) -> None:
                got[i] = list(c.complete(prompts[i], request_id=f"b{i}", **GREEDY).token_ids)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(burst)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert got == dict(enumerate(expected))
            routes = [_route(spans, f"b{i}") for i in range(burst)]
            assert ("local", "queue_deep") in routes and ("remote", "remote") in routes, routes
            m = scrape(metrics_url(decode))
            assert sample(m, "pdserve_prefill_route_total", reason="queue_deep") == routes.count(
                ("local", "queue_deep")
            )
            wait_pool_idle(c)
        info = PrefillInfo(pf.target)
        wait_pool_idle(info)  # type: ignore[arg-type]
        info.close()
    finally:
        stop_all(decode, pf)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_queue_estimate_is_own_calls_plus_the_last_fresh_report() -> None:
    clock = _Clock()
    q = QueueEstimate(ttl_s=2.0, clock=clock)
    a, b = q.add(100), q.add(50)
    assert q.value() == 150  # a burst counts before any reply
    q.done(a, reported=400)  # others queued there too; b was sent before the report: counted in it
    assert q.value() == 400
    q.add(30)  # sent after the report: on top of it
    assert q.value() == 430
    clock.now = 2.5  # the report is stale: only own calls in flight count
    assert q.value() == 80
    q.done(b)
    q.done(b)  # idempotent
    assert q.value() == 30


def test_router_reasons() -> None:
    assert PrefillRouter(None).route(5).reason == "no_prefill"
    client = PrefillClient("127.0.0.1:1", 1.0, KVLayout.from_pb(kv_layout(4)))  # never called here
    router = PrefillRouter(client, local_max_tokens=8, max_queued_tokens=100)
    assert router.route(8).reason == "short_prompt"
    first = router.route(150)  # longer than the limit, but nothing is queued: remote
    assert (first.remote, first.reason) == (True, "remote")
    assert router.route(20).reason == "queue_deep"
    router.done(first)
    assert router.route(20).remote
    router.usable = False
    assert router.route(20).reason == "prefill_mismatch"
