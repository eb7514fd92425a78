"""On a CUDA device: checks never sync, count under graph replay, and STRICT stops the process."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

import invariants
from invariants import Invariant, Severity, expect, levels, predicates
from invariants.predicates import window_expected
from invariants.testing import HostSyncError, no_host_sync
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT
from tests.invariants.strict_testutil import assert_trip_stops_the_process

pytestmark = pytest.mark.gpu

GUARD = Invariant("test_gpu.guard", Severity.GUARD, "a guard on the GPU")
W = 64


def swa_case(device: str = "cuda"):
    slots = torch.tensor([5, 40, 77, 300], device=device)
    lens = torch.tensor([10, 64, 65, 1000], device=device)
    pos = window_expected(lens, W).to(torch.int32)
    return slots, lens, pos


def every_predicate(pos, lens, slots):
    expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, lens), rows=slots)
    expect(GUARD, lambda: predicates.equal(pos, pos), rows=slots)
    expect(GUARD, lambda: predicates.in_range(lens, 0, 4096), rows=slots)
    expect(GUARD, lambda: predicates.finite(pos.float()), rows=slots)
    expect(GUARD, lambda: predicates.page_aligned(lens * 16, 16), rows=slots)
    expect(GUARD, pos >= -1, rows=slots)


@pytest.mark.parametrize("level", ["off", "warn", "strict"])
def test_checks_and_poll_never_sync(level):
    slots, lens, pos = swa_case()
    checker = invariants.checker("cuda")
    with levels(level):
        every_predicate(pos, lens, slots)  # warm-up: compile, allocate
        checker.drain()
        with no_host_sync():
            for _ in range(3):
                every_predicate(pos, lens, slots)
                checker.poll()
        assert checker.drain() == []


def test_a_warn_hit_is_reported_by_poll_without_blocking():
    slots, lens, pos = swa_case()
    pos[2] = -1
    checker = invariants.checker("cuda")
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
        [v] = checker.drain()
        assert (v.rows, v.new_hits) == ((77,), 1)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        from invariants.kernels import spin

        spin.hold(flag)  # the GPU is busy: poll must return at once, reporting nothing yet
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
        t0 = time.perf_counter()
        assert checker.poll() == [] and checker.poll() == []
        assert time.perf_counter() - t0 < 0.5
    side = torch.cuda.Stream()  # release from a side stream: the held stream is queued behind the spin
    with torch.cuda.stream(side):
        flag.fill_(1)
    [v] = checker.drain()
    assert (v.rows, v.new_hits, v.total) == ((77,), 1, 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_check_on_a_gpu_that_is_not_the_current_one_runs_and_counts_there():
    torch.cuda.set_device(0)
    slots, lens, pos = swa_case("cuda:1")
    pos[2] = -1
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
        [v] = invariants.checker("cuda:1").drain()
    assert (v.rows, v.new_hits) == ((77,), 1)
    assert torch.cuda.current_device() == 0, "the thread's device is left as it was"


def test_a_check_captured_in_a_graph_counts_on_every_replay():
    slots, lens, pos = swa_case()
    pos[0] = -1
    checker = invariants.checker("cuda")  # the slab exists before capture
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)  # compile
        checker.drain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
        checker.drain()  # capture does not execute the kernel
        for _ in range(3):
            graph.replay()
    [v] = checker.drain()  # the level was frozen at capture: OFF now changes nothing for the graph
    assert (v.new_hits, v.rows) == (3, (5,))
    graph.replay()
    assert checker.drain()[0].new_hits == 1


def test_no_host_sync_catches_what_sync_debug_mode_sees():
    x = torch.ones(4, device="cuda")
    with pytest.raises(HostSyncError, match="host sync"), no_host_sync():
        x.sum().item()


def test_the_probe_catches_syncs_the_debug_mode_misses():
    x = torch.ones(1 << 20, device="cuda")
    pageable = torch.empty(1 << 20)
    with (
        pytest.raises(HostSyncError, match="waited for the GPU"),
        no_host_sync(sync_debug=False, timeout_s=1.0),
    ):
        pageable.copy_(x, non_blocking=True)
    with (
        pytest.raises(HostSyncError, match="waited for the GPU"),
        no_host_sync(sync_debug=False, timeout_s=1.0),
    ):
        torch.cuda.current_stream().synchronize()


STRICT_SCRIPT = textwrap.dedent(
    """
    import torch, invariants
    from invariants import expect, predicates
    from invariants.predicates import window_expected
    from shared.engine.kv.invariants import SWA_HISTORY_PRESENT
    lens = torch.tensor([10, 70], device="cuda")
    pos = window_expected(lens, 64)
    pos[1] = -1
    invariants.checker("cuda")
    if {graph}:
        g = torch.cuda.CUDAGraph()
        expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos[:1], lens[:1]))  # compile
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, lens))
        g.replay()
    else:
        expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, lens))
    torch.cuda.synchronize()
    print("survived")
    """
)


@pytest.mark.parametrize("graph", [False, True])
def test_a_strict_trip_stops_the_process_and_names_the_invariant(graph):
    assert_trip_stops_the_process(STRICT_SCRIPT.format(graph=graph))


def test_fused_kernel_matches_reference_at_full_size():
    gen = torch.Generator(device="cuda").manual_seed(1)
    inv = Invariant("test_gpu.full_size", Severity.SOFTEN, "parity")
    x = torch.randn(256, 131072, device="cuda", generator=gen, dtype=torch.bfloat16)
    bad = torch.randperm(256, device="cuda", generator=gen)[:17]
    x[bad, 131071] = float("nan")
    ids = torch.arange(256, device="cuda") * 3
    ref = invariants.Checker("cpu")
    ref.check(inv, predicates.finite(x.cpu()), ids.cpu(), crash=False)
    checker = invariants.Checker("cuda")
    checker.check(inv, predicates.finite(x), ids, crash=False)
    [want], [got] = ref.poll(), checker.drain()
    assert (got.total, got.rows) == (want.total, want.rows) and want.total == 17
