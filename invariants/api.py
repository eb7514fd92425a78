"""`expect`, `enabled`, `concurrent_checks`: the call sites' API. At OFF nothing is launched and nothing
is evaluated."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import TracebackType

import torch

from invariants import batched, concurrent
from invariants.checker import Checker
from invariants.levels import Level, crashes, level_of
from invariants.predicates import Predicate, is_true
from invariants.registry import Invariant, InvariantError

__all__ = ["batched_checks", "checker", "concurrent_checks", "enabled", "expect", "reset_checkers"]

PredicateLike = Predicate | torch.Tensor | Callable[[], "Predicate | torch.Tensor"]

_checkers: dict[torch.device, Checker] = {}
_lock = threading.Lock()


def _key(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cuda" if device is None and torch.cuda.is_available() else device or "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def checker(device: torch.device | str | None = None, **options: object) -> Checker:
    """The process's Checker for `device` (created on first use; options apply then only).

    Create it before capturing a CUDA graph: its slab must exist before capture.
    """
    dev = _key(device)
    found = _checkers.get(dev)
    if found is not None:
        return found
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise InvariantError(
            f"no Checker for {dev} yet: call invariants.checker({str(dev)!r}) before graph capture"
        )
    with _lock:
        if dev not in _checkers:
            _checkers[dev] = Checker(dev, **options)  # type: ignore[arg-type]
        return _checkers[dev]


def reset_checkers() -> None:
    """Forget every Checker (tests)."""
    with _lock:
        _checkers.clear()


def enabled(inv: Invariant) -> bool:
    """False at OFF: guard any preparation a check needs so that OFF costs nothing."""
    return level_of(inv) is not Level.OFF


def expect(inv: Invariant, predicate: PredicateLike, *, rows: torch.Tensor | None = None) -> None:
    """Check `predicate` under `inv`'s level without ever waiting for the device.

    `predicate` is a built-in Predicate, a bool tensor (every element must be true), or a callable
    returning either; at OFF the callable is never called. `rows` (int tensor, one id per leading
    row of the predicate) attributes failing rows to requests: pass stable request slots.
    """
    level = level_of(inv)
    if level is Level.OFF:
        return
    if callable(predicate) and not isinstance(predicate, torch.Tensor | Predicate):
        predicate = predicate()
    if isinstance(predicate, torch.Tensor):
        predicate = is_true(predicate)
    if not isinstance(predicate, Predicate):
        raise InvariantError(
            f"{inv.name}: expect() needs a Predicate or a bool tensor, got {type(predicate).__name__}"
        )
    device = predicate.device
    found = _checkers.get(device)  # fast path: a tensor's device carries its index
    (found or checker(device)).check(inv, predicate, rows, crash=crashes(inv.severity, level))


class _ConcurrentBlock:
    """A concurrent_checks block on a CUDA device: depth per thread and device, joins at the end."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        concurrent.enter(self.device)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        failed: Exception | None = None
        for branch in concurrent.leave(self.device):  # the outermost block: everything it forked
            try:
                branch.join()
            except Exception as err:  # join the others all the same
                failed = failed or err
        if failed is None:
            return
        if exc is None:
            raise failed
        # The block already failed (say, an invalidated capture): that is the error to see.
        exc.add_note(f"and joining its concurrent invariant checks failed too: {failed!r}")


_NOTHING = contextlib.nullcontext()


def concurrent_checks(device: torch.device | str | None = None) -> contextlib.AbstractContextManager[None]:
    """Run the checks of the block on a side stream, beside the block's own kernels.

    On CUDA at WARN/STRICT each check inside forks (the side stream waits for everything enqueued
    before the check) and the end of the block joins once (the current stream waits for every
    check), so work after the block, `poll()` included, sees all their counts, and a CUDA graph
    captured around the block holds the checks as parallel branches. Contract: a check reads its
    inputs at any time until the block ends, so check only what the block does not overwrite after
    the check. The block must lie wholly inside or outside a capture, and run on one stream. Blocks
    nest (the outermost joins); an exception still joins. On CPU, or with every check OFF, it is a
    no-op: checks inside behave exactly as outside (a CPU STRICT failure raises at once).
    """
    dev = _key(device)
    return _ConcurrentBlock(dev) if dev.type == "cuda" else _NOTHING


class _BatchedBlock:
    """A batched_checks block: depth per thread and device; the outermost end launches the deferred."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        batched.enter(self.device)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for chk in batched.leave(self.device):
            if exc is None:
                chk.flush()
            else:  # the block failed (say, an invalidated capture): launching now could fail too
                chk.discard()


def batched_checks(device: torch.device | str | None = None) -> contextlib.AbstractContextManager[None]:
    """Defer the block's WARN checks to its end and launch them as one kernel per kind.

    A check that would launch the fused kernel (CUDA, or a Checker built with `use_triton=True`) is
    recorded instead; the outermost block's end launches every recorded check of one kind (operation,
    dtypes, tile) as ONE kernel over a table of their tensors, so a step with a check per layer pays
    one kernel's ramp and tail, not one per layer. Contract: a check reads its inputs at the block's
    end, so check only what the block does not overwrite after the check (as `concurrent_checks`
    asks). STRICT checks, checks through an index, and float bounds launch at once, as outside. Inside
    a `concurrent_checks` block the batched launches fork onto its side stream. Under a CUDA graph
    capture the block must lie wholly inside the capture; each replay re-uploads the tables. An
    exception inside drops the deferred checks. Blocks nest (the outermost launches).
    """
    return _BatchedBlock(_key(device))
