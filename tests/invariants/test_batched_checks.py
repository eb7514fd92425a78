"""`invariants.batched_checks()`: a block's WARN checks wait for its end and launch as one kernel per
kind, counting and attributing exactly what the same checks count one by one.

On CPU the fused kernels run in Triton's interpreter through a Checker built with `use_triton=True`
(the process's CPU Checker uses torch and checks at once, block or not)."""

from __future__ import annotations

import pytest
import torch
from predicate_cases import random_cases

import invariants
from invariants import Checker, Invariant, InvariantViolation, Severity, predicates
from invariants.kernels.check_rows import groupable, launch_grouped
from invariants.predicates import window_expected

INV = Invariant("test.batched", Severity.FATAL_CONTAINABLE, "batched checks count what single ones count")


Cases = list[tuple[predicates.Predicate, set[int]]]


def layer_windows(layers: int, rows: int, gen: torch.Generator) -> Cases:
    """A window check per sliding layer, each missing history in its own rows."""
    lens = torch.randint(1, 60, (rows,), generator=gen)
    cases = []
    for layer in range(layers):
        pos = window_expected(lens, 16).to(torch.int32)
        bad = {(3 * layer + k) % rows for k in range(layer % 3)}
        for r in bad:
            pos[r, 0] = -5
        cases.append((predicates.window_positions(pos, lens), bad))
    return cases


def test_checks_inside_wait_for_the_blocks_end_and_count_what_they_count_one_by_one():
    gen = torch.Generator().manual_seed(3)
    cases = [c for c in random_cases(gen) if groupable(c)] + [p for p, _ in layer_windows(8, 37, gen)]
    ref, fused = Checker("cpu", use_triton=False), Checker("cpu", use_triton=True)
    with invariants.batched_checks("cpu"):
        for pred in cases:
            ids = torch.randperm(4096, generator=gen)[: pred.num_rows]
            for chk in (ref, fused):
                chk.check(INV, pred, ids, crash=False)
                chk.check(INV, pred, None, crash=False)  # a kind of its own: no row ids
        assert int(fused.counts.sum()) == 0, "nothing launched before the block ends"
        assert int(ref.counts.sum()) > 0, "the torch Checker checks at once, block or not"
    [want], [got] = ref.poll(), fused.poll()
    assert want.total > 0 and (got.total, got.rows) == (want.total, want.rows)


def test_one_kernel_per_kind_reads_every_check_of_that_kind():
    gen = torch.Generator().manual_seed(4)
    windows = layer_windows(6, 20, gen)
    ids = torch.arange(20, dtype=torch.int32)
    short = predicates.window_positions(*_short_window(gen))  # fewer rows than the rest: idle programs
    checks = [(p, ids, 1) for p, _ in windows] + [(short, None, 1)]
    checks += [(predicates.in_range(torch.randint(-1, 9, (20, 4), generator=gen), 0, 9), ids, 2)]
    chk = Checker("cpu", use_triton=True)
    _, tables = launch_grouped(checks, counts=chk.counts, bits=chk.bits)
    assert sorted(t.shape[0] for t in tables) == [1, 1, 6], "windows with ids, the short one, the range"
    bad_rows = set().union(*(bad for _, bad in windows))
    want_range = int((~checks[-1][0].row_ok()).sum())
    short_bad = int((~short.row_ok()).sum())
    assert int(chk.counts[1]) == sum(len(bad) for _, bad in windows) + short_bad
    assert int(chk.counts[2]) == want_range
    words = chk.bits[1]
    got_rows = {w * 32 + b for w in range(words.shape[0]) for b in range(32) if int(words[w]) >> b & 1}
    assert got_rows == bad_rows


def _short_window(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.randint(1, 40, (3,), generator=gen)
    pos = window_expected(lens, 16).to(torch.int32)
    pos[1, 2] = 99
    return pos, lens


def test_strict_checks_index_gathers_and_float_bounds_still_check_at_once():
    gen = torch.Generator().manual_seed(5)
    table, lens = _short_window(gen)
    chk = Checker("cpu", use_triton=True)
    immediate = [
        predicates.window_positions(table, lens, index=torch.tensor([0, 1, 2])),  # row 1 fails
        predicates.in_range(torch.tensor([[0.5, 2.0]]), 0.0, 1.0),  # fails
    ]
    with invariants.batched_checks("cpu"):
        for pred in immediate:
            assert not groupable(pred)
            chk.check(INV, pred, None, crash=False)
        assert int(chk.counts.sum()) == 2, "counted before the block ends"
        with pytest.raises(InvariantViolation, match=r"invariant-check FAILED \[test.batched\]"):
            chk.check(INV, predicates.window_positions(table, lens), None, crash=True)


def test_blocks_nest_the_outermost_launches_and_an_exception_drops_what_was_deferred():
    gen = torch.Generator().manual_seed(6)
    (pred, bad), *_ = layer_windows(3, 10, gen)[2:]
    chk = Checker("cpu", use_triton=True)
    with invariants.batched_checks("cpu"):
        with invariants.batched_checks("cpu"):
            chk.check(INV, pred, None, crash=False)
        assert int(chk.counts.sum()) == 0, "an inner block's end launches nothing"
    assert int(chk.counts[chk.slot(INV)]) == len(bad) == 2
    with pytest.raises(RuntimeError, match="the step failed"), invariants.batched_checks("cpu"):
        chk.check(INV, pred, None, crash=False)
        raise RuntimeError("the step failed")
    with invariants.batched_checks("cpu"):
        pass
    assert int(chk.counts[chk.slot(INV)]) == 2, "the failed block's check was dropped, not launched later"
    with invariants.batched_checks("cpu"):
        chk.check(INV, pred, None, crash=False)
    assert int(chk.counts[chk.slot(INV)]) == 4


def test_at_off_a_block_defers_and_builds_nothing():
    built = []
    with invariants.levels("off"), invariants.batched_checks("cpu"):
        invariants.expect(INV, lambda: built.append(1) or predicates.is_true(torch.tensor([False])))
    assert built == []


def test_a_check_of_another_device_is_not_deferred_by_this_devices_block():
    chk = Checker("cpu", use_triton=True)
    pred = predicates.is_true(torch.tensor([[True, False]]))
    with invariants.batched_checks("meta"):
        chk.check(INV, pred, None, crash=False)
        assert int(chk.counts[chk.slot(INV)]) == 1
