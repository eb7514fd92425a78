"""Decode's side of the prefill service: the start-up Handshake and one Prefill call per request.

The call's deadline is min(client deadline, --prefill-timeout + the time the prefill service is expected
to take for the work queued there, this prompt included, at its measured drain rate): a decode never
waits forever on a prefill that died, and a prefill that is merely busy is not taken for dead. The
drain rate (`DrainRate`: prompt tokens per second, from this client's completed calls) also sizes the
router's auto queue limit (decode_service/routing.py). A call that runs out of its own deadline while
the client's still has time raises `PrefillTimedOut`. Cancelling the awaiting task (the client went
away) cancels the call, and the prefill service drops the bytes it extracted. With cuda_ipc or nixl
decode's pool rides on the Handshake and on every Prefill (`pool`) and no chunk comes: prefill writes
into the reservation. Every Prefill carries decode's KV layout; a prefill service whose layout differs
answers FAILED_PRECONDITION before any work (`PrefillRefused`).

Decode's prefix-cache hit rides on every Prefill (`cached_tokens`): prefill ships the full layers' KV
from there on only, and PrefillDone echoes where it started (`full_from`). A stream whose full-layer KV
starts anywhere else, a chunk before the hit included (it would write shared pages), raises
`PrefillMismatch` (an older prefill that ignores the field ships from 0): the caller prefills the
request itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from shared.pb.pdserve.v1 import generation_pb2 as gen_pb
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.serving.runtime import StartupError
from shared.serving.security.files import WatchedFiles
from shared.serving.security.tls import ClientTLS
from shared.transfer.base import KVLayout
from shared.transfer.cuda_ipc import IpcTarget, PoolExport
from shared.transfer.inline import ChunkAssembler, HeldPositions, KVBatch
from shared.transfer.nixl import NixlPool, NixlTarget

__all__ = [
    "DrainRate",
    "PrefillBusy",
    "PrefillClient",
    "PrefillFailed",
    "PrefillMismatch",
    "PrefillRefused",
    "PrefillRejected",
    "PrefillResult",
    "PrefillTimedOut",
    "handshake",
]

log = logging.getLogger("decode_service")

_HANDSHAKE_WAIT_S = 120.0  # how long start-up waits for a prefill service that is still loading
# Reconnect soon after a prefill restart: gRPC's default backoff grows to two minutes. One channel per
# prefill replica, with gRPC's default pick_first: decode resolves a dns:/// name into its replicas
# itself and its router picks one per prompt (decode_service/prefill_targets.py, routing.py).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _channel_options(tls: bool, server_name: str) -> list[tuple[str, Any]]:
    """A replica dialled by the IP its name resolved to checks its certificate against the name."""
    if tls and server_name:
        return [*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)]
    return list(_CHANNEL_OPTIONS)


class PrefillFailed(Exception):
    pass


class PrefillRefused(PrefillFailed):
    """FAILED_PRECONDITION: the prefill service's KV layout differs from decode's (nothing was computed)."""


class PrefillBusy(PrefillFailed):
    """RESOURCE_EXHAUSTED: the prefill service's queue is full (nothing was computed)."""


class PrefillRejected(PrefillFailed):
    """INVALID_ARGUMENT: the prefill service cannot take this prompt (longer than its context, say),
    though decode accepted it (nothing was computed)."""


class PrefillMismatch(PrefillFailed):
    """The prefill service shipped full-layer KV from another position than decode's prefix-cache hit
    (`PrefillRequest.cached_tokens`): an older prefill that ignores the field ships from 0. What came
    does not fit the reservation (and no chunk of it was applied before the hit): the prompt is computed
    here instead. With cuda_ipc or nixl such a prefill wrote only into the reservation's own pages."""


_MISMATCH_LOG_S = 60.0  # a mismatch is logged at once, then at most once a minute (with the count since)


class PrefillTimedOut(PrefillFailed):
    """The call ran past decode's own deadline for it (not the client's): the prefill service is dead,
    hung or far slower than measured. The client's deadline still had time: the prompt can be computed
    here instead. (With cuda_ipc or nixl, prefill may still write into the reservation until its lease.)"""


class DrainRate:
    """How fast the prefill service drains its queue, in prompt tokens per second: an exponentially
    weighted mean over completed calls of (tokens queued there when the call started, its own prompt
    included) / (the call's duration). Unknown (0) until a call has completed. Event loop only."""

    WEIGHT = 0.3  # of each new call: a few calls follow a change of load, one slow call does not swing it

    def __init__(self) -> None:
        self.tokens_per_s = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        w = self.WEIGHT if self.tokens_per_s else 1.0
        self.tokens_per_s += w * (rate - self.tokens_per_s)

    def seconds(self, tokens: int) -> float:
        """Expected seconds to drain `tokens` (0 while the rate is unknown)."""
        return tokens / self.tokens_per_s if self.tokens_per_s else 0.0


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    nbytes: int  # KV bytes received
    first_chunk_ns: int  # epoch ns: the transfer's start as decode sees it (0: no chunk)
    done_ns: int  # epoch ns: PrefillDone received
    queued_tokens: int = 0  # prompt tokens the prefill service still had to compute for others
    cuda_ipc_event: bytes = b""  # cuda_ipc: decode's stream waits on it before reading the pages
    prefill_hit_tokens: int = 0  # prompt tokens the prefill service read from its own prefix cache
    cuda_ipc_rank_events: tuple[bytes, ...] = ()  # cuda_ipc from a prefill of ranks: the others' events

    @property
    def cuda_ipc_events(self) -> tuple[bytes, ...]:
        """Every event decode's streams wait on before reading the pages (none: inline or nixl)."""
        return tuple(e for e in (self.cuda_ipc_event, *self.cuda_ipc_rank_events) if e)


Pool = PoolExport | NixlPool  # decode's pool as a zero-copy backend exports it


def backend_of(pool: Pool | None) -> str:
    return "inline" if pool is None else "nixl" if isinstance(pool, NixlPool) else "cuda_ipc"


def _handshake_request(layout: pb.KVLayout, pool: Pool | None) -> pb.HandshakeRequest:
    if isinstance(pool, NixlPool):
        return pb.HandshakeRequest(layout=layout, backend="nixl", nixl_pool=pool.to_pb())
    if isinstance(pool, PoolExport):
        return pb.HandshakeRequest(layout=layout, backend="cuda_ipc", cuda_ipc_pool=pool.to_pb())
    return pb.HandshakeRequest(layout=layout, backend="inline")


def handshake(
    target: str, layout: KVLayout, wait_s: float = _HANDSHAKE_WAIT_S, pool: Pool | None = None,
    tls: ClientTLS | None = None, server_name: str = "",
) -> None:  # fmt: skip
    """Agree on the KV layout (and, with `pool`, the cuda_ipc or nixl backend) with the prefill service
    at `target`, or raise StartupError. `server_name`: the name its TLS certificate must carry, when
    not the host in `target`.

    Retries while the prefill service is unreachable or loading; a mismatch fails at once.
    """
    deadline = time.monotonic() + wait_s
    req = _handshake_request(layout.to_pb(), pool)
    options = _channel_options(tls is not None, server_name)
    if tls is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, ClientTLS.credentials(tls.watch().contents), options=options)
    with channel:
        stub = pb_grpc.PrefillStub(channel)
        while True:
            try:
                stub.Handshake(req, timeout=5)
                return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    msg = f"prefill service {target} refused the handshake: {e.details()}"
                    raise StartupError(msg) from e
                if time.monotonic() > deadline:
                    raise StartupError(f"prefill service {target} unreachable: {e.details()}") from e
            time.sleep(0.2)


def _failure(e: grpc.RpcError) -> PrefillFailed:
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return PrefillRefused(e.details() or "KV layout mismatch")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PrefillBusy(e.details() or "queue full")
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return PrefillRejected(e.details() or "prompt refused")
    return PrefillFailed(f"{e.code().name}: {e.details()}")


def _received(take: Callable[[], list[KVBatch]]) -> list[KVBatch]:
    """The batches a received chunk completes; a bad chunk or a failed host allocation fails the call."""
    try:
        return take()
    except HeldPositions as e:
        raise PrefillMismatch(f"the KV did not start at decode's prefix-cache hit: {e}") from e
    except ValueError as e:
        raise PrefillFailed(f"bad KV chunk: {e}") from e
    except RuntimeError as e:  # pinned memory exhausted, say
        raise PrefillFailed(f"receiving the KV failed: {e}") from e


class PrefillClient:
    def __init__(
        self, target: str, timeout: float, layout: KVLayout, pool: Pool | None = None, *, pin: bool = False,
        tls: ClientTLS | None = None, server_name: str = "",
    ) -> None:  # fmt: skip
        self.target = target  # one prefill replica (decode_service/prefill_targets.py)
        self._options = _channel_options(tls is not None, server_name)
        self._tls: WatchedFiles | None = tls.watch() if tls is not None else None
        self._retired: set[Any] = set()  # channels closing after a certificate rotation
        self._channel: Any = None
        self.pin = pin  # inline: received KV in pinned memory (decode's cache is on a GPU)
        self.timeout = timeout
        self.layout = layout
        self.pool = pool  # set: the cuda_ipc or nixl backend (prefill writes into this pool)
        self.backend = backend_of(pool)
        self._layout_pb = layout.to_pb()
        self._stub: pb_grpc.PrefillStub | None = None
        self.rate = DrainRate()
        # Prompt tokens queued at the prefill service as decode estimates them (the router's
        # QueueEstimate.value; a remote request counts there from its routing decision, so at a call's
        # start it includes the call's own prompt).
        self.queued_tokens: Callable[[], int] = lambda: 0
        self._mismatches = 0  # PrefillMismatch since the last log line
        self._mismatch_logged = -_MISMATCH_LOG_S  # time.monotonic() of that line

    def _get_stub(self) -> pb_grpc.PrefillStub:
        rotated = False
        if self._tls is not None:
            _, rotated = self._tls.read()  # a stat a second at most
        if self._stub is None or rotated:  # created on first use: an aio channel belongs to the running loop
            if self._stub is not None:  # new calls take the new certificate; running ones end on the old
                old = self._channel
                task = asyncio.get_running_loop().create_task(old.close(grace=self.own_timeout()))
                self._retired.add(task)
                task.add_done_callback(self._retired.discard)
            if self._tls is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            else:
                creds = ClientTLS.credentials(self._tls.contents)
                self._channel = grpc.aio.secure_channel(self.target, creds, options=self._options)
            self._stub = pb_grpc.PrefillStub(self._channel)
        return self._stub

    async def close(self, grace: float | None = None) -> None:
        """Close the channel (the replica left the set); calls running may take `grace` seconds to end."""
        if self._channel is not None:
            await self._channel.close(grace=grace)

    def own_timeout(self) -> float:
        """Seconds a Prefill call starting now may take by decode's rule: --prefill-timeout past the time
        the queued work (this prompt included) takes at the measured drain rate."""
        return self.timeout + self.rate.seconds(self.queued_tokens())

    def call_timeout(self, client_remaining: float | None) -> float:
        """Seconds one Prefill call may take: `own_timeout`, or less when the client's deadline is."""
        own = self.own_timeout()
        return own if client_remaining is None else max(min(own, client_remaining), 0.0)

    def _log_mismatch(self, rid: str, e: PrefillMismatch) -> None:
        self._mismatches += 1
        now = time.monotonic()
        if now - self._mismatch_logged < _MISMATCH_LOG_S:
            return
        log.warning(
            "prefill service %s did not ship the KV from decode's prefix-cache hit (an older prefill that "
            "ignores PrefillRequest.cached_tokens?): %s; request %s (and %d more since the last such line) "
            "prefilled here (route reason prefix_mismatch)",
            self.target, e, rid[:80], self._mismatches - 1,
        )  # fmt: skip
        self._mismatches, self._mismatch_logged = 0, now

    async def handshake(self, timeout: float = 5.0) -> None:
        """One Handshake on the request channel (the replica's own, as its Prefill calls take).

        Raises PrefillRefused on a layout mismatch, PrefillFailed when unreachable or loading."""
        req = _handshake_request(self._layout_pb, self.pool)
        try:
            await self._get_stub().Handshake(req, timeout=timeout)
        except grpc.RpcError as e:
            raise _failure(e) from e

    async def prefill(
        self, rid: str, prompt: list[int], sampling: gen_pb.SamplingParams, history: bool,
        client_remaining: float | None, deliver: Callable[[list[KVBatch]], None],
        metadata: Sequence[tuple[str, str]] = (), target: IpcTarget | NixlTarget | None = None,
        cached_tokens: int = 0,
    ) -> PrefillResult:  # fmt: skip
        """Run one prefill; `deliver` gets the KV in order, as batches joined from the chunks here (on the
        event loop, so that decode's scheduler thread only copies them into the cache). A bad chunk, or
        a stream that ends short of the prompt, raises PrefillFailed at once and cancels the call (the
        caller aborts the request; what was delivered is released with it). `metadata` carries the
        traceparent.

        With `target` (cuda_ipc, nixl) prefill writes into decode's pool instead and no chunk comes.
        `cached_tokens`: decode holds the full layers' KV before it (shared pages; a target's pages start
        there); KV that does not start there raises PrefillMismatch."""
        own = self.own_timeout()
        timeout = self.call_timeout(client_remaining)
        work, start = max(self.queued_tokens(), len(prompt)), time.monotonic()
        req = pb.PrefillRequest(
            request_id=rid, prompt=prompt, sampling=sampling, send_window_history=history,
            layout=self._layout_pb, cached_tokens=cached_tokens,
            cuda_ipc=target.to_pb() if isinstance(target, IpcTarget) else None,
            nixl=target.to_pb() if isinstance(target, NixlTarget) else None,
        )  # fmt: skip
        # wait_for_ready: a restarting prefill service is waited for (within the deadline).
        call = self._get_stub().Prefill(
            req, timeout=timeout, wait_for_ready=True, metadata=tuple(metadata) or None
        )
        nbytes = first_ns = 0
        kv = ChunkAssembler(self.layout, len(prompt), window=history, pin=self.pin, full_from=cached_tokens)
        try:
            async for msg in call:
                if msg.HasField("chunk"):
                    c = msg.chunk
                    k, v = c.k, c.v
                    first_ns = first_ns or time.time_ns()
                    nbytes += len(k) + len(v)
                    add = partial(kv.add, c.layer, c.window, c.token_start, c.token_count, k, v)
                    batches = _received(add)
                    if batches:
                        deliver(batches)
                elif msg.HasField("done"):
                    if msg.done.full_from != cached_tokens:
                        raise PrefillMismatch(
                            f"its full-layer KV starts at position {msg.done.full_from}, decode holds "
                            f"[0, {cached_tokens}) and asked for the rest"
                        )
                    if target is None:  # inline: every layer arrived whole
                        rest = _received(kv.finish)
                        if rest:
                            deliver(rest)
                    d = msg.done
                    now = time.time_ns()
                    self.rate.observe(work, time.monotonic() - start)
                    if target is not None:  # the bytes went pool to pool: count what prefill wrote
                        nbytes, first_ns = d.full_bytes + d.window_bytes, first_ns or now
                    return PrefillResult(
                        d.first_token, nbytes, first_ns, now, d.queued_prompt_tokens, d.cuda_ipc_event,
                        d.prefix_hit_tokens, tuple(d.cuda_ipc_rank_events),
                    )  # fmt: skip
            raise PrefillFailed("the stream ended without PrefillDone")
        except PrefillMismatch as e:
            self._log_mismatch(rid, e)
            raise
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= own:  # ours, not the client's
                msg = (
                    f"no answer within {timeout:.1f}s (--prefill-timeout {self.timeout:g}s + the queue ahead)"
                )
                raise PrefillTimedOut(msg) from e
            raise _failure(e) from e
        finally:
            call.cancel()  # a no-op once done; otherwise the prefill side stops and drops its bytes
