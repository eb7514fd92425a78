"""Built-in predicates. Each is lowered to ONE fused Triton kernel on CUDA and to plain torch on CPU.

A predicate is evaluated per row: the tensor's leading dimension is the batch row, the rest is
flattened. A row fails (one hit) when any of its elements fails. Constructing a predicate launches
nothing; pass a lambda to `expect` to skip even the construction at OFF.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from invariants.registry import InvariantError

__all__ = ["Op", "Predicate", "equal", "finite", "in_range", "is_true", "page_aligned", "window_positions"]


class Op(enum.IntEnum):
    # The values are the kernel's OP constexpr: keep in sync with kernels/check_rows.py.
    EQUAL = 0
    IN_RANGE = 1
    FINITE = 2
    IS_TRUE = 3
    PAGE_ALIGNED = 4
    WINDOW = 5


@dataclass(frozen=True, eq=False)
class Predicate:
    op: Op
    a: torch.Tensor
    b: torch.Tensor | None = None
    lo: int | float = 0
    hi: int | float = 0
    # Row r of the check reads row index[r] of `a` (a table indexed by request slot), fused into
    # the kernel instead of a gather.
    index: torch.Tensor | None = None
    # With an index, `a` may stack `layers` such tables ([layers, table rows, ...]): check row
    # l * len(index) + r reads table l at index[r], with b's row r and row id r. One check per
    # batch over every layer's table instead of one per layer.
    layers: int = 1

    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def num_rows(self) -> int:
        if self.index is not None:
            return self.index.shape[0] * self.layers
        return self.a.shape[0] if self.a.dim() else 1

    @property
    def id_rows(self) -> int:
        """How many row ids (`expect`'s rows) the check takes: one per index entry when layered."""
        return self.num_rows // self.layers

    @property
    def layer_rows(self) -> int:
        """Rows of one stacked table (0 unless layered)."""
        return self.a.shape[1] if self.layers > 1 else 0

    def as_2d(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, cols] views (a copy only where the trailing dims cannot be flattened)."""
        a = self.a.flatten(0, 1) if self.layers > 1 else self.a
        return _rows_view(a), None if self.b is None else _rows_view(self.b)

    def row_ok(self) -> torch.Tensor:
        """The torch reference: a bool tensor [rows], True where the row holds."""
        a, b = self.as_2d()
        if self.index is not None:
            index = self.index.to(torch.int64)
            if self.layers > 1:
                first = torch.arange(self.layers, device=index.device) * self.layer_rows
                index = (first[:, None] + index[None, :]).reshape(-1)
                b = None if b is None else b.repeat(self.layers, 1)
            a = a[index]
        if self.op is Op.EQUAL:
            ok = a == b
        elif self.op is Op.IN_RANGE:
            ok = (a >= self.lo) & (a < self.hi)
        elif self.op is Op.FINITE:
            ok = torch.isfinite(a)
        elif self.op is Op.IS_TRUE:
            ok = a != 0
        elif self.op is Op.PAGE_ALIGNED:
            ok = torch.remainder(a, int(self.lo)) == 0
        else:
            ok = a == window_expected(b.reshape(-1), a.shape[1])
        return ok.all(dim=1)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.dtype != torch.bool:
        return x
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    return x.reshape(x.shape[0], -1)


def _tensor(x: object, arg: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InvariantError(f"predicate argument {arg!r} must be a torch.Tensor, got {type(x).__name__}")
    return x


def equal(a: torch.Tensor, b: torch.Tensor) -> Predicate:
    """Rowwise equality: row i holds when a[i] == b[i] everywhere (NaN never equals)."""
    a, b = _tensor(a, "a"), _tensor(b, "b")
    if a.shape != b.shape or a.device != b.device:
        raise InvariantError(
            f"equal(): shapes/devices differ: {tuple(a.shape)}@{a.device} vs {tuple(b.shape)}@{b.device}"
        )
    if a.dtype != b.dtype:
        raise InvariantError(f"equal(): dtypes differ: {a.dtype} vs {b.dtype}")
    return Predicate(Op.EQUAL, a, b)


def in_range(x: torch.Tensor, lo: int | float, hi: int | float) -> Predicate:
    """lo <= x < hi (half-open, like token ids against a vocabulary size)."""
    x = _tensor(x, "x")
    if x.is_floating_point():
        lo, hi = float(lo), float(hi)
    elif isinstance(lo, float) or isinstance(hi, float):
        raise InvariantError("in_range(): integer tensor needs integer bounds")
    return Predicate(Op.IN_RANGE, x, lo=lo, hi=hi)


def finite(x: torch.Tensor) -> Predicate:
    """No NaN or infinity (integer tensors trivially hold)."""
    return Predicate(Op.FINITE, _tensor(x, "x"))


def is_true(mask: torch.Tensor) -> Predicate:
    """Every element non-zero; what a plain bool tensor passed to `expect` means."""
    return Predicate(Op.IS_TRUE, _tensor(mask, "mask"))


def page_aligned(x: torch.Tensor, page: int) -> Predicate:
    """x % page == 0 (slot offsets at page starts)."""
    x = _tensor(x, "x")
    if x.is_floating_point() or not isinstance(page, int) or page <= 0:
        raise InvariantError("page_aligned(): needs an integer tensor and a positive integer page size")
    return Predicate(Op.PAGE_ALIGNED, x, lo=page)


def window_positions(
    pos: torch.Tensor, seq_lens: torch.Tensor, index: torch.Tensor | None = None
) -> Predicate:
    """A sliding-window ring holds exactly the last W positions of each row.

    `pos[r, i]` is the absolute position whose K/V sits at ring index i (W = pos.shape[-1]; -1 =
    empty); a row with `seq_lens[r]` = L tokens must hold position p at index p % W for every p in
    [max(0, L - W), L) and -1 elsewhere. Missing or stale history fails its row. With `index`,
    row r checks `pos[index[r]]` (pos is then the whole per-slot table), and pos may stack one such
    table per layer ([layers, slots, W]): every layer's ring of each row, in one check.
    """
    pos, seq_lens = _tensor(pos, "pos"), _tensor(seq_lens, "seq_lens")
    rows = pos.shape[:1] if index is None else _tensor(index, "index").shape
    dims = (2,) if index is None else (2, 3)
    if pos.dim() not in dims or seq_lens.shape != rows or pos.device != seq_lens.device:
        raise InvariantError(
            f"window_positions(): pos must be [rows, W] (or a table, or a stack of tables, with index "
            f"[rows]) and seq_lens [rows] on one device, got {tuple(pos.shape)}@{pos.device} and "
            f"{tuple(seq_lens.shape)}@{seq_lens.device}"
        )
    if pos.is_floating_point() or seq_lens.is_floating_point():
        raise InvariantError("window_positions(): pos and seq_lens must be integer tensors")
    if index is not None and (index.dim() != 1 or index.is_floating_point() or index.device != pos.device):
        raise InvariantError("window_positions(): index must be a 1-D integer tensor on pos's device")
    if pos.dim() == 3 and pos.shape[0] == 1:
        pos = pos[0]
    layers = pos.shape[0] if pos.dim() == 3 else 1
    return Predicate(Op.WINDOW, pos, seq_lens.reshape(-1, 1), index=index, layers=layers)


def window_expected(seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """The ring contents `window_positions` expects: [rows, W], -1 where nothing is stored yet."""
    i = torch.arange(window, device=seq_lens.device)
    last = seq_lens.to(torch.int64)[:, None] - 1
    expected = last - torch.remainder(last - i, window)
    return torch.where(expected >= 0, expected, -1)
