"""Per-request output processing on the event loop: token ids -> text deltas, and stop strings.

Detokenizing here rather than on the scheduler thread keeps the engine loop to admit/step/emit (vLLM
moves it to another process for the same reason). Stop strings follow vLLM: the request finishes with
"stop" on the token whose text completes a stop string, and the text ends before it. While streaming,
the last len(longest stop) - 1 characters are held back, since they could be the start of a stop string
that the next token completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.model.tokenizer import Tokenizer

__all__ = ["OutputProcessor", "OutputStep"]


@dataclass(frozen=True)
class OutputStep:
    token_ids: list[int]  # the tokens consumed (a stop string drops those after its last token)
    text: str  # text now safe to send
    stopped: bool  # a stop string matched: the request is done


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()) -> None:
        self._detok = tokenizer.detokenizer() if tokenizer is not None else None
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0  # characters of _text already returned
        self.num_tokens = 0  # tokens consumed, i.e. the completion's length so far
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> OutputStep:
        if self.stopped:
            return OutputStep([], "", True)
        taken: list[int] = []
        for tok in token_ids:
            taken.append(tok)
            self.num_tokens += 1
            if self._detok is None:
                continue
            before = len(self._text)
            self._text += self._detok.step(tok)
            cut = self._find_stop(before)
            if cut is not None:
                self.stopped = True
                text, self._sent = self._text[self._sent : cut], cut
                self._text = self._text[:cut]
                return OutputStep(taken, text, True)
        safe = max(self._sent, len(self._text) - self._hold)
        text, self._sent = self._text[self._sent : safe], safe
        return OutputStep(taken, text, False)

    def flush(self) -> str:
        """The held-back text, once the request has finished for another reason."""
        text, self._sent = self._text[self._sent :], len(self._text)
        return text

    @property
    def text(self) -> str:
        return self._text

    def _find_stop(self, before: int) -> int | None:
        # Only a match that ends in the new text is new; it can start up to len(stop) - 1 chars earlier.
        hits = [i for s in self._stop if (i := self._text.find(s, max(0, before - len(s) + 1))) != -1]
        return min(hits) if hits else None
