"""TLS and mutual TLS with grpcio's own credentials, from PEM files that may rotate.

A server given a certificate and key serves TLS; given a client CA as well, every caller must present a
certificate that CA signed (mutual TLS), checked in the handshake, before any call. Which of those
callers may call what (prefill: only decode's certificate) is the guard's (shared/serving/security/
guard.py), from the names `peer_names` reads. The server's files are re-read at the next handshake
after they change (grpc's dynamic credentials), so a rotated Secret takes effect without a restart;
connections already open keep the certificate they began with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from shared.serving.security.files import WatchedFiles

__all__ = ["ClientTLS", "ServerTLS", "TLSError", "peer_names"]

log = logging.getLogger("pdserve.tls")


class TLSError(ValueError):
    """A certificate, key or CA file that is missing or not what its flag says."""


def _check(kind: str, flag: str, path: str, pem: bytes) -> None:
    markers = {"certificate": (b"-----BEGIN CERTIFICATE-----",), "key": (b"PRIVATE KEY-----",)}
    if not any(m in pem for m in markers[kind]):
        raise TLSError(f"{flag} {path}: not a PEM {kind}")


def _watch(flags_paths: Sequence[tuple[str, str, str]]) -> WatchedFiles:
    """Open (flag, path, kind) files, or TLSError naming the flag."""
    for flag, path, _ in flags_paths:
        try:
            WatchedFiles([path])
        except OSError as e:
            raise TLSError(f"{flag} {path}: {e.strerror}") from e
    files = WatchedFiles([p for _, p, _ in flags_paths])
    for (flag, path, kind), pem in zip(flags_paths, files.contents, strict=True):
        _check(kind, flag, path, pem)
    return files


@dataclass(frozen=True)
class ServerTLS:
    """The TLS a service's port serves (--tls-cert, --tls-key; --tls-client-ca: mutual TLS)."""

    cert: str
    key: str
    client_ca: str = ""
    client_names: tuple[str, ...] = ()  # a caller's certificate must name one (the guard checks)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files at the next handshake after they change."""
        spec = [("--tls-cert", self.cert, "certificate"), ("--tls-key", self.key, "key")]
        if self.client_ca:
            spec.append(("--tls-client-ca", self.client_ca, "certificate"))
        files = _watch(spec)

        def config(contents: tuple[bytes, ...]) -> grpc.ServerCertificateConfiguration:
            cert, key, *ca = contents
            return grpc.ssl_server_certificate_configuration([(key, cert)], ca[0] if ca else None)

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # grpc's threads, every handshake
            contents, changed = files.read()
            if files.error:
                log.warning("TLS files: %s (serving the certificate read before)", files.error)
            if not changed:
                return None
            try:
                for (flag, path, kind), pem in zip(spec, contents, strict=True):
                    _check(kind, flag, path, pem)
            except TLSError as e:
                log.error("rotated TLS files refused: %s (serving the certificate read before)", e)
                return None
            log.info("TLS certificate reloaded from %s", self.cert)
            return config(contents)

        return grpc.dynamic_ssl_server_credentials(
            config(files.contents), fetch, require_client_authentication=self.mutual
        )


@dataclass(frozen=True)
class ClientTLS:
    """A TLS channel to another service (decode -> prefill): the CA its certificate must be signed by,
    and the certificate this side presents for mutual TLS (optional)."""

    ca: str
    cert: str = ""
    key: str = ""
    flags: tuple[str, str, str] = ("--prefill-tls-ca", "--prefill-tls-cert", "--prefill-tls-key")

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TLSError(f"{self.flags[1]} and {self.flags[2]} go together: give both or neither")

    def watch(self) -> WatchedFiles:
        spec = [(self.flags[0], self.ca, "certificate")]
        if self.cert:
            spec += [(self.flags[1], self.cert, "certificate"), (self.flags[2], self.key, "key")]
        return _watch(spec)

    @staticmethod
    def credentials(contents: tuple[bytes, ...]) -> grpc.ChannelCredentials:
        """Channel credentials from the files `watch()` read (CA[, certificate, key])."""
        ca, *pair = contents
        if pair:
            cert, key = pair
            return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
        return grpc.ssl_channel_credentials(ca)


def peer_names(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> set[str]:
    """The names the caller's verified certificate carries (SANs and the subject's CN); empty without a
    client certificate."""
    auth = context.auth_context()
    names = [*auth.get("x509_subject_alternative_name", ()), *auth.get("x509_common_name", ())]
    return {n.decode(errors="replace") for n in names if n}
