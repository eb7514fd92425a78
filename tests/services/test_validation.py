"""Bad input -> INVALID_ARGUMENT with every field violation; the server stays healthy afterwards.

Unit tests of shared/serving/api/validation.py, then the same requests through a real server.
"""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2

from decode_service.servicer import SERVICE_NAME
from shared.client.client import Client, GenerationError
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.serving.api.errors import InvalidRequest
from shared.serving.api.validation import DEFAULT_MAX_TOKENS, Chat, Limits, validate_generate
from tests.services.service_testutil import ServerProcess, health_status, wait_pool_idle

LIMITS = Limits(vocab_size=97, max_context=512)
NAN = math.nan


def req(
    ids: list[int] | None = None, text: str | None = None, request_id: str = "", **sampling
) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if text is not None:
        r.text = text
    elif ids is not None:
        r.token_ids.ids.extend(ids)
    return r


# (request, the field paths it must be refused with)
BAD = {
    "missing input": (req(), {"input"}),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), {"token_ids.ids"}),
    "empty text": (req(text=""), {"text"}),
    "id outside vocab": (req([1, 97, 3, 500]), {"token_ids.ids[1]", "token_ids.ids[3]"}),
    "prompt fills the context": (req([1] * 512), {"token_ids.ids"}),
    "prompt + max_tokens past context": (req([1] * 500, max_tokens=13), {"sampling.max_tokens"}),
    "max_tokens 0": (req([1], max_tokens=0), {"sampling.max_tokens"}),
    "negative temperature": (req([1], temperature=-0.5), {"sampling.temperature"}),
    "infinite temperature": (req([1], temperature=math.inf), {"sampling.temperature"}),
    "top_p 0": (req([1], top_p=0.0), {"sampling.top_p"}),
    "top_p > 1": (req([1], top_p=1.5), {"sampling.top_p"}),
    "top_k -2": (req([1], top_k=-2), {"sampling.top_k"}),
    "min_p 1": (req([1], min_p=1.0), {"sampling.min_p"}),
    "min_p < 0": (req([1], min_p=-0.1), {"sampling.min_p"}),
    "NaN everywhere": (
        req([1], temperature=NAN, top_p=NAN, min_p=NAN),
        {"sampling.temperature", "sampling.top_p", "sampling.min_p"},
    ),
    "too many stop strings": (req([1], stop=["a"] * 17), {"sampling.stop"}),
    "empty stop string": (req([1], stop=["ok", ""]), {"sampling.stop[1]"}),
    "stop token outside vocab": (req([1], stop_token_ids=[3, 99]), {"sampling.stop_token_ids[1]"}),
    "request_id too long": (req([1], request_id="r" * 257), {"request_id"}),
    "everything at once": (
        req([1, 200], request_id="x" * 300, temperature=-1, top_p=2, top_k=-3, min_p=NAN, stop=[""]),
        {
            "request_id",
            "token_ids.ids[1]",
            "sampling.temperature",
            "sampling.top_p",
            "sampling.top_k",
            "sampling.min_p",
            "sampling.stop[0]",
        },
    ),
}


def _encode(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


@pytest.mark.parametrize("name", list(BAD))
def test_validation_reports_every_violation(name: str) -> None:
    request, fields = BAD[name]
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(request, LIMITS, _encode)
    assert {v.field for v in exc.value.violations} == fields
    assert all(v.description for v in exc.value.violations)


def test_many_bad_ids_are_summarised() -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(req([1000] * 100), LIMITS, _encode)
    assert len(exc.value.violations) == 9 and exc.value.violations[-1].field == "token_ids.ids"


def test_defaults_and_conversion() -> None:
    prompt, p = validate_generate(req(text="hi"), LIMITS, _encode)
    assert prompt == _encode("hi")
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        DEFAULT_MAX_TOKENS,
        1.0,
        1.0,
        0,
        0.0,
        None,
    )
    _, p = validate_generate(
        req(
            [1], max_tokens=7, temperature=0, top_p=0.5, top_k=-1, seed=2**64 - 1, stop=["x"], ignore_eos=True
        ),
        LIMITS,
        _encode,
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.0, 0.5, -1, 2**64 - 1)
    assert (p.stop, p.ignore_eos, p.greedy) == (("x",), True, True)


def test_no_tokenizer_refuses_text_and_stop_strings() -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(req(text="hi", stop=["x"]), LIMITS, None)
    assert {v.field for v in exc.value.violations} == {"text", "sampling.stop"}


def _render(messages) -> list[int]:
    """A chat template in miniature: each turn's role and content, then the assistant's turn opened;
    it refuses a conversation that does not start with the user, as strict templates do."""
    if messages[0]["role"] != "user":
        raise ValueError("conversations must start with the user")
    return [t for m in messages for t in [1, *_encode(m["role"] + ":" + m["content"])]] + [1]


CHAT = Chat(_render, end_of_turn=(3,))


def chat_req(*turns: tuple[str, str], **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    r.messages.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in turns)
    return r


def test_a_conversation_is_rendered_and_stops_at_the_end_of_its_turn() -> None:
    prompt, p = validate_generate(chat_req(("user", "hi"), stop_token_ids=[5]), LIMITS, _encode, CHAT)
    assert prompt == _render([{"role": "user", "content": "hi"}])
    assert p.stop_token_ids == (5, 3)
    _, p = validate_generate(chat_req(("user", "hi"), ignore_eos=True), LIMITS, _encode, CHAT)
    assert p.stop_token_ids == (), "ignore_eos: past the end of the turn too"
    _, p = validate_generate(req(text="hi"), LIMITS, _encode, CHAT)
    assert p.stop_token_ids == (), "a text prompt is not a chat"


@pytest.mark.parametrize(
    ("request_", "chat", "fields"),
    [
        (chat_req(("user", "hi")), None, {"messages"}),  # no chat template
        (pb.GenerateRequest(messages=pb.ChatMessages()), CHAT, {"messages.messages"}),
        (chat_req(("user", "hi"), ("", "x"), ("r" * 65, "y")), CHAT,
         {"messages.messages[1].role", "messages.messages[2].role"}),
        (chat_req(("assistant", "hi")), CHAT, {"messages"}),  # the template refuses it
        (chat_req(*[("user", "x")] * 1025), CHAT, {"messages.messages"}),
        (chat_req(("user", "x" * 600)), CHAT, {"messages"}),  # renders past the context
    ],
)  # fmt: skip
def test_a_bad_conversation_is_refused_by_field(request_, chat, fields) -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(request_, LIMITS, _encode, chat)
    assert {v.field for v in exc.value.violations} == fields


def test_a_model_without_a_chat_template_refuses_messages_over_the_wire(client: Client) -> None:
    with pytest.raises(GenerationError) as exc:
        client.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in exc.value.violations] == ["messages"]
    assert not client.model_info().has_chat_template


@pytest.mark.parametrize(
    "name", ["id outside vocab", "prompt + max_tokens past context", "everything at once"]
)
def test_server_answers_invalid_argument_and_stays_healthy(
    server: ServerProcess, client: Client, name: str
) -> None:
    request, fields = BAD[name]
    with pytest.raises(grpc.RpcError) as exc:
        list(client._stub.Generate(request, timeout=10))
    err = exc.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(GenerationError) as wrapped:
        list(client.generate(list(request.token_ids.ids), **_sampling_kwargs(request)))
    assert wrapped.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert {v.field for v in wrapped.value.violations} == fields
    assert health_status(server.target, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    assert client.complete([1, 2, 3], max_tokens=4, temperature=0).finish_reason == "length"
    wait_pool_idle(client)


def _sampling_kwargs(request: pb.GenerateRequest) -> dict:
    s = request.sampling
    out = {f.name: v for f, v in s.ListFields()}
    for name in ("stop", "stop_token_ids"):
        if name in out:
            out[name] = list(out[name])
    return {**out, "request_id": request.request_id}


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized() -> None:
    seen = []

    def encode(text: str) -> list[int]:
        seen.append(text)
        return _encode(text)

    too_long = "a" * (LIMITS.max_text_chars + 1)
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(req(text=too_long), LIMITS, encode)
    assert [(v.field, v.description) for v in exc.value.violations] == [
        ("text", f"longer than {LIMITS.max_text_chars} characters")
    ]
    assert not seen, "the tokenizer never saw it"
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(
            chat_req(("user", too_long)), LIMITS, encode, Chat(lambda m: encode(m[0]["content"]))
        )
    assert [v.field for v in exc.value.violations] == ["messages"] and not seen


def test_a_chat_reply_without_max_tokens_may_run_to_the_end_of_the_context() -> None:
    prompt, p = validate_generate(chat_req(("user", "hi")), LIMITS, _encode, CHAT)
    assert p.max_tokens == LIMITS.max_context - len(prompt)


def test_a_tokenizer_that_names_ids_past_the_vocabulary_is_refused_by_field() -> None:
    wide = lambda text: [ord(c) for c in text]  # 'h' is 104: past the 97-token vocabulary
    with pytest.raises(InvalidRequest) as exc:
        validate_generate(req(text="hi"), LIMITS, wide)
    assert [v.field for v in exc.value.violations] == ["text"]
    assert "outside the model's vocabulary [0, 97): 104, 105" in exc.value.violations[0].description
