"""Files a service re-reads when they change: certificates and token lists mounted from Kubernetes
Secrets, which the kubelet replaces in place (an atomic swap of a symlinked directory) on rotation."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

__all__ = ["WatchedFiles"]

_STAT_EVERY_S = 1.0  # a handshake or a call checks at most this often: a stat per file, no read


class WatchedFiles:
    """The contents of a few files, re-read when one of them changes (its inode, size or mtime).

    `read()` returns the current bytes of every file and whether they changed since the last read. A
    file that cannot be read mid-rotation keeps the previous contents (and `error` says why); at
    construction it raises OSError, so a service with a missing file does not start."""

    def __init__(self, paths: Sequence[str], stat_every_s: float = _STAT_EVERY_S) -> None:
        self.paths = tuple(paths)
        self._every = stat_every_s
        self._lock = threading.Lock()  # grpc calls the TLS fetcher from its own threads
        self._checked = time.monotonic()
        self._sig = self._signature()
        self.contents = tuple(_read(p) for p in self.paths)
        self.error: str | None = None

    def _signature(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def read(self) -> tuple[tuple[bytes, ...], bool]:
        """(contents, changed): changed is True once per change."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self._every:
                return self.contents, False
            self._checked = now
            try:
                sig = self._signature()
                if sig == self._sig:
                    return self.contents, False
                contents = tuple(_read(p) for p in self.paths)
            except OSError as e:  # mid-swap, or removed: keep serving what was read before
                self.error = f"{e.filename}: {e.strerror}"
                return self.contents, False
            self._sig, self.error = sig, None
            changed = contents != self.contents
            self.contents = contents
            return contents, changed


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
