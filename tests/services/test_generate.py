"""Generate against a real decode server (subprocess, tiny random model): parity with the colocated
Engine, usage, stop conditions, and the server's model info."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import load_served_model
from tests.services.service_testutil import random_spec, wait_pool_idle

PROMPTS = [[5, 17, 33, 2, 90, 41, 8], list(range(10, 40)), [3]]


@pytest.fixture(scope="module")
def engine_outputs() -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of the colocated Engine on the server's model (same spec, same seed)."""
    loaded = load_served_model(random_spec())
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with torch.inference_mode():
        reqs = engine.generate(PROMPTS, params)
    return {tuple(p): r.output for p, r in zip(PROMPTS, reqs, strict=True)}


def test_greedy_stream_matches_engine(client: Client, engine_outputs: dict) -> None:
    for prompt in PROMPTS:
        stream = client.generate(prompt, max_tokens=40, temperature=0)
        chunks = list(stream)
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == engine_outputs[tuple(prompt)]
        assert all(c.token_ids or c.text for c in chunks)
        assert stream.finish_reason == "length"
        assert (stream.usage.prompt_tokens, stream.usage.completion_tokens) == (len(prompt), 40)
    wait_pool_idle(client)


def test_concurrent_streams_match_engine(client: Client, engine_outputs: dict) -> None:
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = list(client.complete(PROMPTS[i], max_tokens=40, temperature=0).token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i] for i in range(len(PROMPTS))] == [engine_outputs[tuple(p)] for p in PROMPTS]
    wait_pool_idle(client)


def test_text_prompt_usage_and_text(client: Client) -> None:
    tok = load_served_model(random_spec()).tokenizer
    assert tok is not None
    text, reason, usage, ids = client.complete("Hello, world", max_tokens=12, temperature=0)
    assert reason == "length"
    assert usage.prompt_tokens == len(tok.encode("Hello, world")) == 12
    assert usage.completion_tokens == len(ids) == 12
    assert text == tok.decode(ids)


def test_stop_token_ids(client: Client, engine_outputs: dict) -> None:
    full = engine_outputs[tuple(PROMPTS[1])]
    stop_id = full[6]
    cut = full.index(stop_id) + 1  # the stop token is returned and counted
    _, reason, usage, ids = client.complete(
        PROMPTS[1], max_tokens=40, temperature=0, stop_token_ids=[stop_id]
    )
    assert (reason, list(ids), usage.completion_tokens) == ("stop", full[:cut], cut)


def test_stop_string_truncates_text(client: Client, engine_outputs: dict) -> None:
    tok = load_served_model(random_spec()).tokenizer
    assert tok is not None
    full = engine_outputs[tuple(PROMPTS[0])]
    full_text = tok.decode(full)
    stop = full_text[9:12]  # three characters: a stop string spanning several tokens
    at = full_text.index(stop)
    n_tokens = next(n for n in range(1, len(full) + 1) if stop in tok.decode(full[:n]))
    text, reason, usage, ids = client.complete(PROMPTS[0], max_tokens=40, temperature=0, stop=["\x7f", stop])
    assert reason == "stop"
    assert text == full_text[:at]
    assert list(ids) == full[:n_tokens] and usage.completion_tokens == n_tokens
    wait_pool_idle(client)


def test_stop_string_held_back_not_lost(client: Client, engine_outputs: dict) -> None:
    """A stop string that never matches: held-back text still arrives in full at the end."""
    tok = load_served_model(random_spec()).tokenizer
    assert tok is not None
    full = engine_outputs[tuple(PROMPTS[2])]
    text, reason, _, _ = client.complete(PROMPTS[2], max_tokens=40, temperature=0, stop=["\x7f" * 5])
    assert (text, reason) == (tok.decode(full), "length")


def test_seeded_sampling_is_reproducible(client: Client) -> None:
    a = client.complete(PROMPTS[0], max_tokens=20, temperature=0.9, top_k=20, seed=1234)
    b = client.complete(PROMPTS[0], max_tokens=20, temperature=0.9, top_k=20, seed=1234)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_default_max_tokens(client: Client) -> None:
    assert client.complete([1, 2, 3], temperature=0).usage.completion_tokens == 16
    info = client.model_info()
    # Near the end of the context the default is lowered to the room left rather than refused.
    near_full = [7] * (info.max_context - 5)
    assert client.complete(near_full, temperature=0).usage.completion_tokens == 5


def test_model_info(client: Client) -> None:
    info = client.model_info()
    assert (info.model_name, info.vocab_size, info.max_context) == ("random", 97, 512)
    assert list(info.layer_types) == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert (info.sliding_window, info.page_size, info.dtype, info.has_tokenizer) == (8, 4, "float32", True)
    assert info.kv_pool.pages_total == 512 and info.kv_pool.window_slots_total == 4
    assert info.quantization == "none"  # --quantization auto on an unquantized checkpoint
