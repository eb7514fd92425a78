"""An OpenAI-compatible HTTP front for pdserve: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (streaming or not), answered by the decode service's `pdserve.v1.Generation`
through the Python client (`shared.client.client.AsyncClient`).

    python -m shared.client.openai --target 127.0.0.1:50051 --port 8000    # or: pdserve openai ...

Its own process, a client of decode like any other: HTTP parsing, JSON and SSE encoding stay off the
decode service's event loop (which already tokenizes, detokenizes and drives the scheduler), the front
scales and restarts on its own (several fronts before one decode, or one per node), and a fault in it
cannot take generation down. It imports nothing of the engine or the servers, only the wire types, as
the rest of shared/client.

FastAPI (on Starlette, served by uvicorn) because it is what vLLM's and SGLang's OpenAI servers use:
well kept, asyncio-native (the gRPC client is grpc.aio on the same loop), request bodies validated by
pydantic models that read as the API's schema, and streaming responses that see client disconnects,
which pdserve turns into cancelled calls so decode frees the request's KV at once.

Modules: `app` (routes), `protocol` (request models, response shapes), `generate` (one call, streamed or
whole, cancelled on disconnect), `errors` (OpenAI error objects from gRPC statuses), `edge` (metrics, API
key, body bound), `server` (flags, uvicorn). User guide: docs/openai.md.
"""

from __future__ import annotations

from shared.client.openai.app import Settings, create_app
from shared.client.openai.server import main

__all__ = ["Settings", "create_app", "main"]
