"""store_kv: the scatter both implementations share, skipped rows included."""

from __future__ import annotations

import pytest
import torch

from shared.kernels.attention import AttentionOps, ops_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def ops(request: pytest.FixtureRequest) -> AttentionOps:
    return ops_for(DEVICE, backend=request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scatter_skips_negative_rows(ops: AttentionOps, dtype: torch.dtype) -> None:
    k_new = torch.randn(6, 2, 8, device=DEVICE).to(dtype)
    v_new = torch.randn(6, 2, 8, device=DEVICE).to(dtype)
    k_cache = torch.randn(5, 4, 2, 8, device=DEVICE).to(dtype)  # 5 pages of 4 slots, viewed flat below
    v_cache = torch.randn(5, 4, 2, 8, device=DEVICE).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    index = torch.tensor([7, -1, 0, 19, -1, 12], device=DEVICE)
    ops.store_kv(k_new, v_new, k_cache.view(20, 2, 8), v_cache.view(20, 2, 8), index)
    expect_k, expect_v = before_k.view(20, 2, 8).clone(), before_v.view(20, 2, 8).clone()
    for t, dst in enumerate(index.tolist()):
        if dst >= 0:
            expect_k[dst], expect_v[dst] = k_new[t], v_new[t]
    assert torch.equal(k_cache.view(20, 2, 8), expect_k)
    assert torch.equal(v_cache.view(20, 2, 8), expect_v)


def test_all_rows_skipped_changes_nothing(ops: AttentionOps) -> None:
    k_dst, v_dst = torch.randn(4, 1, 4, device=DEVICE), torch.randn(4, 1, 4, device=DEVICE)
    before = k_dst.clone(), v_dst.clone()
    index = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    new = torch.zeros(3, 1, 4, device=DEVICE)
    ops.store_kv(new, new.clone(), k_dst, v_dst, index)
    assert torch.equal(k_dst, before[0]) and torch.equal(v_dst, before[1])


def test_ring_rows_and_strided_source(ops: AttentionOps) -> None:
    """A ring viewed as [slots * W, Hkv, D], fed from a K slice of a fused projection."""
    w, slot = 4, 1
    fused = torch.randn(3, 2 * 2 * 8, device=DEVICE)
    k_new, v_new = (x.view(3, 2, 8) for x in fused.split(16, dim=1))
    k_ring, v_ring = torch.zeros(2, w, 2, 8, device=DEVICE), torch.zeros(2, w, 2, 8, device=DEVICE)
    positions = torch.tensor([5, 6, 7], device=DEVICE)
    ops.store_kv(k_new, v_new, k_ring.view(-1, 2, 8), v_ring.view(-1, 2, 8), slot * w + positions % w)
    assert torch.equal(k_ring[slot, [1, 2, 3]], k_new) and torch.equal(v_ring[slot, [1, 2, 3]], v_new)
    assert not k_ring[0].any() and not k_ring[slot, 0].any()


def test_empty_batch_is_a_no_op(ops: AttentionOps) -> None:
    dst = torch.zeros(4, 2, 8, device=DEVICE)
    empty = torch.zeros(0, 2, 8, device=DEVICE)
    ops.store_kv(empty, empty, dst, dst.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert not dst.any()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k_new": torch.zeros(3, 2, 8, 1)}, r"k_new must be \[T, Hkv, D\]"),
        ({"v_new": torch.zeros(3, 2, 4)}, "k_new .* and v_new .* differ in shape"),
        ({"k_dst": torch.zeros(10, 3, 8), "v_dst": torch.zeros(10, 3, 8)}, "do not match rows of k_dst"),
        ({"dst_index": torch.zeros(3, dtype=torch.int32)}, "dst_index must have dtype"),
        ({"dst_index": torch.zeros(4, dtype=torch.int64)}, "dst_index has 4 entries, expected T = 3"),
        ({"k_dst": torch.zeros(10, 2, 8, dtype=torch.float16)}, "differ in shape|dtypes"),
        ({"k_dst": torch.zeros(10, 2, 8, device="meta")}, "one device"),
    ],
)
def test_bad_arguments_raise_clear_errors(ops: AttentionOps, change: dict, message: str) -> None:
    args = {
        "k_new": torch.zeros(3, 2, 8), "v_new": torch.zeros(3, 2, 8), "k_dst": torch.zeros(10, 2, 8),
        "v_dst": torch.zeros(10, 2, 8), "dst_index": torch.zeros(3, dtype=torch.int64),
    }  # fmt: skip
    args.update(change)
    args = {k: v.to(DEVICE) if v.device.type != "meta" else v for k, v in args.items()}
    with pytest.raises(ValueError, match=message):
        ops.store_kv(**args)
