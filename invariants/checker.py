"""The Checker: a per-device counter slab that checks write into and `poll()` reads without blocking.

Device side: `counts[slot]` (int64, cumulative failing rows) and `bits[slot, word]` (int32 bitmask of
the row ids that failed since the last poll), preallocated so checks can be captured in CUDA graphs.
Host side: a pinned mirror. `poll()` reads the mirror only once the copy's event has completed
(`event.query()`), then enqueues the next copy and the clearing of the row bits on the same stream.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from invariants import batched, concurrent
from invariants.predicates import Predicate
from invariants.registry import (
    Invariant,
    InvariantError,
    InvariantViolation,
    Severity,
    Violation,
    strict_message,
)

__all__ = ["Checker", "Listener"]

Listener = Callable[[Violation], None]
log = logging.getLogger("pdserve.invariants")

_LOG_LEVEL = {
    Severity.SOFTEN: logging.INFO,
    Severity.GUARD: logging.WARNING,
    Severity.FATAL_CONTAINABLE: logging.ERROR,
    Severity.FATAL_UNCONTAINABLE: logging.CRITICAL,
}


class _Throttle:
    """First hit logged at once, then at most one line per interval: '+N hits, T total'."""

    __slots__ = ("last", "unlogged")

    def __init__(self) -> None:
        self.last: float | None = None
        self.unlogged = 0


class _Deferred(threading.local):
    """One thread's checks deferred inside `invariants.batched_checks()` (predicate, row ids, slot)."""

    def __init__(self) -> None:
        self.checks: list[tuple[Predicate, torch.Tensor | None, int]] = []


class Checker:
    """Counts invariant hits on one device. One per device per process; see `invariants.checker()`."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        max_invariants: int = 128,
        max_rows: int = 4096,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        use_triton: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_rows = max_rows
        self.log_interval_s = log_interval_s
        self._clock = clock
        self._on_cuda = self.device.type == "cuda"
        self._use_triton = self._on_cuda if use_triton is None else use_triton
        if self._on_cuda and not self._use_triton:
            raise InvariantError("on CUDA checks run as the fused Triton kernel: the torch path would sync")
        words = (max_rows + 31) // 32
        # Normal tensors even when first used inside torch.inference_mode(): poll() updates them later.
        with torch.inference_mode(False):
            self.counts = torch.zeros(max_invariants, dtype=torch.int64, device=self.device)
            self.bits = torch.zeros(max_invariants, words, dtype=torch.int32, device=self.device)
            # Per-row verdicts of column-split launches and their ticket counter (kernels/check_rows).
            self.scratch = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
            self.ticket = torch.zeros(1, dtype=torch.int32, device=self.device)
            if self._on_cuda:
                self._counts_host = torch.zeros_like(self.counts, device="cpu").pin_memory()
                self._bits_host = torch.zeros_like(self.bits, device="cpu").pin_memory()
                self._event = torch.cuda.Event()
        # Made now, like the slab, so that it exists before any capture that forks onto it.
        self._side = concurrent.SideBranch(self.device) if self._on_cuda else None
        self._pending = False
        self._deferred = _Deferred()
        self._graph_tables: list[torch.Tensor] = []  # read by captured uploads: kept with the Checker
        self._slots: dict[str, int] = {}
        self._invariants: list[Invariant] = []
        self._seen = np.zeros(max_invariants, dtype=np.int64)
        self._throttle: list[_Throttle] = []
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    # ---- checking (hot path: enqueue only) ----

    def slot(self, inv: Invariant) -> int:
        slot = self._slots.get(inv.name)
        if slot is None:
            with self._lock:
                slot = self._slots.get(inv.name)
                if slot is None:
                    slot = len(self._invariants)
                    if slot >= self.counts.shape[0]:
                        raise InvariantError(
                            f"Checker on {self.device}: more than {slot} invariants; raise max_invariants"
                        )
                    self._invariants.append(inv)
                    self._throttle.append(_Throttle())
                    self._slots[inv.name] = slot
        return slot

    def check(self, inv: Invariant, pred: Predicate, rows: torch.Tensor | None, *, crash: bool) -> None:
        """Evaluate `pred`: count its failing rows, or (crash=True) stop on the first failure."""
        if pred.device != self.device:
            raise InvariantError(f"{inv.name}: predicate on {pred.device}, checker on {self.device}")
        if rows is not None:
            if rows.device != self.device or rows.dim() != 1 or rows.shape[0] != pred.id_rows:
                raise InvariantError(
                    f"{inv.name}: rows must be a 1-D tensor of {pred.id_rows} row ids on {self.device}, "
                    f"got shape {tuple(rows.shape)} on {rows.device}"
                )
            if rows.dtype not in (torch.int32, torch.int64):
                raise InvariantError(f"{inv.name}: rows must be int32 or int64, got {rows.dtype}")
        slot = self.slot(inv)
        if crash and not self._on_cuda:
            # CPU tensors are already computed: checking now is not a sync with any device.
            if not bool(pred.row_ok().all()):
                raise InvariantViolation(strict_message(inv.name))
            return
        if self._on_cuda and self._use_triton and torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):  # Triton launches on the thread's current device
                return self.check(inv, pred, rows, crash=crash)
        if self._use_triton:
            from invariants.kernels import check_rows

            if not crash and batched.depth(self.device) and check_rows.groupable(pred):
                self._deferred.checks.append((pred, rows, slot))  # launched by flush()
                batched.note_pending(self.device, self)
                return
            side = self._side if self._side is not None and concurrent.depth(self.device) else None
            used = check_rows.launch(
                pred, counts=self.counts, bits=self.bits, scratch=self.scratch, ticket=self.ticket,
                slot=slot, rows=rows,
                assert_message=strict_message(inv.name) if crash else None,
                fork=None if side is None else side.fork,
            )  # fmt: skip
            if side is not None and used:
                side.hold(used)
            return
        self._count_with_torch(pred, rows, slot)

    def flush(self) -> None:
        """Launch this thread's deferred checks, one kernel per kind (`invariants.batched_checks()`
        calls it as its outermost block ends)."""
        checks, self._deferred.checks = self._deferred.checks, []
        if not checks:
            return
        from invariants.kernels import check_rows

        with torch.cuda.device(self.device) if self._on_cuda else contextlib.nullcontext():
            side = self._side if self._side is not None and concurrent.depth(self.device) else None
            used, tables = check_rows.launch_grouped(
                checks, counts=self.counts, bits=self.bits, fork=None if side is None else side.fork
            )
            if side is not None and used:
                side.hold(tuple(used))
            if self._on_cuda and torch.cuda.is_current_stream_capturing():
                self._graph_tables += tables

    def discard(self) -> None:
        """Drop this thread's deferred checks (their block failed before its end)."""
        self._deferred.checks = []

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The stream checks run on inside `invariants.concurrent_checks()` (None on CPU)."""
        return None if self._side is None else self._side.stream

    def join(self) -> None:
        """Order the current stream after this thread's checks on the side stream (no-op if none).

        The outermost `concurrent_checks()` block joins as it ends, and `poll()` before its copy.
        """
        if self._side is not None:
            self._side.join()

    def _count_with_torch(self, pred: Predicate, rows: torch.Tensor | None, slot: int) -> None:
        bad = ~pred.row_ok()
        self.counts[slot] += bad.sum()
        if rows is not None:
            rows = rows.repeat(pred.layers)
            for rid in rows[bad].tolist():
                if 0 <= rid < self.max_rows:
                    word, bit = divmod(rid, 32)
                    value = int(self.bits[slot, word]) | (1 << bit)
                    self.bits[slot, word] = value - (1 << 32) if value >= 1 << 31 else value

    # ---- reporting (where the scheduler already waits) ----

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def poll(self) -> list[Violation]:
        """Report hits whose copy has landed; never blocks. Call once per scheduler step."""
        if not self._on_cuda:
            return self._consume(self.counts.numpy(), self._take_bits_cpu())
        found: list[Violation] = []
        if self._pending:
            if not self._event.query():
                return found
            self._pending = False
            found = self._consume(self._counts_host.numpy(), self._bits_host.numpy())
        self._enqueue_copy()
        return found

    def report(self, found: list[Violation]) -> list[Violation]:
        """Violations another process's checker found (a tensor-parallel rank's), reported as this
        checker's: logged and handed to the listeners. Returns them."""
        for v in found:
            log.log(_LOG_LEVEL[v.severity], "invariant %s violated on another rank: %d hits, rows %s",
                    v.name, v.new_hits, list(v.rows))  # fmt: skip
            for listener in list(self._listeners):
                listener(v)
        return list(found)

    def drain(self) -> list[Violation]:
        """Blocking poll for shutdown and tests: waits for the device and reports everything."""
        if not self._on_cuda:
            return self.poll()
        torch.cuda.synchronize(self.device)
        found = self.poll()  # consumes a copy in flight, enqueues a fresh one
        if self._pending:
            self._event.synchronize()
        return found + self.poll()

    def totals(self) -> dict[str, int]:
        """Hits per invariant as of the last poll."""
        return {inv.name: int(self._seen[i]) for i, inv in enumerate(self._invariants)}

    def _enqueue_copy(self) -> None:
        n = len(self._invariants)
        if n == 0:
            return
        self.join()  # polled inside a block: the copy and the clearing must follow its checks
        with torch.cuda.device(self.device):
            self._counts_host[:n].copy_(self.counts[:n], non_blocking=True)
            self._bits_host[:n].copy_(self.bits[:n], non_blocking=True)
            self.bits[:n].zero_()
            self._event.record()
        self._pending = True

    def _take_bits_cpu(self) -> np.ndarray:
        bits = self.bits.numpy().copy()
        self.bits.zero_()
        return bits

    def _consume(self, counts: np.ndarray, bits: np.ndarray) -> list[Violation]:
        found = []
        now = self._clock()
        for slot, inv in enumerate(list(self._invariants)):
            total = int(counts[slot])
            new = total - int(self._seen[slot])
            rows: tuple[int, ...] = ()
            if new > 0:
                self._seen[slot] = total
                rows = _rows_of(bits[slot])
                found.append(Violation(inv.name, inv.severity, new, total, rows))
            self._log(slot, inv, max(new, 0), total, now, rows)
        for violation in found:
            for listener in list(self._listeners):
                listener(violation)
            recover = self._invariants[self._slots[violation.name]].recover
            if recover is not None:
                recover(violation)
        return found

    def _log(
        self, slot: int, inv: Invariant, new: int, total: int, now: float, rows: tuple[int, ...]
    ) -> None:
        th = self._throttle[slot]
        th.unlogged += new
        if th.unlogged == 0:
            return
        if th.last is None:
            log.log(_LOG_LEVEL[inv.severity], "invariant %s violated: %d hits, rows %s (%s)",
                    inv.name, th.unlogged, list(rows), inv.description)  # fmt: skip
        elif now - th.last >= self.log_interval_s:
            log.log(
                _LOG_LEVEL[inv.severity], "invariant %s: +%d hits, %d total", inv.name, th.unlogged, total
            )
        else:
            return
        th.last, th.unlogged = now, 0


def _rows_of(words: np.ndarray) -> tuple[int, ...]:
    """Row ids whose bit is set in an int32 bitmask."""
    nz = np.flatnonzero(words)
    if nz.size == 0:
        return ()
    bits = np.unpackbits(words[nz].astype("<u4").view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    word_idx, bit_idx = np.nonzero(bits)
    return tuple(int(r) for r in nz[word_idx] * 32 + bit_idx)
