"""Tensor parallelism's engines: rank 0's `LeaderEngine` decides, every other rank's `FollowerEngine`
repeats.

Each rank holds an Engine over its share of the model (`shared/model/tensor_parallel.py`) and a KV
cache of its share of the KV heads. Only rank 0 has a scheduler thread and callers. Every engine call
that changes state (`add_request`, `step`, `reserve`, ...) is sent to the followers before rank 0
makes it, and each follower makes the same call on its own engine, in the same order: the same
admissions, chunks, page and window-slot choices, snapshots and replays, so the forwards of each step
meet in the same collectives. What is not a function of the calls comes from rank 0:

- the tokens: rank 0 samples, the runner broadcasts them on the device (`ModelRunner._forward`);
- `on_ranks(fn, ...)` / `on_ranks_later`: a function every rank runs on its engine, its results back
  on rank 0, waited for or collected as they come (how a KV transfer reads or writes each rank's
  heads: `shared/transfer/ranks.py`). A follower's result may be a `Later` (a NIXL WRITE in
  flight): the follower polls it between calls and sends its value when it has one, so results
  arrive tagged with their op's number, in any order;
- containment: a follower never aborts on its own invariant hits; it sends them to rank 0, whose
  `poll()` reports them beside its own, and the requests rank 0 aborts for any of them are aborted on
  every follower before its next call.

A call the engine refuses (ValueError: a request it will not take) is refused on every rank alike:
rank 0's caller gets the error, and the followers carry on.

Before each forward launches, a follower compares its plan (mode, and each row's request, window slot
and token count) with the one rank 0 sends: ranks that disagree would meet in collectives of other
sizes, so a follower that differs stops with both plans in its error instead (its service then stops,
`shared/serving/tensor_parallel.py`).

`Link` is the two ends' message channel (a `multiprocessing` Connection between the processes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import invariants
from shared.engine.engine import Engine, Later, Pending
from shared.engine.request import Request
from shared.engine.schedule import Plan

__all__ = ["FollowerEngine", "LeaderEngine", "Link", "PlanMismatch", "follow"]

F = TypeVar("F", bound=Callable[..., Any])
LATER_POLL_S = 0.0005  # how long a follower with results still to come waits for rank 0's next call
Signature = tuple[str, tuple[tuple[int, int, int], ...]]


class Link(Protocol):
    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...


class PlanMismatch(RuntimeError):
    """A follower's next forward is not rank 0's."""


def signature(plan: Plan) -> Signature:
    """A plan as both ends compare it: its mode and (request id, window slot, tokens) per row."""
    counts = [len(item.token_ids) for item in plan.items] or [1] * len(plan.reqs)
    slots = [r.window.slot if r.window is not None else -1 for r in plan.reqs]
    rows = tuple(zip((r.rid for r in plan.reqs), slots, counts, strict=True))
    return plan.mode.value, rows


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A request named by its id in a message (each end holds its own Request object)."""

    rid: int


def _mirrored(method: F) -> F:
    """A LeaderEngine method that the followers make too: sent first (a follower must be on its way
    into the same collectives), then made here. Calls it makes itself are not sent again."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: LeaderEngine, *args: Any, **kwargs: Any) -> Any:
        if self._depth:
            return method(self, *args, **kwargs)
        self._send(("call", name, _refs(args), _refs_kw(kwargs), self._take_contained()))
        self._depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._depth -= 1

    return call  # type: ignore[return-value]


def _refs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_Ref(a.rid) if isinstance(a, Request) else a for a in args)


def _refs_kw(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: _Ref(v.rid) if isinstance(v, Request) else v for k, v in kwargs.items()}


class LeaderEngine(Engine):
    """Rank 0's Engine: its state-changing calls go to the followers first (`links`, one a rank)."""

    def __init__(
        self, *args: Any, links: list[Link], on_close: Callable[[], None] | None = None, **kwargs: Any
    ) -> None:
        self.links = links
        self._on_close = on_close
        self._depth = 0
        self._contained: list[int] = []  # rids aborted here for a violation, not yet sent
        self._found: list[invariants.Violation] = []  # followers' reports, until the next poll
        self._ops = 0  # ops sent so far: an op's number is its place in this count (followers count alike)
        self._awaiting: dict[int, Pending] = {}  # ops whose followers' results are still to come
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        """Stop the followers (`follow` returns), through `on_close` where it stops their processes."""
        if self._on_close is not None:
            self._on_close()
        else:
            self._send(("stop",))

    def _send(self, message: Any) -> None:
        for link in self.links:
            link.send(message)

    def _take_contained(self) -> tuple[int, ...]:
        out, self._contained = tuple(self._contained), []
        return out

    add_request = _mirrored(Engine.add_request)
    generate = _mirrored(Engine.generate)
    abort = _mirrored(Engine.abort)
    step = _mirrored(Engine.step)
    flush = _mirrored(Engine.flush)
    warm_up = _mirrored(Engine.warm_up)
    reserve = _mirrored(Engine.reserve)
    admit_prefilled = _mirrored(Engine.admit_prefilled)
    release = _mirrored(Engine.release)
    rebuild_window = _mirrored(Engine.rebuild_window)
    free_finished = _mirrored(Engine.free_finished)

    def on_ranks_later(self, fn: Callable[..., Any], *args: Any) -> Pending:
        if self._depth or not self.links:
            return Pending([fn(self, *args)])
        self._send(("op", fn, _refs(args), {}, self._take_contained()))
        number, self._ops = self._ops, self._ops + 1
        self._depth += 1
        try:
            pending = Pending.awaiting(fn(self, *args), len(self.links))
        finally:
            self._depth -= 1
        self._awaiting[number] = pending
        return pending

    def collect(self, pending: Pending, *, block: bool = False) -> bool:
        self._pump()
        while block and not pending.done:
            rank = next(r for r in range(1, len(pending.results)) if pending.missing(r))
            self.links[rank - 1].poll(None)  # until that follower's next message
            self._pump()
        return pending.done

    def _pump(self) -> None:
        """Take what the followers have sent: violation reports, and op results by op number."""
        for i, link in enumerate(self.links, start=1):
            while link.poll(0):
                kind, *value = link.recv()
                if kind == "violations":
                    self._found += self.checker.report(value[0])
                    continue
                number, result = value
                pending = self._awaiting[number]
                pending.results[i] = result
                if pending.done:
                    del self._awaiting[number]

    def _planned(self, plan: Plan) -> None:
        self._send(("plan", signature(plan)))

    def _poll(self) -> list[invariants.Violation]:
        """This rank's violations and those the followers have sent, reported here as this
        checker's (counted, logged, handed to its listeners: the service's spans and metrics)."""
        self._pump()
        found, self._found = self.checker.poll() + self._found, []
        return found

    def _contain(self, violations: list[invariants.Violation]) -> None:
        before = {r.rid for r in self.running}
        super()._contain(violations)
        self._contained += sorted(before - {r.rid for r in self.running})


class FollowerEngine(Engine):
    """Rank r > 0's Engine: `follow` makes rank 0's calls on it."""

    def __init__(self, *args: Any, link: Link, **kwargs: Any) -> None:
        self.link = link
        self.requests: dict[int, Request] = {}  # every request rank 0 has named, by id, until done
        super().__init__(*args, **kwargs)

    def _new_request(self, prompt: list[int], params: Any) -> Request:
        req = super()._new_request(prompt, params)
        self.requests[req.rid] = req
        return req

    def _planned(self, plan: Plan) -> None:
        kind, theirs = self.link.recv()
        ours = signature(plan)
        if kind != "plan" or theirs != ours:
            raise PlanMismatch(f"tensor parallel: this rank's next forward {ours} is not rank 0's {theirs}")

    def _poll(self) -> list[invariants.Violation]:
        found = self.checker.poll()
        if found:
            self.link.send(("violations", found))
        return []  # contained by rank 0, whose aborts arrive with its next call

    def contain(self, rids: tuple[int, ...]) -> None:
        """Abort what rank 0 aborted for a violation (before its next call reaches this engine)."""
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                req.error = "aborted on rank 0 for an invariant violation"
                self._finish(req, "abort")

    def resolve(self, value: Any) -> Any:
        """An argument of rank 0's call, its requests as this rank's (KeyError: one not known here)."""
        return self.requests[value.rid] if isinstance(value, _Ref) else value

    def forget_finished(self) -> None:
        """Drop the finished requests' ids (rank 0 names a request only while it is live)."""
        for rid in [rid for rid, r in self.requests.items() if r.finished and r not in self.held]:
            del self.requests[rid]


def follow(engine: FollowerEngine) -> None:
    """Make rank 0's calls on `engine` until rank 0 says stop (or its end of the link closes:
    EOFError). Results still to come (`Later`) are polled between calls and sent as they arrive."""
    ops = 0
    later: dict[int, Later] = {}
    while True:
        if later:
            _send_arrived(engine, later)
            if later and not engine.link.poll(LATER_POLL_S):
                continue
        message = engine.link.recv()
        if message[0] == "stop":
            return
        kind, name, args, kwargs, contained = message
        if kind not in ("call", "op"):
            raise PlanMismatch(f"tensor parallel: expected a call from rank 0, got {message!r}")
        engine.contain(contained)
        number = ops
        ops += kind == "op"
        try:
            args = tuple(engine.resolve(a) for a in args)
            kwargs = {k: engine.resolve(v) for k, v in kwargs.items()}
        except KeyError:
            if name in ("abort", "release"):  # of a request finished and forgotten here: done already
                continue
            raise
        if kind == "op":  # `name` is the function itself
            result = name(engine, *args)
            if isinstance(result, Later):
                later[number] = result
            else:
                engine.link.send(("result", number, result))
            continue
        try:
            getattr(Engine, name)(engine, *args, **kwargs)
        except ValueError:  # a request the engine refuses: rank 0 got the same refusal, its caller the error
            continue
        if name in ("step", "flush", "free_finished", "release", "abort", "generate"):
            engine.forget_finished()


def _send_arrived(engine: FollowerEngine, later: dict[int, Later]) -> None:
    for number, result in list(later.items()):
        done, value = result.poll()
        if done:
            del later[number]
            engine.link.send(("result", number, value))
