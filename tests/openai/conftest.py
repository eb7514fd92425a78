"""One decode service on the embedded default model (SmolLM2-135M-Instruct: a tokenizer and a chat
template) once per test run, writing its spans to a file, and the OpenAI-compatible front before it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared.client.client import Client
from shared.model import default_gguf_path
from tests.openai.openai_testutil import FrontProcess
from tests.services.service_testutil import ServerProcess


@pytest.fixture(scope="session")
def spans_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai") / "decode-spans.jsonl"


@pytest.fixture(scope="session")
def decode(spans_path: Path) -> Iterator[ServerProcess]:
    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    srv = ServerProcess(
        "", "--device", "cpu", "--dtype", "float32", "--metrics-port", "0", "--num-pages", "64",
        "--max-running", "4",
        env={"PDSERVE_TEST_SPAN_FILE": str(spans_path)},
    )  # fmt: skip
    try:
        yield srv
        srv.terminate()
        assert srv.wait() == 0
    finally:
        srv.kill()


@pytest.fixture(scope="session")
def front(decode: ServerProcess) -> Iterator[FrontProcess]:
    proc = FrontProcess(decode.target)
    try:
        yield proc
        code, log = proc.stop()
        assert code == 0, log
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def decode_client(decode: ServerProcess) -> Iterator[Client]:
    with Client(decode.target) as c:
        yield c


@pytest.fixture
def oai(front: FrontProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
