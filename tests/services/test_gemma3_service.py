"""A real sliding-window checkpoint served disaggregated: Gemma 3 270M (Q4_K_M GGUF, W = 512, five
local layers to one global) in a prefill and a decode process on loopback, every prompt prefilled
remotely. Prompts longer than the window decode to the tokens of a colocated Engine; a second turn
reads its prefix (and the sliding layers' window at it) from the prefix cache; the sliding layers ship
W tokens whatever the prompt's length; GetModelInfo reports the layout; chat requests use Gemma's
template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2

from decode_service.servicer import SERVICE_NAME as DECODE
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.model import FULL, SLIDING, LoadedModel
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.serving.api.model_source import load_served_model
from tests.model.model_testutil import gemma3_gguf_or_skip
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    layout_of,
    stop_all,
    wait_health,
    wait_pool_idle,
)

pytestmark = pytest.mark.slow

PAGE, PAGES, W = 16, 160, 512
COMMON = ("--dtype", "float32", "--page-size", str(PAGE), "--num-pages", str(PAGES), "--max-running", "2")
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# Three processes load 1 GB of float32 weights at once, on a CPU shared with other tests.
LOAD_S = 300
TEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100))


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_gguf_or_skip()


@pytest.fixture(scope="module")
def services(gemma_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    model = str(gemma_path)
    prefill = ServerProcess(model, *COMMON, module="prefill_service", service=PREFILL, wait_ready=False)
    remote = ("--prefill-target", prefill.target, "--local-prefill-max-tokens", "0")  # every prompt
    decode = ServerProcess(model, *COMMON, *remote, wait_ready=False)
    try:
        yield prefill, decode
    finally:
        stop_all(decode, prefill)


@pytest.fixture(scope="module")
def gemma(gemma_path: Path, services: tuple[ServerProcess, ServerProcess]) -> LoadedModel:
    """The same checkpoint in this process (loaded while the services load theirs), once they serve."""
    loaded = load_served_model(str(gemma_path), dtype=torch.float32)
    for proc, service in zip(services, (PREFILL, DECODE), strict=True):
        try:
            wait_health(proc.target, service, health_pb2.HealthCheckResponse.SERVING, timeout=LOAD_S)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; its log ends:\n{proc.log()[-3000:]}") from e
    return loaded


def colocated(gemma: LoadedModel, prompts: list[list[int]], **sampling: object) -> list[list[int]]:
    engine = Engine(gemma.model, KVConfig(page_size=PAGE, num_pages=PAGES, max_requests=2), EngineConfig())
    params = SamplingParams(**{**GREEDY, **sampling})  # type: ignore[arg-type]
    return [engine.generate([p], params)[0].output for p in prompts]


def test_model_info_reports_the_layout(gemma, services) -> None:
    prefill, decode = services
    info = PrefillInfo(prefill.target)
    try:
        with Client(decode.target) as c:
            for got in (c.model_info(), info.model_info()):
                assert got.model_name == "gemma-3-270m" and got.vocab_size == 262144
                assert list(got.layer_types) == [*([SLIDING] * 5 + [FULL])] * 3
                assert got.sliding_window == W and got.dtype == "float32" and got.has_chat_template
    finally:
        info.close()


def test_prompts_longer_than_the_window_decode_as_colocated(gemma, services) -> None:
    """Remote prefill with the window history shipped; then a second turn whose prompt starts with the
    first: both services read that prefix from their prefix cache (the sliding layers' window at it
    from a snapshot or a bounded replay), and the tokens still equal the colocated Engine's."""
    _, decode = services
    # Past the window (its 36 whole pages cached), ending at "Line 39": the text goes on ": the quick
    # brown fox".
    first = gemma.tokenizer.encode(TEXT)[: W + 68]
    second = [*first, *gemma.tokenizer.encode(" And then?", add_special_tokens=False)]
    want = colocated(gemma, [first, second])
    with Client(decode.target) as c:
        a = c.complete(first, **GREEDY)
        b = c.complete(second, **GREEDY)
        assert [list(a.token_ids), list(b.token_ids)] == want
        assert b.usage.cached_prompt_tokens >= W, b.usage
        wait_pool_idle(c)
    assert "the quick brown fox" in gemma.tokenizer.decode(want[0])  # text, not noise


def _transfer(info: PrefillInfo, layout: pb.KVLayout, prompt: list[int]) -> tuple[int, pb.PrefillDone]:
    req = pb.PrefillRequest(
        request_id=f"bytes-{len(prompt)}", prompt=prompt, send_window_history=True, layout=layout
    )
    msgs = list(info.stub.Prefill(req, timeout=120))
    assert msgs[-1].HasField("done") and all(m.HasField("chunk") for m in msgs[:-1])
    window = sum(len(m.chunk.k) + len(m.chunk.v) for m in msgs[:-1] if m.chunk.window)
    return window, msgs[-1].done


def test_the_sliding_layers_ship_w_tokens_whatever_the_prompt_length(gemma, services) -> None:
    prefill, _ = services
    info = PrefillInfo(prefill.target)
    layout = layout_of(gemma, PAGE)
    ids = gemma.tokenizer.encode(TEXT)
    try:
        n = W + PAGE  # past the window, and twice that
        (w1, short), (w2, long) = (_transfer(info, layout, ids[:k]) for k in (n, 2 * n))
        cfg = gemma.config
        per_token = cfg.num_kv_heads * cfg.head_dim * 2 * 4  # K and V, float32
        assert w1 == w2 == short.window_bytes == long.window_bytes == len(cfg.sliding_layers) * W * per_token
        assert short.full_bytes == len(cfg.full_layers) * n * per_token
        assert long.full_bytes == 2 * short.full_bytes
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()


def test_a_chat_request_renders_gemmas_template(gemma, services) -> None:
    _, decode = services
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [want] = colocated(gemma, [gemma.tokenizer.encode_chat(messages)])
    with Client(decode.target) as c:
        got = c.complete(messages=messages, max_tokens=8, temperature=0.0)
        wait_pool_idle(c)
    # The reply may end at <end_of_turn> (or <eos>) before 8 tokens; up to there it is the Engine's.
    assert list(got.token_ids) == want[: len(got.token_ids)] and got.token_ids
    assert got.finish_reason == "length" or got.token_ids[-1] in (1, 106) or got.finish_reason == "stop"
