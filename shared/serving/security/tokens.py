"""Bearer tokens: who a caller of the public API is.

A token list is one entry per line (`#` starts a comment), from a file (--auth-tokens-file, re-read when
it changes, so a rotated Secret takes effect without a restart) and/or the PDSERVE_AUTH_TOKENS
variable (entries separated by newlines or commas; never a flag, which `ps` would show):

    alice:3f9c...e1          a caller named alice
    ops:77ab...90:admin      an admin: may Abort anyone's request

A call sends `authorization: Bearer <token>` metadata. Tokens are compared as SHA-256 digests with
`hmac.compare_digest`, every entry every time: how long a check takes does not say how much of a
guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

from shared.serving.security.files import WatchedFiles

__all__ = ["ENV", "Identity", "TokenError", "Tokens"]

ENV = "PDSERVE_AUTH_TOKENS"
log = logging.getLogger("pdserve.auth")


class TokenError(ValueError):
    """A token list that cannot be used (named by where it came from and its line)."""


@dataclass(frozen=True)
class Identity:
    """Who a call comes from: a token's name, or the name on a client certificate."""

    name: str
    admin: bool = False


def _parse(text: str, where: str, sep: str = "\n") -> list[tuple[bytes, Identity]]:
    entries = []
    for n, raw in enumerate(text.replace(sep, "\n").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]) or (len(parts) == 3 and parts[2] != "admin"):
            raise TokenError(f"{where} entry {n}: expected name:token or name:token:admin")
        name, token = parts[0].strip(), parts[1].strip()
        if len(token) < 16:
            raise TokenError(f"{where} entry {n} ({name}): a token needs at least 16 characters")
        entries.append((hashlib.sha256(token.encode()).digest(), Identity(name, len(parts) == 3)))
    return entries


class Tokens:
    """The accepted tokens; `identify(token)` is the caller they name, or None."""

    def __init__(self, path: str = "", env: str | None = None) -> None:
        self.path = path
        self._env = _parse(env, f"${ENV}", ",") if env else []
        self._file: WatchedFiles | None = None
        self._from_file: list[tuple[bytes, Identity]] = []
        if path:
            try:
                self._file = WatchedFiles([path])
            except OSError as e:
                raise TokenError(f"--auth-tokens-file {path}: {e.strerror}") from e
            self._from_file = self._parse_file(self._file.contents[0])
        if not self._env and not self._from_file:
            where = f"--auth-tokens-file {path}" if path else f"${ENV}"
            raise TokenError(f"{where}: no token in it (an empty list would refuse every call)")

    @classmethod
    def configured(cls, path: str, environ: dict[str, str] | None = None) -> Tokens | None:
        """The tokens the flag and the environment give; None when neither does (auth off)."""
        env = (os.environ if environ is None else environ).get(ENV, "")
        return cls(path, env) if path or env.strip() else None

    def _parse_file(self, data: bytes) -> list[tuple[bytes, Identity]]:
        return _parse(data.decode("utf-8", errors="replace"), f"--auth-tokens-file {self.path}")

    def _entries(self) -> list[tuple[bytes, Identity]]:
        if self._file is not None:
            (data,), changed = self._file.read()
            if changed:
                try:
                    self._from_file = self._parse_file(data)
                    log.info("tokens reloaded from %s (%d)", self.path, len(self._from_file))
                except TokenError as e:
                    log.error("%s; keeping the tokens read before", e)
        return self._env + self._from_file

    def identify(self, token: str) -> Identity | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, who in self._entries():  # every entry: no early exit
            if hmac.compare_digest(digest, known) and found is None:
                found = who
        return found
