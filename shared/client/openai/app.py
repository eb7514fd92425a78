"""The ASGI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over the decode service's
`pdserve.v1.Generation`, plus /health and /metrics. `create_app(Settings(target=...))`.

Each request's `Authorization: Bearer <key>` goes on to decode as the gRPC bearer token of its calls,
so decode's own authentication (and per-identity rules: aborting only one's own requests) applies to
OpenAI callers too; its UNAUTHENTICATED is a 401 here, PERMISSION_DENIED a 403. The front's own token
(`Settings.credentials.token`) is used for its own calls alone (/health), never for a caller's."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.client.client import AsyncClient, GenerationError
from shared.client.credentials import Credentials
from shared.client.openai.edge import Edge, Metrics, bearer_token
from shared.client.openai.errors import APIError, from_generation_error, from_validation_error
from shared.client.openai.generate import Generation, run_generation
from shared.client.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Settings", "create_app"]

# Room for a prompt that fills a 128k-token context as text or as a JSON list of ids, not much more.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_INFO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Settings:
    target: str  # the decode service, host:port
    api_key: str | None = None  # None: no key asked for
    served_model_name: str | None = None  # None: the decode service's model_name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    credentials: Credentials | None = None  # to decode: TLS; the token: the front's own, for /health


class _State:
    """Per process: the gRPC client (made on the server's event loop) and the served model's name."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.created = int(time.time())
        self.client: AsyncClient | None = None
        self._name = settings.served_model_name
        creds = settings.credentials
        self.own_token = creds.token if creds is not None else None

    def connect(self) -> AsyncClient:
        """The client of decode: TLS as configured, no token of its own (each call says whose)."""
        creds = self.settings.credentials
        return AsyncClient(self.settings.target, credentials=creds.without_token() if creds else None)

    async def model_info(self, token: str | None) -> Any:
        assert self.client is not None
        try:
            return await self.client.model_info(timeout=_INFO_TIMEOUT_S, token=token)
        except GenerationError as e:
            raise from_generation_error(e) from e

    async def model_name(self, token: str | None) -> str:
        """The name requests must use: --served-model-name, else decode's model (asked once)."""
        if self._name is None:
            self._name = (await self.model_info(token)).model_name
        return self._name

    async def check_model(self, model: str | None, token: str | None) -> str:
        name = await self.model_name(token)
        if model and model != name:
            msg = f"the model {model!r} does not exist; this server serves {name!r}"
            raise APIError(404, msg, "invalid_request_error", "model", "model_not_found")
        return name


def create_app(settings: Settings) -> Any:
    """The FastAPI app wrapped in the edge middleware (metrics, API key, body bound): an ASGI app."""
    state = _State(settings)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client = state.connect()  # grpc.aio channels belong to the running loop
        try:
            yield
        finally:
            await state.client.close()

    app = FastAPI(title="pdserve OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pdserve = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        return from_validation_error(exc, content_type).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.get("/health")
    async def health() -> Response:
        """200 while the decode service answers GetModelInfo (it does once its model is loaded), asked
        with the front's own token."""
        await state.model_info(state.own_token)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str, info: Any) -> dict[str, Any]:
        return {
            "id": name, "object": "model", "created": state.created, "owned_by": "pdserve",
            "max_model_len": info.max_context,
        }  # fmt: skip

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        token = _caller_token(request)
        info = await state.model_info(token)
        return {"object": "list", "data": [model_card(await state.model_name(token), info)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        token = _caller_token(request)
        info = await state.model_info(token)
        return model_card(await state.check_model(model, token), info)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _refuse(body.refusal())
        model = await state.check_model(body.model, _caller_token(request))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        g = Generation(
            endpoint="/v1/completions", rid=rid, model=model, stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            gen_kwargs={"prompt": body.single_prompt(), **body.sampling()}, param_aliases={},
            whole=lambda text, finish, use: completion_response(rid, created, model, text, finish, use),
            chunk=lambda text, finish: completion_chunk(rid, created, model, text, finish),
        )  # fmt: skip
        return await _generate(request, g)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _refuse(body.refusal())
        model = await state.check_model(body.model, _caller_token(request))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            delta = None if text is None else ({"content": text} if text else {})
            return chat_chunk(rid, created, model, delta, finish)

        g = Generation(
            endpoint="/v1/chat/completions", rid=rid, model=model, stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            gen_kwargs={"messages": body.wire_messages(), **body.sampling()},
            param_aliases={"max_tokens": body.max_tokens_param()},
            whole=lambda text, finish, use: chat_response(rid, created, model, text, finish, use),
            chunk=chunk,
            opening=chat_chunk(rid, created, model, {"role": "assistant", "content": ""}),
        )  # fmt: skip
        return await _generate(request, g)

    async def _generate(request: Request, g: Generation) -> Response:
        assert state.client is not None
        ttft = metrics.ttft.labels(g.endpoint)
        return await run_generation(request, state.client, g, ttft, _caller_token(request))

    return Edge(app, metrics, settings.api_key, settings.max_body_bytes)


def _caller_token(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization"))


def _refuse(refusal: tuple[str, str] | None) -> None:
    if refusal is not None:
        param, why = refusal
        raise APIError(400, f"{param}: {why}", "invalid_request_error", param, "unsupported_parameter")
