"""Invariants: named, severity-tagged correctness checks, registered once at import time."""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "Invariant",
    "InvariantError",
    "InvariantViolation",
    "Severity",
    "Violation",
    "all_invariants",
    "get",
    "strict_message",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
# CUDA's device-side assert truncates its message; keep ours whole.
_MAX_MESSAGE = 254


class InvariantError(ValueError):
    """A misuse of the invariants API (bad name, duplicate registration, bad configuration)."""


class InvariantViolation(AssertionError):
    """Raised on CPU where a CUDA device would trip a device-side assert."""


class Severity(enum.Enum):
    """What a violation costs, by level (OFF never checks).

    ============================  ====================================  =====================
    severity                      WARN                                   STRICT
    ============================  ====================================  =====================
    SOFTEN                        counted, logged at INFO                counted, logged
    GUARD                         counted, logged                        device-side assert
    FATAL_CONTAINABLE             counted, logged, failing rows reported device-side assert
    FATAL_UNCONTAINABLE           device-side assert                     device-side assert
    ============================  ====================================  =====================
    """

    SOFTEN = "soften"
    GUARD = "guard"
    FATAL_CONTAINABLE = "fatal_containable"
    FATAL_UNCONTAINABLE = "fatal_uncontainable"


@dataclass(frozen=True)
class Violation:
    """New hits of one invariant, reported by `Checker.poll()` to listeners.

    `rows` are the row ids the caller passed to `expect(..., rows=)` for the failing rows (stable
    request slots, so they stay meaningful when polling lags a step or two behind the checks).
    """

    name: str
    severity: Severity
    new_hits: int
    total: int
    rows: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class Invariant:
    """A named check. Constructing one registers it; a second with the same name is an error.

    `recover`, when given, is called from `Checker.poll()` with each `Violation` of this invariant,
    after the listeners: the owner's own response (e.g. abort the attributed requests).
    """

    name: str
    severity: Severity
    description: str
    recover: Callable[[Violation], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.severity, Severity):
            raise InvariantError(
                f"invariant {self.name!r}: severity must be a Severity, got {self.severity!r}"
            )
        if not _NAME.match(self.name):
            raise InvariantError(
                f"invariant name {self.name!r} must be dotted lowercase identifiers, "
                "e.g. 'swa.history_present'"
            )
        if len(strict_message(self.name)) > _MAX_MESSAGE:
            raise InvariantError(f"invariant name {self.name!r} is too long for a device-side assert message")
        _register(self)

    @property
    def namespace(self) -> str:
        return self.name.rsplit(".", 1)[0]


def strict_message(name: str) -> str:
    """The text of a STRICT failure, on the device and on CPU alike."""
    return f"invariant-check FAILED [{name}]"


_lock = threading.Lock()
_registry: dict[str, Invariant] = {}
_on_register: list[Callable[[Invariant], None]] = []


def _register(inv: Invariant) -> None:
    with _lock:
        if inv.name in _registry:
            raise InvariantError(f"invariant {inv.name!r} is already registered")
        _registry[inv.name] = inv
        hooks = list(_on_register)
    for hook in hooks:
        hook(inv)


def on_register(hook: Callable[[Invariant], None]) -> None:
    """Call `hook` for every invariant registered from now on (levels cache, checkers' slots)."""
    with _lock:
        _on_register.append(hook)


def get(name: str) -> Invariant:
    try:
        return _registry[name]
    except KeyError:
        raise InvariantError(f"no invariant named {name!r}") from None


def all_invariants() -> list[Invariant]:
    with _lock:
        return list(_registry.values())
