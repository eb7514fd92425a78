"""The cuda_ipc KV transfer: prefill writes into another process's reserved pages, ordered by events.

CPU: the row-copy kernel (Triton's interpreter) against torch, and the pool export's wire form. GPU:
two real processes, decode's pool mapped into prefill's, on one GPU and across two; what lands in the
pages equals what the inline backend writes, and neither side's critical path syncs.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing as mp
import sys
import traceback
import types

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from shared.kernels.copy_rows import copy_heads, copy_rows
from shared.transfer.cuda_ipc import HeadRun, push
from shared.transfer.ipc_memory import POOL_TENSORS, IpcTensor, PoolExport
from shared.transfer.ipc_ranks import rank_writes
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


def test_copy_heads_moves_a_run_of_heads_between_pools_of_other_head_counts():
    """A rank of 2 KV heads writes its heads 0-1 into heads 1-2 of a rank of 4 (tensor-parallel
    degrees that differ): only those heads of the chosen rows change, every token of them."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 6, 4, 2, 8, generator=g).to(DEV)  # [layers, pages, page tokens, heads, dim]
    dst = torch.zeros(2, 5, 4, 4, 8, device=DEV)
    s, d = torch.tensor([5, 1], device=DEV), torch.tensor([0, 3], device=DEV)
    copy_heads(src, dst, tuple(dst.shape), s, d, (0, 1, 2))
    want = torch.zeros_like(dst)
    want[:, d, :, 1:3] = src[:, s]
    assert torch.equal(dst, want)


def test_copy_heads_copies_a_rings_filled_tokens_only():
    src = torch.randn(1, 3, 10, 4, 8, device=DEV)  # one head taken from the middle of four
    dst = torch.zeros(1, 2, 10, 1, 8, device=DEV)
    copy_heads(src, dst, tuple(dst.shape), torch.tensor([2], device=DEV), torch.tensor([1], device=DEV),
               (2, 0, 1), tokens=7)  # fmt: skip
    assert torch.equal(dst[0, 1, :7, 0], src[0, 2, :7, 2]) and not dst[0, 1, 7:].any() and not dst[0, 0].any()
    with pytest.raises(ValueError, match=r"heads \(3, 0, 2\) outside 4 source, 1 destination heads"):
        copy_heads(src, dst, tuple(dst.shape), torch.tensor([0], device=DEV), torch.tensor([0], device=DEV),
                   (3, 0, 2))  # fmt: skip


def test_each_prefill_rank_writes_the_heads_each_decode_rank_holds():
    """`rank_writes` over degrees: every head of every decode rank once, from the first prefill rank
    holding it, and each decode rank's ring_pos row once; one rank each side: whole rows."""
    pool = PoolExport("d0", "GPU-0", ())
    one, two = [range(4)], [range(0, 2), range(2, 4)]
    d0, d1 = dataclasses.replace(pool, heads=range(0, 2)), PoolExport("d1", "GPU-1", (), range(2, 4))
    ranked = dataclasses.replace(d0, other_ranks=(d1,))
    assert rank_writes(one, 0, pool, 4) == [(pool, None)]
    assert rank_writes(two, 0, pool, 4) == [(pool, HeadRun(0, 0, 2, True))]
    assert rank_writes(two, 1, pool, 4) == [(pool, HeadRun(0, 2, 2, False))]
    assert rank_writes(one, 0, ranked, 4) == [(ranked, HeadRun(0, 0, 2, True)), (d1, HeadRun(2, 0, 2, True))]
    assert rank_writes(two, 1, ranked, 4) == [(d1, HeadRun(0, 0, 2, True))]
    replicated = [range(0, 1), range(0, 1)]  # one KV head, two ranks: rank 1 writes nothing
    assert rank_writes(replicated, 1, pool, 1) == []


def test_push_regroups_heads_between_degrees_as_inline_would():
    """A prefill rank of all 2 KV heads pushes a prompt into two decode ranks of one head each (the
    `push` of a tensor-parallel handoff, into real decode caches): each rank's pages, ring and ring_pos
    equal its share of what the inline backend would have written."""
    prompt = random_tokens(11, seed=5)
    cfg = tiny_config("SF", heads=2, kv_heads=2)
    model = tiny_model(cfg).to(DEV)
    src = Engine(model, KVConfig(page_size=4, num_pages=8, max_requests=2, device=DEV), EngineConfig())
    req = src.add_request(prompt, SamplingParams(max_tokens=1), hold_kv=True)
    while not req.finished:
        src.step()
    ranks = [KVCache(dataclasses.replace(cfg, num_kv_heads=1), KVConfig(page_size=4, num_pages=6,
                                                                               max_requests=2, device=DEV))
             for _ in range(2)]  # fmt: skip
    dst_pages, slot = [4, 1, 3], 1
    total = (0, 0)
    for rank, cache in enumerate(ranks):
        pool = types.SimpleNamespace(tensors={n: getattr(cache, n) for n in POOL_TENSORS})
        run = HeadRun(rank, 0, 1, True)
        written = push(
            src.cache, req.pages, req.slot, len(prompt), pool, dst_pages, slot, window=True, heads=run
        )
        total = (total[0] + written[0], total[1] + written[1])
        for name in ("k_pages", "v_pages"):
            theirs, mine = getattr(cache, name), getattr(src.cache, name)
            assert torch.equal(theirs[:, dst_pages], mine[:, req.pages, :, rank : rank + 1])
        for name in ("k_ring", "v_ring"):
            theirs, mine = getattr(cache, name), getattr(src.cache, name)
            assert torch.equal(theirs[:, slot, :W], mine[:, req.slot, :W, rank : rank + 1])
        assert torch.equal(cache.ring_pos[:, slot], src.cache.ring_pos[:, req.slot])
    whole = push_bytes(src.cache, req, len(prompt))
    assert total == whole, "the ranks' writes add up to one rank's"


def push_bytes(cache: KVCache, req: Request, num_tokens: int) -> tuple[int, int]:
    """What `push` of every head reports: its whole rows' bytes."""
    size = cache.k_pages.element_size()
    full = 2 * cache.k_pages[:, 0].numel() * cache.pages_needed(num_tokens) * size
    window = 2 * cache.k_ring.shape[0] * min(num_tokens, cache.window) * cache.k_ring[0, 0, 0].numel() * size
    return full, window


def test_a_pool_export_survives_the_wire():
    tensor = IpcTensor("k_pages", bytes(range(64)), 512, "bfloat16", (2, 8, 4, 2, 16))
    export = PoolExport("p1", "GPU-abc", (tensor,))
    ranked = PoolExport(
        "p0", "GPU-0", (tensor,), range(0, 2), (dataclasses.replace(export, heads=range(2, 4)),)
    )
    assert PoolExport.from_pb(ranked.to_pb()) == ranked
    assert PoolExport.from_pb(type(export.to_pb()).FromString(export.to_pb().SerializeToString())) == export


# ---- GPU: two processes ----

PAGES, SLOT = [9, 2, 14, 5, 11, 0, 7, 3], 2  # decode's reservation: scattered on purpose


def _kv(device: str, kv_heads: int = 2) -> KVCache:
    cfg = dataclasses.replace(tiny_config("SSFS"), num_kv_heads=kv_heads)
    return KVCache(cfg, KVConfig(page_size=4, num_pages=16, max_requests=4, device=device))


def _decode_side(device: str, conn, kv_heads: int = 2) -> None:  # type: ignore[no-untyped-def]
    """Child process, one per device pair (or per tensor-parallel rank, holding `kv_heads` of the
    model's 2): for each prompt prefill sends, reserve (stale bytes, an emptied ring), wait for
    prefill's event, compare with the reference. "stop" ends it."""
    from invariants.testing import no_host_sync
    from shared.transfer.cuda_ipc import EventRing, OpenedEvents, export_pool

    faulthandler.dump_traceback_later(150, exit=True, file=sys.stderr)  # a hang shows where, then ends
    try:
        torch.cuda.set_device(device)
        cache = _kv(device, kv_heads)
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


def _reference(prefill, p, n: int, device: str, heads: range | None = None) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """What the inline backend writes into the same reservation; `heads`: of those KV heads only."""
    from shared.transfer.inline import apply_chunk, begin_receive, extract_chunks

    ref = _kv(device)
    begin_receive(ref, SLOT)
    for chunk in extract_chunks(prefill.cache, p.pages, p.slot, n):
        apply_chunk(ref, PAGES, SLOT, chunk)
    out = {name: getattr(ref, name).cpu() for name in ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")}
    if heads is not None:  # pages [L, pages, page, H, D], rings [L, slots, W, H, D]
        out.update({name: out[name][:, :, :, heads.start : heads.stop].clone() for name in POOL_TENSORS[:4]})
    return out


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


def _rank_caches(prefill: KVCache, ranks: int) -> list[KVCache]:
    """Prefill's KV as `ranks` tensor-parallel ranks would hold it: each rank its run of KV heads."""
    if ranks == 1:
        return [prefill]
    share = prefill.k_pages.shape[3] // ranks
    cfg = dataclasses.replace(prefill.model, num_kv_heads=share)
    return [KVCache(cfg, prefill.cfg) for _ in range(ranks)]


def _push_ranks(caches, writes, p, n: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Every prefill rank's writes (its cache, its pools and head runs); their bytes summed."""
    total = (0, 0)
    for cache, rank in zip(caches, writes, strict=True):
        for pool, run in rank:
            f, w = push(cache, p.pages, p.slot, n, pool, PAGES, SLOT, window=True, heads=run)
            total = (total[0] + f, total[1] + w)
    return total


@gpu
@pytest.mark.parametrize(("src", "dst"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_each_prefill_rank_writes_its_heads_into_the_decode_processes_that_hold_them(src, dst):
    """Tensor parallelism through real IPC mappings on one GPU: each decode rank is its own process
    exporting a pool of its share of the 2 KV heads (rank 0's export names the others'), and each
    prefill rank's writes (`rank_writes`) put its heads into the ranks holding them. Every decode
    rank then holds its heads of what the inline backend writes; the byte counts add up to one
    whole-row transfer's; the writes and the waits do not sync the host."""
    from invariants.testing import no_host_sync
    from shared.transfer.cuda_ipc import EventRing, OpenedEvents, PeerPools

    dev = "cuda:0"
    torch.cuda.set_device(dev)
    ctx = mp.get_context("spawn")
    kv_heads = 2
    dst_heads = [range(r * kv_heads // dst, (r + 1) * kv_heads // dst) for r in range(dst)]
    src_heads = [range(r * kv_heads // src, (r + 1) * kv_heads // src) for r in range(src)]
    conns, procs, peers = [], [], []
    try:
        for heads in dst_heads:  # one process per decode rank: each pool its own allocations
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode_side, args=(dev, child, len(heads)), daemon=True)
            proc.start()
            conns.append(parent)
            procs.append(proc)
        wire = type(PoolExport("", "", ()).to_pb())
        exports = [
            PoolExport.from_pb(wire.FromString(_recv(c, p))) for c, p in zip(conns, procs, strict=True)
        ]
        if dst == 1:
            export = exports[0]
        else:  # as decode's rank 0 sends it (shared/transfer/ranks.py export_ranks)
            named = [dataclasses.replace(e, heads=h) for e, h in zip(exports, dst_heads, strict=True)]
            export = dataclasses.replace(named[0], other_ranks=tuple(named[1:]))
        export = PoolExport.from_pb(wire.FromString(export.to_pb().SerializeToString()))
        cfg = tiny_config("SSFS")
        kv = KVConfig(page_size=4, num_pages=32, max_requests=4, device=dev)
        prefill = Engine(tiny_model(cfg).to(dev), kv, EngineConfig(max_batch_tokens=16))
        caches = _rank_caches(prefill.cache, src)
        pools = PeerPools(prefill.cache.device, caches[0])  # one process here: each pool mapped once
        opened, ring = OpenedEvents(prefill.cache.device), EventRing(prefill.cache.device, size=4)
        writes = [
            [(pools.get(pool), run) for pool, run in rank_writes(src_heads, r, export, kv_heads)]
            for r in range(src)
        ]
        peers = list({id(pool): pool for rank in writes for pool, _ in rank}.values())
        assert len(peers) == dst and sum(len(rank) for rank in writes) == max(src, dst)
        for n in (3, W + 1, 3 * W + 5):
            p = prefill.add_request(
                random_tokens(n), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True
            )
            while not p.finished:
                prefill.step()
            prefill.flush()
            for cache, heads in zip(caches, src_heads, strict=True):
                if cache is not prefill.cache:  # a rank's share of the heads, as its own pool holds it
                    for name in POOL_TENSORS[:4]:
                        getattr(cache, name).copy_(
                            getattr(prefill.cache, name)[:, :, :, heads.start : heads.stop]
                        )
                    cache.ring_pos.copy_(prefill.cache.ring_pos)

            _push_ranks(caches, writes, p, n)  # warm: compile, pin
            torch.cuda.synchronize(dev)  # landed: decode's stale bytes below come after it
            for c in conns:
                c.send("reserve")
            ready = [_recv(c, proc) for c, proc in zip(conns, procs, strict=True)]
            with no_host_sync():
                for event in ready:
                    opened.wait(event)
                written = _push_ranks(caches, writes, p, n)
                done = ring.record()
            refs = [_reference(prefill, p, n, dev, heads if dst > 1 else None) for heads in dst_heads]
            prefill.release(p)
            row = 2 * kv_heads * cfg.head_dim * 4  # K and V of one token of one layer, fp32
            assert written == (-(-n // 4) * 4 * row, 3 * min(n, W) * row), (
                "the ranks' bytes add up to one rank's"
            )
            for c, proc, ref in zip(conns, procs, refs, strict=True):
                c.send((done, n, ref))
                assert _recv(c, proc) == "ok"
    finally:
        torch.cuda.synchronize(dev)
        for peer in peers:  # the exporters outlive the mappings: unmap before the children exit
            peer.close()
        for c, proc in zip(conns, procs, strict=True):
            if proc.is_alive():
                c.send("stop")
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
