"""The nixl backend between real processes: prefill writes into decode's pool with one NIXL WRITE.

Needs NIXL (pdserve[nixl]: `make test` installs it and requires it; a bare pytest without it checks
only the clear start-up failure, which runs with NIXL too, hidden from decode). CPU
(DRAM pools over UCX, here): greedy tokens equal an inline decode's against the same prefill, with and
without window history; window bytes do not grow with the prompt, and what lands equals the inline
chunks; a WRITE NIXL refuses fails the call UNAVAILABLE; a client cancel while prefill computes or
writes frees decode's reservation after the lease and both pools come back to idle; a decode agent
prefill cannot reach, or a prefill that cannot use NIXL, fails the handshake. GPU (`gpu`: prefill on
cuda:0, decode on cuda:1, VRAM pools): the tokens and the cancel again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.kv.cache import KVCache, KVConfig
from shared.pb.pdserve.v1 import nixl_pb2
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.serving.api.model_source import load_served_model
from shared.transfer.base import Chunk
from shared.transfer.inline import apply_chunk, begin_receive
from shared.transfer.nixl import NixlPool, NixlTarget, NixlTensor
from tests.engine.test_transfer_nixl import requires_nixl
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    abandon_then_idle,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)
from tests.services.test_disagg import COMMON, GREEDY, LENGTHS, W, _prefill, _prompt
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape

NAMES = ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _decode_device(kind: str) -> str:
    if kind == "cpu":
        return "cpu"
    return "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def _decode(
    prefill: ServerProcess, transfer: str, device: str, *extra: str, ready: bool = True,
    env: dict[str, str] | None = None,
) -> ServerProcess:  # fmt: skip
    return ServerProcess(
        random_spec(), *COMMON, "--device", device, "--prefill-target", prefill.target,
        "--local-prefill-max-tokens", "0", "--kv-transfer", transfer, *extra, wait_ready=ready, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module", params=DEVICES)
def prefill(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, str]]:
    kind = request.param
    p = _prefill("--device", "cpu" if kind == "cpu" else "cuda:0")
    yield p, kind
    stop_all(p)


def _without_nixl(tmp: Path) -> dict[str, str]:
    """An environment in which no NIXL package imports: a stub that raises ImportError ahead of each
    module shared/transfer/nixl.py tries, installed or not."""
    for module in ("nixl", "nixl_cu13", "nixl_cu12"):
        (tmp / module).mkdir()
        (tmp / module / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)}


def test_without_nixl_decode_start_up_says_what_to_install(prefill, tmp_path):
    pf, kind = prefill
    decode = _decode(pf, "nixl", _decode_device(kind), ready=False, env=_without_nixl(tmp_path))
    try:
        assert decode.wait(timeout=120) == 1
        log = decode.log()
        assert "--kv-transfer nixl" in log and "pdserve[nixl]" in log, log[-2000:]
    finally:
        decode.kill()


@requires_nixl
@pytest.mark.parametrize("history", [True, False])
def test_nixl_tokens_equal_inline_tokens(prefill, history):
    pf, kind = prefill
    flags = () if history else ("--no-window-history",)
    dev = _decode_device(kind)
    nixl, inline = _decode(pf, "nixl", dev, *flags), _decode(pf, "inline", dev, *flags)
    info = PrefillInfo(pf.target)
    try:
        with Client(nixl.target) as a, Client(inline.target) as b:
            for n in LENGTHS:
                want = b.complete(_prompt(n), **GREEDY).token_ids
                assert a.complete(_prompt(n), **GREEDY).token_ids == want, n
            wait_pool_idle(a)
        moved = scrape(metrics_url(nixl))  # the KV went by NIXL, not in the stream
        assert sample(moved, "pdserve_kv_transfer_bytes_total", backend="nixl", direction="receive") > 0
        assert sample(moved, "pdserve_kv_transfer_bytes_total", backend="inline") == 0
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(nixl, inline)


@requires_nixl
@pytest.mark.parametrize("kind", DEVICES)
def test_a_cancel_while_prefill_computes_or_writes_frees_both_pools_after_the_lease(kind):
    # Slow prefill steps, so the deadlines below end in the queue, the compute or the WRITE.
    env = {"PDSERVE_TEST_FAULTS": "step_delay:0.02"}
    pf = ServerProcess(
        random_spec(), *COMMON, "--device", "cpu" if kind == "cpu" else "cuda:0",
        module="prefill_service", service=PREFILL, env=env,
    )  # fmt: skip
    decode = _decode(pf, "nixl", _decode_device(kind), "--prefill-timeout", "2")
    info = PrefillInfo(pf.target)
    try:
        with Client(decode.target) as c:
            # The lease (2 s) and the write grace (5 s) pass before decode's pages come back.
            abandon_then_idle(c, info, _prompt(200), (0.005, 0.02, 0.05, 0.1, 0.2))
            assert c.complete(_prompt(9), **GREEDY).finish_reason == "length"
    finally:
        info.close()
        stop_all(decode, pf)


# ---- a child process as decode: its own agent and pool, Prefill called directly ----
# NIXL is never loaded in the test process: its bundled libraries and grpcio-tools' protoc (which
# tests/services/test_protos.py loads) crash when they share one.


def _cache() -> KVCache:
    return KVCache(
        load_served_model(random_spec()).config, KVConfig(page_size=4, num_pages=64, max_requests=4)
    )


def _decode_agent(conn) -> None:  # type: ignore[no-untyped-def]
    """Child process: a pool like a decode service's and its agent; empties a slot's rings and reports
    the pool on request; exits (and its agent dies) on "exit" or a closed pipe."""
    from shared.transfer.nixl import NixlReceiver

    cache = _cache()
    receiver = NixlReceiver(cache)  # its agent lives as long as it does
    conn.send(receiver.export.to_pb().SerializeToString())
    while True:
        try:
            cmd, slot = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            return
        if cmd == "reserve":
            begin_receive(cache, slot)
            conn.send("ok")
        else:  # "pool": the pages whole, the slot's rings (arrays: a tensor would need shared memory)
            pages = {n: getattr(cache, n).numpy() for n in NAMES[:2]}
            conn.send({**pages, **{n: getattr(cache, n)[:, slot].numpy() for n in NAMES[2:]}})


class _Decode:
    """The decode child, seen from the test process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_agent, args=(child,), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the decode child sent no pool"
        self.export = NixlPool.from_pb(nixl_pb2.NixlPool.FromString(self.conn.recv()))

    def _ask(self, cmd: str, slot: int):  # type: ignore[no-untyped-def]
        self.conn.send((cmd, slot))
        assert self.conn.poll(60), f"the decode child did not answer {cmd}"
        return self.conn.recv()

    def target(self, pages: list[int], slot: int, pool: NixlPool | None = None) -> pb.NixlTarget:
        assert self._ask("reserve", slot) == "ok"
        deadline = time.time_ns() + 30 * 10**9
        return NixlTarget(pool or self.export, tuple(pages), slot, deadline).to_pb()

    def pool(self, slot: int) -> dict[str, torch.Tensor]:
        """k_pages and v_pages whole; the rings and ring_pos of `slot`."""
        return {name: torch.from_numpy(a) for name, a in self._ask("pool", slot).items()}

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit", 0))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _call(info: PrefillInfo, n: int, **kw) -> list[pb.PrefillResponse]:  # type: ignore[no-untyped-def]
    req = pb.PrefillRequest(
        request_id=f"nixl-{n}", prompt=_prompt(n), send_window_history=True, layout=kv_layout(4), **kw
    )
    return list(info.stub.Prefill(req, timeout=30))


@requires_nixl
def test_window_bytes_do_not_grow_and_what_lands_equals_the_inline_chunks():
    # Each prompt goes twice, nixl then inline, compared bit for bit: the second must compute it as the
    # first did, not read its prefix from the cache and compute the rest in another chunk.
    pf = _prefill("--no-prefix-cache")
    info, decode = PrefillInfo(pf.target), _Decode()
    try:
        done = {}
        for n, pages in ((2 * W, [5, 1, 9, 3]), (8 * W, list(range(40, 56)))):
            msgs = _call(info, n, nixl=decode.target(pages, 1))
            assert len(msgs) == 1 and msgs[0].HasField("done"), "nixl streams no chunk"
            done[n] = msgs[0].done
            ref = _cache()
            begin_receive(ref, 1)
            for m in _call(info, n):  # the same prompt, inline
                if m.HasField("chunk"):
                    apply_chunk(ref, pages, 1, Chunk.from_pb(m.chunk))
            got, rows = decode.pool(1), torch.tensor([pages[p // 4] * 4 + p % 4 for p in range(n)])
            for name in ("k_pages", "v_pages"):
                want = getattr(ref, name)
                assert torch.equal(got[name].flatten(1, 2)[:, rows], want.flatten(1, 2)[:, rows]), (n, name)
            for name in ("k_ring", "v_ring", "ring_pos"):
                assert torch.equal(got[name], getattr(ref, name)[:, 1]), (n, name)
        assert done[2 * W].window_bytes == done[8 * W].window_bytes > 0
        assert done[8 * W].full_bytes == 4 * done[2 * W].full_bytes
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        decode.close()
        stop_all(pf)


@requires_nixl
def test_a_write_nixl_refuses_fails_unavailable_and_a_bad_target_invalid_argument():
    pf = _prefill()
    info, decode = PrefillInfo(pf.target), _Decode()
    try:
        export = decode.export
        # Addresses past decode's registered memory: NIXL refuses the WRITE (same agent, same shapes).
        shifted = NixlPool(export.agent_name, export.agent_metadata, export.mem_type, tuple(
            NixlTensor(t.name, t.addr + (1 << 40), t.nbytes, t.device_id, t.dtype, t.shape)
            for t in export.tensors
        ))  # fmt: skip
        for target, code, words in (
            (decode.target([1, 2, 3, 4], 0, shifted), grpc.StatusCode.UNAVAILABLE, "nixl"),
            (decode.target([1, 2, 3, 64], 0), grpc.StatusCode.INVALID_ARGUMENT, "outside decode's pool"),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                _call(info, 2 * W, nixl=target)
            assert exc.value.code() == code and words in exc.value.details(), exc.value.details()
        wait_pool_idle(info)  # type: ignore[arg-type]
        assert len(_call(info, 2 * W, nixl=decode.target([1, 2, 3, 4], 0))) == 1  # the agent still works
    finally:
        info.close()
        decode.close()
        stop_all(pf)


@requires_nixl
def test_a_handshake_with_an_agent_prefill_cannot_reach_fails_naming_it():
    decode = _Decode()
    decode.close()  # its agent is gone with it
    pool = decode.export.to_pb()
    pf = _prefill()
    info = PrefillInfo(pf.target)
    try:
        req = pb.HandshakeRequest(layout=kv_layout(4), backend="nixl", nixl_pool=pool)
        with pytest.raises(grpc.RpcError) as exc:
            info.stub.Handshake(req, timeout=30)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"cannot reach decode's NIXL agent {pool.agent_name}" in exc.value.details()
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
        stop_all(pf)


@requires_nixl
def test_a_prefill_that_cannot_use_nixl_fails_decode_start_up():
    # UCX with only shared memory and loopback cannot make the UCX backend: prefill has no NIXL agent.
    pf = ServerProcess(
        random_spec(), *COMMON, module="prefill_service", service=PREFILL,
        env={"UCX_TLS": "shm,self"},
    )  # fmt: skip
    try:
        decode = _decode(pf, "nixl", "cpu", ready=False)
        assert decode.wait(timeout=120) == 1
        log = decode.log()
        assert "refused the handshake" in log and "cannot use NIXL" in log, log[-2000:]
        decode.kill()
    finally:
        stop_all(pf)
