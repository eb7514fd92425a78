"""Who may call the services, end to end with real processes on loopback: TLS on the public port, mutual
TLS on prefill's internal port (only a certificate naming decode may call it), certificate and token
rotation without a restart, and bearer tokens on the public API (missing, wrong, right; Abort only by
the request's owner or an admin)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.servicer import SERVICE_NAME
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client, GenerationError
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from shared.pb.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.services.security_testutil import Pem, issue, replace, tls_channel, write_ca
from tests.services.service_testutil import (
    ROOT,
    ServerProcess,
    kv_layout,
    random_spec,
    stop_all,
    wait_health,
    wait_pool_idle,
)

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
ONE = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, trustme.CA, str]]:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    yield where, ca, write_ca(ca, where / "ca.crt")


def _tls_server(
    pem: Pem, *args: str, module: str = "decode_service", env: dict | None = None
) -> ServerProcess:
    service = PREFILL if module == "prefill_service" else SERVICE_NAME
    return ServerProcess(
        random_spec(), "--tls-cert", pem.cert, "--tls-key", pem.key, "--no-metrics", *args,
        module=module, service=service, wait_ready=False,
    )  # fmt: skip


def test_the_public_port_serves_tls_and_refuses_plaintext(pki) -> None:
    where, ca, ca_file = pki
    decode = _tls_server(issue(ca, where, "pdserve-decode"))
    try:
        with tls_channel(decode.target, ca_file) as ch:
            wait_health(decode.target, SERVICE_NAME, SERVING, timeout=60, channel=ch)
            done = Client(decode.target, channel=ch).complete([1, 2, 3], **ONE)
            assert len(done.token_ids) == 3
        with Client(decode.target) as plain, pytest.raises(GenerationError) as exc:
            plain.complete([1, 2, 3], **ONE, timeout=5)
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_all(decode)


def test_prefill_over_mutual_tls_serves_decode_and_refuses_everyone_else(pki) -> None:
    where, ca, ca_file = pki
    decode_pem = issue(ca, where, "pdserve-decode")
    stranger = issue(ca, where, "stranger")
    prefill = _tls_server(
        issue(ca, where, "pdserve-prefill"), "--tls-client-ca", ca_file, "--tls-client-names",
        "pdserve-decode", module="prefill_service",
    )  # fmt: skip
    decode = None
    try:
        decode = ServerProcess(
            random_spec(), "--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
            "--prefill-tls-ca", ca_file, "--prefill-tls-cert", decode_pem.cert, "--prefill-tls-key",
            decode_pem.key, "--no-metrics",
        )  # fmt: skip
        with Client(decode.target) as client:
            assert len(client.complete(list(range(1, 40)), **ONE).token_ids) == 3
            wait_pool_idle(client)
        handshake = prefill_pb2.HandshakeRequest(layout=kv_layout(16), backend="inline")
        # No certificate: the TLS handshake itself fails.
        with tls_channel(prefill.target, ca_file) as ch, pytest.raises(grpc.RpcError) as exc:
            prefill_pb2_grpc.PrefillStub(ch).Handshake(handshake, timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate the CA signed, but not decode's: refused by name; its health checks still answer.
        with tls_channel(prefill.target, ca_file, stranger) as ch:
            with pytest.raises(grpc.RpcError) as exc:
                prefill_pb2_grpc.PrefillStub(ch).Handshake(handshake, timeout=5)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "stranger" in exc.value.details() and "--tls-client-names" in exc.value.details()
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=PREFILL))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        # Plaintext: no TLS, no call.
        with grpc.insecure_channel(prefill.target) as ch, pytest.raises(grpc.RpcError) as exc:
            prefill_pb2_grpc.PrefillStub(ch).Handshake(handshake, timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_all(*(p for p in (decode, prefill) if p is not None))


def test_a_rotated_certificate_is_served_without_a_restart(pki) -> None:
    where, ca, ca_file = pki
    serving = issue(ca, where, "rotating")
    decode = _tls_server(serving)
    try:
        with tls_channel(decode.target, ca_file) as ch:
            wait_health(decode.target, SERVICE_NAME, SERVING, timeout=60, channel=ch)
        new_ca = trustme.CA()
        new_ca_file = write_ca(new_ca, where / "new-ca.crt")
        rotated = issue(new_ca, where, "rotated")
        replace(rotated.key, serving.key)
        replace(rotated.cert, serving.cert)
        time.sleep(1.5)  # the files are checked at most once a second
        with tls_channel(decode.target, new_ca_file) as ch:
            wait_health(decode.target, SERVICE_NAME, SERVING, timeout=10, channel=ch)
            assert len(Client(decode.target, channel=ch).complete([4, 5], **ONE).token_ids) == 3
        with tls_channel(decode.target, ca_file) as ch, pytest.raises(grpc.RpcError) as exc:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE  # the old CA no longer verifies it
        assert decode.proc.poll() is None
    finally:
        stop_all(decode)


def _bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


ALICE, BOB, OPS, CAROL = (
    "alice-token-0123456789",
    "bob-token-0123456789",
    "ops-token-0123456789",
    "carol-0123456789ab",
)


def test_bearer_tokens_guard_the_public_api_and_abort_is_the_owners(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# name:token[:admin]\nalice:{ALICE}\nbob:{BOB}\nops:{OPS}:admin\n")
    decode = ServerProcess(
        random_spec(), "--auth-tokens-file", str(tokens), "--no-metrics",
        env={"PDSERVE_AUTH_TOKENS": f"carol:{CAROL}", "PDSERVE_TEST_FAULTS": "step_delay:0.05"},
    )  # fmt: skip
    try:
        with grpc.insecure_channel(decode.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            info = pb.GetModelInfoRequest()
            for metadata, code in [
                (None, grpc.StatusCode.UNAUTHENTICATED),
                (_bearer("wrong-token-0123456789"), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", f"Basic {ALICE}"),), grpc.StatusCode.UNAUTHENTICATED),
            ]:
                with pytest.raises(grpc.RpcError) as exc:
                    stub.GetModelInfo(info, metadata=metadata, timeout=5)
                assert exc.value.code() == code, exc.value.details()
            assert stub.GetModelInfo(info, metadata=_bearer(ALICE), timeout=5).model_name
            assert stub.GetModelInfo(info, metadata=_bearer(CAROL), timeout=5).model_name  # from the variable
            ok = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert ok.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token

            def start(rid: str, token: str):  # type: ignore[no-untyped-def]
                req = pb.GenerateRequest(
                    request_id=rid, token_ids=pb.TokenIds(ids=[1, 2, 3]),
                    sampling=pb.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
                )  # fmt: skip
                stream = stub.Generate(req, metadata=_bearer(token), timeout=60)
                next(stream)  # running
                return stream

            stream = start("alices", ALICE)
            with pytest.raises(grpc.RpcError) as exc:
                stub.Abort(pb.AbortRequest(request_id="alices"), metadata=_bearer(BOB), timeout=5)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert stub.Abort(pb.AbortRequest(request_id="alices"), metadata=_bearer(ALICE)).found
            assert [m.complete.finish_reason for m in stream if m.HasField("complete")] == ["abort"]
            stream = start("bobs", BOB)
            assert stub.Abort(pb.AbortRequest(request_id="bobs"), metadata=_bearer(OPS)).found  # an admin
            assert [m.complete.finish_reason for m in stream if m.HasField("complete")] == ["abort"]

            # The file is re-read when it changes: a new token works, a removed one no longer does.
            dave = "dave-token-0123456789"
            tokens.write_text(f"alice:{ALICE}\ndave:{dave}\n")
            time.sleep(1.5)
            assert stub.GetModelInfo(info, metadata=_bearer(dave), timeout=5).model_name
            with pytest.raises(grpc.RpcError) as exc:
                stub.GetModelInfo(info, metadata=_bearer(BOB), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            pool = stub.GetModelInfo(info, metadata=_bearer(ALICE)).kv_pool
            deadline = time.monotonic() + 10
            while pool.pages_free + pool.pages_cached != pool.pages_total and time.monotonic() < deadline:
                time.sleep(0.05)
                pool = stub.GetModelInfo(info, metadata=_bearer(ALICE)).kv_pool
            assert pool.pages_free + pool.pages_cached == pool.pages_total and pool.running == 0
    finally:
        stop_all(decode)


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (["--auth-tokens-file", "/nonexistent/tokens"], {}, "--auth-tokens-file /nonexistent/tokens"),
        ([], {"PDSERVE_AUTH_TOKENS": "alice:short"}, "at least 16 characters"),
        (
            ["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"],
            {},
            "--tls-cert /nonexistent.crt",
        ),
    ],
)
def test_unusable_credentials_stop_the_service_at_start_naming_them(flags, env, says) -> None:
    cmd = [sys.executable, "-m", "decode_service", "--port", "0", "--model", random_spec(), "--no-metrics"]
    proc = subprocess.run(
        [*cmd, *flags], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
