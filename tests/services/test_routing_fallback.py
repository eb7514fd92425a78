"""A busy prefill service does not fail decode's requests: decode measures how fast prefill drains its
queue, keeps prompts here while the queue would take more than half the prefill timeout (the `auto`
queue limit; one prompt at a time until a first call has been measured), and gives each remote call
the prefill timeout on top of the time its queue is expected to take. Units for the rate, the limit and the
deadline; then real processes: a slow prefill under a burst, every request answered with the right
tokens, both pools idle after."""

from __future__ import annotations

import threading
from pathlib import Path

from decode_service.config import parse_args
from decode_service.prefill_client import DrainRate, PrefillClient, PrefillTimedOut
from decode_service.routing import PrefillRouter
from shared.client.client import Client, GenerationError
from shared.transfer.base import KVLayout
from tests.services.service_testutil import PrefillInfo, kv_layout, stop_all, wait_pool_idle
from tests.services.test_prefill_routing import GREEDY, _decode, _expected, _prefill, _prompt, _route
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape


def _client(timeout: float = 10.0) -> PrefillClient:
    return PrefillClient("127.0.0.1:1", timeout, KVLayout.from_pb(kv_layout(4)))  # never called here


def test_drain_rate_is_a_weighted_mean_of_calls() -> None:
    r = DrainRate()
    assert r.tokens_per_s == 0 and r.seconds(1000) == 0  # unknown: no allowance
    r.observe(1000, 2.0)  # the first call sets it
    assert r.tokens_per_s == 500 and r.seconds(1000) == 2.0
    r.observe(100, 1.0)  # a slow call moves it part of the way
    assert 300 < r.tokens_per_s < 500
    r.observe(0, 1.0)
    r.observe(10, 0.0)  # nothing to learn from either
    assert 300 < r.tokens_per_s < 500


def test_the_auto_queue_limit_is_what_prefill_drains_in_half_the_timeout() -> None:
    client = _client(timeout=10.0)
    router = PrefillRouter(client, max_queued_tokens=None)
    assert router.queue_limit() == 1  # nothing measured yet: one prompt at a time
    first = router.route(1000)  # an empty queue takes any prompt
    assert first.remote
    assert router.route(1).reason == "queue_deep"
    router.done(first)
    client.rate.observe(4000, 2.0)  # 2000 tokens/s: 10 s / 2 drains 10000 tokens
    assert router.queue_limit() == 10000
    a, b = router.route(6000), router.route(3000)
    assert a.remote and b.remote and router.route(2000).reason == "queue_deep"
    assert PrefillRouter(client, max_queued_tokens=0).queue_limit() == 0  # 0: no limit
    assert PrefillRouter(client, max_queued_tokens=77).queue_limit() == 77


def test_a_call_may_take_the_timeout_past_its_queue() -> None:
    client = _client(timeout=10.0)
    router = PrefillRouter(client, max_queued_tokens=None)
    assert client.call_timeout(None) == 10.0  # no rate yet: the timeout alone
    client.rate.observe(1000, 1.0)
    router.route(3000)  # the call's own prompt counts from its routing decision
    assert client.call_timeout(None) == 13.0
    assert client.call_timeout(5.0) == 5.0  # the client's deadline, if sooner
    assert issubclass(PrefillTimedOut, Exception)


def test_the_queue_limit_flag() -> None:
    assert parse_args([], env={}).queue_limit is None  # auto
    assert parse_args(["--remote-prefill-max-queued-tokens", "0"], env={}).queue_limit == 0
    assert parse_args([], env={"PDSERVE_REMOTE_PREFILL_MAX_QUEUED_TOKENS": "512"}).queue_limit == 512
    for bad in ("-1", "lots"):
        try:
            parse_args(["--remote-prefill-max-queued-tokens", bad], env={})
        except ValueError as e:
            assert "auto or a number" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_a_burst_against_a_slow_prefill_completes_without_errors(tmp_path: Path) -> None:
    """Prefill: 0.3 s per step of 16 tokens, so a 40-token prompt takes ~1 s and a burst of 8 would
    queue ~6 s there. Decode gives a remote prefill 4 s past its expected time. With the auto limit
    the first prompt goes remote (cold start: one at a time) and the rest stay here until the queue has
    room; nothing times out. (With --remote-prefill-max-queued-tokens 0, the old default, all
    eight go remote and most fail UNAVAILABLE after 4 s.)"""
    spans = tmp_path / "spans.jsonl"
    burst = 8
    prompts = [_prompt(40, salt) for salt in range(burst)]
    expected = _expected(prompts)
    pf = _prefill("--max-batch-tokens", "16", env={"PDSERVE_TEST_FAULTS": "step_delay:0.3"})
    decode = _decode(pf, spans, "--max-batch-tokens", "16", "--prefill-timeout", "4")
    got: dict[int, list[int]] = {}
    errors: list[str] = []
    try:
        with Client(decode.target) as c:

            def call(i: int) -> None:
                try:
                    got[i] = list(c.complete(prompts[i], request_id=f"b{i}", **GREEDY).token_ids)
                except GenerationError as e:
                    errors.append(f"b{i}: {e}")

            threads = [threading.Thread(target=call, args=(i,)) for i in range(burst)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            routes = [_route(spans, f"b{i}") for i in range(burst)]
            assert not errors and got == dict(enumerate(expected)), (errors, routes)
            assert ("remote", "remote") in routes and ("local", "queue_deep") in routes, routes
            m = scrape(metrics_url(decode))
            assert sample(m, "pdserve_prefill_queue_limit_tokens") > 0
            wait_pool_idle(c)
        info = PrefillInfo(pf.target)
        wait_pool_idle(info)  # type: ignore[arg-type]
        info.close()
    finally:
        stop_all(decode, pf)
