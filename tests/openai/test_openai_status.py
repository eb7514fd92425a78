"""Statuses that need a decode service of their own: a full queue (429), no decode at all (503), a
model without a chat template (400 on messages); and --served-model-name. The tiny random model
(no tokenizer: token-id prompts) starts in a second."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from shared.client.client import Client
from tests.openai.openai_testutil import FrontProcess
from tests.services.service_testutil import ServerProcess, random_spec, wait_pool_idle

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 500, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[ServerProcess, FrontProcess]]:
    # One running place, no queue; each step slowed so a long request holds the place for seconds.
    srv = ServerProcess(
        random_spec(), "--max-running", "1", "--max-queue", "0", "--page-size", "4",
        env={"PDSERVE_TEST_FAULTS": "step_delay:0.02"},
    )  # fmt: skip
    front = None
    try:
        front = FrontProcess(srv.target, "--served-model-name", "tiny")
        yield srv, front
        code, log = front.stop()
        assert code == 0, log
        srv.terminate()
        assert srv.wait() == 0
    finally:
        if front is not None:
            front.kill()
        srv.kill()


def test_served_model_name(tiny: tuple[ServerProcess, FrontProcess]) -> None:
    with openai.OpenAI(base_url=f"{tiny[1].url}/v1", api_key="x", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["tiny"]
        got = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, temperature=0)
        assert got.model == "tiny" and got.usage is not None and got.usage.completion_tokens == 2


def test_queue_full_is_429(tiny: tuple[ServerProcess, FrontProcess]) -> None:
    srv, front = tiny
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0) as c, Client(srv.target) as dc:
        running = c.completions.create(model="tiny", prompt=[1, 2], stream=True, **LONG)  # type: ignore[arg-type]
        next(iter(running))  # it holds the only running place
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="tiny", prompt=[3], max_tokens=2)
        assert info.value.status_code == 429 and info.value.code == "resource_exhausted"
        running.close()
        wait_pool_idle(dc, timeout=5)


def test_chat_without_a_template_is_400(tiny: tuple[ServerProcess, FrontProcess]) -> None:
    with openai.OpenAI(base_url=f"{tiny[1].url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert info.value.param == "messages" and "chat template" in str(info.value.message)


def test_no_decode_is_503() -> None:
    front = FrontProcess("127.0.0.1:1", wait_healthy=False)  # nothing listens on port 1
    try:
        with openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.models.list()
            assert info.value.status_code == 503 and info.value.code == "unavailable"
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="", prompt="hi", max_tokens=1)
            assert info.value.status_code == 503
    finally:
        code, log = front.stop()
        assert code == 0, log
