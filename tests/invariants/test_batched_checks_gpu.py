"""On a CUDA device: a `batched_checks` block's WARN checks launch at its end as one kernel per kind,
count on every graph replay (the table's upload is replayed with it), never sync, and combine with
`concurrent_checks` (the batched launch forks onto the side stream)."""

from __future__ import annotations

import pytest
import torch

import invariants
from invariants import Invariant, Severity, batched_checks, concurrent_checks, expect, levels, predicates
from invariants.predicates import window_expected
from invariants.testing import no_host_sync
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT

pytestmark = pytest.mark.gpu

GUARD = Invariant("test_batched_checks_gpu.guard", Severity.GUARD, "a guard batched with the windows")
W, LAYERS = 64, 6


def swa_case():
    slots = torch.tensor([5, 40, 77, 300], device="cuda")
    lens = torch.tensor([10, 64, 65, 1000], device="cuda")
    return slots, lens, [window_expected(lens, W).to(torch.int32) for _ in range(LAYERS)]


def step(x, pos, lens, slots, concurrent: bool):
    with concurrent_checks() if concurrent else batched_checks(), batched_checks():
        for layer in range(LAYERS):
            expect(SWA_HISTORY_PRESENT, lambda p=pos[layer]: predicates.window_positions(p, lens), rows=slots)
            expect(GUARD, lambda: predicates.in_range(lens, 0, 4096), rows=slots)
            x = torch.tanh(x @ x)
    return x


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_graph_captured_around_the_block_counts_every_layer_on_every_replay(concurrent):
    slots, lens, pos = swa_case()
    pos[2][3] = -1  # layer 2 lost request 300's history
    pos[4][1] = -1  # layer 4 lost request 40's
    x = torch.randn(128, 128, device="cuda") / 12
    checker = invariants.checker("cuda")
    with levels("warn"):
        want = step(x, pos, lens, slots, concurrent)  # compiles
        first = checker.drain()
        assert sum(v.new_hits for v in first) == 2 and set(first[0].rows) == {40, 300}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(x, pos, lens, slots, concurrent)
        assert checker.drain() == []  # capture runs nothing
        for _ in range(20):
            graph.replay()
        found = checker.drain()
    assert sum(v.new_hits for v in found) == 2 * 20 and {r for v in found for r in v.rows} == {40, 300}
    torch.testing.assert_close(out, want)


def test_a_batched_block_never_syncs():
    slots, lens, pos = swa_case()
    x = torch.randn(128, 128, device="cuda") / 12
    checker = invariants.checker("cuda")
    with levels("warn"):
        step(x, pos, lens, slots, False)  # compiles
        torch.cuda.synchronize()
        with no_host_sync():
            step(x, pos, lens, slots, False)
            step(x, pos, lens, slots, True)
            checker.poll()
        assert checker.drain() == []
