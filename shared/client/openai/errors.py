"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status a client
of OpenAI's API expects, from the front's own checks and from the decode service's gRPC statuses."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shared.client.client import GenerationError

__all__ = ["APIError", "from_generation_error", "from_validation_error"]

_MEMBER = re.compile(r"[\[\]]|^(str|int|float|bool|list|dict|function-\w+)$")  # a union member's name

# gRPC status -> (HTTP status, OpenAI error type). What the decode service answers (see
# protos/pdserve/v1/generation.proto); anything else is the server's fault (500).
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),  # decode's bearer token check
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),  # e.g. decode refused our certificate
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
# The `code` of an error, where OpenAI's differs from the gRPC status's name (lower case).
_CODES = {grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key"}


class APIError(Exception):
    """An OpenAI error object and its HTTP status; raised anywhere in a handler, answered by the app."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def openai_param(field: str, aliases: dict[str, str] | None = None) -> str | None:
    """A field path of the gRPC request (`sampling.top_p`, `token_ids.ids[3]`, `messages.messages[0]`)
    -> the OpenAI request's parameter that it came from (`top_p`, `prompt`, `messages`)."""
    parts = re.split(r"[.\[]", field)
    if parts[0] == "sampling":
        param = parts[1] if len(parts) > 1 else None
    elif parts[0] in ("text", "token_ids", "input"):
        param = "prompt"
    elif parts[0] == "messages":  # messages.messages[2].role -> messages.[2].role, as OpenAI names it
        param = re.sub(r"^messages(\.messages)?", "messages", field).replace("[", ".[")
    else:
        param = None
    return (aliases or {}).get(param or "", param)


def from_generation_error(err: GenerationError, aliases: dict[str, str] | None = None) -> APIError:
    """The decode service's refusal as an OpenAI error; `aliases` renames parameters (e.g. `max_tokens`
    -> `max_completion_tokens` when the chat request used that name)."""
    status, type_ = _GRPC_TO_HTTP.get(err.code, (500, "server_error"))
    code = _CODES.get(err.code, err.code.name.lower())
    if err.violations:
        params = [openai_param(v.field, aliases) for v in err.violations]
        parts = [f"{p or v.field}: {v.description}" for p, v in zip(params, err.violations, strict=True)]
        return APIError(status, "; ".join(parts), type_, params[0], code)
    return APIError(status, err.details or err.code.name, type_, None, code)


def from_validation_error(exc: RequestValidationError, content_type: str = "application/json") -> APIError:
    """Pydantic's complaints about the body -> one 400 naming the first bad parameter (OpenAI's shape,
    not FastAPI's 422 list)."""
    errors: Sequence[dict[str, Any]] = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    # A union (str | list[int]) names the member that failed too: keep the request's own path only.
    loc = [p for p in first.get("loc", ()) if p != "body"]
    path = [f"[{p}]" if isinstance(p, int) else p for p in loc if isinstance(p, int) or not _MEMBER.search(p)]
    param = ".".join(path) or None
    if param is None and content_type != "application/json":
        return APIError(400, "send the request as JSON, with `Content-Type: application/json`")
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", "invalid_request_error", param)
