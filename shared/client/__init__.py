"""The client side of pdserve: the Python client of `pdserve.v1.Generation` (sync and asyncio) and its
credentials (TLS, mutual TLS, a bearer token), the `pdserve` command line (with `health`, a TLS-capable
probe), and the load generator its `bench` runs. It speaks the wire types alone
(`shared/pb`): no engine, no torch.

The names below load on first use (PEP 562): `pdserve health` runs as a Kubernetes exec probe, and must
be able to quiet grpc's own logging (GRPC_VERBOSITY, read when grpc is imported) before grpc loads."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.client.client import (
        AsyncClient,
        AsyncStream,
        Chunk,
        Client,
        Completion,
        GenerationError,
        Stream,
        Usage,
    )
    from shared.client.credentials import Credentials, CredentialsError, TLSFiles
    from shared.client.errors import FieldViolation

_HOME = {
    **dict.fromkeys(
        ("AsyncClient", "AsyncStream", "Chunk", "Client", "Completion", "GenerationError", "Stream", "Usage"),
        "shared.client.client",
    ),
    **dict.fromkeys(("Credentials", "CredentialsError", "TLSFiles"), "shared.client.credentials"),
    "FieldViolation": "shared.client.errors",
}

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "Completion",
    "Credentials",
    "CredentialsError",
    "FieldViolation",
    "GenerationError",
    "Stream",
    "TLSFiles",
    "Usage",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
