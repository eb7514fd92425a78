"""Text <-> token ids, chat templates and streaming detokenization, on top of the `tokenizers` library.

Built from a Hugging Face tokenizer.json, or rebuilt from a GGUF file's `tokenizer.ggml.*` metadata the
way transformers' GGUF integration does it (`gguf_tokenizer.py`), so that both give the same ids as
transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from shared.model.gguf_tokenizer import gguf_backend, gguf_chat_template


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


_SLICE_CHARS = 1 << 16


class PromptTooLong(ValueError):
    """A text that encodes to more tokens than the caller takes: `tokens` of them, or (not `exact`)
    more than `tokens`."""

    def __init__(self, tokens: int, exact: bool = True) -> None:
        super().__init__(f"{'' if exact else 'over '}{tokens} tokens")
        self.tokens = tokens
        self.exact = exact


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        conf_file = path / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.exists() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_text(conf.get("bos_token")),
            eos_token=_token_text(conf.get("eos_token")),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """meta: GGUF key -> value (strings decoded, arrays as lists), at least the tokenizer.* keys. A
        file without its chat template gets its architecture's, where we know it (Gemma 3's)."""
        tokens = meta["tokenizer.ggml.tokens"]
        bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            gguf_backend(meta),
            chat_template=gguf_chat_template(meta),
            bos_token=tokens[bos] if bos is not None else None,
            eos_token=tokens[eos] if eos is not None else None,
            eos_token_ids=() if eos is None else (int(eos),),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """The ids of `text`; PromptTooLong when there are more than `max_tokens`.

        A long text goes through `encode_batch`, which lets go of the GIL while it runs (plain `encode`
        holds it throughout: seconds for a few MB, every other thread of the server frozen). Making and
        freeing the ids of millions of tokens holds the GIL too, so with `max_tokens` a long text is
        first counted slice by slice and refused once it is clearly over."""
        if max_tokens is not None and len(text) > _SLICE_CHARS:
            self._refuse_far_over(text, max_tokens)
        if len(text) > _SLICE_CHARS:
            enc = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        if max_tokens is not None and len(enc) > max_tokens:
            raise PromptTooLong(len(enc))
        return enc.ids

    def _refuse_far_over(self, text: str, max_tokens: int) -> None:
        # Slices may tokenize a little differently from the whole at their cuts: only twice the limit
        # is clearly over; below that the exact count decides.
        counted = 0
        for start in range(0, len(text), _SLICE_CHARS):
            piece = [text[start : start + _SLICE_CHARS]]
            counted += len(self.backend.encode_batch(piece, add_special_tokens=False)[0])
            if counted > 2 * max_tokens:
                raise PromptTooLong(2 * max_tokens, exact=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template (same Jinja settings as transformers). Encode the result with
        add_special_tokens=False: the template already writes the special tokens it wants."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A conversation's prompt: the chat template rendered with the assistant's turn opened.
        ValueError when the template refuses the conversation (its raise_exception, a sandbox breach)."""
        try:
            text = self.apply_chat_template(messages, add_generation_prompt=True)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(str(e) or type(e).__name__) from e
        return self.encode(text, add_special_tokens=False)

    @functools.cached_property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token the chat template closes an assistant turn with (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>, Gemma's <end_of_turn>), found by rendering a turn and reading what
        follows its text; () without a template or when nothing special follows. A chat request stops
        there as it would at end-of-sequence: otherwise the model writes the next turn too."""
        if self.chat_template is None:
            return ()
        mark = "\x00pdserve\x00"
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}]
        try:
            text = self.apply_chat_template(turns, add_generation_prompt=False)
        except jinja2.exceptions.TemplateError:
            return ()
        after = text.partition(mark)[2]
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids = self.encode(after, add_special_tokens=False)[:1] if after else []
        return tuple(i for i in ids if i in special)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Feed generated ids one by one; get text deltas whose concatenation is the full decode.

    A token that ends inside a multi-byte UTF-8 character yields "" until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, int(token_id)) or ""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> jinja2.Environment:
    # Templates come from checkpoints, i.e. untrusted: sandboxed, with transformers' settings and helpers.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
