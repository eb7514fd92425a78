"""A `tokenizers` backend rebuilt from a GGUF file's `tokenizer.ggml.*` metadata, the way transformers'
GGUF integration rebuilds it, so that both give the same ids; and the chat template of a file that lost
its own.

Two kinds: byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, Qwen) with the file's
merges, and Gemma's sentencepiece BPE ("llama" in a gemma3 file), whose merges the file does not
store: they are recovered from the vocabulary, as transformers' `gemma_tokenizer` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["gguf_backend", "gguf_chat_template"]

# llama.cpp's token types (gguf's TokenType): which vocabulary entries are added tokens.
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes for the `tokenizer.ggml.pre` names transformers knows; any other name (SmolLM2's
# "smollm" included) gets GPT-2's own regex inside the ByteLevel pre-tokenizer, as in transformers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# GGUF architectures whose "llama" (sentencepiece) vocabulary is Gemma's.
_GEMMA_ARCHS = ("gemma3",)

# Gemma 3's chat template, as google/gemma-3-*-it ship it: for a gemma3 file without
# `tokenizer.chat_template` (GGUF-my-repo conversions of the base checkpoints drop it).
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
_FAMILY_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def gguf_chat_template(meta: Mapping[str, Any]) -> str | None:
    """The file's chat template, else its architecture's (Gemma 3's), else None."""
    return meta.get("tokenizer.chat_template") or _FAMILY_TEMPLATES.get(meta.get("general.architecture", ""))


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table, that byte-level BPE vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> tuple[HFTokenizer, dict[str, int], set[str]]:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # Tokens written with characters outside the byte alphabet are respelled byte by byte.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, vocab, alphabet


def _gemma(meta: Mapping[str, Any], tokens: list[str]) -> tuple[HFTokenizer, dict[str, int]]:
    """transformers' `gemma_tokenizer` + `GemmaTokenizer`: a token of spaces alone is looked up as
    that many "▁"; the merges are every split of a token into two tokens, ranked by the token's place
    in the file (Gemma's scores do not follow its merge order), longer left parts first."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [
        (t[:j], t[j:]) for t in tokens for j in range(len(t) - 1, 0, -1) if t[:j] in vocab and t[j:] in vocab
    ]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk] if unk is not None else "<unk>",
    )  # fmt: skip
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def gguf_backend(meta: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer GGUF metadata describes (key -> value, strings decoded, arrays as lists)."""
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture", "")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        tok, vocab, alphabet = _byte_level(meta, tokens)
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would
        # grow the vocabulary past the model's, so (like transformers) it is skipped.
        spelled_ok = lambda t: set(t) <= alphabet
    elif kind == "llama" and arch in _GEMMA_ARCHS:
        tok, vocab = _gemma(meta, tokens)
        spelled_ok = lambda t: True
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported for {arch!r}; supported: 'gpt2' (byte-level "
            f"BPE), and 'llama' (sentencepiece) in {', '.join(_GEMMA_ARCHS)} files"
        )
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types, strict=False)
            if k == _CONTROL and spelled_ok(t)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=False)
            if k == _USER_DEFINED and t in vocab
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok
