"""A prefill service that cannot take a request makes decode prefill it, never fail it: a prompt longer
than prefill's context (INVALID_ARGUMENT there) and a full prefill queue (RESOURCE_EXHAUSTED there)
both complete, each counted under its own route reason, and both pools end idle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from tests.services.service_testutil import PrefillInfo, ServerProcess, random_spec, stop_all, wait_pool_idle
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def test_a_prompt_prefill_cannot_take_and_a_full_prefill_queue_are_prefilled_by_decode() -> None:
    # Prefill: a 32-token context (8 pages of 4), one request at a time, no queue, slow steps.
    prefill = ServerProcess(
        random_spec(), "--no-metrics", "--page-size", "4", "--num-pages", "8", "--max-running", "1",
        "--max-queue", "0", module="prefill_service", service=PREFILL,
        env={"PDSERVE_TEST_FAULTS": "step_delay:0.3"},
    )  # fmt: skip
    decode = ServerProcess(
        random_spec(), "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--page-size", "4",
        "--num-pages", "256", "--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
        "--remote-prefill-max-queued-tokens", "0",
    )  # fmt: skip
    info = PrefillInfo(prefill.target)
    try:
        url = metrics_url(decode)
        with Client(decode.target) as c:
            long = c.complete(list(range(1, 61)), **GREEDY)  # 60 tokens: over prefill's 32
            assert len(long.token_ids) == 4
            with ThreadPoolExecutor(3) as pool:
                done = list(pool.map(lambda i: c.complete([i, 2, 3, 4], **GREEDY), range(1, 4)))
            assert all(len(d.token_ids) == 4 for d in done)
            wait_pool_idle(c)
        wait_pool_idle(info)  # type: ignore[arg-type]
        samples = scrape(url)
        route = "pdserve_prefill_route_total"
        assert sample(samples, route, prefill="local", reason="prefill_rejected") == 1
        assert sample(samples, route, prefill="local", reason="prefill_busy") >= 1
        assert sample(samples, route, prefill="remote", reason="remote") >= 1
        assert sample(samples, "pdserve_requests_total", finish_reason="length") == 4
    finally:
        info.close()
        stop_all(decode, prefill)
