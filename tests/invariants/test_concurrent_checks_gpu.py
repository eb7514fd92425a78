"""On a CUDA device: checks inside `concurrent_checks` run on the side stream beside the block's work,
count eagerly and on every graph replay, never sync, and a STRICT failure still stops the process.

Tests that hold the side stream with a spin kernel release it from a third stream: the current
stream waits for the side stream after the block, so releasing from it would deadlock.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from collections.abc import Iterator

import pytest
import torch

import invariants
from invariants import Invariant, Severity, concurrent_checks, expect, levels, predicates
from invariants.kernels import spin
from invariants.predicates import window_expected
from invariants.testing import no_host_sync
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT
from shared.engine.runner import ModelRunner
from tests.engine.engine_testutil import build_batch, random_tokens, tiny_config, tiny_model
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


def _graph_nodes_and_edges(dot: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Node labels and successor sets of a CUDA graph's DOT dump (cudaGraphDebugDotPrint)."""
    labels: dict[str, str] = {}
    succ: dict[str, set[str]] = {}
    current = None
    for line in dot.splitlines():
        edge = re.match(r'\s*"([^"]+)"\s*->\s*"([^"]+)"', line)
        if edge:
            succ.setdefault(edge[1], set()).add(edge[2])
            current = None
            continue
        node = re.match(r'\s*"([^"]+)"\s*\[', line)
        if node:
            current = node[1]
            labels[current] = ""
        if current is not None:
            labels[current] += line
    return labels, succ


def _reaches(succ: dict[str, set[str]], src: str, dst: str) -> bool:
    todo, seen = [src], set()
    while todo:
        n = todo.pop()
        if n == dst:
            return True
        if n not in seen:
            seen.add(n)
            todo += succ.get(n, ())
    return False


def test_a_check_runs_beside_the_block_and_the_block_end_waits_for_it(tmp_path):
    # The structure is the promise: captured, the check is a branch that the block's next kernel does
    # not depend on, and that the first kernel after the block does. (Timing it instead depends on
    # the GPU's block scheduler: a large check on the high-priority side stream starves the others.)
    slots, lens, pos = swa_case()
    x = torch.randn(256, device="cuda")
    invariants.checker("cuda")  # its slab and side stream exist before capture
    with levels("warn"):
        expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)  # compile
        torch.tanh(x).exp()
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # the graph (not only its instance) stays to dump
        graph.enable_debug_mode()
        with torch.cuda.graph(graph):
            with concurrent_checks():
                expect(SWA_HISTORY_PRESENT, predicates.window_positions(pos, lens), rows=slots)
                y = torch.tanh(x)
            torch.exp(y)
    graph.debug_dump(str(tmp_path / "graph.dot"))
    dot = (tmp_path / "graph.dot").read_text()
    labels, succ = _graph_nodes_and_edges(dot)

    def node(name: str) -> str:
        found = [n for n, label in labels.items() if name in label]
        assert len(found) == 1, f"{name}: {found} in\n{dot}"
        return found[0]

    check, inside, after = node("_check_rows"), node("tanh_kernel_cuda"), node("exp_kernel_cuda")
    assert not _reaches(succ, check, inside), "the block's next kernel waits for the check"
    assert _reaches(succ, check, after), "the work after the block does not wait for the check"
    assert not _reaches(succ, inside, check), "the check waits for the block's later work"


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
                batch = build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
                assert batch.num_seqs == (4 if graphs else 3), "the graph path was not taken"
                runner.forward(batch, None)
                found += checker.poll()
            assert found + checker.drain() == []
            seqs[1].window.clear()
            runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
            [v] = checker.drain()
        assert (v.name, v.rows, v.new_hits) == ("swa.history_present", (seqs[1].window.slot,), 3)


STRICT_SCRIPT = textwrap.dedent(
    """
    import torch, invariants
    from invariants import concurrent_checks, expect, predicates
    from invariants.predicates import window_expected
    from shared.engine.kv.invariants import SWA_HISTORY_PRESENT
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
