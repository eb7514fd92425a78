"""The front before a decode service that asks who its callers are (mutual TLS, bearer tokens): each
HTTP caller's API key goes on to decode as their gRPC bearer token, so decode's auth (and its
per-identity rules: only a request's owner may abort it) applies to OpenAI callers; its UNAUTHENTICATED
is a 401, PERMISSION_DENIED a 403, in OpenAI's error shape. The front's own token serves its /health
alone. All real: decode and the front as processes, on loopback, with a throwaway CA."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import trustme

from decode_service.servicer import SERVICE_NAME
from shared.client.client import Client, GenerationError
from shared.client.credentials import Credentials
from shared.client.health import check
from tests.openai.openai_testutil import ROOT, FrontProcess
from tests.services.security_testutil import Pem, issue, write_ca
from tests.services.service_testutil import ServerProcess, random_spec, stop_all

pytestmark = pytest.mark.slow  # real processes (a tiny random model: seconds)

ALICE, BOB, FRONT = "alice-token-0123456789", "bob-token-0123456789", "front-token-0123456789"
PROMPT = [1, 2, 3]  # token ids: the random model's character tokenizer has no chat template


@dataclass(frozen=True)
class Setup:
    decode: ServerProcess
    front: FrontProcess
    ca: str
    tester: Pem  # a certificate decode accepts, for direct gRPC calls
    stranger: Pem  # signed by the same CA, but not a name decode lets call


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    where = tmp_path_factory.mktemp("front-auth")
    authority = trustme.CA()
    ca = write_ca(authority, where / "ca.crt")
    tokens = where / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\nfront:{FRONT}\n")
    (where / "front-token").write_text(FRONT + "\n")
    served = issue(authority, where, "pdserve-decode")
    front_pem = issue(authority, where, "pdserve-openai")
    tester, stranger = issue(authority, where, "pdserve-tester"), issue(authority, where, "stranger")
    decode = ServerProcess(
        random_spec(), "--tls-cert", served.cert, "--tls-key", served.key, "--tls-client-ca", ca,
        "--tls-client-names", "pdserve-openai,pdserve-tester", "--auth-tokens-file", str(tokens),
        "--no-metrics", wait_ready=False, env={"PDSERVE_TEST_FAULTS": "step_delay:0.02"},
    )  # fmt: skip
    front = None
    try:
        creds = Credentials.from_files(tls_ca=ca, tls_cert=tester.cert, tls_key=tester.key)
        deadline = time.monotonic() + 60
        while not check(decode.target, service=SERVICE_NAME, credentials=creds, timeout=2).serving:
            assert time.monotonic() < deadline, decode.log()[-3000:]
            time.sleep(0.1)
        # /health (which FrontProcess waits for) answers with the front's own token over mutual TLS.
        front = FrontProcess(
            decode.target, "--tls-ca", ca, "--tls-cert", front_pem.cert, "--tls-key", front_pem.key,
            "--token-file", str(where / "front-token"),
        )  # fmt: skip
        yield Setup(decode, front, ca, tester, stranger)
        code, log = front.stop()
        assert code == 0, log
    finally:
        if front is not None:
            front.kill()
        stop_all(decode)


def _request(
    front: FrontProcess, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None
) -> http.client.HTTPResponse:
    """An HTTP request with exactly the Authorization header given (or none); the response unread."""
    u = urlsplit(front.url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": key} if key is not None else {})
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    return conn.getresponse()


def _status(front: FrontProcess, method: str, path: str, key: str | None = None) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": 2} if method == "POST" else None
    resp = _request(front, method, path, body, key)
    raw = resp.read()
    return resp.status, json.loads(raw) if raw else None


def _oai(front: FrontProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_caller_with_a_token_decode_accepts_is_served(setup: Setup) -> None:
    with _oai(setup.front, ALICE) as oai:
        model = oai.models.list().data[0].id
        done = oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert done.choices[0].finish_reason == "length" and done.usage and done.usage.completion_tokens == 3
        stream = oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=3, stream=True, extra_body={"ignore_eos": True}
        )
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


def test_a_wrong_or_missing_token_is_a_401_in_openais_shape(setup: Setup) -> None:
    with _oai(setup.front, "wrong-token-0123456789") as oai:
        for call in (
            lambda: oai.models.list(),
            lambda: oai.completions.create(model="random", prompt=PROMPT, max_tokens=2),
            lambda: oai.completions.create(model="random", prompt=PROMPT, max_tokens=2, stream=True),
        ):
            with pytest.raises(openai.AuthenticationError) as exc:
                call()
            assert exc.value.status_code == 401
            body = exc.value.response.json()["error"]
            assert (body["type"], body["code"]) == ("invalid_request_error", "invalid_api_key"), body
    # No Authorization header at all: the front's own token is not lent to its callers.
    status, body = _status(setup.front, "POST", "/v1/completions")
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert _status(setup.front, "GET", "/v1/models")[0] == 401
    assert _status(setup.front, "GET", "/health")[0] == 200  # asked with the front's own token
    # Not a token gRPC metadata can carry, or not a bearer one: none is sent, decode says who?
    assert _status(setup.front, "GET", "/v1/models", "Bearer has space")[0] == 401
    assert _status(setup.front, "GET", "/v1/models", f"Basic {ALICE}")[0] == 401
    assert _status(setup.front, "GET", "/v1/models", f"bearer {ALICE}")[0] == 200  # the scheme's any case


def test_the_callers_identity_reaches_decode_only_the_owner_may_abort(setup: Setup) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}  # 8 s at 20 ms a step
    tls = Credentials.from_files(tls_ca=setup.ca, tls_cert=setup.tester.cert, tls_key=setup.tester.key).tls
    resp = _request(setup.front, "POST", "/v1/completions", body, f"Bearer {ALICE}")
    assert resp.status == 200
    rid = resp.headers["x-request-id"]  # the decode request's id too
    assert resp.readline().startswith(b"data: ")  # running on decode
    with Client(setup.decode.target, credentials=Credentials(tls, BOB)) as bob:
        with pytest.raises(GenerationError) as exc:
            bob.abort(rid, timeout=10)
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with Client(setup.decode.target, credentials=Credentials(tls, ALICE)) as alice:
        assert alice.abort(rid, timeout=10)
    events = [line.removeprefix(b"data: ").decode() for line in resp.read().splitlines() if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "aborted", events[-3:]


def test_a_front_whose_certificate_decode_refuses_answers_403(setup: Setup) -> None:
    stranger = setup.stranger
    front = FrontProcess(
        setup.decode.target, "--tls-ca", setup.ca, "--tls-cert", stranger.cert, "--tls-key", stranger.key,
        wait_healthy=False,
    )  # fmt: skip
    try:
        with _oai(front, ALICE) as oai, pytest.raises(openai.PermissionDeniedError) as exc:
            oai.completions.create(model="random", prompt=PROMPT, max_tokens=2)
        body = exc.value.response.json()["error"]
        assert (body["type"], body["code"]) == ("permission_error", "permission_denied"), body
        assert "stranger" in body["message"]
    finally:
        code, log = front.stop()
        assert code == 0, log


def test_unusable_credential_flags_stop_the_front_before_it_binds(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "shared.client.openai", "--port", "0", "--tls-ca", str(tmp_path / "ca.pem")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "listening" not in out.stdout
    assert out.stderr.strip() == f"pdserve openai: --tls-ca {tmp_path / 'ca.pem'}: no such file"
