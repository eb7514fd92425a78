"""On a CUDA device: checks inside `concurrent_checks` run on the side stream beside the block's work,
count eagerly and on every graph replay, never sync, and a STRICT failure still stops the process.

Tests that hold the side stream with a spin kernel release it from a third stream: the current
stream waits for the side stream after the block, so releasing from it would deadlock.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator

import pytest
import torch

import invariants
from invariants import Invariant, Severity, concurrent_checks, expect, levels, predicates
from invariants.kernels import spin
from invariants.predicates import window_expected
from invariants.testing import no_host_sync
from shared.batch import ForwardBatch, Mode
from shared.kv.cache import KVCache, KVConfig
from shared.kv.invariants import SWA_HISTORY_PRESENT
from shared.runner import ModelRunner
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model
from tests.engine.test_engine_parity import Seq
from tests.invariants.strict_testutil import assert_trip_stops_the_process

pytestmark = pytest.mark.gpu

GUARD = Invariant("test_concurrent_checks_gpu.guard", Severity.GUARD, "a guard checked beside other work")
W = 64
CHECKS = 5


def swa_case():
    slots = torch.tensor([5, 40, 77, 300], device="cuda")
    lens = torch.tensor([10, 64, 65, 1000], device="cuda")
    return slots, lens, window_expected(lens, W).to(torch.int32)


def layer(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x)  # the work a check should run beside


def step(x, pos, lens, slots):
    """CHECKS layers, each checking the history before its work, inside one block."""
    with concurrent_checks():
        for _ in range(CHECKS):
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, lens), rows=slots)
            expect(GUARD, lambda: predicates.in_range(lens, 0, 4096), rows=slots)
            x = layer(x)
    return x


@contextlib.contextmanager
def side_stream_held(checker: invariants.Checker) -> Iterator[None]:
    """The checker's side stream spins (its checks wait) until the with-block is done."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    checker.side_stream.wait_stream(torch.cuda.current_stream())  # the spin reads the zeroed flag
    with torch.cuda.stream(checker.side_stream):
        spin.hold(flag)
    try:
        yield
    finally:
        with torch.cuda.stream(torch.cuda.Stream()):  # neither the current nor the side stream
            flag.fill_(1)
        torch.cuda.synchronize()  # the spin has seen the flag before its memory can be reused


def warm_up_spin() -> None:
    spin.hold(torch.ones(1, dtype=torch.int32, device="cuda"))  # compiles; returns at once
    torch.cuda.synchronize()


def test_checks_inside_the_block_count_eagerly_and_change_nothing_else():
    slots, lens, pos = swa_case()
    pos[1] = -1
    x = torch.randn(256, 256, device="cuda") / 16
    want = x
    for _ in range(CHECKS):
        want = layer(want)
    checker = invariants.checker("cuda")
    with levels("warn"):
        got = step(x, pos, lens, slots)
        [v] = checker.drain()
    assert (v.name, v.new_hits, v.rows) == ("swa.history_present", CHECKS, (40,))
    torch.testing.assert_close(got, want)


def test_a_check_runs_beside_the_block_and_the_block_end_waits_for_it():
    # A slow check (a 1 GiB ring: hundreds of microseconds) and a tiny kernel after it: forked, the
    # tiny kernel ends long before the check does; joined, the work after the block starts after it.
    lens = torch.randint(1 << 16, 1 << 18, (4096,), device="cuda")
    pos = window_expected(lens, 1 << 16).to(torch.int32)
    pos[7, 3] = -1
    slots = torch.arange(4096, device="cuda")
    checker = invariants.checker("cuda")
    start, check_done, inside, after = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)  # compile
        checker.drain()
        torch.cuda.synchronize()
        start.record()
        with concurrent_checks():
            expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
            check_done.record(checker.side_stream)
            torch.ones(1024, device="cuda").mul_(2)
            inside.record()
        after.record()
        torch.cuda.synchronize()
        [v] = checker.drain()
    assert (v.new_hits, v.rows) == (1, (7,))
    check_ms, inside_ms = start.elapsed_time(check_done), start.elapsed_time(inside)
    assert inside_ms < 0.8 * check_ms, f"the next kernel waited for the check ({inside_ms} vs {check_ms} ms)"
    assert start.elapsed_time(after) >= check_ms, "the block's end did not wait for its check"


def test_a_checks_temporaries_live_until_the_join():
    # The clone is freed on the current stream as soon as expect() returns. Were it not held, the
    # allocations after it would take its block and the delayed check would read -7s: 64 hits.
    base = torch.arange(64 * 1024, device="cuda", dtype=torch.int32).reshape(64, 1024)
    checker = invariants.checker("cuda")
    warm_up_spin()
    with levels("warn"):
        expect(GUARD, lambda: predicates.equal(base, base.clone()))  # compile
        checker.drain()
        with side_stream_held(checker), concurrent_checks():
            expect(GUARD, lambda: predicates.equal(base, base.clone()))
            junk = [torch.full_like(base, -7) for _ in range(4)]
        del junk
        assert checker.drain() == []


def test_a_graph_captured_around_the_block_counts_on_every_replay():
    slots, lens, pos = swa_case()
    pos[3] = -1
    x = torch.randn(128, 128, device="cuda") / 12
    checker = invariants.checker("cuda")  # slab and side stream exist before capture
    with levels("warn"):
        want = step(x, pos, lens, slots)  # warm-up: compile every kernel
        checker.drain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(x, pos, lens, slots)
        assert checker.drain() == []  # capture runs nothing
        replays = 200
        found = []
        for i in range(replays):
            graph.replay()
            if i % 50 == 0:
                found += checker.poll()  # polls between replays lose nothing
        found += checker.drain()
    assert sum(v.new_hits for v in found) == CHECKS * replays
    assert {v.rows for v in found} == {(300,)}
    torch.testing.assert_close(out, want)


def test_an_exception_inside_the_block_still_rejoins_the_capture():
    # An unjoined side stream would fail capture_end (cudaErrorStreamCaptureUnjoined).
    slots, lens, pos = swa_case()
    pos[2] = -1
    checker = invariants.checker("cuda")
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)  # compile
        checker.drain()
        graph = torch.cuda.CUDAGraph()
        # Two blocks nested inside the capture: the outer one's end joins, exception or not.
        with (
            torch.cuda.graph(graph),
            pytest.raises(RuntimeError, match="mid-step"),
            concurrent_checks(),
            concurrent_checks(),
        ):
            expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
            raise RuntimeError("mid-step")
        graph.replay()
        graph.replay()
        [v] = checker.drain()
    assert (v.new_hits, v.rows) == (2, (77,))


@pytest.mark.parametrize("level", ["warn", "strict"])
def test_the_block_never_syncs(level):
    slots, lens, pos = swa_case()
    x = torch.randn(64, 64, device="cuda") / 8
    checker = invariants.checker("cuda")
    with levels(level):
        for _ in range(2):  # warm-up: compile, allocate
            step(x, pos, lens, slots)
            checker.poll()
        checker.drain()
        with no_host_sync():
            for _ in range(3):
                step(x, pos, lens, slots)
                checker.poll()
        assert checker.drain() == []


def test_the_runner_checks_beside_its_layers_with_and_without_graphs():
    # The rings' positions are stored after the block, so no false hit however long it decodes;
    # a request whose history is gone is caught by each of the three sliding layers.
    cfg = tiny_config("SSFS")
    checker = invariants.checker("cuda")
    for graphs in (False, True):
        cache = KVCache(cfg, KVConfig(page_size=16, num_pages=64, max_requests=8, device="cuda"))
        runner = ModelRunner(tiny_model(cfg).cuda(), cache)
        with levels("warn"):
            if graphs:
                runner.capture_decode_graphs([4], max_pages=8)
            seqs = [Seq(cache, i, random_tokens(60, seed=i)) for i in range(3)]
            runner.forward(ForwardBatch.build([s.chunk(20) for s in seqs], Mode.EXTEND, cache), None)
            found = []
            for _ in range(30):
                batch = runner.build_batch([s.chunk(1) for s in seqs], Mode.DECODE)
                assert batch.num_seqs == (4 if graphs else 3), "the graph path was not taken"
                runner.forward(batch, None)
                found += checker.poll()
            assert found + checker.drain() == []
            seqs[1].window.clear()
            runner.forward(runner.build_batch([s.chunk(1) for s in seqs], Mode.DECODE), None)
            [v] = checker.drain()
        assert (v.name, v.rows, v.new_hits) == ("swa.history_present", (seqs[1].window.slot,), 3)


STRICT_SCRIPT = textwrap.dedent(
    """
    import torch, invariants
    from invariants import concurrent_checks, expect, predicates
    from invariants.predicates import window_expected
    from shared.kv.invariants import SWA_HISTORY_PRESENT
    lens = torch.tensor([10, 70], device="cuda")
    pos = window_expected(lens, 64)
    pos[1] = -1
    x = torch.randn(256, 256, device="cuda")
    invariants.checker("cuda")

    def step(p, l):
        with concurrent_checks():
            y = x @ x
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(p, l))
            return y @ x

    if {graph}:
        step(pos[:1], lens[:1])  # compile (passes)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(pos, lens)
        g.replay()
    else:
        step(pos, lens)
    torch.cuda.synchronize()
    print("survived")
    """
)


@pytest.mark.parametrize("graph", [False, True])
def test_a_strict_trip_on_the_side_stream_stops_the_process_and_names_the_invariant(graph):
    assert_trip_stops_the_process(STRICT_SCRIPT.format(graph=graph))
