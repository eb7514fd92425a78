"""Random cases of every built-in predicate, shared by the kernel-vs-reference tests (wide and narrow)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from invariants import predicates
from invariants.predicates import window_expected


def random_cases(gen: torch.Generator) -> Iterator[predicates.Predicate]:
    """Each built-in predicate on random data where roughly a third of the rows fail."""
    rows = 37
    a = torch.randint(0, 50, (rows, 3, 70), generator=gen)
    b = a.clone()
    flip = torch.rand(rows, generator=gen) < 0.3
    b[flip, 1, 5] += 1
    yield predicates.equal(a, b)
    ids = torch.randint(-2, 100, (rows, 9), generator=gen)
    yield predicates.in_range(ids, 0, 98)
    x = torch.randn(rows, 600, generator=gen)
    x[flip, 599] = float("nan")
    x[3, 0] = float("-inf")
    yield predicates.finite(x.to(torch.float16))
    yield predicates.is_true(torch.rand(rows, 5, generator=gen) > 0.08)
    yield predicates.page_aligned(torch.randint(0, 40, (rows,), generator=gen) * 8 + (flip * 3), 8)
    lens = torch.randint(0, 40, (rows,), generator=gen)
    pos = window_expected(lens, 16).to(torch.int32)
    pos[flip, 0] = -7
    yield predicates.window_positions(pos, lens)
    table = torch.full((64, 16), -1, dtype=torch.int32)
    slots = torch.randperm(64, generator=gen)[:rows]
    table[slots] = pos
    yield predicates.window_positions(table, lens, index=slots)  # rows gathered in the kernel
    wide = torch.randn(5, 9000, generator=gen)
    wide[1, [0, 4500, 8999]] = float("nan")  # one row failing in every column split counts once
    wide[3, 8999] = float("inf")
    yield predicates.finite(wide)
    yield predicates.is_true(torch.tensor(False))  # a 0-d tensor is one row
    yield predicates.finite(x[:, ::3])  # strided columns
