"""One grouped launch (`launch_grouped`: a program per check and row block) counts and attributes
exactly what the torch reference finds, slot by slot, for every operation it takes.

A block with no failing row records nothing (nearly every block of a healthy step): so the cases hold
checks that pass entirely and checks whose only failing row is their last, beside checks of uneven
row counts in one table, each with row ids and without. (`test_batched_checks.py` holds how a block
defers checks and groups them by kind; here checks are launched directly, over many slots.)

On a GPU the kernel runs compiled. On CPU it runs in Triton's interpreter, which runs Python, not the
compiler: that the kernel compiles for an H200, with its tile loads vectorized and its record behind
the block's verdict, is checked by compiling it for sm_90 without a GPU (a compile probe: under the
`perf` marker, `pytest -m perf`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from predicate_cases import random_cases

from invariants import Checker, predicates
from invariants.kernels import check_rows
from invariants.kernels.check_rows import groupable, grouped_plan, launch_grouped
from invariants.predicates import window_expected

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter


def windows_of_uneven_rows(gen: torch.Generator) -> list[predicates.Predicate]:
    """Window checks of one kind (16 columns, int32) with 37, 20, 3 and 1 rows, each failing in its
    middle row and its last: one table whose short checks leave the grid's later row blocks idle."""
    preds = []
    for rows in (37, 20, 3, 1):
        lens = torch.randint(1, 60, (rows,), generator=gen)
        pos = window_expected(lens, 16).to(torch.int32)
        pos[rows - 1, 15] = -5
        pos[rows // 2, 0] = -5
        preds.append(predicates.window_positions(pos, lens))
    return preds


def rows_of(pred: predicates.Predicate, rows: list[int]) -> predicates.Predicate:
    """The check of `pred`'s rows `rows`, in that order."""
    return dataclasses.replace(pred, a=pred.a[rows], b=None if pred.b is None else pred.b[rows])


def every_kind(gen: torch.Generator) -> list[check_rows.Pending]:
    """Every groupable random case (each operation, a wide row over several column tiles, strided
    columns), and of each its passing rows alone (a check that passes entirely) and then followed by
    one failing row (a check whose only failing row is its last), plus the windows of uneven rows
    and a 5-row range check; each with row ids and without (a kind of its own), over several slots."""
    preds = []
    for pred in (p for p in random_cases(gen) if groupable(p)):
        preds.append(pred)
        ok = pred.row_ok()
        good, bad = ok.nonzero().flatten().tolist(), (~ok).nonzero().flatten().tolist()
        if pred.a.dim() and good and bad:
            preds += [rows_of(pred, good), rows_of(pred, good + bad[:1])]
    preds += windows_of_uneven_rows(gen)
    preds.append(predicates.in_range(torch.randint(-1, 9, (5, 9), generator=gen), 0, 8))
    checks = []
    for i, pred in enumerate(preds):
        ids = torch.randperm(4096, generator=gen)[: pred.num_rows]
        checks += [(pred, ids, 1 + i % 5), (pred, None, 6 + i % 3)]
    return checks


def on_device(checks: list[check_rows.Pending]) -> list[check_rows.Pending]:
    """`checks` with their tensors on DEVICE."""

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE)

    return [(dataclasses.replace(p, a=to(p.a), b=to(p.b)), to(rows), slot) for p, rows, slot in checks]


def counted(checks: list[check_rows.Pending]) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, bits) after one `launch_grouped` of `checks` (on DEVICE)."""
    chk = Checker(DEVICE, use_triton=True)
    launch_grouped(checks, counts=chk.counts, bits=chk.bits)
    return chk.counts.cpu(), chk.bits.cpu()


def reference(checks: list[check_rows.Pending]) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, bits) by the torch reference: per slot, the number of failing rows, and the bits of
    the failing rows' ids (where the check has ids)."""
    like = Checker("cpu", use_triton=True)
    counts, bits = torch.zeros_like(like.counts), torch.zeros(like.bits.shape, dtype=torch.int64)
    for pred, rows, slot in checks:
        bad = ~pred.row_ok().cpu()
        counts[slot] += int(bad.sum())
        for rid in [] if rows is None else rows.cpu()[bad].tolist():
            bits[slot, rid // 32] |= 1 << (rid % 32)
    return counts, torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def test_one_launch_counts_and_attributes_what_the_torch_reference_finds_for_every_kind():
    """Per slot, the failing rows' count and their ids' bits, as the torch reference finds them, for
    every operation, with ids and without: a check that passes entirely adds nothing, a check whose
    only failing row is its last counts it."""
    checks = on_device(every_kind(torch.Generator().manual_seed(11)))
    assert sum(int((~p.row_ok()).sum()) == 0 for p, _, _ in checks) >= 10  # checks that pass entirely
    want_counts, want_bits = reference(checks)
    assert int(want_counts.sum()) > 0 and int(want_bits.ne(0).sum()) > 0
    counts, bits = counted(checks)
    assert torch.equal(counts, want_counts)
    assert torch.equal(bits, want_bits)


def test_checks_of_uneven_rows_share_one_table_and_every_failing_row_counts_once():
    """The four window checks (37, 20, 3, 1 rows, in blocks of 2 rows) and a passing 37-row check in
    another slot are one table, one launch. Every planted row is counted and attributed once: the
    37-row check's last block is its last row alone (the next row masked off), the 20-row check's
    last block fails in its last row only; the passing check's slot stays empty."""
    gen = torch.Generator().manual_seed(12)
    preds = windows_of_uneven_rows(gen)
    lens = torch.randint(1, 60, (37,), generator=gen)
    passing = predicates.window_positions(window_expected(lens, 16).to(torch.int32), lens)
    ids = [torch.arange(100 * i, 100 * i + p.num_rows) for i, p in enumerate(preds)]
    checks = [(p, rows, 2) for p, rows in zip(preds, ids, strict=True)] + [(passing, torch.arange(37), 3)]
    assert grouped_plan(37, 16)[0] == 2
    chk = Checker(DEVICE, use_triton=True)
    _, tables = launch_grouped(on_device(checks), counts=chk.counts, bits=chk.bits)
    assert [t.shape[0] for t in tables] == [5]
    want = {int(rows[r]) for p, rows in zip(preds, ids, strict=True) for r in (~p.row_ok()).nonzero()}
    words = chk.bits[2].cpu()
    got = {w * 32 + b for w in range(words.shape[0]) for b in range(32) if int(words[w]) >> b & 1}
    assert int(chk.counts[2]) == len(want) == 7 and got == want  # the 1-row check's two plants: one row
    assert int(chk.counts[3]) == 0 and not chk.bits[3].any()


_COMPILE_FOR_SM90 = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from invariants.kernels import check_rows as cr

fn = cr._check_rows_grouped
# What a launch specializes on: 16-byte aligned tensors, a width and row strides that are multiples of
# 16 (a ring of 1024 int32 columns), unit column strides.
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
         for n in ("desc_ptr", "counts_ptr", "bits_ptr", "words_per_slot", "C", "sa_r", "sb_r")}
TYPES = {0: tl.int32, 1: tl.int64, 2: tl.bfloat16, 3: tl.uint8, 4: tl.int64, 5: tl.int32}
for op, a_ty in TYPES.items():
    for aligned in (True, False):
        for has_rows in (True, False):
            consts = dict(
                A_TY=a_ty, B_TY=tl.int64 if op == 5 else a_ty, R_TY=tl.int32, OP=op, HAS_ROWS=has_rows,
                ALIGNED=aligned, BLOCK_R=2, BLOCK_C=1024, EVICT="evict_first", sa_c=1, sb_c=1,
            )
            ptrs = {"desc_ptr": "*i64", "counts_ptr": "*i64", "bits_ptr": "*i32"}
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
            kernel = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4},
            )
            tile = re.findall(r"ld\\.global\\.L1::evict_first[\\w.:]*", kernel.asm["ptx"])
            ttir = kernel.asm["ttir"]
            record_if_bad = ttir.rfind("scf.if", 0, ttir.find("tt.atomic_rmw")) > ttir.find("scf.for")
            vector = all(".v2." in ld or ".v4." in ld for ld in tile)
            print(op, aligned, has_rows, bool(tile) and vector, record_if_bad, flush=True)
"""


@pytest.mark.perf
def test_the_grouped_kernel_compiles_for_the_h200_with_vector_loads_and_its_record_behind_the_verdict():
    """Every operation's grouped kernel, with row ids and without, compiles for sm_90 (without a GPU).
    With ALIGNED (the tensors' addresses vouched for, as the launch does where they are 16-byte
    aligned) its tile loads are 16-byte vectors, read evict-first; without, they are not, so the
    promise is what vectorizes them. And the record (its atomics) sits under a branch taken after the
    column loop: a block with no failing row skips it. The interpreter sees neither."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # compile, not interpret
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert len(rows) == 24, out.stdout
    for op, aligned, has_rows, vector, record_if_bad in rows:
        assert vector == aligned, (op, aligned, has_rows)
        assert record_if_bad == "True", (op, aligned, has_rows)
