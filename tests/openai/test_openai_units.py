"""The front's mappings, without processes: gRPC field paths -> OpenAI parameters, request models, and
the Authorization header -> the bearer token forwarded to decode."""

from __future__ import annotations

import pytest

from shared.client.openai.edge import bearer_token
from shared.client.openai.errors import openai_param
from shared.client.openai.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("sampling.temperature", "temperature"),
        ("sampling.stop[3]", "stop"),
        ("sampling", None),
        ("text", "prompt"),
        ("token_ids.ids[7]", "prompt"),
        ("input", "prompt"),
        ("messages", "messages"),
        ("messages.messages", "messages"),
        ("messages.messages[2].role", "messages.[2].role"),
        ("request_id", None),
    ],
)
def test_openai_param(field: str, param: str | None) -> None:
    assert openai_param(field) == param


def test_chat_renames_max_tokens_for_its_errors() -> None:
    assert openai_param("sampling.max_tokens", {"max_tokens": "max_completion_tokens"}) == (
        "max_completion_tokens"
    )


def test_sampling_sends_only_what_was_set() -> None:
    req = CompletionRequest(prompt="hi", temperature=0, stop="x", seed=-1)
    assert req.sampling() == {"temperature": 0, "stop": ["x"], "seed": 2**64 - 1}
    assert CompletionRequest(prompt="hi").sampling() == {}


def test_prompt_shapes() -> None:
    assert CompletionRequest(prompt=[[1, 2]]).single_prompt() == [1, 2]
    assert CompletionRequest(prompt=["a"]).single_prompt() == "a"
    assert CompletionRequest(prompt=["a", "b"]).refusal() is not None


def test_chat_messages_and_max_completion_tokens() -> None:
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        max_tokens=5,
        max_completion_tokens=7,
    )  # type: ignore[arg-type]
    assert req.wire_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert req.sampling() == {"max_tokens": 7} and req.max_tokens_param() == "max_completion_tokens"
    image = {"type": "image_url", "image_url": {"url": "x"}}
    assert ChatCompletionRequest(messages=[{"role": "user", "content": [image]}]).refusal() == (  # type: ignore[list-item]
        "messages.[0].content.[0]",
        "content of type 'image_url' is not supported",
    )


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer sk-abc.DEF_123~+/=", "sk-abc.DEF_123~+/="),
        ("bearer  sk-abc ", "sk-abc"),  # the scheme in any case (RFC 9110), spaces around the key
        ("BEARER sk-abc", "sk-abc"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic c2stYWJj", None),  # not a bearer key: nothing forwarded
        ("Bearer two words", None),  # gRPC metadata could not carry it
        ("Bearer tökén", None),
    ],
)
def test_the_bearer_token_forwarded_to_decode(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token
