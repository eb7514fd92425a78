"""The embedded default model (SmolLM2-135M-Instruct) behind a real server answers a chat: written out
as its ChatML text, or as messages the server renders with the checkpoint's own chat template, the
reply ending with its turn."""

from __future__ import annotations

import grpc
import pytest

from shared.client.client import Client, GenerationError
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

            assert info.has_chat_template
            question = [{"role": "user", "content": "What is the capital of France?"}]
            reply = c.complete(messages=question, max_tokens=64, temperature=0)
            assert "Paris" in reply.text, reply.text
            # The turn ended at <|im_end|>: a stop, not the length limit, and no next turn written.
            assert reply.finish_reason == "stop" and reply.usage.completion_tokens < 64
            assert reply.token_ids[-1] == 2 and "<|im_start|>" not in reply.text
            assert reply.text.strip() == text.strip(), "the same prompt as the template written out"

            with pytest.raises(GenerationError) as bad:
                c.complete(messages=[{"role": "", "content": "hi"}], max_tokens=4)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in bad.value.violations] == ["messages.messages[0].role"]
    finally:
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()
