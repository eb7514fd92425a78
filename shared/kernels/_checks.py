"""Argument checks shared by the torch and Triton attention ops.

Everything here reads shapes, dtypes, strides and devices only: a check that looked at values would
make the host wait for the device, which is exactly what these ops promise never to do. Value-level
contracts (cu_q sorted with cu_q[-1] == T, per-sequence query counts <= max_q, block tables that
cover each context) are the scheduler's, stated in the docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kernels.kv_quant import FP8_KV_DTYPE, KVQuant

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_dims(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(op, f"{name} must be {layout}, got shape {_shape(t)}")


def check_dtype(op: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        fail(op, f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        found = ", ".join(f"{n}={d}" for n, d in devices.items())
        fail(op, f"all tensors must be on one device, got {found}")
    return first


def check_last_dim_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """The Triton kernels address rows by stride but read each head's D values as one run."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            fail(op, f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


@dataclass(frozen=True)
class Varlen:
    """Host-side sizes of a flattened query batch."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def check_varlen(
    op: str, q: torch.Tensor, cu_q: torch.Tensor, q_start: torch.Tensor, num_kv_heads: int, head_dim: int,
    max_q: int, scale: float,
) -> Varlen:  # fmt: skip
    check_dims(op, "q", q, 3, "[T, Hq, D]")
    check_dims(op, "cu_q", cu_q, 1, "[B+1]")
    check_dims(op, "q_start", q_start, 1, "[B]")
    check_dtype(op, "q", q, FLOAT_DTYPES)
    check_dtype(op, "cu_q", cu_q, (torch.int32,))
    check_dtype(op, "q_start", q_start, (torch.int32,))
    num_tokens, num_q_heads, d = q.shape
    batch = q_start.shape[0]
    if cu_q.shape[0] != batch + 1:
        fail(op, f"cu_q must have B+1 = {batch + 1} entries (q_start has B = {batch}), got {cu_q.shape[0]}")
    if batch < 1:
        fail(op, "need at least one sequence")
    if num_tokens < 1:
        fail(op, "q holds no tokens")
    if d != head_dim:
        fail(op, f"q head dim {d} != kv head dim {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        fail(op, f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if not isinstance(max_q, int) or isinstance(max_q, bool) or max_q < 1:
        fail(op, f"max_q must be a positive Python int (the longest chunk in the batch), got {max_q!r}")
    if not isinstance(scale, float | int) or isinstance(scale, bool):
        fail(op, f"scale must be a Python float, got {type(scale).__name__}")
    return Varlen(num_tokens, num_q_heads, num_kv_heads, head_dim, batch)


def check_cache_dtype(
    op: str, name: str, t: torch.Tensor, dtype: torch.dtype, quant: KVQuant | None, of: str = "q"
) -> None:
    """A KV cache (or ring) holds `dtype` (`of`'s: the activations'), or with `quant` FP8 e4m3."""
    if quant is not None and not isinstance(quant, KVQuant):
        raise TypeError(f"{op}: quant must be a KVQuant or None, got {type(quant).__name__}")
    want = dtype if quant is None else FP8_KV_DTYPE
    if t.dtype != want:
        if quant is not None:
            fail(op, f"{name} dtype {t.dtype}: quant= (FP8 scales) needs a {FP8_KV_DTYPE} cache")
        hint = " (an FP8 cache needs quant=, its scales)" if t.dtype == FP8_KV_DTYPE else ""
        fail(op, f"{name} dtype {t.dtype} != {of} dtype {dtype}{hint}")


def check_window(op: str, window: int | None, *, required: bool) -> None:
    if window is None:
        if required:
            fail(op, "window is required")
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        fail(op, f"window must be a positive Python int or None, got {window!r}")


def check_paged(
    op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cu_q: torch.Tensor, q_start: torch.Tensor, max_q: int, scale: float, window: int | None,
    quant: KVQuant | None = None,
) -> Varlen:  # fmt: skip
    check_dims(op, "k_cache", k_cache, 4, "[num_pages, page_size, Hkv, D]")
    check_dims(op, "v_cache", v_cache, 4, "[num_pages, page_size, Hkv, D]")
    check_dims(op, "block_table", block_table, 2, "[B, max_pages]")
    if k_cache.shape != v_cache.shape:
        fail(op, f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ in shape")
    check_dtype(op, "block_table", block_table, (torch.int32,))
    vl = check_varlen(op, q, cu_q, q_start, k_cache.shape[2], k_cache.shape[3], max_q, scale)
    if block_table.shape[0] != vl.batch:
        fail(op, f"block_table has {block_table.shape[0]} rows, expected B = {vl.batch}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_cache_dtype(op, name, t, q.dtype, quant)
    check_window(op, window, required=False)
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cu_q=cu_q,
                      q_start=q_start)  # fmt: skip
    return vl


def check_ring(
    op: str, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor,
    v_ring: torch.Tensor, slots: torch.Tensor, cu_q: torch.Tensor, q_start: torch.Tensor, max_q: int,
    scale: float, window: int, quant: KVQuant | None = None,
) -> Varlen:  # fmt: skip
    check_dims(op, "k_ring", k_ring, 4, "[num_slots, W, Hkv, D]")
    check_dims(op, "v_ring", v_ring, 4, "[num_slots, W, Hkv, D]")
    check_dims(op, "k_new", k_new, 3, "[T, Hkv, D]")
    check_dims(op, "v_new", v_new, 3, "[T, Hkv, D]")
    check_dims(op, "slots", slots, 1, "[B]")
    if k_ring.shape != v_ring.shape:
        fail(op, f"k_ring {_shape(k_ring)} and v_ring {_shape(v_ring)} differ in shape")
    check_dtype(op, "slots", slots, (torch.int32,))
    vl = check_varlen(op, q, cu_q, q_start, k_ring.shape[2], k_ring.shape[3], max_q, scale)
    check_window(op, window, required=True)
    if k_ring.shape[1] != window:
        fail(op, f"ring width {k_ring.shape[1]} != window {window}")
    expect = (vl.num_tokens, vl.num_kv_heads, vl.head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != expect:
            fail(op, f"{name} must be [T, Hkv, D] = {list(expect)}, got {_shape(t)}")
    if slots.shape[0] != vl.batch:
        fail(op, f"slots has {slots.shape[0]} entries, expected B = {vl.batch}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dtype != q.dtype:
            fail(op, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    for name, t in (("k_ring", k_ring), ("v_ring", v_ring)):
        check_cache_dtype(op, name, t, q.dtype, quant)
    check_same_device(op, q=q, k_new=k_new, v_new=v_new, k_ring=k_ring, v_ring=v_ring, slots=slots, cu_q=cu_q,
                      q_start=q_start)  # fmt: skip
    return vl


def check_store(
    op: str, k_new: torch.Tensor, v_new: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
    dst_index: torch.Tensor, quant: KVQuant | None = None,
) -> None:  # fmt: skip
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_dims(op, name, t, 3, "[T, Hkv, D]")
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        check_dims(op, name, t, 3, "[S, Hkv, D] (a cache viewed flat)")
    check_dims(op, "dst_index", dst_index, 1, "[T]")
    check_dtype(op, "dst_index", dst_index, (torch.int64,))
    if k_new.shape != v_new.shape:
        fail(op, f"k_new {_shape(k_new)} and v_new {_shape(v_new)} differ in shape")
    if k_dst.shape != v_dst.shape:
        fail(op, f"k_dst {_shape(k_dst)} and v_dst {_shape(v_dst)} differ in shape")
    if k_new.shape[1:] != k_dst.shape[1:]:
        fail(op, f"rows of k_new {_shape(k_new)} do not match rows of k_dst {_shape(k_dst)}")
    if dst_index.shape[0] != k_new.shape[0]:
        fail(op, f"dst_index has {dst_index.shape[0]} entries, expected T = {k_new.shape[0]}")
    if quant is None:
        for name, t in (("k_new", k_new), ("v_new", v_new), ("k_dst", k_dst), ("v_dst", v_dst)):
            if t.dtype == FP8_KV_DTYPE:
                fail(op, f"{name} is an FP8 cache ({t.dtype}): storing into it needs quant=, its scales")
            check_dtype(op, name, t, FLOAT_DTYPES)
        if k_new.dtype != k_dst.dtype or v_new.dtype != v_dst.dtype:
            src, dst = (k_new.dtype, v_new.dtype), (k_dst.dtype, v_dst.dtype)
            fail(op, f"source dtypes {src} != destination dtypes {dst}")
    else:  # quantized on the way in: any float source, an FP8 destination
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_dtype(op, name, t, FLOAT_DTYPES)
        for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
            check_cache_dtype(op, name, t, k_new.dtype, quant, "k_new")
    check_same_device(op, k_new=k_new, v_new=v_new, k_dst=k_dst, v_dst=v_dst, dst_index=dst_index)
