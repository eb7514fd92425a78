"""The front's edge against real processes: API key, body bound, client disconnects that free decode's
KV, trace context carried to decode, its own /metrics, and the raw SSE framing."""

from __future__ import annotations

import http.client
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from shared.client.client import Client
from tests.openai.openai_testutil import FrontProcess
from tests.services.service_testutil import ServerProcess, wait_pool_idle
from tests.telemetry.telemetry_testutil import sample, scrape, wait_spans

pytestmark = pytest.mark.slow  # a real decode service on the embedded model (CPU)

KEY = "sk-test-" + "k" * 24
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}  # runs for many seconds on a CPU


@pytest.fixture(scope="module")
def keyed(decode: ServerProcess) -> Iterator[FrontProcess]:
    proc = FrontProcess(decode.target, "--max-body-bytes", "2048", env={"PDSERVE_API_KEY": KEY})
    try:
        yield proc
        code, log = proc.stop()
        assert code == 0, log
    finally:
        proc.kill()


def post(url: str, path: str, body: bytes, headers: dict, chunked: bool = False) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        if chunked:  # no Content-Length: the bound must hold while the body is read
            conn.request("POST", path, iter([body[i : i + 512] for i in range(0, len(body), 512)]),
                         headers, encode_chunked=True)  # fmt: skip
        else:
            conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_api_key_is_required_when_set(keyed: FrontProcess) -> None:
    for key in ("wrong", KEY[:-1], ""):
        with (
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key or "x", max_retries=0) as bad,
            pytest.raises(openai.AuthenticationError) as info,
        ):
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    status, _ = post(keyed.url, "/v1/models", b"", {})  # no Authorization header at all
    assert status == 401
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0) as good:
        assert good.models.list().data
    status, _ = post(keyed.url, "/v1/completions", b"{}", {"Authorization": f"bearer {KEY}"})
    assert status == 400  # past the key (the scheme is case-insensitive), refused for its body


def test_request_body_is_bounded(keyed: FrontProcess) -> None:
    body = json.dumps({"prompt": "x" * 4096, "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for chunked in (False, True):
        status, raw = post(keyed.url, "/v1/completions", body, auth, chunked=chunked)
        assert status == 413, raw
        assert "exceeds 2048 bytes" in json.loads(raw)["error"]["message"]
    status, _ = post(keyed.url, "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 401  # the key is checked before the body is read


def test_stream_closed_midway_aborts_the_request(oai: openai.OpenAI, decode_client: Client) -> None:
    stream = oai.completions.create(model="", prompt="Tell me a story.", stream=True, temperature=0, **LONG)  # type: ignore[arg-type]
    it = iter(stream)
    next(it)
    next(it)
    assert decode_client.model_info().kv_pool.running == 1
    stream.close()
    wait_pool_idle(decode_client, timeout=5)  # 400 tokens would take far longer: it was aborted


def test_server_abort_mid_stream_is_an_error_event(oai: openai.OpenAI, decode_client: Client) -> None:
    stream = oai.completions.create(model="", prompt="Tell me a story.", stream=True, temperature=0, **LONG)  # type: ignore[arg-type]
    it = iter(stream)
    first = next(it)
    assert decode_client.abort(first.id)  # the front names the gRPC request after its response id
    with pytest.raises(openai.APIError, match="aborted"):
        list(it)
    wait_pool_idle(decode_client, timeout=5)


def test_whole_answer_abandoned_aborts_the_request(front: FrontProcess, decode_client: Client) -> None:
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0, timeout=1.5) as impatient:
        messages = [{"role": "user", "content": "Tell me a story."}]
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="", messages=messages, **LONG)  # type: ignore[arg-type]
    wait_pool_idle(decode_client, timeout=5)


def test_traceparent_reaches_decode_and_sse_framing(front: FrontProcess, spans_path: Path) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent}-01"}
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "stream": True}
    status, raw = post(front.url, "/v1/completions", json.dumps(body).encode(), headers)
    assert status == 200
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"

    def joined(spans: list[dict]) -> bool:
        return any(s["trace_id"] == trace_id and s["parent_id"] == parent for s in spans)

    assert joined(wait_spans(spans_path, joined)), "decode's request span did not join the caller's trace"


def test_metrics(front: FrontProcess, oai: openai.OpenAI) -> None:
    oai.completions.create(model="", prompt="Hi", max_tokens=1, stream=True).close()
    oai.completions.create(model="", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="", prompt="Hi", max_tokens=1, n=3)
    ep = "/v1/completions"
    deadline = time.monotonic() + 5
    samples = scrape(f"{front.url}/metrics")
    while sample(samples, "pdserve_openai_requests_in_flight", endpoint=ep) and time.monotonic() < deadline:
        time.sleep(0.05)  # the closed stream's handler may still be unwinding
        samples = scrape(f"{front.url}/metrics")
    assert sample(samples, "pdserve_openai_requests_in_flight", endpoint=ep) == 0
    assert sample(samples, "pdserve_openai_requests_total", endpoint=ep, status="200") >= 2
    assert sample(samples, "pdserve_openai_requests_total", endpoint=ep, status="400") >= 1
    assert sample(samples, "pdserve_openai_time_to_first_token_seconds_count", endpoint=ep) >= 1
    assert sample(samples, "pdserve_openai_request_duration_seconds_count", endpoint=ep) >= 3
    assert sample(samples, "pdserve_openai_request_duration_seconds_bucket", endpoint=ep, le="+Inf") >= 3
    assert not any(":" in name for name, _ in samples)
