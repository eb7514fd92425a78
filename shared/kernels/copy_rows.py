"""Triton copy of selected rows of every layer from one pool to another: `dst[l, d[i]] = src[l, s[i]]`.

The cuda_ipc backend moves a request's KV with it: prefill's pages and ring rows on one side, decode's
reserved ones on the other, gathered and scattered in one pass. The destination may be another
process's memory mapped through CUDA IPC (on the same GPU, or a peer reached over NVLink): it is passed
as any object with `data_ptr()` and `dtype`, which Triton takes as a pointer. No index reaches the host.

`copy_heads` copies a run of KV heads of each row instead (tensor-parallel ranks hold a share of the
heads each, so a request's KV reaches a rank of one side from the ranks of the other that hold them).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import triton
import triton.language as tl

from shared.kernels._launch import check_triton_device

__all__ = ["Pool", "copy_heads", "copy_rows"]

_BLOCK = 1024  # elements per load/store step
_CHUNK = 16384  # elements per program: a row longer than this is spread over several programs


class Pool(Protocol):
    """A contiguous [layers, rows, *row] tensor, or a peer mapping that describes one."""

    dtype: torch.dtype

    def data_ptr(self) -> int: ...


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, src_layer_stride, dst_layer_stride, src_row, dst_row,
    count, seg, src_seg_stride, dst_seg_stride, src_first, dst_first, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Element e < count of a row is element e % seg of segment e // seg: segments sit src_seg_stride
    # (dst_seg_stride) apart from src_first (dst_first) on in their rows. Whole rows: one segment.
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    first = tl.program_id(2) * CHUNK
    s = tl.load(src_rows_ptr + i).to(tl.int64)
    d = tl.load(dst_rows_ptr + i).to(tl.int64)
    src = src_ptr + layer * src_layer_stride + s * src_row + src_first
    dst = dst_ptr + layer * dst_layer_stride + d * dst_row + dst_first
    for start in tl.range(first, first + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        part, within = offs // seg, offs % seg
        value = tl.load(src + part * src_seg_stride + within, mask=mask)
        tl.store(dst + part * dst_seg_stride + within, value, mask=mask)


def _check(src: torch.Tensor, dst: Pool, dst_shape: tuple[int, ...], src_rows: torch.Tensor,
           dst_rows: torch.Tensor) -> None:  # fmt: skip
    if not src.is_contiguous():
        raise ValueError("copy_rows: src must be contiguous")
    if dst.dtype != src.dtype:
        raise ValueError(f"copy_rows: dtype {src.dtype} -> {dst.dtype}")
    if src.dim() < 2 or len(dst_shape) != src.dim() or dst_shape[0] != src.shape[0]:
        shapes = f"src {tuple(src.shape)} and dst {dst_shape}"
        raise ValueError(f"copy_rows: {shapes} must be [layers, rows, *row] with the same layers")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError("copy_rows: src_rows and dst_rows must be 1-D and of one length")
    if src_rows.device != src.device or dst_rows.device != src.device:
        raise ValueError("copy_rows: row ids must be on src's device")
    check_triton_device("copy_rows", src.device)


def _launch(
    src: torch.Tensor, dst: Pool, dst_shape: tuple[int, ...], src_rows: torch.Tensor, dst_rows: torch.Tensor,
    count: int, seg: int, strides: tuple[int, int], firsts: tuple[int, int],
) -> None:  # fmt: skip
    n, layers = src_rows.shape[0], src.shape[0]
    if n == 0 or layers == 0 or count == 0:
        return
    src_row, dst_row = math.prod(src.shape[2:]), math.prod(dst_shape[2:])
    chunk = min(_CHUNK, triton.next_power_of_2(count))
    block = min(_BLOCK, chunk)
    _copy_rows_kernel[(n, layers, triton.cdiv(count, chunk))](
        src, dst, src_rows, dst_rows, src.shape[1] * src_row, dst_shape[1] * dst_row, src_row, dst_row,
        count, seg, *strides, *firsts, CHUNK=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip


def copy_rows(
    src: torch.Tensor, dst: Pool, dst_shape: tuple[int, ...], src_rows: torch.Tensor, dst_rows: torch.Tensor,
    count: int | None = None,
) -> None:  # fmt: skip
    """Copy row `src_rows[i]` of every layer of `src` to row `dst_rows[i]` of the same layer of `dst`.

    `src` is a contiguous [layers, rows, *row] tensor; `dst` is one of shape `dst_shape` with the same
    layers, row shape and dtype (a tensor, or a peer mapping). Row ids are int32/int64 device tensors;
    the caller has checked them against both pools' row counts. `count`: copy only each row's first
    `count` elements (a ring's filled prefix).
    """
    _check(src, dst, dst_shape, src_rows, dst_rows)
    if tuple(dst_shape[2:]) != tuple(src.shape[2:]):
        raise ValueError(f"copy_rows: row shapes differ: {tuple(src.shape[2:])} != {tuple(dst_shape[2:])}")
    row = math.prod(src.shape[2:]) if src.shape[1] else 0
    count = row if count is None else count
    if not 0 <= count <= row:
        raise ValueError(f"copy_rows: count {count} outside [0, {row}]")
    _launch(src, dst, dst_shape, src_rows, dst_rows, count, max(count, 1), (0, 0), (0, 0))


def copy_heads(
    src: torch.Tensor, dst: Pool, dst_shape: tuple[int, ...], src_rows: torch.Tensor, dst_rows: torch.Tensor,
    heads: tuple[int, int, int], tokens: int | None = None,
) -> None:  # fmt: skip
    """`copy_rows` of a run of KV heads: rows are [tokens, heads, head_dim] on both sides, with each
    side's own head count (a tensor-parallel rank's share); `heads` = (first source head, first
    destination head, how many). `tokens`: only each row's first `tokens` (a ring's filled prefix)."""
    _check(src, dst, dst_shape, src_rows, dst_rows)
    if src.dim() != 5 or len(dst_shape) != 5:
        raise ValueError(f"copy_heads: pools must be [layers, rows, tokens, heads, head_dim], got "
                         f"{tuple(src.shape)} and {dst_shape}")  # fmt: skip
    (_, _, row_tokens, src_heads, dim), (_, _, dst_tokens, dst_heads, dst_dim) = src.shape, dst_shape
    if (row_tokens, dim) != (dst_tokens, dst_dim):
        raise ValueError(f"copy_heads: rows of {row_tokens} x {dim} and {dst_tokens} x {dst_dim} differ")
    first_src, first_dst, n = heads
    if n < 0 or min(first_src, first_dst) < 0 or first_src + n > src_heads or first_dst + n > dst_heads:
        raise ValueError(
            f"copy_heads: heads {heads} outside {src_heads} source, {dst_heads} destination heads"
        )
    tokens = row_tokens if tokens is None else tokens
    if not 0 <= tokens <= row_tokens:
        raise ValueError(f"copy_heads: tokens {tokens} outside [0, {row_tokens}]")
    seg, strides = n * dim, (src_heads * dim, dst_heads * dim)
    firsts = (first_src * dim, first_dst * dim)
    _launch(src, dst, dst_shape, src_rows, dst_rows, tokens * seg, max(seg, 1), strides, firsts)
