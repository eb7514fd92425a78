"""Decode's side of the prefill service: the start-up Handshake and one Prefill call per request.

The call's deadline is min(client deadline, --prefill-timeout): a decode never waits forever on a
prefill that died. Cancelling the awaiting task (the client went away) cancels the call, and the
prefill service drops the bytes it extracted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from shared.pb.pdserve.v1 import generation_pb2 as gen_pb
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.service_runtime import StartupError
from shared.transfer.base import Chunk, KVLayout

__all__ = ["PrefillClient", "PrefillFailed", "PrefillResult", "handshake"]

_HANDSHAKE_WAIT_S = 120.0  # how long start-up waits for a prefill service that is still loading
# Reconnect soon after a prefill restart: gRPC's default backoff grows to two minutes.
# round_robin: behind a headless Service (dns:///...) every prefill pod gets a share of one decode
# pod's calls; gRPC's default pick_first would pin each decode pod to a single prefill pod.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.lb_policy_name", "round_robin"),
]


class PrefillFailed(Exception):
    pass


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    nbytes: int  # KV bytes received
    first_chunk_ns: int  # epoch ns: the transfer's start as decode sees it (0: no chunk)
    done_ns: int  # epoch ns: PrefillDone received


def handshake(target: str, layout: KVLayout, wait_s: float = _HANDSHAKE_WAIT_S) -> None:
    """Agree on the KV layout with the prefill service at `target`, or raise StartupError.

    Retries while the prefill service is unreachable or loading; a mismatch fails at once.
    """
    deadline = time.monotonic() + wait_s
    req = pb.HandshakeRequest(layout=layout.to_pb(), backend="inline")
    with grpc.insecure_channel(target) as channel:
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


class PrefillClient:
    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        self._stub: pb_grpc.PrefillStub | None = None

    def _get_stub(self) -> pb_grpc.PrefillStub:
        if self._stub is None:  # created on first use: an aio channel belongs to the running loop
            self._stub = pb_grpc.PrefillStub(grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS))
        return self._stub

    async def prefill(
        self, rid: str, prompt: list[int], sampling: gen_pb.SamplingParams, history: bool,
        client_remaining: float | None, deliver: Callable[[list[Chunk]], None],
        metadata: Sequence[tuple[str, str]] = (),
    ) -> PrefillResult:  # fmt: skip
        """Run one prefill; `deliver` gets the KV chunks in order. `metadata` carries the traceparent."""
        timeout = self.timeout if client_remaining is None else min(self.timeout, client_remaining)
        req = pb.PrefillRequest(request_id=rid, prompt=prompt, sampling=sampling, send_window_history=history)
        # wait_for_ready: a restarting prefill service is waited for (within the deadline).
        call = self._get_stub().Prefill(
            req, timeout=max(timeout, 0.0), wait_for_ready=True, metadata=tuple(metadata) or None
        )
        nbytes = first_ns = 0
        try:
            async for msg in call:
                if msg.HasField("chunk"):
                    chunk = Chunk.from_pb(msg.chunk)
                    first_ns = first_ns or time.time_ns()
                    nbytes += chunk.nbytes
                    deliver([chunk])
                elif msg.HasField("done"):
                    return PrefillResult(msg.done.first_token, nbytes, first_ns, time.time_ns())
            raise PrefillFailed("the stream ended without PrefillDone")
        except grpc.RpcError as e:
            raise PrefillFailed(f"{e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # a no-op once done; otherwise the prefill side stops and drops its bytes
