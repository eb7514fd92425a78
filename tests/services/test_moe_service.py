"""A gpt-oss-like mixture-of-experts model with attention sinks (`random:` with experts and sinks)
through real processes: a prefill and a decode service generate the colocated Engine's greedy tokens
on the remote and the local path, and GetModelInfo reports the architecture's layout."""

from __future__ import annotations

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import load_served_model
from tests.services.service_testutil import ServerProcess, random_spec, stop_all, wait_pool_idle

MOE = {"layers": "SFSF", "experts": 4, "top_k": 2, "expert_intermediate": 48, "sinks": True,
       "gpt_oss_experts": True}  # fmt: skip
COMMON = ("--page-size", "4", "--max-running", "4")
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[(5 * i + n) % 97 for i in range(n)] for n in (3, 17)]


def test_moe_services_generate_the_engines_tokens_and_report_the_layout() -> None:
    loaded = load_served_model(random_spec(**MOE))
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    expected = [r.output for r in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    prefill = ServerProcess(random_spec(**MOE), *COMMON, module="prefill_service", service=PREFILL)
    decode = ServerProcess(random_spec(**MOE), *COMMON, "--prefill-target", prefill.target,
                           "--local-prefill-max-tokens", "8")  # fmt: skip
    try:
        with Client(decode.target) as c:
            info = c.model_info()
            assert (info.num_experts, info.experts_per_token, list(info.moe_layers)) == (4, 2, [0, 1, 2, 3])
            assert info.attention_sinks and info.architecture == "random"
            for prompt, want in zip(PROMPTS, expected, strict=True):  # 3 tokens local, 17 remote
                assert list(c.complete(prompt, **GREEDY).token_ids) == want, len(prompt)
            wait_pool_idle(c)
    finally:
        stop_all(decode, prefill)
