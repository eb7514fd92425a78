"""The official `openai` client against the front, the front against a real decode service on the
embedded model: completions and chat, streamed and not, /v1/models, and OpenAI's errors."""

from __future__ import annotations

import openai
import pytest

from shared.client.client import Client

pytestmark = pytest.mark.slow  # a real decode service on the embedded model (CPU)

PROMPT = "Once upon a time"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(oai: openai.OpenAI, decode_client: Client) -> None:
    name = decode_client.model_info().model_name
    models = oai.models.list().data
    assert [m.id for m in models] == [name]
    assert models[0].owned_by == "pdserve" and models[0].created > 0
    assert oai.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_completion_streamed_equals_whole(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=5, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 5 and whole.usage.prompt_tokens > 0
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"

    stream = oai.completions.create(
        model=whole.model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    events = list(stream)
    text = "".join(c.choices[0].text for c in events if c.choices)
    finishes = [c.choices[0].finish_reason for c in events if c.choices and c.choices[0].finish_reason]
    assert text == choice.text and finishes == ["length"]
    assert [c.usage for c in events if c.usage] == [whole.usage]  # once, on the last chunk
    assert events[-1].choices == [] and all(c.id == events[0].id for c in events)


def test_completion_of_token_ids(oai: openai.OpenAI, decode_client: Client) -> None:
    ids = [28, 260, 2240, 282]
    want = decode_client.complete(ids, max_tokens=3, temperature=0)
    got = oai.completions.create(model="", prompt=ids, max_tokens=3, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)


def test_completion_stop_string_and_sampling_extras(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0)
    stop = whole.choices[0].text.split()[1]  # a word the greedy answer reaches
    got = oai.completions.create(
        model="", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=-3, stop=stop, user="someone",
        extra_body={"top_k": 1, "min_p": 0.05, "ignored_by_openai_too": True},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop" and stop not in got.choices[0].text  # top_k=1: greedy


def test_chat_streamed_equals_whole(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="", messages=QUESTION, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"  # the template's end-of-turn token, before max_tokens
    assert whole.object == "chat.completion" and whole.usage is not None
    assert whole.usage.prompt_tokens > 10  # the rendered template, not the bare question

    stream = oai.chat.completions.create(
        model="", messages=QUESTION, max_completion_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    events = list(stream)
    deltas = [c.choices[0].delta for c in events if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    assert [c.choices[0].finish_reason for c in events if c.choices][-1] == "stop"
    use = events[-1].usage
    assert use is not None
    assert use.prompt_tokens == whole.usage.prompt_tokens
    assert use.completion_tokens == whole.usage.completion_tokens
    # The same prompt a second time: its whole pages come from the prefix cache.
    assert use.prompt_tokens_details is not None and use.prompt_tokens_details.cached_tokens > 0


def test_chat_content_parts_and_developer_role(oai: openai.OpenAI) -> None:
    messages = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    got = oai.chat.completions.create(model="", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert got.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "params"),
    [
        ({"temperature": -1}, {"temperature", "sampling.temperature"}),
        ({"top_p": 2.0}, {"top_p"}),
        ({"n": 2}, {"n"}),
        ({"max_tokens": 100_000}, {"max_tokens"}),
        ({"max_tokens": 0}, {"max_tokens"}),
        ({"logprobs": 2}, {"logprobs"}),
        ({"echo": True}, {"echo"}),
        ({"extra_body": {"top_k": "many"}}, {"top_k"}),
        ({"prompt": ["one", "two"]}, {"prompt"}),
        ({"prompt": ""}, {"prompt"}),
        ({"stop": ["x"] * 100}, {"stop"}),
    ],
)
def test_completion_errors(oai: openai.OpenAI, kwargs: dict, params: set[str]) -> None:
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="", max_tokens=kwargs.pop("max_tokens", 2), **kwargs)
    err = info.value
    assert err.status_code == 400 and err.param in params, err.body
    assert isinstance(err.body, dict) and err.body["message"] and err.body["type"] == "invalid_request_error"


def test_chat_errors(oai: openai.OpenAI) -> None:
    cases: list[tuple[dict, str]] = [
        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),  # the name the caller used
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.[0].role"),
    ]
    for kwargs, param in cases:
        kwargs = {"messages": QUESTION, **kwargs}
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="", **kwargs)
        assert info.value.param == param, (kwargs, info.value.body)


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=1)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)  # type: ignore[arg-type]
