"""The scheduler both services build on: one thread owns the Engine and runs admit -> step -> emit.

The Engine is not thread-safe, so nothing else touches it. Other threads (the gRPC event loop) talk to
the scheduler through `submit` / `abort`, which only put work in an inbox under a lock and wake the
thread; results leave through each request's `emit` callback, called on the scheduler thread (the
servicer's callback hops onto the event loop). When there is nothing to do the thread sleeps on a
condition, so an idle server burns no CPU.

Subclasses plug in at a few hooks: `_start` (how a new request reaches the engine), `_abort_one`,
`_on_done` (a finished request, before its Finished event), `_after_step` and `_poll_interval` (wakes
an idle loop to poll work outside the engine, e.g. a transfer); `_post` runs a function on the
scheduler thread (how decode applies transferred KV). Servicers see only `submit`, `abort` and events,
never the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import invariants
from shared.engine.engine import Engine
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from shared.serving.faults import Faults
from shared.serving.kv_sizing import capacity_text
from shared.serving.scheduler_types import (
    AlreadyExists,
    Event,
    Finished,
    NotAccepting,
    PoolState,
    QueueFull,
    SchedulerConfig,
    SubmitError,
    Tokens,
)

__all__ = [
    "AlreadyExists",
    "Event",
    "Finished",
    "NotAccepting",
    "PoolState",
    "QueueFull",
    "Scheduler",
    "SchedulerConfig",
    "SubmitError",
    "Tokens",
]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    rid: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], Any]
    opts: Any = None  # a subclass's per-request options (remote prefill, window history, ...)
    req: Request | None = None  # set once the scheduler thread has handed it to the engine
    sent: int = 0  # output tokens already emitted


@dataclass
class _Inbox:
    new: list[_Entry] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    calls: list[Callable[[], None]] = field(default_factory=list)  # run on the scheduler thread

    def has_work(self) -> bool:
        return bool(self.new or self.aborts or self.calls)


class Scheduler:
    thread_name = "scheduler"

    def __init__(self, engine: Engine, cfg: SchedulerConfig | None = None) -> None:
        self.cfg = cfg or SchedulerConfig()
        self._engine = engine
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._live: dict[str, _Entry] = {}  # every submitted, unfinished request; guarded by _cond
        self._accepting = True
        self._stopping = False
        self.failure: BaseException | None = None
        self._state = self._pool_state()
        self._active: dict[str, _Entry] = {}  # handed to the engine, unfinished; scheduler thread only
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self.on_failure: Callable[[BaseException], None] | None = None
        self.faults: Faults | None = (
            None  # test-only fault injection (shared/serving/faults.py); None in production
        )
        self._on_violation: Callable[[invariants.Violation, tuple[str, ...]], None] | None = None

    def watch_invariants(self, callback: Callable[[invariants.Violation, tuple[str, ...]], None]) -> None:
        """Call `callback(violation, request ids)` for each violation the engine's checker reports.

        Called on the scheduler thread, inside the poll of an engine step, while the hurt requests still
        hold their window slots: that is when `violation.rows` (slots) map to request ids. The callback
        must only hand off (e.g. to the event loop).
        """
        self._on_violation = callback
        self._engine.checker.add_listener(self._attribute)

    def _attribute(self, v: invariants.Violation) -> None:
        callback = self._on_violation
        if callback is None:
            return
        slots = set(v.rows)
        rids = tuple(
            e.rid for e in self._active.values()
            if e.req is not None and e.req.window is not None and e.req.window.slot in slots
        )  # fmt: skip
        callback(v, rids)

    # ---- any thread ----

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, rid: str, prompt: list[int], params: SamplingParams, emit: Callable[[Event], Any],
        opts: Any = None,
    ) -> None:  # fmt: skip
        """Queue a request. `emit` gets its Tokens events then one Finished, on the scheduler thread."""
        with self._cond:
            if not self._accepting:
                raise NotAccepting(
                    "the server is draining or stopped" if self.failure is None else "engine failed"
                )
            if rid in self._live:
                raise AlreadyExists(f"request_id {rid!r} is already in flight")
            # Counted against capacity rather than the engine's waiting list, which lags the inbox by a
            # step: with max_queue 0 a request is still taken while a running place is free.
            if len(self._live) >= self._engine.cfg.max_running + self.cfg.max_queue:
                raise QueueFull(f"the queue is full ({self.cfg.max_queue} requests waiting to run)")
            entry = _Entry(rid, prompt, params, emit, opts)
            self._live[rid] = entry
            self._inbox.new.append(entry)
            self._cond.notify_all()

    def abort(self, rid: str) -> bool:
        """End a request (its stream gets Finished("abort")); False when it is not in flight."""
        with self._cond:
            if rid not in self._live:
                return False
            self._inbox.aborts.append(rid)
            self._cond.notify_all()
            return True

    def abort_all(self) -> int:
        with self._cond:
            self._inbox.aborts.extend(self._live)
            self._cond.notify_all()
            return len(self._live)

    def _post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread at its next iteration."""
        with self._cond:
            self._inbox.calls.append(fn)
            self._cond.notify_all()

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no request is in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._live, timeout)

    def pool_state(self) -> PoolState:
        with self._cond:
            return self._state

    def capacity(self) -> str:
        """The KV pool's capacity in words, for the start-up banner (fixed once the engine is built)."""
        return capacity_text(self._engine)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread. Streams still open get Finished("abort")."""
        with self._cond:
            self._accepting = False
            self._inbox.aborts.extend(self._live)
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._engine.close()
        if self._on_violation is not None:
            self._on_violation = None
            self._engine.checker.remove_listener(self._attribute)

    # ---- the scheduler thread ----

    def _run(self) -> None:
        active = self._active
        if self._engine.cache.device.type == "cuda":
            # A thread starts on device 0: make the engine's device current, or streams, events and
            # graph replays made without a device argument would land on another GPU.
            torch.cuda.set_device(self._engine.cache.device)
        with torch.inference_mode():
            while True:
                poll = self._poll_interval()
                with self._cond:
                    # A step still in flight must be completed even with no request left: a request
                    # aborted during the poll of a step (containment) frees its pages only then.
                    self._cond.wait_for(
                        lambda: self._inbox.has_work() or active or self._engine.in_flight or self._stopping,
                        poll,  # something to poll (a transfer in flight): come round again meanwhile
                    )
                    inbox, self._inbox = self._inbox, _Inbox()
                    busy = inbox.has_work() or active or self._engine.in_flight or poll is not None
                    if self._stopping and not busy:
                        return
                try:
                    self._apply(inbox, active)
                    # Tokens known before the step (a transferred prompt's first token) go out now,
                    # not one forward later.
                    self._emit(active)
                    if not self._engine.idle:
                        self._engine.step()
                        if self.faults is not None:
                            self.faults.after_step()
                    self._emit(active)
                    self._after_step()
                except Exception as exc:  # the engine's state is unknown now: fail everything, stop
                    log.exception("%s: engine step failed", self.thread_name)
                    self._fail(exc, active)
                    return

    def _apply(self, inbox: _Inbox, active: dict[str, _Entry]) -> None:
        for entry in inbox.new:
            try:
                self._start(entry)
            except ValueError as exc:  # validation let through what the engine refuses: this request only
                self._finish(entry, Finished("abort", len(entry.prompt), 0, error=str(exc)))
        for fn in inbox.calls:
            fn()
        for rid in inbox.aborts:
            self._abort_one(rid)

    # ---- hooks (scheduler thread) ----

    def _start(self, entry: _Entry) -> None:
        """Hand a new request to the engine (raise ValueError to refuse it)."""
        entry.req = self._engine.add_request(entry.prompt, entry.params)
        self._active[entry.rid] = entry

    def _abort_one(self, rid: str) -> None:
        entry = self._active.get(rid)
        if entry is not None and entry.req is not None:
            self._engine.abort(entry.req)  # frees pages and window; a no-op if already finished

    def _on_done(self, entry: _Entry) -> None:
        """A request finished; called before its Finished event."""

    def _after_step(self) -> None:
        """After each iteration's emit (pages may have been freed)."""

    def _poll_interval(self) -> float | None:
        """Seconds after which an otherwise idle loop runs again (to poll work in flight outside the
        engine, in `_after_step`); None: sleep until woken."""
        return None

    # ---- the loop's parts ----

    def _emit(self, active: dict[str, _Entry]) -> None:
        done = []
        for entry in active.values():
            req = entry.req
            assert req is not None
            if len(req.output) > entry.sent:
                first = entry.sent == 0
                if first and self.faults is not None:
                    self.faults.first_token(self._engine, entry.prompt, req)
                entry.emit(Tokens(tuple(req.output[entry.sent :]), req.admitted_ns if first else 0))
                entry.sent = len(req.output)
            if req.finished:
                done.append(entry)
        # The step's tokens are out: now the KV of what it finished (Engine.step defers those frees
        # past its tokens), and the pool without them published before anyone hears of an end.
        self._engine.free_finished()
        for entry in done:
            del active[entry.rid]
            self._on_done(entry)
        if done:
            self._publish(leaving=len(done))
        for entry in done:
            req = entry.req
            assert req is not None and req.finish_reason is not None
            done = Finished(req.finish_reason, len(req.prompt), len(req.output), req.error, req.cached_tokens)
            self._finish(entry, done)
        if done and self._engine.idle:
            self._engine.check_idle_integrity()  # host-only; every page and slot must be back
        self._publish()

    def _finish(self, entry: _Entry, event: Finished) -> None:
        # The id is free before the client hears of the end: it may reuse it at once.
        with self._cond:
            self._live.pop(entry.rid, None)
            self._cond.notify_all()
        entry.emit(event)

    def _publish(self, leaving: int = 0) -> None:
        """The pool state readers see; `leaving`: live requests about to end, not counted as queued."""
        state = self._pool_state(leaving)
        with self._cond:
            self._state = state

    def _pool_state(self, leaving: int = 0) -> PoolState:
        cache, kv = self._engine.cache, self._engine.kv
        with self._cond:
            queued = len(self._live) - leaving - len(self._engine.running)
        return PoolState(
            pages_total=cache.pages.capacity,
            pages_free=cache.pages.num_free,
            slots_total=cache.slots.capacity,
            slots_free=cache.slots.num_free,
            running=len(self._engine.running),
            waiting=max(queued, 0),
            pages_cached=len(kv.prefix) if kv.prefix is not None else 0,
            prefix_queried_tokens=kv.queried_tokens,
            prefix_hit_tokens=kv.hit_tokens,
            prefix_evicted_pages=kv.evicted_pages,
        )

    def _fail(self, exc: BaseException, active: dict[str, _Entry]) -> None:
        with self._cond:
            self.failure = exc
            self._accepting = False
            entries = list(self._live.values())
        for entry in entries:
            n = len(entry.req.output) if entry.req is not None else 0
            self._finish(entry, Finished("abort", len(entry.prompt), n, error=f"engine failure: {exc}"))
        active.clear()
        if self.on_failure is not None:
            self.on_failure(exc)
