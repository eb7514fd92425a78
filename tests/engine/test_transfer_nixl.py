"""The nixl KV transfer: one WRITE moves a prompt's KV from prefill's pool into decode's reserved pages.

Without NIXL: the descriptors (`write_descs`), carried out by memmove between two caches of this
process, land what the inline backend writes; the pool's wire form; what a target outside decode's pool
or a pool of another shape gets. With NIXL (pdserve[nixl]: `make test` installs it and requires it;
a bare pytest without it skips these): two real processes, each with its agent, over UCX: DRAM to DRAM
here, VRAM to VRAM across two GPUs (`gpu`); the handshake's probe, the WRITE polled to DONE, and the
pages equal to the reference; a dead decode agent fails the probe; an idle agent does not spin a core.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from shared.engine.kv.cache import KVCache, KVConfig
from shared.transfer.nixl import (
    PROBE,
    NixlPool,
    NixlTarget,
    NixlTensor,
    check_compatible,
    nixl_available,
    write_descs,
)
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model

# `make test` (CI too) installs pdserve[nixl] and sets PDSERVE_TEST_REQUIRE_NIXL=1: there the NIXL tests
# never skip, so a missing install fails them (and test_nixl_is_installed_where_make_test_requires_it).
REQUIRE_NIXL = os.environ.get("PDSERVE_TEST_REQUIRE_NIXL") == "1"
requires_nixl = pytest.mark.skipif(
    not (nixl_available() or REQUIRE_NIXL), reason="needs NIXL (pip install 'pdserve[nixl]')"
)
gpu = pytest.mark.gpu
NAMES = ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")
PAGES, SLOT = [9, 2, 14, 5, 11, 0, 7, 3], 2  # decode's reservation: scattered on purpose


def _kv(device: str = "cpu", num_pages: int = 16) -> KVCache:
    return KVCache(
        tiny_config("SSFS"), KVConfig(page_size=4, num_pages=num_pages, max_requests=4, device=device)
    )


def _described(cache: KVCache) -> dict[str, NixlTensor]:
    probe = torch.zeros(64, dtype=torch.uint8)
    tensors = [NixlTensor.of(n, getattr(cache, n)) for n in NAMES] + [NixlTensor.of(PROBE, probe)]
    return {t.name: t for t in tensors}


def _pool(cache: KVCache, name: str = "decode") -> NixlPool:
    return NixlPool(name, b"md", "DRAM", tuple(_described(cache).values()))


def _prefilled(n: int, device: str = "cpu"):  # type: ignore[no-untyped-def]
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams

    kv = KVConfig(page_size=4, num_pages=32, max_requests=4, device=device)
    engine = Engine(tiny_model(tiny_config("SSFS")).to(device), kv, EngineConfig(max_batch_tokens=16))
    p = engine.add_request(random_tokens(n), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while not p.finished:
        engine.step()
    engine.flush()
    return engine, p


def _reference(
    prefill: KVCache, pages: list[int], slot: int, n: int, history: bool
) -> dict[str, torch.Tensor]:
    """What the inline backend writes into the same reservation."""
    from shared.transfer.inline import apply_chunk, begin_receive, extract_chunks

    ref = _kv()
    begin_receive(ref, SLOT)
    for chunk in extract_chunks(prefill, pages, slot, n, window=history):
        apply_chunk(ref, PAGES, SLOT, chunk)
    return {name: getattr(ref, name).cpu() for name in NAMES}


def _assert_lands_as_inline(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], n: int, history: bool
) -> None:
    rows = torch.tensor([PAGES[p // 4] * 4 + p % 4 for p in range(n)])
    for name in ("k_pages", "v_pages"):
        assert torch.equal(got[name].flatten(1, 2)[:, rows], ref[name].flatten(1, 2)[:, rows]), name
    if not history:
        return
    held = torch.tensor([p % W for p in range(max(0, n - W), n)])
    for name in ("k_ring", "v_ring"):
        assert torch.equal(got[name][:, SLOT, held], ref[name][:, SLOT, held]), name
    assert torch.equal(got["ring_pos"][:, SLOT], ref["ring_pos"][:, SLOT]), "ring_pos"


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("n", [3, W + 1, 3 * W + 5])
def test_the_descriptors_land_what_inline_would(n, history):
    engine, p = _prefilled(n)
    decode = _kv()
    decode.ring_pos[:, SLOT].fill_(-1)  # decode's begin_receive
    plan = write_descs(
        _described(engine.cache), _pool(decode), 4, W, p.pages, p.slot, n, PAGES, SLOT, history=history
    )
    for (src, size, _), (dst, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        ctypes.memmove(dst, src, size)  # what UCX does between the two processes
    got = {name: getattr(decode, name) for name in NAMES}
    _assert_lands_as_inline(got, _reference(engine.cache, p.pages, p.slot, n, history), n, history)
    row = 2 * 2 * 16 * 4  # K and V of one token of one layer: 2 heads x 16, fp32
    # SSFS: one full layer, whole pages of 4 tokens; three sliding layers, their rings' filled part.
    assert plan.full_bytes == -(-n // 4) * 4 * row
    assert plan.window_bytes == (3 * min(n, W) * row if history else 0)


def test_consecutive_pages_merge_into_one_descriptor_per_layer_and_tensor():
    engine, p = _prefilled(3 * W)  # 6 pages of prompt, consecutive in a fresh pool
    assert p.pages[:6] == list(range(p.pages[0], p.pages[0] + 6))
    mine, pool = _described(engine.cache), _pool(_kv())
    plan = write_descs(mine, pool, 4, W, p.pages, p.slot, 3 * W, list(range(6)), SLOT, history=False)
    assert len(plan.local) == 2  # k_pages and v_pages of the one full layer
    assert plan.local[:, 1].tolist() == [6 * 4 * 2 * 16 * 4] * 2


def test_a_target_outside_decodes_pool_is_refused():
    engine, p = _prefilled(9)
    mine, pool = _described(engine.cache), _pool(_kv())
    with pytest.raises(ValueError, match="outside decode's pool"):
        write_descs(mine, pool, 4, W, p.pages, p.slot, 9, [1, 2, 16], 0, history=True)
    with pytest.raises(ValueError, match="slot 5 outside"):
        write_descs(mine, pool, 4, W, p.pages, p.slot, 9, [1, 2, 3], 5, history=True)
    with pytest.raises(ValueError, match="cannot hold"):
        write_descs(mine, pool, 4, W, p.pages, p.slot, 9, [1, 2], 0, history=True)


def test_a_pool_of_another_shape_is_refused_and_the_target_survives_the_wire():
    mine = _described(_kv())
    check_compatible(mine, _pool(_kv(num_pages=64)))  # more pages: fine
    other = KVCache(tiny_config("SSFS", window=16), KVConfig(page_size=4, num_pages=16, max_requests=4))
    with pytest.raises(ValueError, match="rows differ"):
        check_compatible(mine, _pool(other))
    target = NixlTarget(_pool(_kv()), (3, 1, 4), 2, 123456789)
    assert NixlTarget.from_pb(type(target.to_pb()).FromString(target.to_pb().SerializeToString())) == target


@requires_nixl
def test_nixl_is_installed_where_make_test_requires_it():
    assert nixl_available(), "PDSERVE_TEST_REQUIRE_NIXL=1 but no NIXL: pip install -e '.[dev,nixl]'"


# ---- NIXL: two processes ----
# NIXL is only ever loaded in child processes: its bundled libraries and grpcio-tools' protoc (which
# tests/services/test_protos.py loads) crash when they share one.


def _decode_side(conn, device: str) -> None:  # type: ignore[no-untyped-def]
    """Register a pool with an agent, send its export, compare what lands with the reference."""
    from shared.transfer.nixl import NixlReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    cache = _kv(device)
    cache.k_pages.fill_(7.0)  # stale bytes the transfer must overwrite
    cache.ring_pos[:, SLOT].fill_(-1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # UCX writes outside the stream's order (the service: Reserved.settled)
    receiver = NixlReceiver(cache)
    conn.send(receiver.export.to_pb().SerializeToString())
    msg = conn.recv()
    if msg == "exit":  # the agent dies with this process
        return
    n, history, ref = msg
    _assert_lands_as_inline({name: getattr(cache, name).cpu() for name in ref}, ref, n, history)
    conn.send("ok")


def _prefill_side(conn, device: str, n: int, history: bool, export: bytes) -> None:  # type: ignore[no-untyped-def]
    """Compute a prompt, then the handshake's probe and one WRITE, posted and polled to DONE."""
    from invariants.testing import no_host_sync
    from shared.transfer.nixl_writer import NixlWriter

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    engine, p = _prefilled(n, device)
    pool = NixlPool.from_pb(type(NixlPool("", b"", "", ()).to_pb()).FromString(export))
    writer = NixlWriter(engine.cache)
    writer.probe(pool)  # the handshake: loads the agent, writes its probe buffer
    target = NixlTarget(pool, tuple(PAGES), SLOT, time.time_ns() + 60 * 10**9)
    with no_host_sync():  # the scheduler thread's part: post and poll, never wait
        posted = writer.start(p.pages, p.slot, n, [(target, None)], history=history)
        assert posted is not None
        (xfer,) = posted
        states = [writer.poll(xfer)]
    deadline = time.monotonic() + 30
    while states[-1] == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        states.append(writer.poll(xfer))
    assert states[-1] == "DONE", (states[-1], xfer.error)
    ref = _reference(engine.cache, p.pages, p.slot, n, history)
    # As arrays: a tensor would go through shared memory, gone once this process has exited.
    conn.send((xfer.full_bytes, xfer.window_bytes, {k: v.numpy() for k, v in ref.items()}))


def _probe_side(conn, export: bytes) -> None:  # type: ignore[no-untyped-def]
    """The handshake's probe into the agent of `export`; what it raised."""
    from shared.transfer.nixl import NixlError
    from shared.transfer.nixl_writer import NixlWriter

    pool = NixlPool.from_pb(type(NixlPool("", b"", "", ()).to_pb()).FromString(export))
    writer = NixlWriter(_kv())
    try:
        writer.probe(pool, timeout_s=5)
    except NixlError as e:
        conn.send(("raised", str(e), writer.connected(pool.agent_name)))
        return
    conn.send(("no error", "", True))


def _idle_side(conn) -> None:  # type: ignore[no-untyped-def]
    """The CPU time this process spends, per second, with an agent and nothing to do."""
    from shared.transfer.nixl import new_agent

    agent = new_agent("decode")
    start, cpu = time.monotonic(), time.process_time()
    time.sleep(1.0)
    conn.send((time.process_time() - cpu) / (time.monotonic() - start))
    del agent


def _run(conn, fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(conn, *args)
    except BaseException:  # reported to the parent, which fails the test
        conn.send(traceback.format_exc())


class _Child:
    def __init__(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_run, args=(child, fn, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 120.0):  # type: ignore[no-untyped-def]
        """The child's next message; a child that died or hangs fails the test instead of hanging it."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"the child sent nothing in {timeout} s (exit code {self.proc.exitcode})")
        msg = self.conn.recv()
        if isinstance(msg, str) and msg.startswith("Traceback"):
            raise AssertionError(f"the child failed:\n{msg}")
        return msg

    def close(self) -> None:
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def _pairs() -> list:  # type: ignore[type-arg]
    return [
        ("cpu", "cpu"),
        pytest.param("cuda:0", "cuda:1", marks=gpu),
        pytest.param("cuda:0", "cuda:0", marks=gpu),
    ]


@requires_nixl
@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize(("prefill_dev", "decode_dev"), _pairs())
def test_one_write_lands_in_another_processes_pages_what_inline_would(prefill_dev, decode_dev, history):
    if "cuda:1" in (prefill_dev, decode_dev) and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    n = 3 * W + 5
    decode = _Child(_decode_side, decode_dev)
    prefill = None
    try:
        prefill = _Child(_prefill_side, prefill_dev, n, history, decode.recv())
        full, window, arrays = prefill.recv()
        ref = {k: torch.from_numpy(v) for k, v in arrays.items()}
        row = 2 * 2 * 16 * 4  # K and V of one token of one layer, fp32
        assert (full, window) == (-(-n // 4) * 4 * row, 3 * W * row if history else 0)
        decode.conn.send((n, history, ref))
        assert decode.recv() == "ok"
    finally:
        decode.close()
        if prefill is not None:
            prefill.close()


@requires_nixl
def test_an_idle_agent_does_not_spin_a_core():
    # NIXL's Python API polls UCX without ever blocking: a whole core per service, even idle.
    idle = _Child(_idle_side)
    try:
        assert idle.recv() < 0.25, "the NIXL progress thread spins (shared/transfer/nixl.py PROGRESS_POLL_US)"
    finally:
        idle.close()


@requires_nixl
def test_a_probe_into_an_agent_that_is_gone_fails_clearly():
    decode = _Child(_decode_side, "cpu")
    try:
        export = decode.recv()
        decode.conn.send("exit")
        decode.close()
        name = NixlPool.from_pb(type(NixlPool("", b"", "", ()).to_pb()).FromString(export)).agent_name
        prefill = _Child(_probe_side, export)
        outcome, msg, connected = prefill.recv()
        prefill.close()
        assert outcome == "raised" and f"decode's NIXL agent {name}" in msg, msg
        assert not connected
    finally:
        decode.close()
