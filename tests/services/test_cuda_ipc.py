"""The cuda_ipc backend between real processes: prefill writes into decode's GPU pool.

GPU (one H200: both services on it; two: prefill on cuda:0, decode on cuda:1): greedy tokens equal an
inline decode's against the same prefill, with and without window history; a client cancel while the
writes may be in flight frees decode's reservation only after the lease, and both pools come back to
idle; a prefill that cannot map decode's pool fails decode's start-up naming cuda_ipc. CPU: the flag
is validated at start-up, and a cuda_ipc request prefill cannot serve (its lease already over, or a
pool it cannot write) is refused before any write with prefill's pool back at idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from decode_service.config import ServiceConfig
from shared.client.client import Client
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.transfer.cuda_ipc import IpcTarget
from shared.transfer.ipc_memory import IpcTensor, PoolExport
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    abandon_then_idle,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)
from tests.services.test_disagg import COMMON, GREEDY, LENGTHS, _prefill, _prompt

gpu = pytest.mark.gpu


def test_cuda_ipc_is_refused_at_start_up_without_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_ipc needs a CUDA device"):
        ServiceConfig(kv_transfer="cuda_ipc", device="cpu", prefill_target="127.0.0.1:1")
    with pytest.raises(ValueError, match="kv_transfer must be one of inline, cuda_ipc"):
        ServiceConfig(kv_transfer="nvlink")


def _decode_device() -> str:
    return "cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cuda:0"


def _decode(prefill: ServerProcess, transfer: str, *extra: str, ready: bool = True) -> ServerProcess:
    return ServerProcess(
        random_spec(), *COMMON, "--device", _decode_device(), "--prefill-target", prefill.target,
        "--local-prefill-max-tokens", "0", "--kv-transfer", transfer, *extra, wait_ready=ready,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gpu_prefill() -> Iterator[ServerProcess]:
    p = _prefill("--device", "cuda:0")
    yield p
    stop_all(p)


@gpu
@pytest.mark.parametrize("history", [True, False])
def test_cuda_ipc_tokens_equal_inline_tokens(gpu_prefill, history):
    flags = () if history else ("--no-window-history",)
    ipc, inline = _decode(gpu_prefill, "cuda_ipc", *flags), _decode(gpu_prefill, "inline", *flags)
    try:
        with Client(ipc.target) as a, Client(inline.target) as b:
            for n in LENGTHS:
                want = b.complete(_prompt(n), **GREEDY).token_ids
                assert a.complete(_prompt(n), **GREEDY).token_ids == want, n
            wait_pool_idle(a)
    finally:
        stop_all(ipc, inline)


@gpu
def test_a_cancel_during_the_writes_frees_the_reservation_after_the_lease(gpu_prefill):
    decode = _decode(gpu_prefill, "cuda_ipc", "--prefill-timeout", "2")
    info = PrefillInfo(gpu_prefill.target)
    try:
        with Client(decode.target) as c:
            # The deadlines end in the queue, the compute or the writes; the lease (2 s) and the write
            # grace (5 s) pass before decode's pages come back.
            abandon_then_idle(c, info, _prompt(200), (0.001, 0.003, 0.006, 0.01, 0.02))
            assert c.complete(_prompt(9), **GREEDY).finish_reason == "length"
    finally:
        info.close()
        stop_all(decode)


@gpu
def test_a_prefill_that_cannot_map_the_pool_fails_decode_start_up():
    cpu_prefill = _prefill("--device", "cpu")
    try:
        decode = _decode(cpu_prefill, "cuda_ipc", ready=False)
        assert decode.wait(timeout=120) == 1
        log = decode.log()
        assert "refused the handshake" in log and "cuda_ipc" in log and "CUDA device" in log, log[-2000:]
        decode.kill()
    finally:
        stop_all(cpu_prefill)


def _ipc_request(deadline_ns: int) -> pb.PrefillRequest:
    pool = PoolExport(
        "decode-1", "GPU-00000000", (IpcTensor("k_pages", bytes(64), 0, "float32", (1, 8, 4, 2, 16)),)
    )
    target = IpcTarget(pool, (0, 1, 2), 0, b"", deadline_ns)
    return pb.PrefillRequest(
        request_id="ipc", prompt=_prompt(9), send_window_history=True, layout=kv_layout(4),
        cuda_ipc=target.to_pb(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def cpu_prefill() -> Iterator[ServerProcess]:
    p = _prefill("--device", "cpu")
    yield p
    stop_all(p)


def test_a_cuda_ipc_request_prefill_cannot_serve_writes_nothing_and_frees_its_pool(cpu_prefill):
    # CPU prefill: a lease already over is refused as it arrives (DEADLINE_EXCEEDED); a live one
    # cannot be mapped by a CPU prefill (FAILED_PRECONDITION, before it is queued: decode prefills
    # locally). Either way nothing is computed or written, and prefill keeps serving.
    info = PrefillInfo(cpu_prefill.target)
    try:
        with pytest.raises(grpc.RpcError) as late:
            list(info.stub.Prefill(_ipc_request(time.time_ns() - 1), timeout=30))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "lease" in late.value.details()
        with pytest.raises(grpc.RpcError) as cpu:
            list(info.stub.Prefill(_ipc_request(time.time_ns() + int(30e9)), timeout=30))
        assert cpu.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cuda_ipc" in cpu.value.details()
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
