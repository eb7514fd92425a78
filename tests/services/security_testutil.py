"""Certificates and TLS channels for the security tests: a throwaway CA (trustme) and PEM files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import trustme


@dataclass(frozen=True)
class Pem:
    cert: str
    key: str


def issue(ca: trustme.CA, where: Path, name: str, *sans: str) -> Pem:
    """A certificate for `name` (and 127.0.0.1, where the tests' services listen) signed by `ca`."""
    leaf = ca.issue_cert(name, *sans, "127.0.0.1")
    cert, key = where / f"{name}.crt", where / f"{name}.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return Pem(str(cert), str(key))


def write_ca(ca: trustme.CA, path: Path) -> str:
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def replace(src: str, dst: str) -> None:
    """Swap a file in atomically, as the kubelet swaps a rotated Secret."""
    tmp = f"{dst}.new"
    Path(tmp).write_bytes(Path(src).read_bytes())
    os.replace(tmp, dst)


def tls_channel(target: str, ca: str, client: Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(ca).read_bytes(),
        private_key=Path(client.key).read_bytes() if client else None,
        certificate_chain=Path(client.cert).read_bytes() if client else None,
    )
    return grpc.secure_channel(target, creds)
