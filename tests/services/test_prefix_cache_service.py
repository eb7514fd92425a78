"""The prefix cache behind a real decode process, full-attention and hybrid (sliding-window) models: on
by default, the same greedy tokens as a decode started with --no-prefix-cache, Usage counting the
prompt tokens read from the cache, GetModelInfo the pages it keeps (an idle pool: free + cached =
total), and /metrics the tokens looked up and found."""

from __future__ import annotations

import pytest

from shared.client.client import Client
from tests.services.service_testutil import ServerProcess, random_spec, stop_all, wait_pool_idle
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SYSTEM = list(range(3, 43))  # a shared prefix: 10 pages of 4, longer than the window (8)


@pytest.mark.parametrize("layers", ["FFFF", "SSFS"])
def test_prompts_sharing_a_prefix_get_the_tokens_they_get_without_the_cache(layers: str) -> None:
    spec = random_spec(layers=layers)
    cached = ServerProcess(spec, "--metrics-port", "0", "--page-size", "4")
    plain = ServerProcess(spec, "--no-metrics", "--page-size", "4", "--no-prefix-cache")
    try:
        prompts = [[*SYSTEM, 50 + i] for i in range(4)] + [SYSTEM[:21], [*SYSTEM, 50, 60]]
        with Client(cached.target) as c, Client(plain.target) as p:
            cached_tokens = []
            for prompt in prompts:
                done = c.complete(prompt, **GREEDY)
                assert done.token_ids == p.complete(prompt, **GREEDY).token_ids
                cached_tokens.append(done.usage.cached_prompt_tokens)
            # Usage says what was read from the cache: nothing at first, then the shared 10 pages. The
            # 21-token prompt reads its 5 whole pages (full attention), or nothing with sliding layers:
            # no window was kept at 20 (the prompts so far ended, and diverged, at 40).
            assert cached_tokens == [0, 40, 40, 40, 20 if layers == "FFFF" else 0, 40]
            wait_pool_idle(c)
            wait_pool_idle(p)
            assert c.model_info().kv_pool.pages_cached >= 10
            assert p.model_info().kv_pool.pages_cached == 0
            metrics = scrape(metrics_url(cached))
            assert sample(metrics, "pdserve_prefix_cache_queried_tokens_total") == sum(map(len, prompts))
            assert sample(metrics, "pdserve_prefix_cache_hit_tokens_total") == sum(cached_tokens)
    finally:
        stop_all(cached, plain)
