"""`--quantization fp8` through real processes (tiny random model, CPU reference kernels): a prefill and
a decode service both serving FP8 weights generate the colocated FP8 Engine's greedy tokens on the
remote and the local path, GetModelInfo says the quantization, and a decode serving the same
checkpoint unquantized is refused at the handshake, which names the weights' quantization."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.model.quant import quantize_head
from shared.serving.api.model_source import load_served_model
from tests.services.service_testutil import ServerProcess, random_spec, stop_all, wait_pool_idle

COMMON = ("--page-size", "4", "--max-running", "4")
FP8 = ("--quantization", "fp8")
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[(7 * i + n) % 97 for i in range(n)] for n in (3, 9, 25)]


@pytest.fixture(scope="module")
def prefill() -> Iterator[ServerProcess]:
    p = ServerProcess(random_spec(), *COMMON, *FP8, module="prefill_service", service=PREFILL)
    yield p
    stop_all(p)


def test_fp8_services_generate_the_fp8_engines_tokens(prefill: ServerProcess) -> None:
    loaded = load_served_model(random_spec(), quantization="fp8")
    assert loaded.model.quantization == "fp8"
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    expected = [r.output for r in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    unquantized = load_served_model(random_spec())
    plain = Engine(unquantized.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    assert expected != [r.output for r in plain.generate(PROMPTS, SamplingParams(**GREEDY))]  # FP8 it is
    for local in ("0", "1000"):  # every prompt remote, every prompt local
        flags = ("--local-prefill-max-tokens", local)
        decode = ServerProcess(random_spec(), *COMMON, *FP8, "--prefill-target", prefill.target, *flags)
        try:
            with Client(decode.target) as c:
                assert c.model_info().quantization == "fp8"
                for prompt, want in zip(PROMPTS, expected, strict=True):
                    assert list(c.complete(prompt, **GREEDY).token_ids) == want, (flags, len(prompt))
                wait_pool_idle(c)
        finally:
            stop_all(decode)


def test_an_fp8_lm_head_serves_its_own_tokens_and_a_prefill_without_it_refuses_it(
    prefill: ServerProcess,
) -> None:
    """--quantize-lm-head: the decode service generates what the engine over FP8 weights and head
    generates; a prefill whose head is not FP8 holds other weights, and says so at the handshake."""
    loaded = load_served_model(random_spec(), quantization="fp8")
    engine = Engine(
        quantize_head(loaded.model), KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig()
    )
    expected = [r.output for r in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    alone = ServerProcess(random_spec(), *COMMON, *FP8, "--quantize-lm-head")
    refused = ServerProcess(random_spec(), *COMMON, *FP8, "--quantize-lm-head", "--prefill-target",
                            prefill.target, wait_ready=False)  # fmt: skip
    try:
        with Client(alone.target) as c:
            assert [list(c.complete(p, **GREEDY).token_ids) for p in PROMPTS] == expected
        assert refused.wait(60) == 1
        assert "refused the handshake" in refused.log() and "weights: '" in refused.log(), refused.log()[
            -2000:
        ]
    finally:
        refused.kill()
        stop_all(alone)


def test_an_unquantized_decode_is_refused_by_an_fp8_prefill(prefill: ServerProcess) -> None:
    decode = ServerProcess(random_spec(), *COMMON, "--prefill-target", prefill.target, wait_ready=False)
    try:
        assert decode.wait(60) == 1
        log = decode.log()
        assert "refused the handshake" in log and "weights: '" in log and "'fp8:" in log, log[-2000:]
    finally:
        decode.kill()
