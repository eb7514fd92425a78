"""The client's credentials: files read and checked up front (a missing or wrong one named with its
flag), the bearer token on every call exactly once (call credentials over TLS, metadata in plaintext),
`pdserve health` against real grpc servers (plaintext, TLS, mutual TLS) as a Kubernetes exec probe, and
the client over TLS with a token against a real decode service."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_service.servicer import SERVICE_NAME
from shared.client import cli
from shared.client.client import AsyncClient, Client, GenerationError
from shared.client.credentials import TOKEN_ENV, Credentials, CredentialsError
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.services.security_testutil import Pem, issue, write_ca
from tests.services.service_testutil import ROOT, ServerProcess, random_spec, stop_all

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
TOKEN = "alice-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, trustme.CA, str]:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    return where, ca, write_ca(ca, where / "ca.crt")


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


# -- Credentials.from_files ---------------------------------------------------------------------------


def test_plaintext_and_no_token_when_nothing_is_given() -> None:
    assert Credentials.from_files() == Credentials(None, None)


def test_tls_files_are_read_and_the_token_stays_out_of_repr(pki, tmp_path: Path) -> None:
    where, ca, ca_file = pki
    me = issue(ca, where, "pdserve-client")
    (tmp_path / "token").write_text(f"  {TOKEN}\n")
    creds = Credentials.from_files(
        tls_ca=ca_file, tls_cert=me.cert, tls_key=me.key, tls_server_name="pdserve-decode",
        token_file=tmp_path / "token",
    )  # fmt: skip
    assert creds.token == TOKEN and creds.tls is not None
    assert creds.tls.root_certificates == Path(ca_file).read_bytes()
    assert creds.tls.certificate_chain == Path(me.cert).read_bytes()
    assert creds.tls.private_key == Path(me.key).read_bytes()
    assert creds.tls.channel_options() == [("grpc.ssl_target_name_override", "pdserve-decode")]
    assert TOKEN not in repr(creds) and "PRIVATE" not in repr(creds)
    assert creds.without_token() == Credentials(creds.tls, None)


def test_the_token_comes_from_the_environment_unless_a_file_gives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, f"{TOKEN}\n")
    assert Credentials.from_files().token == TOKEN
    assert Credentials.from_files(token_env=None).token is None
    (tmp_path / "token").write_text("from-the-file-0123456789")
    assert Credentials.from_files(token_file=tmp_path / "token").token == "from-the-file-0123456789"
    monkeypatch.setenv(TOKEN_ENV, "")
    assert Credentials.from_files().token is None


def _fails(says: list[str], **files: Any) -> CredentialsError:
    with pytest.raises(CredentialsError) as exc:
        Credentials.from_files(**files)
    for words in says:
        assert words in exc.value.for_flag(), exc.value.for_flag()
    return exc.value


def test_a_missing_file_is_named_with_its_flag(pki, tmp_path: Path) -> None:
    where, ca, ca_file = pki
    me = issue(ca, where, "pdserve-client")
    missing = str(tmp_path / "nope.pem")
    _fails([f"--tls-ca {missing}: no such file"], tls_ca=missing)
    _fails([f"--tls-cert {missing}: no such file"], tls_ca=ca_file, tls_cert=missing, tls_key=me.key)
    _fails([f"--tls-key {missing}: no such file"], tls_ca=ca_file, tls_cert=me.cert, tls_key=missing)
    _fails([f"--token-file {missing}: no such file"], token_file=missing)
    _fails([f"--tls-ca {tmp_path}: is a directory"], tls_ca=tmp_path)
    err = _fails(["--tls-cert", "give --tls-key too"], tls_ca=ca_file, tls_cert=me.cert)
    assert err.option == "tls_cert" and "give tls_key too" in str(err)  # the library's own names
    _fails(["--tls-key", "give --tls-cert too"], tls_key=me.key)


def test_what_is_not_pem_is_refused_naming_the_file(pki, tmp_path: Path) -> None:
    where, ca, _ = pki
    me, other = issue(ca, where, "pdserve-client"), issue(ca, where, "someone-else")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    truncated = tmp_path / "truncated.pem"
    truncated.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    binary = tmp_path / "binary.der"
    binary.write_bytes(b"\x30\x82\xff\xfe")
    for bad in (garbage, truncated, binary):
        _fails([f"--tls-ca {bad}: not a PEM certificate"], tls_ca=bad)
    _fails([f"--tls-cert {garbage}: not a PEM certificate"], tls_cert=garbage, tls_key=me.key)
    _fails([f"--tls-cert {me.key}: not a PEM certificate"], tls_cert=me.key, tls_key=me.key)
    _fails([f"--tls-key {garbage}: not a PEM private key"], tls_cert=me.cert, tls_key=garbage)
    _fails(
        [f"--tls-key {other.key}: not the key of the --tls-cert certificate"],
        tls_cert=me.cert,
        tls_key=other.key,
    )
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(Path(me.key).read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    _fails([f"--tls-key {encrypted}: the key is encrypted"], tls_cert=me.cert, tls_key=encrypted)


def test_a_token_is_one_word_of_visible_ascii(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for content, says in [
        ("", "empty"),
        ("\n  \n", "empty"),
        ("two words", "a token is one word"),
        ("a\nb", "a token is one word"),
    ]:
        (tmp_path / "token").write_text(content)
        _fails([f"--token-file {tmp_path / 'token'}: {says}"], token_file=tmp_path / "token")
    (tmp_path / "token").write_bytes("tökén".encode())
    _fails(["not ASCII"], token_file=tmp_path / "token")
    monkeypatch.setenv(TOKEN_ENV, "has space")
    _fails([f"${TOKEN_ENV}: a token is one word"])
    with pytest.raises(ValueError, match="one word"):
        Credentials(token="a b")


# -- the token on the wire ----------------------------------------------------------------------------


class Recorder(pb_grpc.GenerationServicer):
    """A Generation service that answers GetModelInfo and keeps each call's metadata."""

    def __init__(self) -> None:
        self.metadata: list[list[tuple[str, str]]] = []

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        self.metadata.append([(m.key, m.value) for m in context.invocation_metadata()])
        return pb.ModelInfo(model_name="recorder")

    def authorizations(self) -> list[list[str]]:
        return [[v for k, v in md if k == "authorization"] for md in self.metadata]


class AioServer:
    """A grpc.aio server on its own event loop thread (the calls under test block this one)."""

    def __init__(
        self, setup: Callable[[grpc.aio.Server], Any], port: Callable[[grpc.aio.Server], int]
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> tuple[grpc.aio.Server, Any, int]:
            server = grpc.aio.server()
            made = setup(server)
            bound = port(server)
            await server.start()
            return server, made, bound

        self.server, self.made, bound = self.call(start())
        self.target = f"127.0.0.1:{bound}"

    def call(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(30)

    def close(self) -> None:
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _tls_port(pem: Pem, client_ca: str | None = None) -> Callable[[grpc.aio.Server], int]:
    def bind(server: grpc.aio.Server) -> int:
        creds = grpc.ssl_server_credentials(
            [(Path(pem.key).read_bytes(), Path(pem.cert).read_bytes())],
            root_certificates=Path(client_ca).read_bytes() if client_ca else None,
            require_client_auth=client_ca is not None,
        )
        return server.add_secure_port("127.0.0.1:0", creds)

    return bind


def _plain_port(server: grpc.aio.Server) -> int:
    return server.add_insecure_port("127.0.0.1:0")


def _recorder(server: grpc.aio.Server) -> Recorder:
    rec = Recorder()
    pb_grpc.add_GenerationServicer_to_server(rec, server)
    return rec


@pytest.fixture(params=["plaintext", "tls"])
def recorder(request: pytest.FixtureRequest, pki) -> Iterator[tuple[AioServer, Credentials]]:
    where, ca, ca_file = pki
    if request.param == "tls":
        srv = AioServer(_recorder, _tls_port(issue(ca, where, "pdserve-decode")))
        creds = Credentials.from_files(tls_ca=ca_file, tls_server_name="pdserve-decode")
    else:
        srv = AioServer(_recorder, _plain_port)
        creds = Credentials()
    try:
        yield srv, creds
    finally:
        srv.close()


def test_the_token_goes_on_every_call_once_and_a_call_may_carry_another(recorder) -> None:
    srv, creds = recorder
    with Client(srv.target, credentials=Credentials(creds.tls, TOKEN)) as c:
        assert c.model_info(timeout=10).model_name == "recorder"
        c.model_info(timeout=10, token="bob-token-0123456789")
    with Client(srv.target, credentials=creds) as c:
        c.model_info(timeout=10)
        with pytest.raises(ValueError, match="one word"):
            c.model_info(timeout=10, token="not a token")

    async def aio() -> None:
        async with AsyncClient(srv.target, credentials=Credentials(creds.tls, TOKEN)) as c:
            await c.model_info(timeout=10)
            await c.model_info(timeout=10, token="carol-token-0123456789")

    asyncio.run(aio())
    assert srv.made.authorizations() == [
        [f"Bearer {TOKEN}"], ["Bearer bob-token-0123456789"], [], [f"Bearer {TOKEN}"],
        ["Bearer carol-token-0123456789"],
    ]  # fmt: skip


def test_tls_credentials_and_a_channel_of_ones_own_do_not_mix(pki) -> None:
    _, _, ca_file = pki
    with grpc.insecure_channel("127.0.0.1:1") as ch, pytest.raises(TypeError, match="not both"):
        Client("127.0.0.1:1", channel=ch, credentials=Credentials.from_files(tls_ca=ca_file))


# -- pdserve health -----------------------------------------------------------------------------------


def _health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


@pytest.fixture
def health_server() -> Iterator[AioServer]:
    srv = AioServer(_health, _plain_port)
    srv.call(srv.made.set("", SERVING))
    srv.call(srv.made.set(SERVICE_NAME, NOT_SERVING))
    try:
        yield srv
    finally:
        srv.close()


def _probe(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["health", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_health_exits_0_when_serving_and_1_with_one_line_why_otherwise(
    health_server: AioServer, capsys: pytest.CaptureFixture[str]
) -> None:
    t = health_server.target
    code, out, err = _probe(capsys, "--target", t)
    assert (code, err) == (0, "") and out == f"pdserve health: {t}: the server SERVING\n"
    code, out, err = _probe(capsys, "--target", t, "--service", SERVICE_NAME)
    assert (code, out) == (1, "") and err == f"pdserve health: {t}: service {SERVICE_NAME!r} NOT_SERVING\n"
    health_server.call(health_server.made.set(SERVICE_NAME, SERVING))
    assert _probe(capsys, "--target", t, "--service", SERVICE_NAME)[0] == 0
    code, out, err = _probe(capsys, "--target", t, "--service", "no.such.Service")
    assert code == 1 and err.count("\n") == 1 and "'no.such.Service' is unknown" in err


def test_health_of_nothing_listening_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    code, out, err = _probe(capsys, "--target", f"127.0.0.1:{port}", "--timeout", "10")
    assert time.monotonic() - t0 < 3
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"pdserve health: 127.0.0.1:{port}: unreachable"), err


def test_health_times_out_on_a_server_that_never_answers(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # accepts TCP connections (the backlog) and never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        code, _, err = _probe(capsys, "--target", f"127.0.0.1:{s.getsockname()[1]}", "--timeout", "0.5")
        assert time.monotonic() - t0 < 3
    assert code == 1 and "no answer within 0.5 s" in err, err


def test_health_over_tls_and_mutual_tls(pki, capsys: pytest.CaptureFixture[str]) -> None:
    where, ca, ca_file = pki
    server_pem, client_pem = issue(ca, where, "pdserve-decode"), issue(ca, where, "pdserve-probe")
    tls = AioServer(_health, _tls_port(server_pem))
    mtls = AioServer(_health, _tls_port(server_pem, client_ca=ca_file))
    other_ca = write_ca(trustme.CA(), where / "other-ca.crt")
    try:
        for srv in (tls, mtls):
            srv.call(srv.made.set("", SERVING))
        # The certificate names 127.0.0.1 (issue()), and pdserve-decode, which --tls-server-name asks for.
        assert _probe(capsys, "--target", tls.target, "--tls-ca", ca_file)[0] == 0
        named = ("--tls-server-name", "pdserve-decode")
        assert _probe(capsys, "--target", tls.target, "--tls-ca", ca_file, *named)[0] == 0
        code, _, err = _probe(capsys, "--target", tls.target, "--tls-ca", ca_file, "--tls-server-name", "x.y")
        assert code == 1 and "TLS refused" in err, err
        code, _, err = _probe(capsys, "--target", tls.target)  # plaintext to a TLS port
        assert code == 1 and "unreachable (if the port serves TLS, give --tls-ca)" in err, err
        code, _, err = _probe(capsys, "--target", tls.target, "--tls-ca", other_ca)
        assert code == 1 and "TLS refused" in err and err.count("\n") == 1, err
        # Mutual TLS: no client certificate, no answer.
        assert _probe(capsys, "--target", mtls.target, "--tls-ca", ca_file)[0] == 1
        mine = ("--tls-cert", client_pem.cert, "--tls-key", client_pem.key)
        assert _probe(capsys, "--target", mtls.target, "--tls-ca", ca_file, *mine)[0] == 0
    finally:
        tls.close()
        mtls.close()


def test_health_refuses_unusable_credentials_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _probe(capsys, "--target", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem")
    assert (code, out) == (2, "") and err == "pdserve health: --tls-ca /nonexistent/ca.pem: no such file\n"


def test_health_as_a_process_is_light_and_says_one_line(health_server: AioServer) -> None:
    """The exec probe's own cost: no torch, no engine, no serving layer imported."""
    cmd = [sys.executable, "-X", "importtime", "-m", "shared.client.cli", "health", "--target"]
    out = subprocess.run(
        [*cmd, health_server.target, "--service", SERVICE_NAME], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "import time:" in line}
    assert imported and not {m for m in imported if m.split(".")[0] in ("torch", "numpy")}
    assert not {m for m in imported if m.startswith(("shared.serving", "shared.engine", "shared.model"))}
    why = [line for line in out.stderr.splitlines() if "import time:" not in line]
    assert out.returncode == 1 and why == [
        f"pdserve health: {health_server.target}: service {SERVICE_NAME!r} NOT_SERVING"
    ]


def test_a_refused_handshake_is_one_line_too(pki, tmp_path: Path) -> None:
    """grpc logs a failed handshake itself (INFO, on stderr): the probe quiets it before grpc loads."""
    where, ca, _ = pki
    srv = AioServer(_health, _tls_port(issue(ca, where, "pdserve-decode")))
    other_ca = write_ca(trustme.CA(), tmp_path / "other-ca.crt")
    try:
        cmd = [
            sys.executable,
            "-m",
            "shared.client.cli",
            "health",
            "--target",
            srv.target,
            "--tls-ca",
            other_ca,
        ]
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    finally:
        srv.close()
    assert out.returncode == 1 and out.stdout == "", out
    assert len(out.stderr.splitlines()) == 1 and "TLS refused" in out.stderr, out.stderr


# -- the flags ----------------------------------------------------------------------------------------

FLAGS = ["--tls-ca", "ca.pem", "--tls-cert", "me.pem", "--tls-key", "me.key", "--tls-server-name", "decode"]


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench"], ["health"]])
def test_generate_bench_and_health_take_the_credential_flags(argv: list[str]) -> None:
    args = cli.build_parser().parse_args([*argv, *FLAGS])
    assert (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name) == (
        "ca.pem", "me.pem", "me.key", "decode"
    )  # fmt: skip
    defaults = cli.build_parser().parse_args(argv)
    assert defaults.tls_ca is defaults.tls_cert is defaults.tls_key is defaults.tls_server_name is None
    if argv[0] == "health":  # the services answer health checks without a token
        assert not hasattr(args, "token_file")
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([*argv, "--token-file", "tok"])
    else:
        assert cli.build_parser().parse_args([*argv, "--token-file", "tok"]).token_file == "tok"
        assert defaults.token_file is None


def test_health_ignores_a_token_in_the_environment(
    health_server: AioServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "not a usable token")  # would be refused, were it read
    assert _probe(capsys, "--target", health_server.target)[0] == 0


def test_health_flags_and_defaults() -> None:
    args = cli.build_parser().parse_args(["health", "--target", "h:1", "--service", "s", "--timeout", "1.5"])
    assert (args.target, args.service, args.timeout) == ("h:1", "s", 1.5)
    args = cli.build_parser().parse_args(["health"])
    assert (args.service, args.timeout) == ("", 5.0)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["health", "--timeout", "0"])


def test_a_bad_credential_file_fails_generate_before_any_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "hi", "--target", "127.0.0.1:1", "--token-file", "/nonexistent/tok"]) == 2
    assert capsys.readouterr().err == "pdserve generate: --token-file /nonexistent/tok: no such file\n"


# -- against a real decode service ----------------------------------------------------------------------


def test_generate_and_bench_over_tls_with_a_token_against_a_real_decode(pki, tmp_path: Path) -> None:
    where, ca, ca_file = pki
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{TOKEN}\n")
    pem = issue(ca, where, "pdserve-decode")
    decode = ServerProcess(
        random_spec(), "--tls-cert", pem.cert, "--tls-key", pem.key, "--auth-tokens-file", str(tokens),
        "--no-metrics", wait_ready=False,
    )  # fmt: skip
    try:
        creds = Credentials.from_files(tls_ca=ca_file, token_file=None)
        deadline = time.monotonic() + 60
        while cli.main(["health", "--target", decode.target, "--tls-ca", ca_file, "--service", SERVICE_NAME]):
            assert time.monotonic() < deadline, decode.log()[-3000:]
            time.sleep(0.2)
        with Client(decode.target, credentials=Credentials(creds.tls, TOKEN)) as c:
            assert len(c.complete([1, 2, 3], max_tokens=3, ignore_eos=True).token_ids) == 3
        for token in (None, "wrong-token-0123456789"):
            with Client(decode.target, credentials=Credentials(creds.tls, token)) as c:
                with pytest.raises(GenerationError) as exc:
                    c.model_info(timeout=10)
                assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        (tmp_path / "tok").write_text(TOKEN + "\n")
        bench = [
            sys.executable, "-m", "shared.client.cli", "bench", "--target", decode.target,
            "--tls-ca", ca_file, "--rate", "50", "--sessions", "2", "--turns", "1", "--prefix-tokens", "4",
            "--turn-tokens", "2", "--output-tokens", "2",
        ]  # fmt: skip
        env = {**os.environ, TOKEN_ENV: TOKEN}  # the token from the environment
        out = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0 and "errors: none" in out.stdout, out.stdout + out.stderr
        gen = [sys.executable, "-m", "shared.client.cli", "generate", "x", "--target", decode.target]
        out = subprocess.run(
            [*gen, "--tls-ca", ca_file, "--token-file", str(tmp_path / "tok"), "--max-tokens", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0 and "finish_reason=" in out.stdout, out.stdout + out.stderr
        out = subprocess.run(
            [*gen, "--tls-ca", ca_file], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr
    finally:
        stop_all(decode)
