"""Check levels: OFF | WARN | STRICT, from PDSERVE_INVARIANT_CHECK, with per-namespace overrides.

    PDSERVE_INVARIANT_CHECK=warn                      every invariant at WARN
    PDSERVE_INVARIANT_CHECK="warn,swa.*=strict"       WARN, but the swa namespace at STRICT
    PDSERVE_INVARIANT_CHECK="off,kv.page_ids_in_range=warn"

The most specific rule wins: an exact name, then the longest namespace pattern, then the default.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from invariants.registry import Invariant, InvariantError, Severity, all_invariants, on_register

ENV_VAR = "PDSERVE_INVARIANT_CHECK"

__all__ = ["ENV_VAR", "Level", "LevelConfig", "configure", "level_of", "levels", "parse"]


class Level(enum.Enum):
    OFF = "off"
    WARN = "warn"
    STRICT = "strict"


_PATTERN = re.compile(r"^(\*|[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*(\.\*)?)$")
_FORMS = (
    "accepted forms: 'off' | 'warn' | 'strict', optionally followed by comma-separated overrides "
    "'<name>=<level>' or '<namespace>.*=<level>', e.g. 'warn,swa.*=strict'"
)


@dataclass(frozen=True)
class LevelConfig:
    default: Level = Level.OFF
    overrides: tuple[tuple[str, Level], ...] = ()

    def level_for(self, name: str) -> Level:
        best: tuple[int, Level] | None = None
        for pattern, level in self.overrides:
            if pattern == name:
                return level
            if pattern == "*":
                rank = 0
            elif pattern.endswith(".*") and name.startswith(pattern[:-1]):
                rank = len(pattern)
            else:
                continue
            if best is None or rank >= best[0]:
                best = (rank, level)
        return best[1] if best else self.default

    def __str__(self) -> str:
        return ",".join([self.default.value, *(f"{p}={lvl.value}" for p, lvl in self.overrides)])


def _level(text: str, spec: str) -> Level:
    try:
        return Level(text.strip().lower())
    except ValueError:
        raise InvariantError(f"{ENV_VAR}={spec!r}: unknown level {text.strip()!r}; {_FORMS}") from None


def parse(spec: str) -> LevelConfig:
    """Parse a level spec; a malformed one raises InvariantError naming the accepted forms."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise InvariantError(f"{ENV_VAR}={spec!r}: empty entry; {_FORMS}")
    default = Level.OFF
    overrides: list[tuple[str, Level]] = []
    for i, part in enumerate(parts):
        if "=" not in part:
            if i != 0:
                raise InvariantError(f"{ENV_VAR}={spec!r}: a bare level may only come first; {_FORMS}")
            default = _level(part, spec)
            continue
        pattern, _, value = (s.strip() for s in part.partition("="))
        if not _PATTERN.match(pattern):
            raise InvariantError(f"{ENV_VAR}={spec!r}: bad name pattern {pattern!r}; {_FORMS}")
        overrides.append((pattern, _level(value, spec)))
    return LevelConfig(default, tuple(overrides))


def from_env() -> LevelConfig:
    spec = os.environ.get(ENV_VAR, "")
    return parse(spec) if spec.strip() else LevelConfig()


# Resolved level per invariant name, rebuilt when the configuration changes, so `expect` pays one
# dict lookup. Configuration is read at import: a malformed value fails the process at start-up.
_lock = threading.Lock()
_config: LevelConfig = from_env()
_resolved: dict[str, Level] = {}


def _resolve_all() -> None:
    _resolved.clear()
    for inv in all_invariants():
        _resolved[inv.name] = _config.level_for(inv.name)


def _on_register(inv: Invariant) -> None:
    _resolved[inv.name] = _config.level_for(inv.name)


on_register(_on_register)


def configure(spec: str | LevelConfig | None = None) -> LevelConfig:
    """Set the levels from code (a spec string, a LevelConfig, or None to re-read the environment).

    Returns the previous configuration. Checks captured in a CUDA graph keep the level they were
    captured with: re-capture after changing levels.
    """
    global _config
    new = from_env() if spec is None else parse(spec) if isinstance(spec, str) else spec
    with _lock:
        old, _config = _config, new
        _resolve_all()
    return old


def current() -> LevelConfig:
    return _config


@contextlib.contextmanager
def levels(spec: str | LevelConfig) -> Iterator[LevelConfig]:
    """Temporarily set levels (tests): `with levels("warn,swa.*=strict"): ...`."""
    old = configure(spec)
    try:
        yield _config
    finally:
        configure(old)


def level_of(inv: Invariant) -> Level:
    level = _resolved.get(inv.name)
    return level if level is not None else _config.level_for(inv.name)


def crashes(severity: Severity, level: Level) -> bool:
    """Whether a violation at this severity and level stops the process (device-side assert)."""
    if level is Level.STRICT:
        return severity is not Severity.SOFTEN
    if level is Level.WARN:
        return severity is Severity.FATAL_UNCONTAINABLE
    return False
