"""Tokenizer: same ids as transformers' tokenizer built from the same GGUF, chat templates, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from shared.model import Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "Grüße aus Köln: naïve café, 東京タワー, Привет мир! 🦀🎨 ∑x² ≤ 1e-4",
    "def f(x):\n    return x ** 2  # 12345 67",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "I'm sure they'll say \"it's fine\" -- won't they?",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Ünïcödé? 🦀"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And numbers 2024?"},
]


@pytest.fixture(scope="module")
def tok(smollm) -> Tokenizer:
    return smollm.tokenizer


@pytest.fixture(scope="module")
def hf_tok(hf_gguf_dir, hf_reads_smollm):
    from transformers import AutoTokenizer

    with hf_reads_smollm():  # transformers' own reading of the vocabulary, from the test run's one parse
        return AutoTokenizer.from_pretrained(hf_gguf_dir, gguf_file="model.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers_gguf_tokenizer(tok: Tokenizer, hf_tok, text: str) -> None:
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special)
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, generation_prompt: bool) -> None:
    text = tok.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
    assert text == hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
    hf_ids = hf_tok.apply_chat_template(CHAT, add_generation_prompt=generation_prompt, return_dict=False)
    assert tok.encode(text, add_special_tokens=False) == list(hf_ids)


def test_default_chat_template_renders_the_smollm_format(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system prompt
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> stay whole


@pytest.mark.parametrize("text", [TEXTS[2], "🦀🎨🧑‍🚀 done", "日本語のテキスト、そして emoji 🦀."])
def test_streaming_detokenizer_never_emits_broken_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    stream = tok.detokenizer()
    deltas = [stream.step(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # at least one token ended mid-character and was held back
    assert "".join(deltas) == tok.decode(ids) == text


def test_streaming_detokenizer_skips_special_tokens(tok: Tokenizer) -> None:
    ids = [*tok.encode("Paris.", add_special_tokens=False), 2]
    stream = tok.detokenizer()
    assert "".join(stream.step(i) for i in ids) == "Paris."
    keep = tok.detokenizer(skip_special_tokens=False)
    assert "".join(keep.step(i) for i in ids) == "Paris.<|im_end|>"


def test_tokenizer_json_directory_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|im_end|>",
            }
        )
    )
    again = Tokenizer.from_hf_dir(tmp_path)
    assert again.eos_token_ids == (2,)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_missing_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHAT)


def test_a_chat_prompt_opens_the_assistants_turn_and_its_end_is_the_templates_end_of_turn(
    tok: Tokenizer,
) -> None:
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert [tok.backend.id_to_token(i) for i in tok.end_of_turn_ids] == ["<|im_end|>"]


@pytest.mark.parametrize(
    ("template", "end"),
    [
        # Gemma's shape: the turn closes with <end_of_turn>, not the end-of-sequence token.
        ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}",
         "<end_of_turn>"),
        # A template that closes a turn with plain text has no end-of-turn token to stop at.
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", None),
    ],
)  # fmt: skip
def test_the_end_of_turn_token_is_read_from_the_template(
    tok: Tokenizer, template: str, end: str | None
) -> None:
    backend = HFTokenizer.from_str(tok.backend.to_str())
    backend.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    other = Tokenizer(backend, chat_template=template)
    assert [backend.id_to_token(i) for i in other.end_of_turn_ids] == ([end] if end else [])


def test_a_template_that_refuses_a_conversation_is_a_value_error(tok: Tokenizer) -> None:
    strict = Tokenizer(tok.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.encode_chat([{"role": "user", "content": "hi"}])
    assert strict.end_of_turn_ids == ()
