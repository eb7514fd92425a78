"""A forward's input ids from a token table: `take_tokens(ids, slots, table)` is `ids` where it is
>= 0, else `table[slots]`.

The engine keeps each request's latest sampled token in a device table indexed by its window slot,
written by the step that samples it. A step the host launches before it has read the step in flight's
tokens (overlap scheduling) marks those inputs -1 and this kernel takes them from the table on the
device: one mechanism for every row of every step (decodes, a mixed step's decode rows, a prompt's
known tokens), and no index list built or uploaded by the host.

Slots are read only where ids < 0, so any slot of a host token is fine. The wrapper checks shapes and
dtypes, never values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import check_triton_device

__all__ = ["take_tokens", "take_tokens_reference"]

_BLOCK = 1024


@triton.jit
def _take_tokens_kernel(ids_ptr, slots_ptr, table_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    ids = tl.load(ids_ptr + offs, mask=inside, other=0)
    pending = inside & (ids < 0)
    slots = tl.load(slots_ptr + offs, mask=pending, other=0)
    fed = tl.load(table_ptr + slots.to(tl.int64), mask=pending, other=0)
    tl.store(out_ptr + offs, tl.where(pending, fed, ids), mask=inside)


def take_tokens_reference(ids: torch.Tensor, slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The torch version (CPU, and the oracle of the kernel's tests)."""
    pending = ids < 0
    at = torch.where(pending, slots.long(), 0)  # a host token's slot is never read
    return torch.where(pending, table.index_select(0, at), ids)


def take_tokens(
    ids: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """ids [T] int64 (-1: take the token from the table), slots [T] int32/int64 (each token's slot),
    table [S] int64. Returns [T] int64 on ids' device. "auto": the kernel on CUDA, torch elsewhere;
    "triton" forces the kernel (the interpreter on CPU)."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"take_tokens: ids must be [T] int64, got {tuple(ids.shape)} {ids.dtype}")
    if slots.shape != ids.shape or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"take_tokens: slots must be [T={ids.shape[0]}] int32 or int64, got "
                         f"{tuple(slots.shape)} {slots.dtype}")  # fmt: skip
    if table.dim() != 1 or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError(f"take_tokens: table must be a contiguous [S] int64 tensor, got "
                         f"{tuple(table.shape)} {table.dtype}")  # fmt: skip
    if not (ids.device == slots.device == table.device):
        raise ValueError(f"take_tokens: ids, slots and table must share a device, got "
                         f"{ids.device}, {slots.device}, {table.device}")  # fmt: skip
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"take_tokens: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or (backend == "auto" and not ids.is_cuda) or ids.numel() == 0:
        return take_tokens_reference(ids, slots, table)
    check_triton_device("take_tokens", ids.device)
    ids, slots = ids.contiguous(), slots.contiguous()
    out = torch.empty_like(ids)
    n = ids.numel()
    _take_tokens_kernel[(triton.cdiv(n, _BLOCK),)](ids, slots, table, out, n, BLOCK=_BLOCK, num_warps=4)
    return out
