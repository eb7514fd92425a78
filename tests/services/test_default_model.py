"""The embedded default model (SmolLM2-135M-Instruct) behind a real server streams text for a chat prompt."""

from __future__ import annotations

import pytest

from shared.client.client import Client
from shared.model import default_gguf_path
from tests.services.service_testutil import ServerProcess

# SmolLM2's chat template (ChatML), written out: the client has no tokenizer of its own.
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.slow
def test_default_model_streams_a_chat_answer() -> None:
    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    srv = ServerProcess("", "--device", "cpu", "--num-pages", "64", "--max-running", "2")
    try:
        with Client(srv.target) as c:
            info = c.model_info()
            assert info.model_name == "SmolLM2-135M-Instruct" and info.has_tokenizer
            stream = c.generate(CHAT, max_tokens=24, temperature=0)
            chunks = list(stream)
            text = "".join(ch.text for ch in chunks)
            assert len(chunks) > 1 and stream.finish_reason in ("stop", "length")
            assert "Paris" in text, text
    finally:
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()
