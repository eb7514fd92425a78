"""Built-in predicates: the torch reference, and the fused Triton kernel agreeing with it row for row.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from invariants import Checker, Invariant, InvariantError, Severity, predicates
from invariants.predicates import window_expected
from tests.invariants.predicate_cases import random_cases

INV = Invariant("test_predicates.kernel", Severity.SOFTEN, "kernel vs reference")


def bad_rows(pred) -> list[int]:
    return torch.nonzero(~pred.row_ok()).flatten().tolist()


def test_equal_is_rowwise():
    a = torch.arange(12).reshape(3, 2, 2)
    b = a.clone()
    b[1, 1, 0] = -1
    assert bad_rows(predicates.equal(a, b)) == [1]


def test_equal_treats_nan_as_unequal():
    a = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert bad_rows(predicates.equal(a, a.clone())) == [0]


def test_in_range_is_half_open():
    ids = torch.tensor([[0, 5], [9, 10], [-1, 3]])
    assert bad_rows(predicates.in_range(ids, 0, 10)) == [1, 2]


def test_finite_catches_nan_and_inf_only_in_floats():
    x = torch.tensor([[1.0, 2.0], [float("inf"), 0.0], [float("nan"), 1.0]])
    assert bad_rows(predicates.finite(x)) == [1, 2]
    assert bad_rows(predicates.finite(torch.tensor([1, 2]))) == []


def test_is_true_and_page_aligned():
    assert bad_rows(predicates.is_true(torch.tensor([[True, True], [True, False]]))) == [1]
    assert bad_rows(predicates.page_aligned(torch.tensor([0, 16, 17, 32]), 16)) == [2]


def test_window_expected_follows_the_ring_layout():
    # W=4: L=2 holds positions 0,1 at indices 0,1; L=6 holds 4,5,2,3 (p at p % 4).
    assert window_expected(torch.tensor([0, 2, 6]), 4).tolist() == [
        [-1, -1, -1, -1],
        [0, 1, -1, -1],
        [4, 5, 2, 3],
    ]


def test_window_positions_can_read_rows_of_a_slot_table():
    lens = torch.tensor([3, 9])
    table = torch.full((10, 4), -1)
    table[7] = window_expected(lens[1:], 4)[0]
    table[2] = window_expected(lens[:1], 4)[0]
    assert bad_rows(predicates.window_positions(table, lens, index=torch.tensor([2, 7]))) == []
    assert bad_rows(predicates.window_positions(table, lens, index=torch.tensor([7, 2]))) == [0, 1]


def stacked_rings(lens: torch.Tensor, slots: list[int], layers: int = 3) -> torch.Tensor:
    """One [10, 4] slot table per layer, each holding `lens`' history at `slots`."""
    table = torch.full((layers, 10, 4), -1, dtype=torch.int32)
    table[:, slots] = window_expected(lens, 4).to(torch.int32)
    return table


def test_window_positions_checks_every_layers_table_of_a_stack_at_once():
    # Check row l * 2 + r is layer l's ring of slot index[r]; row ids come one per index entry.
    lens, slots = torch.tensor([3, 9]), [2, 7]
    table = stacked_rings(lens, slots)
    pred = predicates.window_positions(table, lens, index=torch.tensor(slots))
    assert (pred.layers, pred.num_rows, pred.id_rows) == (3, 6, 2)
    assert bad_rows(pred) == []
    table[2, 7, 1] = 0  # the last layer's ring of slot 7 (row 1) stale
    table[1, 2] = -1  # the middle layer's ring of slot 2 (row 0) missing
    assert bad_rows(predicates.window_positions(table, lens, index=torch.tensor(slots))) == [2, 5]
    one = predicates.window_positions(table[:1], lens, index=torch.tensor(slots))  # a stack of one
    assert one.layers == 1 and bad_rows(one) == []


@pytest.mark.parametrize("split", [False, True])
def test_the_fused_kernel_attributes_a_stacks_failures_to_their_rows(split):
    # A failing layer of slot 7 sets row id 107's bit, whichever layer it is; counts are per (layer,
    # row). `split`: rings wide enough that the kernel splits their columns (a ticket's last program
    # records the rows).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    width = 4 if not split else 8192
    lens, slots = torch.tensor([3, 9, 5]), [2, 7, 4]
    table = torch.full((3, 10, width), -1, dtype=torch.int32)
    table[:, slots] = window_expected(lens, width).to(torch.int32)
    table[2, 7, 1] = 0
    table[0, 7, 2] = 0
    table[1, 4, 0] = 9
    ids = torch.tensor([100, 107, 104])
    pred = predicates.window_positions(
        table.to(device), lens.to(device), index=torch.tensor(slots, device=device)
    )
    ref = Checker("cpu", use_triton=False)
    fused = Checker(device, use_triton=True)
    ref.check(INV, predicates.window_positions(table, lens, index=torch.tensor(slots)), ids, crash=False)
    fused.check(INV, pred, ids.to(device), crash=False)
    [want], [got] = ref.poll(), fused.drain()
    assert (want.total, list(want.rows)) == (3, [104, 107])
    assert (got.total, got.rows) == (want.total, want.rows)
    assert int(fused.scratch.abs().sum()) == 0 and int(fused.ticket) == 0


def test_a_stacks_row_ids_are_one_per_index_entry():
    table = stacked_rings(torch.tensor([3]), [2])
    pred = predicates.window_positions(table, torch.tensor([3]), index=torch.tensor([2]))
    with pytest.raises(InvariantError, match="1 row ids"):
        Checker("cpu", use_triton=False).check(INV, pred, torch.tensor([0, 1, 2]), crash=False)


def test_window_positions_flags_missing_and_stale_rows():
    lens = torch.tensor([2, 6, 6, 6])
    pos = window_expected(lens, 4)
    pos[2] = -1  # history missing
    pos[3, 0] = 0  # stale: position 0 where 4 belongs
    assert bad_rows(predicates.window_positions(pos, lens)) == [2, 3]


@pytest.mark.parametrize(
    "make,error",
    [
        (lambda: predicates.equal(torch.zeros(2), torch.zeros(3)), "shapes"),
        (lambda: predicates.equal(torch.zeros(2), torch.zeros(2, dtype=torch.int64)), "dtypes"),
        (lambda: predicates.in_range(torch.zeros(2, dtype=torch.int64), 0, 1.5), "integer bounds"),
        (lambda: predicates.page_aligned(torch.zeros(2, dtype=torch.int64), 0), "positive integer page"),
        (
            lambda: predicates.window_positions(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(3)),
            "pos must be",
        ),
        (lambda: predicates.is_true([True]), "must be a torch.Tensor"),
    ],
)
def test_bad_arguments_are_clear_errors(make, error):
    with pytest.raises(InvariantError, match=error):
        make()


def test_the_fused_kernel_agrees_with_the_torch_reference():
    # On CUDA the compiled kernel; on CPU the same kernel in Triton's interpreter.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for cpu_pred in random_cases(gen):
        moved = {k: getattr(cpu_pred, k) for k in ("a", "b", "index") if getattr(cpu_pred, k) is not None}
        pred = dataclasses.replace(cpu_pred, **{k: t.to(device) for k, t in moved.items()})
        ids = torch.randperm(4096, generator=gen)[: pred.num_rows]
        ref = Checker("cpu", use_triton=False)
        fused = Checker(device, use_triton=True)
        for chk, p, rows in ((ref, cpu_pred, ids), (fused, pred, ids.to(device))):
            chk.check(INV, p, rows, crash=False)
            chk.check(INV, p, None, crash=False)
        [want], [got] = ref.poll(), fused.drain()
        expected_rows = sorted(ids[~cpu_pred.row_ok()].tolist())
        assert want.total == 2 * len(expected_rows) and list(want.rows) == expected_rows, pred.op
        assert (got.total, got.rows) == (want.total, want.rows), pred.op
        assert int(fused.scratch.abs().sum()) == 0 and int(fused.ticket) == 0, "split scratch left dirty"


def test_wide_rows_split_their_columns_and_narrow_ones_do_not():
    from invariants.kernels.check_rows import plan

    assert plan(5, 9000, 4096)[3] == 3  # three 4096-column chunks, counted once per row
    assert plan(8, 131072, 4096)[3] == 32
    assert plan(4096, 1024, 4096)[3] == 1
    assert plan(5000, 9000, 4096)[3] == 1  # more rows than scratch: one program per row block
