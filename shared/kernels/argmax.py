"""Greedy argmax over decode logits: `argmax_rows(x)` is `x.argmax(dim=-1)` for a 2-D float x, with
each row's vocabulary split over many programs on a GPU.

Why: torch's reduction gives a row to a block, so a batch-64 decode step's [64, 128256] logits run
on 64 SMs of a GPU's 132, far from its memory bandwidth. Here the grid is (rows, S):
program (r, s) scans columns [s * chunk, (s + 1) * chunk) of row r in BLOCK-wide tiles and keeps
its chunk's (max, first index). With S = 1 it writes the row's answer; otherwise it stores the pair
as a partial and takes a ticket, and the row's last program to finish reduces the S partials, writes
the answer and resets the ticket for the next launch: one kernel, no zeroing pass, no host sync.
S comes from host ints alone (rows, V, tile, SM count) and is a runtime argument of the kernel, so
a new batch size neither compiles a kernel nor changes anything but the grid.

Semantics are torch.argmax's, exactly (the result is an index, no rounding is involved): the first
index of the maximum; a NaN counts as the maximum (the first NaN's index); a row of -inf gives 0;
-0.0 and 0.0 tie. The comparisons run in float32, which holds every bf16 and fp16 value exactly.
Across splits the same rules hold: a partial carries its chunk's value (NaN if it saw one) and its
global index, and the reduction takes NaN over any number, then the larger value, then the lower
index, in whatever order the programs finished.

What goes to torch.argmax instead: CPU tensors (unless `backend="triton"`, which the interpreter
tests use), dtypes other than float32/float16/bfloat16, a last dimension that is not contiguous (a
copy would cost more than the argmax saves), empty shapes, and rows of more than 2**30 columns. Rows
may have any stride (a slice `logits[:n]` of a larger buffer, every other row). The wrapper launches
on the tensor's device.

Tickets: int32 counters per row (`_tickets.py`), zero between launches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shared.kernels._launch import check_triton_device, sm_count
from shared.kernels._tickets import tickets
from shared.kernels.ops import Backend

__all__ = ["MAX_SPLITS", "PROGRAMS_PER_SM", "argmax_rows", "choose_block", "choose_splits"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MAX_COLUMNS = 2**30  # the kernel indexes columns in int32, tiles past V included

# Split rule: enough (row, split) programs for PROGRAMS_PER_SM on every SM, no split shorter than one
# tile, at most MAX_SPLITS (the reduction's width). Batch 64 x 128256 bf16 on 132 SMs: 8 splits of 4
# tiles (512 programs); batch 1: 32 splits of one tile. bench/argmax.py times other choices beside it.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64
# One tile's loads per program: 4096 bf16/fp16 values or 2048 fp32 (4 warps: 64 B a thread).
_TILE_BYTES = 8192


@triton.jit
def _first_max(vals, idxs):
    """(value, index) of a 1-D block: NaN beats everything, then the larger value, then the lower
    index. `idxs` of lanes that hold no element must be larger than every real index."""
    nan = vals != vals
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), vals), axis=0)
    candidate = tl.where(has_nan, nan, vals == top)
    index = tl.min(tl.where(candidate, idxs, 2147483647), axis=0)
    return tl.where(has_nan, float("nan"), top), index


@triton.jit
def _settle(
    row, index, out_ptr, host_ptr, dst_ptr, dst_index_ptr, HOST: tl.constexpr, SCATTER: tl.constexpr
):  # fmt: skip
    """A row's token is known: to the output, and to the pinned host copy and `dst[dst_index[row]]`
    as the launch asked."""
    tl.store(out_ptr + row, index.to(tl.int64))
    if HOST:
        tl.store(host_ptr + row, index.to(tl.int64))
    if SCATTER:
        at = tl.load(dst_index_ptr + row).to(tl.int64)
        tl.store(dst_ptr + at, index.to(tl.int64))


# num_splits changes with the batch size: only loop bounds and masks read it, and specializing on it
# (== 1) would compile a second kernel mid-traffic.
@triton.jit(do_not_specialize=["num_splits"])
def _argmax_kernel(
    x_ptr, out_ptr, val_ptr, idx_ptr, ticket_ptr, host_ptr, dst_ptr, dst_index_ptr, V, stride_row, chunk,
    num_splits, BLOCK: tl.constexpr, MAX_S: tl.constexpr, HOST: tl.constexpr, SCATTER: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride_row
    start = split * chunk  # < V: the host launches no empty split
    cols = start + tl.arange(0, BLOCK)
    # Lane-wise running (max, first index): the first tile as it is, lanes past V at -inf with an
    # index past V (they lose every tie), then each later tile in column order, so a lane takes a
    # value only when it is strictly larger, or a first NaN (NaN > x is false, hence the test).
    best = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best_i = cols
    for off in range(start + BLOCK, tl.minimum(start + chunk, V), BLOCK):
        c = off + tl.arange(0, BLOCK)
        v = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        take = (v > best) | ((v != v) & (best == best))
        best = tl.where(take, v, best)
        best_i = tl.where(take, c, best_i)
    value, index = _first_max(best, best_i)
    if num_splits == 1:
        _settle(row, index, out_ptr, host_ptr, dst_ptr, dst_index_ptr, HOST, SCATTER)
    else:
        part = row * num_splits
        tl.store(val_ptr + part + split, value)
        tl.store(idx_ptr + part + split, index)
        tl.debug_barrier()  # the partial is written before the ticket releases it
        ticket = tl.atomic_add(ticket_ptr + row, 1)
        if ticket == num_splits - 1:  # the row's last program: every partial is in
            s = tl.arange(0, MAX_S)
            ok = s < num_splits
            vals = tl.load(val_ptr + part + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(idx_ptr + part + s, mask=ok, other=0, cache_modifier=".cg")
            _, index = _first_max(vals, tl.where(ok, idxs, 2147483647))
            _settle(row, index, out_ptr, host_ptr, dst_ptr, dst_index_ptr, HOST, SCATTER)
            tl.atomic_xchg(ticket_ptr + row, 0)  # ready for the next launch


def choose_block(dtype: torch.dtype) -> int:
    """Columns per tile: _TILE_BYTES of loads (4096 bf16/fp16, 2048 fp32)."""
    return _TILE_BYTES // torch.tensor([], dtype=dtype).element_size()


def choose_splits(rows: int, size: int, block: int, sms: int) -> int:
    """Splits per row for `rows` rows of `size` columns in `block`-wide tiles on `sms` SMs: the fewest
    that give PROGRAMS_PER_SM programs an SM, but no split shorter than a tile and at most MAX_SPLITS.
    The launch then rounds each split up to whole tiles, which may leave fewer splits."""
    want = math.ceil(PROGRAMS_PER_SM * sms / max(rows, 1))
    return max(1, min(want, math.ceil(size / block), MAX_SPLITS))


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no SMs to fill
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _argmax_triton(
    x: torch.Tensor,
    num_splits: int | None,
    block: int | None,
    host_out: torch.Tensor | None = None,
    scatter_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    rows, size = x.shape
    device = x.device
    check_triton_device("argmax_rows", device)
    block = block or choose_block(x.dtype)
    num_splits = num_splits or choose_splits(rows, size, block, _sms(device))
    chunk = triton.cdiv(triton.cdiv(size, num_splits), block) * block
    splits = triton.cdiv(size, chunk)  # no empty split: each one's partial is awaited
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if splits > 1:
        # Partials: int32 indices, then float32 values, each part 16-byte aligned (Triton specializes
        # on a pointer's alignment: an odd offset would compile a second kernel).
        n = rows * splits
        pad = triton.cdiv(n, 4) * 4
        scratch = torch.empty(2 * pad, dtype=torch.int32, device=device)
        idx, val, ticket = scratch[:n], scratch[pad : pad + n].view(torch.float32), tickets(device, rows)
    else:  # the kernel writes the answer directly; typed views of `out` keep one signature
        idx = ticket = out.view(torch.int32)
        val = out.view(torch.float32)
    dst, dst_index = scatter_out if scatter_out is not None else (out, out)
    _argmax_kernel[(rows, splits)](
        x, out, val, idx, ticket, host_out if host_out is not None else out, dst, dst_index, size,
        x.stride(0), chunk, splits, BLOCK=block, MAX_S=MAX_SPLITS, HOST=host_out is not None,
        SCATTER=scatter_out is not None, num_warps=4,
    )  # fmt: skip
    return out


def _check_tuning(num_splits: int | None, block: int | None) -> None:
    if num_splits is not None and (
        not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"argmax_rows: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if block is not None and (
        not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1)
    ):
        raise ValueError(f"argmax_rows: block must be a power of two >= 16, got {block!r}")


def argmax_rows(
    x: torch.Tensor, *, backend: Backend = "auto", num_splits: int | None = None, block: int | None = None,
    host_out: torch.Tensor | None = None, scatter_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`x.argmax(dim=-1)` of a 2-D x [B, V]: int64 [B] on x's device, the same indices bit for bit.

    `backend` "auto" takes the Triton kernel for CUDA tensors and torch.argmax elsewhere; "triton"
    forces the kernel (CPU tensors need TRITON_INTERPRET=1, as the tests set); "torch" forces torch.
    `num_splits` (at most MAX_SPLITS) and `block` (a power of two) override the launch's split count
    and tile width (tests and bench/argmax.py); results do not depend on them. Inputs the kernel does
    not take (see the module's docstring) go to torch.argmax whatever the backend.

    `host_out` (a contiguous int64 CPU tensor of at least B values, pinned when x is on CUDA) also
    gets the indices. The CUDA kernel writes it itself, through the pinned memory's device mapping: no
    device-to-host copy follows it (an op, and a gap on the GPU's timeline before it). The caller
    keeps it alive, unreused, until the launch has completed. Elsewhere a copy
    fills it.

    `scatter_out` (dst, index): also `dst[index[r]] = ` row r's index, by the same kernel (dst a
    contiguous int64 tensor on x's device, index [>= B] int32 or int64 there): the engine's token
    table, indexed by each row's slot (`shared/engine/runner.py`). Elsewhere an index_copy_ does it.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"argmax_rows: x must be a 2-D tensor [B, V], got {shape}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"argmax_rows: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    _check_tuning(num_splits, block)
    rows, size = x.shape
    if host_out is not None:
        ok = host_out.device.type == "cpu" and host_out.dtype == torch.int64 and host_out.is_contiguous()
        if not ok or host_out.numel() < rows or (x.is_cuda and not host_out.is_pinned()):
            raise ValueError(
                f"argmax_rows: host_out must be a contiguous int64 CPU tensor of at least {rows} values "
                f"(pinned for CUDA x), got {tuple(host_out.shape)} {host_out.dtype} on {host_out.device}"
            )
    if scatter_out is not None:
        dst, index = scatter_out
        ok = dst.device == x.device == index.device and dst.dtype == torch.int64 and dst.is_contiguous()
        ok = ok and dst.dim() == 1 and index.dim() == 1 and index.dtype in (torch.int32, torch.int64)
        if not ok or index.numel() < rows:
            raise ValueError(
                f"argmax_rows: scatter_out must be (a contiguous [S] int64 tensor, an [>= {rows}] int32 or "
                f"int64 index) on {x.device}, got {tuple(dst.shape)} {dst.dtype} on {dst.device} and "
                f"{tuple(index.shape)} {index.dtype} on {index.device}"
            )
    takes = x.dtype in _FLOATS and x.stride(1) == 1 and rows > 0 and 0 < size <= _MAX_COLUMNS
    kernel = takes and (backend == "triton" or (backend == "auto" and x.is_cuda))
    direct = host_out if kernel and x.is_cuda else None  # the kernel writes host_out itself
    if not kernel:
        out = x.argmax(dim=-1)
    elif x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            out = _argmax_triton(x, num_splits, block, direct, scatter_out)
    else:
        out = _argmax_triton(x, num_splits, block, direct, scatter_out)
    if host_out is not None and direct is None:
        host_out[:rows].copy_(out, non_blocking=x.is_cuda)
    if scatter_out is not None and not kernel:
        scatter_out[0].index_copy_(0, scatter_out[1][:rows].long(), out)
    return out
