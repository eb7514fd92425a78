"""Triton scatter of new K/V rows into a flat view of a paged cache or a sliding-window ring.

One program per source row: it reads the row's destination index on the device and, unless it is
negative (a padded or skipped token), copies all Hkv * D values of K and of V; into an FP8 cache
(`quant`) it quantizes them on the way (`_round.to_e4m3`). No value ever reaches the host, so the
scheduler can pass padded, graph-sized batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_last_dim_contiguous, check_store
from shared.kernels._launch import check_triton_device, next_pow2
from shared.kernels._round import to_e4m3
from shared.kernels.kv_quant import KVQuant


# The store index is a view into a packed buffer at an offset that moves with the batch (one value a
# program): no alignment specialization, no compile mid-traffic.
@triton.jit(do_not_specialize_on_alignment=["idx_ptr"])
def _store_kv_kernel(
    kn_ptr, vn_ptr, kd_ptr, vd_ptr, idx_ptr,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kds, stride_kdh, stride_vds, stride_vdh,
    inv_k, inv_v,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    dst = tl.load(idx_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # The skip test is broadcast to the tile explicitly: the interpreter rejects a scalar-broadcast mask.
    dst = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + dst
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & (dst >= 0)
    k = tl.load(kn_ptr + t * stride_knt + h * stride_knh + d, mask=mask)
    if QUANT:
        k = to_e4m3(k.to(tl.float32), inv_k, kd_ptr.dtype.element_ty)
    tl.store(kd_ptr + dst * stride_kds + h * stride_kdh + d, k, mask=mask)
    v = tl.load(vn_ptr + t * stride_vnt + h * stride_vnh + d, mask=mask)
    if QUANT:
        v = to_e4m3(v.to(tl.float32), inv_v, vd_ptr.dtype.element_ty)
    tl.store(vd_ptr + dst * stride_vds + h * stride_vdh + d, v, mask=mask)


def store_kv(
    k_new: torch.Tensor, v_new: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
    dst_index: torch.Tensor, quant: KVQuant | None = None,
) -> None:  # fmt: skip
    """Triton version of `reference.store_kv`: k_dst[dst_index[t]] = k_new[t]; dst_index < 0 is skipped.
    With `quant` the destination is FP8 and the rows are quantized on the way."""
    op = "store_kv"
    check_store(op, k_new, v_new, k_dst, v_dst, dst_index, quant)
    check_last_dim_contiguous(op, k_new=k_new, v_new=v_new, k_dst=k_dst, v_dst=v_dst)
    check_triton_device(op, k_new.device)
    num_rows, num_heads, head_dim = k_new.shape
    if num_rows == 0:
        return
    _store_kv_kernel[(num_rows,)](
        k_new, v_new, k_dst, v_dst, dst_index,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        quant.inv_k if quant else 1.0, quant.inv_v if quant else 1.0,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
        QUANT=quant is not None, num_warps=4,
    )  # fmt: skip
