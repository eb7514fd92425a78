"""Triton copy of selected rows of every layer from one pool to another: `dst[l, d[i]] = src[l, s[i]]`.

The cuda_ipc backend moves a request's KV with it: prefill's pages and ring rows on one side, decode's
reserved ones on the other, gathered and scattered in one pass. The destination may be another
process's memory mapped through CUDA IPC (on the same GPU, or a peer reached over NVLink): it is passed
as any object with `data_ptr()` and `dtype`, which Triton takes as a pointer. No index reaches the host.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from shared.kernels._launch import check_triton_device

__all__ = ["Pool", "copy_rows"]

_BLOCK = 1024  # elements per load/store step
_CHUNK = 16384  # elements per program: a row longer than this is spread over several programs


class Pool(Protocol):
    """A contiguous [layers, rows, *row] tensor, or a peer mapping that describes one."""

    dtype: torch.dtype

    def data_ptr(self) -> int: ...


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, src_layer_stride, dst_layer_stride, row, count,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    first = tl.program_id(2) * CHUNK
    s = tl.load(src_rows_ptr + i).to(tl.int64)
    d = tl.load(dst_rows_ptr + i).to(tl.int64)
    src = src_ptr + layer * src_layer_stride + s * row
    dst = dst_ptr + layer * dst_layer_stride + d * row
    for start in tl.range(first, first + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


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
    if not src.is_contiguous():
        raise ValueError("copy_rows: src must be contiguous")
    if dst.dtype != src.dtype:
        raise ValueError(f"copy_rows: dtype {src.dtype} -> {dst.dtype}")
    if src.dim() < 2 or len(dst_shape) != src.dim() or dst_shape[0] != src.shape[0]:
        shapes = f"src {tuple(src.shape)} and dst {dst_shape}"
        raise ValueError(f"copy_rows: {shapes} must be [layers, rows, *row] with the same layers")
    if tuple(dst_shape[2:]) != tuple(src.shape[2:]):
        raise ValueError(f"copy_rows: row shapes differ: {tuple(src.shape[2:])} != {tuple(dst_shape[2:])}")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError("copy_rows: src_rows and dst_rows must be 1-D and of one length")
    if src_rows.device != src.device or dst_rows.device != src.device:
        raise ValueError("copy_rows: row ids must be on src's device")
    check_triton_device("copy_rows", src.device)
    row = src[0, 0].numel() if src.shape[1] else 0
    count = row if count is None else count
    if not 0 <= count <= row:
        raise ValueError(f"copy_rows: count {count} outside [0, {row}]")
    n, layers = src_rows.shape[0], src.shape[0]
    if n == 0 or layers == 0 or count == 0:
        return
    chunk = min(_CHUNK, triton.next_power_of_2(count))
    block = min(_BLOCK, chunk)
    _copy_rows_kernel[(n, layers, triton.cdiv(count, chunk))](
        src, dst, src_rows, dst_rows, src.shape[1] * row, dst_shape[1] * row, row, count,
        CHUNK=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip
