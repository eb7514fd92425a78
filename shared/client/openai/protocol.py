"""The OpenAI request bodies pdserve takes (pydantic: FastAPI validates them), and the response objects
it answers with (plain dicts in OpenAI's shapes).

Unknown fields are ignored, as OpenAI's API tolerates them. Known fields pdserve cannot honour are
refused with a 400 naming them (`refusal`) rather than silently changing what the caller asked for:
n > 1, logprobs, echo, suffix, best_of > 1, penalties, logit_bias, tools, structured output.
Value rules (temperature >= 0, top_p in (0, 1], ...) are the decode service's: its INVALID_ARGUMENT
field violations come back as 400s naming the parameter. Only what the wire types need (unsigned, 32-
and 64-bit ranges) is checked here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "usage",
]

_U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
_SEED = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # OpenAI's seed is signed; the wire's uint64
_MAX_TOKENS = Annotated[int, Field(ge=1, le=2**32 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share; the vLLM extensions (top_k, min_p, stop_token_ids, ignore_eos) are
    the ones the openai client sends through `extra_body`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model (as vLLM's server allows)
    max_tokens: _MAX_TOKENS | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    min_p: float | None = None
    seed: _SEED | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[_U32] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def sampling(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `AsyncClient.generate`: what the caller set, nothing else (the server
        applies its defaults to the rest)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        kw: dict[str, Any] = {
            "max_tokens": max_tokens if max_tokens is not None else self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed % 2**64 if self.seed is not None else None,  # two's complement: reproducible
            "stop": stop or None,
            "stop_token_ids": self.stop_token_ids or None,
            "ignore_eos": self.ignore_eos or None,
        }
        return {k: v for k, v in kw.items() if v is not None}

    def refusal(self) -> tuple[str, str] | None:
        """(parameter, why) for the first field set to something pdserve does not do; None if none."""
        if self.n not in (None, 1):
            return "n", "only n=1 is supported (send one request per choice)"
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, "presence and frequency penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_Sampling):
    # One prompt: text, or token ids. A list of one is taken as that prompt; more are refused (one
    # request per prompt keeps each one's abort, usage and errors its own).
    prompt: str | list[_U32] | list[str] | list[list[_U32]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int] | None:
        """The prompt as the gRPC API takes it; None for a batch of several prompts."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p  # type: ignore[return-value]
        return p[0] if len(p) == 1 else None  # type: ignore[return-value]

    def refusal(self) -> tuple[str, str] | None:
        if self.single_prompt() is None:
            return "prompt", "a list of several prompts is not supported: send one request per prompt"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return super().refusal()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _MAX_TOKENS | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling(self, max_tokens: int | None = None) -> dict[str, Any]:
        return super().sampling(self.max_completion_tokens)

    def wire_messages(self) -> list[dict[str, str]]:
        """[{role, content}] for `AsyncClient.generate(messages=...)`: text parts joined; OpenAI's newer
        "developer" role is the "system" role chat templates know."""
        out = []
        for m in self.messages:
            if isinstance(m.content, list):
                content = "".join(p.text or "" for p in m.content)
            else:
                content = m.content or ""
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out

    def refusal(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                return f"messages.[{i}].tool_calls", "tool calls are not supported"
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":
                    return f"messages.[{i}].content.[{j}]", f"content of type {part.type!r} is not supported"
        if self.logprobs or self.top_logprobs:
            return ("logprobs" if self.logprobs else "top_logprobs"), "logprobs are not supported"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tools (function calling) are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().refusal()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # the prefix cache's hits
    }


def completion_response(
    rid: str, created: int, model: str, text: str, finish: str, use: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _envelope(rid, "text_completion", created, model, [choice]) | {"usage": use}


def completion_chunk(
    rid: str, created: int, model: str, text: str | None, finish: str | None = None
) -> dict[str, Any]:
    """text None: the usage-only chunk (no choices) that `stream_options.include_usage` asks for."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return _envelope(rid, "text_completion", created, model, choices)


def chat_response(
    rid: str, created: int, model: str, text: str, finish: str, use: dict[str, Any]
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    return _envelope(rid, "chat.completion", created, model, [choice]) | {"usage": use}


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any] | None, finish: str | None = None
) -> dict[str, Any]:
    """delta None: the usage-only chunk (no choices)."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    choices = [] if delta is None else [choice]
    return _envelope(rid, "chat.completion.chunk", created, model, choices)


def _envelope(rid: str, obj: str, created: int, model: str, choices: list[Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
