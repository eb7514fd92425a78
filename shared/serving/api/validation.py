"""GenerateRequest -> (prompt token ids, SamplingParams), or `InvalidRequest` naming every bad field.

Checks here are the API's contract, made before the request reaches a scheduler: the engine repeats
some of them (vocabulary, context) as asserts, but a client must learn of all its mistakes at once, with
field paths it can map back to its request (`sampling.top_p`, `token_ids.ids[3]`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import PromptTooLong, Tokenizer
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.serving.api.errors import FieldViolation, InvalidRequest

__all__ = ["DEFAULT_MAX_TOKENS", "Chat", "Limits", "validate_generate"]

DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default; lowered to the room the context has left
_MAX_LISTED = 8  # per repeated field: enough to fix a request, bounded so a huge bad prompt stays small


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # prompt + max_tokens must fit
    max_request_id_len: int = 256
    max_stop: int = 16
    max_stop_len: int = 256
    max_messages: int = 1024
    max_role_len: int = 64
    # Characters of text (or of a conversation's contents) per token of context: a longer text cannot
    # fit, and is refused before the tokenizer spends time on it.
    max_chars_per_token: int = 32

    @property
    def max_text_chars(self) -> int:
        return self.max_chars_per_token * self.max_context


@dataclass(frozen=True)
class Chat:
    """A model's chat template, as validation uses it: `encode` renders a conversation with the
    assistant's turn opened and encodes it (raising ValueError for one the template refuses);
    `end_of_turn` are the ids a chat reply stops at besides end-of-sequence."""

    encode: Callable[[Sequence[Mapping[str, str]]], list[int]]
    end_of_turn: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> Chat | None:
        """The tokenizer's chat template; None when the model has none."""
        if tokenizer is None or tokenizer.chat_template is None:
            return None
        return cls(tokenizer.encode_chat, tokenizer.end_of_turn_ids)


def _bad_ids(field: str, ids: Sequence[int], vocab: int, out: list[FieldViolation]) -> None:
    bad = [i for i, t in enumerate(ids) if t >= vocab]  # uint32 on the wire: never negative
    for i in bad[:_MAX_LISTED]:
        out.append(
            FieldViolation(f"{field}[{i}]", f"token id {ids[i]} is outside the vocabulary [0, {vocab})")
        )
    if len(bad) > _MAX_LISTED:
        out.append(FieldViolation(field, f"{len(bad) - _MAX_LISTED} more token ids outside [0, {vocab})"))


def _tokenizer_ids(field: str, ids: Sequence[int], vocab: int, out: list[FieldViolation]) -> None:
    """The tokenizer's ids must be the model's: a tokenizer with more tokens than the model's
    vocabulary (a checkpoint that added tokens without resizing) would crash the step, not one request."""
    outside = sorted({t for t in ids if t >= vocab})
    if outside:
        shown = ", ".join(map(str, outside[:_MAX_LISTED]))
        out.append(
            FieldViolation(
                field, f"encodes to token ids outside the model's vocabulary [0, {vocab}): {shown}"
            )
        )


def _messages(
    req: pb.GenerateRequest, limits: Limits, chat: Chat | None, out: list[FieldViolation]
) -> list[int]:
    msgs = req.messages.messages
    if chat is None:
        out.append(FieldViolation("messages", "this model has no chat template: send text or token_ids"))
        return []
    if not msgs:
        out.append(FieldViolation("messages.messages", "must not be empty"))
        return []
    if len(msgs) > limits.max_messages:
        out.append(FieldViolation("messages.messages", f"at most {limits.max_messages} messages"))
        return []
    if sum(len(m.content) for m in msgs) > limits.max_text_chars:
        out.append(FieldViolation("messages", f"longer than {limits.max_text_chars} characters in all"))
        return []
    bad, rule = len(out), f"must be 1 to {limits.max_role_len} characters"
    for i, m in enumerate(msgs):
        if not m.role or len(m.role) > limits.max_role_len:
            out.append(FieldViolation(f"messages.messages[{i}].role", rule))
    if len(out) > bad:
        return []
    try:
        ids = chat.encode([{"role": m.role, "content": m.content} for m in msgs])
    except ValueError as e:  # the template refused the conversation (e.g. roles that must alternate)
        out.append(FieldViolation("messages", f"the model's chat template refused it: {e}"))
        return []
    if not ids:
        out.append(FieldViolation("messages", "renders to no tokens"))
    return ids


def _prompt(
    req: pb.GenerateRequest,
    limits: Limits,
    encode: Callable[[str], list[int]] | None,
    chat: Chat | None,
    out: list[FieldViolation],
) -> tuple[str, list[int]]:
    """The prompt's ids and the field path that names it ("" when the input is missing)."""
    kind = req.WhichOneof("input")
    if kind is None:
        out.append(FieldViolation("input", "set one of text, token_ids or messages"))
        return "", []
    if kind == "messages":
        ids = _messages(req, limits, chat, out)
        _tokenizer_ids("messages", ids, limits.vocab_size, out)
        return "messages", ids
    if kind == "text":
        if not req.text:
            out.append(FieldViolation("text", "must not be empty"))
            return "text", []
        if encode is None:
            out.append(FieldViolation("text", "this model has no tokenizer: send token_ids"))
            return "text", []
        if len(req.text) > limits.max_text_chars:
            out.append(FieldViolation("text", f"longer than {limits.max_text_chars} characters"))
            return "text", []
        try:
            ids = encode(req.text)
        except PromptTooLong as e:  # counted without materializing millions of ids
            out.append(FieldViolation("text", _too_long(e.tokens if e.exact else f"over {e.tokens}", limits)))
            return "text", []
        if not ids:
            out.append(FieldViolation("text", "encodes to no tokens"))
        _tokenizer_ids("text", ids, limits.vocab_size, out)
        return "text", ids
    ids = list(req.token_ids.ids)
    if not ids:
        out.append(FieldViolation("token_ids.ids", "must not be empty"))
    _bad_ids("token_ids.ids", ids, limits.vocab_size, out)
    return "token_ids.ids", ids


def _finite_in(
    field: str, value: float, ok: Callable[[float], bool], rule: str, out: list[FieldViolation]
) -> None:
    if math.isnan(value):
        out.append(FieldViolation(field, "must not be NaN"))
    elif not ok(value):
        out.append(FieldViolation(field, f"{rule}, got {value!r}"))


def _sampling(s: pb.SamplingParams, limits: Limits, has_tokenizer: bool, out: list[FieldViolation]) -> None:
    if s.HasField("temperature"):
        rule = "must be finite and >= 0 (0 is greedy)"
        _finite_in("sampling.temperature", s.temperature, lambda t: math.isfinite(t) and t >= 0, rule, out)
    if s.HasField("top_p"):
        _finite_in("sampling.top_p", s.top_p, lambda p: 0 < p <= 1, "must be in (0, 1]", out)
    _finite_in("sampling.min_p", s.min_p, lambda p: 0 <= p < 1, "must be in [0, 1) (0 is off)", out)
    if s.top_k < -1:
        out.append(FieldViolation("sampling.top_k", f"must be >= 1, or 0 or -1 for off, got {s.top_k}"))
    if s.HasField("max_tokens") and s.max_tokens < 1:
        out.append(FieldViolation("sampling.max_tokens", "must be >= 1 (leave it unset for the default)"))
    if s.stop and not has_tokenizer:
        out.append(FieldViolation("sampling.stop", "this model has no tokenizer: use stop_token_ids"))
    if len(s.stop) > limits.max_stop:
        out.append(
            FieldViolation("sampling.stop", f"at most {limits.max_stop} stop strings, got {len(s.stop)}")
        )
    for i, stop in enumerate(s.stop[: limits.max_stop]):
        if not stop:
            out.append(FieldViolation(f"sampling.stop[{i}]", "must not be empty"))
        elif len(stop) > limits.max_stop_len:
            out.append(FieldViolation(f"sampling.stop[{i}]", f"longer than {limits.max_stop_len} characters"))
    _bad_ids("sampling.stop_token_ids", list(s.stop_token_ids), limits.vocab_size, out)


def _too_long(n_prompt: int | str, limits: Limits) -> str:
    return (
        f"the prompt has {n_prompt} tokens; the context holds {limits.max_context}, "
        "prompt and at least one generated token included"
    )


def _max_tokens(s: pb.SamplingParams, prompt_field: str, n_prompt: int, limits: Limits, out: list) -> int:
    room = limits.max_context - n_prompt
    if room < 1:
        out.append(FieldViolation(prompt_field, _too_long(n_prompt, limits)))
        return 1
    if not s.HasField("max_tokens"):
        # A chat reply runs to the end of its turn, as OpenAI's chat API does: the context's room.
        return room if prompt_field == "messages" else min(DEFAULT_MAX_TOKENS, room)
    if s.max_tokens > room:
        out.append(
            FieldViolation(
                "sampling.max_tokens",
                f"prompt ({n_prompt} tokens) + max_tokens ({s.max_tokens}) exceeds the context "
                f"({limits.max_context}); at most {room} here",
            )
        )
    return s.max_tokens


def validate_generate(
    req: pb.GenerateRequest,
    limits: Limits,
    encode: Callable[[str], list[int]] | None = None,
    chat: Chat | None = None,
) -> tuple[list[int], SamplingParams]:
    """Check every field of `req`; raise InvalidRequest with all violations, or return what the engine
    takes. `encode` is the tokenizer's (None: the model has none, so text and stop strings are refused);
    `chat` its chat template (None: messages are refused)."""
    out: list[FieldViolation] = []
    if len(req.request_id) > limits.max_request_id_len:
        out.append(FieldViolation("request_id", f"longer than {limits.max_request_id_len} characters"))
    prompt_field, prompt = _prompt(req, limits, encode, chat, out)
    s = req.sampling
    _sampling(s, limits, encode is not None, out)
    max_tokens = _max_tokens(s, prompt_field, len(prompt), limits, out) if prompt else 1
    if out:
        raise InvalidRequest(out)
    try:
        params = SamplingParams(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            min_p=s.min_p,
            seed=s.seed if s.HasField("seed") else None,
            max_tokens=max_tokens,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids) + _end_of_turn(req, chat),
            ignore_eos=s.ignore_eos,
        )
    except ValueError as e:  # a rule SamplingParams has and the checks above missed
        raise InvalidRequest([FieldViolation("sampling", str(e))]) from e
    return prompt, params


def _end_of_turn(req: pb.GenerateRequest, chat: Chat | None) -> tuple[int, ...]:
    """A chat reply ends with its turn, as it would at end-of-sequence (unless ignore_eos)."""
    if req.WhichOneof("input") != "messages" or chat is None or req.sampling.ignore_eos:
        return ()
    return tuple(t for t in chat.end_of_turn if t not in req.sampling.stop_token_ids)
