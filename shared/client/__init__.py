"""The client side of pdserve: the Python client of `pdserve.v1.Generation` (sync and asyncio), the
`pdserve` command line, and the load generator its `bench` runs. It speaks the wire types alone
(`shared/pb`): no engine, no torch."""

from __future__ import annotations

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
from shared.client.errors import FieldViolation

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "Completion",
    "FieldViolation",
    "GenerationError",
    "Stream",
    "Usage",
]
