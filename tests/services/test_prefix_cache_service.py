"""The prefix cache behind a real decode process (a full-attention random model): on by default, the
same greedy tokens as a decode started with --no-prefix-cache, Usage counting the prompt tokens read
from the cache, and GetModelInfo the pages it keeps (an idle pool: free + cached = total)."""

from __future__ import annotations

import pytest

from shared.client.client import Client
from tests.services.service_testutil import ServerProcess, random_spec, stop_all, wait_pool_idle

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SYSTEM = list(range(3, 43))  # a shared prefix: 10 pages of 4


def test_prompts_sharing_a_prefix_get_the_tokens_they_get_without_the_cache() -> None:
    spec = random_spec(layers="FFFF")
    cached = ServerProcess(spec, "--no-metrics", "--page-size", "4")
    plain = ServerProcess(spec, "--no-metrics", "--page-size", "4", "--no-prefix-cache")
    try:
        prompts = [[*SYSTEM, 50 + i] for i in range(4)] + [SYSTEM[:21], [*SYSTEM, 50, 60]]
        with Client(cached.target) as c, Client(plain.target) as p:
            cached_tokens = []
            for prompt in prompts:
                done = c.complete(prompt, **GREEDY)
                assert done.token_ids == p.complete(prompt, **GREEDY).token_ids
                cached_tokens.append(done.usage.cached_prompt_tokens)
            # Usage says what was read from the cache: nothing at first, then the shared 10 pages (the
            # 21-token prompt: its 5 whole pages).
            assert cached_tokens == [0, 40, 40, 40, 20, 40]
            wait_pool_idle(c)
            wait_pool_idle(p)
            assert c.model_info().kv_pool.pages_cached >= 10
            assert p.model_info().kv_pool.pages_cached == 0
    finally:
        stop_all(cached, plain)
