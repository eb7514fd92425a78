"""Triton merge of split-K partial attention results (the second half of flash-decoding).

Split s left, for each (token, head), its normalized output o_s and its log2-sum-exp lse_s; the
exact result is sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). Empty splits carry
lse = -inf and weigh zero. An e4m3 `out` takes codes (the partials are in V's codes then: `_split_k.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import MAX_SPLITS, next_pow2
from shared.kernels._round import to_output


# num_tokens and num_splits change with the batch: one compiled kernel for them all (SPLITS_P2 is
# the most splits the rule gives, rounded up to a power of two).
@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_tokens, num_heads, stride_ot, stride_oh, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    row = (s * num_tokens + t) * num_heads + h
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    mask = s_ok[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    o = tl.where(w[:, None] > 0, o, 0.0)  # an empty split's o is never written: do not read its bytes
    total = tl.sum(w, 0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    out = out_ptr + t * stride_ot + h * stride_oh + d
    tl.store(out, to_output(merged, out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """part_o [S, T, H, D] fp32, part_lse [S, T, H] fp32 -> out [T, H, D] (written in place)."""
    if part_o.dim() != 4 or part_lse.shape != part_o.shape[:3] or out.shape != part_o.shape[1:]:
        raise ValueError(
            f"merge_splits: want part_o [S, T, H, D], part_lse [S, T, H], out [T, H, D]; got "
            f"{list(part_o.shape)}, {list(part_lse.shape)}, {list(out.shape)}"
        )
    if part_o.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError("merge_splits: partials must be float32")
    if not (part_o.is_contiguous() and part_lse.is_contiguous()) or out.stride(-1) != 1:
        raise ValueError("merge_splits: partials must be contiguous and out's last dim contiguous")
    splits, tokens, heads, head_dim = part_o.shape
    _merge_splits_kernel[(tokens, heads)](
        part_o, part_lse, out, tokens, heads, out.stride(0), out.stride(1), splits,
        SPLITS_P2=max(next_pow2(splits), MAX_SPLITS), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
    )  # fmt: skip
