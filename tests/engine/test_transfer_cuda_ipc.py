"""The cuda_ipc KV transfer: prefill writes into another process's reserved pages, ordered by events.

CPU: the row-copy kernel (Triton's interpreter) against torch, and the pool export's wire form. GPU:
two real processes, decode's pool mapped into prefill's, on one GPU and across two; what lands in the
pages equals what the inline backend writes, and neither side's critical path syncs.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import sys
import traceback

import pytest
import torch

from shared.engine.kv.cache import KVCache, KVConfig
from shared.kernels.copy_rows import copy_rows
from shared.transfer.ipc_memory import IpcTensor, PoolExport
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model

gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel in Triton's interpreter


def test_copy_rows_moves_each_row_of_every_layer():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(3, 40, 2, 16, generator=g).to(DEV)
    dst = torch.zeros(3, 25, 2, 16, device=DEV)
    s = torch.tensor([7, 0, 39, 12], dtype=torch.int32, device=DEV)
    d = torch.tensor([24, 3, 0, 11], device=DEV)
    copy_rows(src, dst, tuple(dst.shape), s, d)
    want = torch.zeros_like(dst)
    want[:, d] = src[:, s.long()]
    assert torch.equal(dst, want)


def test_copy_rows_copies_long_int_rows_in_blocks():
    src = torch.arange(2 * 3 * 1500, dtype=torch.int32, device=DEV).view(2, 3, 1500)  # rows > one block
    dst = torch.full((2, 4, 1500), -1, dtype=torch.int32, device=DEV)
    copy_rows(src, dst, tuple(dst.shape), torch.tensor([2], device=DEV), torch.tensor([1], device=DEV))
    assert torch.equal(dst[:, 1], src[:, 2]) and bool((dst[:, [0, 2, 3]] == -1).all())


def test_copy_rows_can_copy_a_prefix_of_long_rows_over_several_programs():
    src = torch.randn(2, 3, 40000, device=DEV)
    dst = torch.zeros(2, 3, 40000, device=DEV)
    rows = torch.tensor([1, 2], device=DEV), torch.tensor([0, 1], device=DEV)
    copy_rows(src, dst, tuple(dst.shape), *rows, count=33000)
    assert torch.equal(dst[:, :2, :33000], src[:, 1:, :33000]) and not dst[:, :, 33000:].any()


def test_copy_rows_refuses_what_does_not_fit():
    src, rows = torch.zeros(2, 4, 8, device=DEV), torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="dtype"):
        copy_rows(src, torch.zeros(2, 4, 8, dtype=torch.float16, device=DEV), (2, 4, 8), rows, rows)
    with pytest.raises(ValueError, match="row shapes differ"):
        copy_rows(src, torch.zeros(2, 4, 9, device=DEV), (2, 4, 9), rows, rows)
    with pytest.raises(ValueError, match="same layers"):
        copy_rows(src, torch.zeros(3, 4, 8, device=DEV), (3, 4, 8), rows, rows)


def test_a_pool_export_survives_the_wire():
    tensor = IpcTensor("k_pages", bytes(range(64)), 512, "bfloat16", (2, 8, 4, 2, 16))
    export = PoolExport("p1", "GPU-abc", (tensor,))
    assert PoolExport.from_pb(type(export.to_pb()).FromString(export.to_pb().SerializeToString())) == export


# ---- GPU: two processes ----

PAGES, SLOT = [9, 2, 14, 5, 11, 0, 7, 3], 2  # decode's reservation: scattered on purpose


def _kv(device: str) -> KVCache:
    return KVCache(tiny_config("SSFS"), KVConfig(page_size=4, num_pages=16, max_requests=4, device=device))


def _decode_side(device: str, conn) -> None:  # type: ignore[no-untyped-def]
    """Child process, one per device pair: for each prompt prefill sends, reserve (stale bytes, an
    emptied ring), wait for prefill's event, compare with the reference. "stop" ends it."""
    from invariants.testing import no_host_sync
    from shared.transfer.cuda_ipc import EventRing, OpenedEvents, export_pool

    faulthandler.dump_traceback_later(150, exit=True, file=sys.stderr)  # a hang shows where, then ends
    try:
        torch.cuda.set_device(device)
        cache = _kv(device)
        ring, export = EventRing(cache.device, size=4), export_pool(cache)
        opened = OpenedEvents(cache.device)
        conn.send(export.to_pb().SerializeToString())
        while (msg := conn.recv()) != "stop":
            if msg == "reserve":
                for name in ("k_pages", "v_pages", "k_ring", "v_ring"):
                    getattr(cache, name).fill_(7.0)  # stale bytes the transfer must overwrite
                with no_host_sync():  # the reservation's side of decode's receive path
                    cache.ring_pos[:, SLOT].fill_(-1)
                    conn.send(ring.record())
                continue
            done_event, n, ref = msg
            with no_host_sync():  # and the admission's: its stream waits on prefill's event
                opened.wait(done_event)
            got = {name: getattr(cache, name).cpu() for name in ref}
            rows = torch.tensor([PAGES[p // 4] * 4 + p % 4 for p in range(n)])
            for name in ("k_pages", "v_pages"):
                a, b = got[name].flatten(1, 2)[:, rows], ref[name].flatten(1, 2)[:, rows]
                assert torch.equal(a, b), f"{name} differs (n={n})"
            held = torch.tensor([p % W for p in range(max(0, n - W), n)])
            for name in ("k_ring", "v_ring"):
                assert torch.equal(got[name][:, SLOT, held], ref[name][:, SLOT, held]), (
                    f"{name} differs (n={n})"
                )
            assert torch.equal(got["ring_pos"][:, SLOT], ref["ring_pos"][:, SLOT]), (
                f"ring_pos differs (n={n})"
            )
            conn.send("ok")
    except BaseException:  # reported to the parent, which fails the test
        conn.send(traceback.format_exc())


def _reference(prefill, p, n: int, device: str) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """What the inline backend writes into the same reservation."""
    from shared.transfer.inline import apply_chunk, begin_receive, extract_chunks

    ref = _kv(device)
    begin_receive(ref, SLOT)
    for chunk in extract_chunks(prefill.cache, p.pages, p.slot, n):
        apply_chunk(ref, PAGES, SLOT, chunk)
    return {name: getattr(ref, name).cpu() for name in ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")}


def _recv(conn, proc, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    """The child's next message; a child that died or hangs fails the test instead of hanging it."""
    if not conn.poll(timeout):
        raise AssertionError(f"the decode process sent nothing in {timeout} s (exit code {proc.exitcode})")
    msg = conn.recv()
    if isinstance(msg, str) and msg != "ok":
        raise AssertionError(f"the decode process failed:\n{msg}")
    return msg


def _pairs() -> list[tuple[str, str]]:
    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    return [("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")] if two else [])


@gpu
@pytest.mark.parametrize(("prefill_dev", "decode_dev"), _pairs())
def test_prefill_writes_into_another_processes_pages_what_inline_would(prefill_dev, decode_dev):
    from invariants.testing import no_host_sync
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams
    from shared.transfer.cuda_ipc import EventRing, OpenedEvents, PeerPools, PoolExport, push

    torch.cuda.set_device(prefill_dev)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(decode_dev, child), daemon=True)
    proc.start()  # one child for every prompt length: a spawn and its CUDA start-up cost seconds
    peer = None
    try:
        cfg = tiny_config("SSFS")
        kv = KVConfig(page_size=4, num_pages=32, max_requests=4, device=prefill_dev)
        prefill = Engine(tiny_model(cfg).to(prefill_dev), kv, EngineConfig(max_batch_tokens=16))
        pools = PeerPools(prefill.cache.device, prefill.cache)
        opened, ring = OpenedEvents(prefill.cache.device), EventRing(prefill.cache.device, size=4)
        export = PoolExport.from_pb(type(PoolExport("", "", ()).to_pb()).FromString(_recv(parent, proc)))
        peer = pools.get(export)  # maps once: outside the hot path
        for n in (3, W + 1, 3 * W + 5):  # within one page, just past the window, several windows
            p = prefill.add_request(
                random_tokens(n), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True
            )
            while not p.finished:
                prefill.step()
            prefill.flush()
            push(prefill.cache, p.pages, p.slot, n, peer, PAGES, SLOT, window=True)  # warm: compile, pin
            torch.cuda.synchronize(prefill_dev)  # landed: decode's stale bytes below come after it
            parent.send("reserve")
            ready = _recv(parent, proc)
            with no_host_sync():
                opened.wait(ready)
                full, window = push(prefill.cache, p.pages, p.slot, n, peer, PAGES, SLOT, window=True)
                done = ring.record()
            ref = _reference(prefill, p, n, prefill_dev)
            prefill.release(p)  # at once: later work on prefill's stream runs after the writes
            row = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of one token of one layer, fp32
            # SSFS: one full layer, whole pages of 4 tokens; three sliding layers, their rings' filled part.
            assert (full, window) == (-(-n // 4) * 4 * row, 3 * min(n, W) * row)
            parent.send((done, n, ref))
            assert _recv(parent, proc) == "ok"
    finally:
        if peer is not None:  # the exporter outlives the mapping: unmap before the child exits
            torch.cuda.synchronize(prefill_dev)
            peer.close()
        if proc.is_alive():
            parent.send("stop")
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
