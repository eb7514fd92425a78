"""`pdserve health`: one grpc.health.v1 `Check`, over TLS when asked, as a Kubernetes exec probe.

The kubelet's own gRPC probe speaks plaintext only; on ports that serve TLS (or mutual TLS) the probe is
`pdserve health --target 127.0.0.1:PORT --tls-ca ... [--tls-cert ... --tls-key ...]` instead. It is
light (grpc and the health messages; no torch, no engine) and bounded by --timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from shared.client.credentials import CallAuth, Credentials, channel

__all__ = ["HealthResult", "check"]


@dataclass(frozen=True)
class HealthResult:
    serving: bool
    message: str  # one line: the status, or why there is none


def check(
    target: str, *, service: str = "", credentials: Credentials | None = None, timeout: float = 5.0
) -> HealthResult:
    """`Check(service)` on `target`; serving only for SERVING. Never raises for the server's sake: an
    unreachable server, a refused handshake or a timeout is a HealthResult saying so."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = f"service {service!r}" if service else "the server"
    tls = credentials is not None and credentials.tls is not None
    with channel(target, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        auth = CallAuth(credentials).call_kwargs()
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, **auth)
        except grpc.RpcError as e:
            return HealthResult(False, _why(target, name, e, timeout, tls))
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthResult(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {name} {status}")


def _why(target: str, name: str, err: grpc.RpcError, timeout: float, tls: bool) -> str:
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    details = " ".join((err.details() or "").split())  # type: ignore[attr-defined]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{target}: no answer within {timeout:g} s"
    if code == grpc.StatusCode.NOT_FOUND:
        return f"{target}: {name} is unknown to the health service"
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = ""
        if not tls and "Socket closed" in details:
            hint = " (if the port serves TLS, give --tls-ca)"
        elif tls and ("handshake" in details.lower() or "verification" in details.lower()):
            hint = " (TLS refused: check --tls-ca, --tls-server-name, and that the port serves TLS)"
        return f"{target}: unreachable{hint}: {details}"
    return f"{target}: {code.name}: {details}"
