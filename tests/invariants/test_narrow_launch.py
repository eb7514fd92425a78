"""Narrow launches (a check forked beside the step): a few persistent programs loop over the row
blocks and must agree with the torch reference row for row, as the wide grid does.

On CPU the kernel runs in Triton's interpreter (the root conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from invariants import Checker, Invariant, Severity, predicates
from invariants.kernels import check_rows
from invariants.kernels.check_rows import plan
from tests.invariants.predicate_cases import random_cases

INV = Invariant("test_narrow_launch.kernel", Severity.SOFTEN, "narrow kernel vs reference")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _launch(chk: Checker, pred: predicates.Predicate, rows: torch.Tensor | None, message: str | None) -> None:
    check_rows.launch(
        pred, counts=chk.counts, bits=chk.bits, scratch=chk.scratch, ticket=chk.ticket,
        slot=chk.slot(INV), rows=rows, assert_message=message, narrow=True,
    )  # fmt: skip


def _on_device(cpu_pred: predicates.Predicate) -> predicates.Predicate:
    moved = {k: getattr(cpu_pred, k) for k in ("a", "b", "index") if getattr(cpu_pred, k) is not None}
    return dataclasses.replace(cpu_pred, **{k: t.to(DEVICE) for k, t in moved.items()})


# 2 and 4: fewer programs than the row blocks of most cases (37 rows of one row each), so each
# program loops, the wide [5, 9000] case over its three column chunks unsplit; 64: more programs
# than row blocks (one block each, the split + ticket path for [5, 9000]).
@pytest.mark.parametrize("programs", [2, 4, 64])
def test_narrow_launch_agrees_with_the_torch_reference(monkeypatch, programs):
    monkeypatch.setattr(check_rows, "NARROW_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(1)
    for cpu_pred in random_cases(gen):
        pred = _on_device(cpu_pred)
        ids = torch.randperm(4096, generator=gen)[: pred.num_rows]
        ref = Checker("cpu", use_triton=False)
        fused = Checker(DEVICE, use_triton=True)
        ref.check(INV, cpu_pred, ids, crash=False)
        ref.check(INV, cpu_pred, None, crash=False)
        _launch(fused, pred, ids.to(DEVICE), None)
        _launch(fused, pred, None, None)
        [want], [got] = ref.poll(), fused.drain()
        assert want.total == 2 * int((~cpu_pred.row_ok()).sum()), pred.op
        assert (got.total, got.rows) == (want.total, want.rows), (pred.op, programs)
        assert int(fused.scratch.abs().sum()) == 0 and int(fused.ticket) == 0, "split scratch left dirty"


@pytest.mark.skipif(DEVICE == "cuda", reason="a device assert ends the process: strict_testutil's subprocess")
@pytest.mark.parametrize("programs", [3, 64])
def test_narrow_strict_launch_asserts_only_on_a_failing_row(monkeypatch, programs):
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    monkeypatch.setattr(check_rows, "NARROW_PROGRAMS", programs)
    # The interpreter drops tl.device_assert unless its own options say debug (jit's debug=True
    # does not reach them); with it, a failing assert raises (wrapped) with the message.
    debug = interpreter.InterpreterOptions(debug=True)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", debug)
    lens = torch.randint(0, 40, (37,))
    pos = predicates.window_expected(lens, 16).to(torch.int32)
    chk = Checker(DEVICE, use_triton=True)
    _launch(chk, _on_device(predicates.window_positions(pos, lens)), None, "invariant-check FAILED [t]")
    pos[30, 0] = -7  # a row only a later iteration of the persistent loop reaches
    with pytest.raises(InterpreterError, match=r"invariant-check FAILED \[t\]"):
        _launch(chk, _on_device(predicates.window_positions(pos, lens)), None, "invariant-check FAILED [t]")


def test_narrow_plan_keeps_the_total_programs_near_the_budget():
    budget = check_rows.NARROW_PROGRAMS
    assert 8 <= budget <= 32
    splits = plan(8, 131072, 4096, budget)[3]  # logits: 8 rows x split columns
    assert 8 * splits <= budget and splits > 1
    assert plan(4096, 1024, 4096, budget)[3] == 1  # the gpu-bound ring: rows looped, never split
    assert plan(5, 9000, 4096, 2)[3] == 1  # row programs use the whole budget: no split
