"""Progress of a long load (the weights of a checkpoint), to stderr.

On a terminal: a tqdm bar. Elsewhere (a log file, a pipe, `pdserve up`'s children, a Pod's log): no
bar, whose carriage returns would fill the log, but an INFO log line every `LOG_EVERY_S` seconds of a
load still running, then one line when it is done: visible where the process configures logging (the
services do), silent in a library caller that does not. `enabled=True` forces the bar, False turns
both off.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["LOG_EVERY_S", "Progress", "track"]

LOG_EVERY_S = 5.0
T = TypeVar("T")
log = logging.getLogger("shared.model.loader")


class Progress:
    """`update()` once per item of `total`; `close()` at the end (or use `track`)."""

    def __init__(self, label: str, total: int, enabled: bool | None = None, unit: str = "tensor") -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self._start = self._logged = time.monotonic()
        self._bar: Any = None
        tty = sys.stderr is not None and sys.stderr.isatty()
        self._log = enabled is None and not tty
        if enabled or (enabled is None and tty):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._log and time.monotonic() - self._logged >= LOG_EVERY_S:
            self._logged = time.monotonic()
            pct = 100 * self.done / max(self.total, 1)
            took = self._logged - self._start
            log.info(
                "%s: %d/%d %ss (%.0f%%), %.0f s", self.label, self.done, self.total, self.unit, pct, took
            )

    def close(self) -> None:
        took = time.monotonic() - self._start
        if self._bar is not None:
            self._bar.close()
        if self._bar is not None or self._log:
            log.info("%s: %d %ss in %.1f s", self.label, self.done, self.unit, took)


def track(items: Iterable[T], progress: Progress) -> Iterator[T]:
    """`items`, counting each one as it is consumed."""
    try:
        for item in items:
            yield item
            progress.update()
    finally:
        progress.close()
