"""The attention seam of the engine: one abstract interface, a torch and a Triton implementation.

The model's attention layers call `store_kv` then `paged_attention` for full-attention layers, and
`ring_attention` then `store_kv` for sliding layers. In a decode step (one query per sequence) the
attention call takes q and k before RoPE with `rope=` (`fused_rope.RopeInKernel`): it applies RoPE and
stores the K/V itself, which the Triton kernels do inside attention (`BatchAttention`,
shared/engine/runner.py). Both implementations share every argument check and contract, and take
only host-side sizes as Python ints, so neither ever syncs.

`quant` (a layer's `KVQuant`, for an FP8 cache): every store into the cache quantizes, every read of it
dequantizes, and a sliding layer's chunk keys are attended as the ring will hold them
(`shared/kernels/kv_quant.py`). None (the default): the cache holds q's dtype, as always.

`sinks` (gpt-oss's learned attention sinks, float32 [Hq] on q's device): query head h's softmax also
runs over the logit sinks[h], whose probability is dropped (it has no value), on sliding and full
layers alike (`reference.py` has the formula). None (the default): no sink, results as always.

`fp8_out` (an FP8 cache only): the output is e4m3 codes at V's scale instead of q's dtype, the input
an FP8 o projection takes with no quantizer before it (`reference.py` says why no scale is needed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from shared.kernels.attention import reference
from shared.kernels.attention.fused_rope import RopeInKernel, check_rope_in_kernel
from shared.kernels.kv_quant import KVQuant

Tensor = torch.Tensor


class AttentionOps(ABC):
    """Attention over paged caches and sliding-window rings (layouts: shared/kernels/attention/README.md)."""

    name: str

    @abstractmethod
    def store_kv(
        self, k_new: torch.Tensor, v_new: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
        dst_index: torch.Tensor, quant: KVQuant | None = None,
    ) -> None:  # fmt: skip
        """k_dst[dst_index[t]] = k_new[t], v likewise; dst [S, Hkv, D] is a cache or ring viewed flat."""

    @abstractmethod
    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
        cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int | None,
        k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
        rope: RopeInKernel | None = None, quant: KVQuant | None = None, sinks: torch.Tensor | None = None,
        fp8_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Causal (optionally windowed) attention over a paged cache that already holds the chunk.

        With `rope` (decode-shaped calls: max_q == 1) the cache does not hold the chunk yet: q and
        k_new arrive before RoPE; RoPE is applied and the rotated k_new and v_new are stored where
        `rope` says (the pages, viewed flat) before they are attended to."""

    @abstractmethod
    def ring_attention(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor,
        v_ring: torch.Tensor, slots: torch.Tensor, cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int,
        scale: float, window: int, rope: RopeInKernel | None = None, quant: KVQuant | None = None,
        sinks: torch.Tensor | None = None,
        fp8_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Sliding-window attention over a ring of the history before the chunk plus the chunk itself.

        With `rope` (decode-shaped calls) q and k_new arrive before RoPE; RoPE is applied and the
        rotated k_new and v_new are stored into the ring where `rope` says: the token's own entry,
        slot * W + position % W (it holds a position the query no longer sees, so storing first
        changes nothing; the Triton kernel reads the key back from there)."""


class TorchOps(AttentionOps):
    """Vectorized torch (any device): the CPU path and the reference the Triton kernels are held to."""

    name = "torch"

    def store_kv(
        self, k_new: Tensor, v_new: Tensor, k_dst: Tensor, v_dst: Tensor, dst_index: Tensor,
        quant: KVQuant | None = None,
    ) -> None:  # fmt: skip
        reference.store_kv(k_new, v_new, k_dst, v_dst, dst_index, quant)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_q: Tensor, q_start: Tensor,
        *, max_q: int, scale: float, window: int | None, k_new: Tensor | None = None,
        v_new: Tensor | None = None, rope: RopeInKernel | None = None, quant: KVQuant | None = None,
        sinks: Tensor | None = None,
        fp8_out: bool = False,
    ) -> Tensor:  # fmt: skip
        reference.check_sinks("paged_attention", sinks, q)  # before RoPE's store
        reference.check_fp8_out("paged_attention", fp8_out, quant)
        if rope is not None:
            q, _, _ = _rope_and_store("paged_attention", rope, q, k_new, v_new, max_q, quant)
        return reference.paged_attention(
            q, k_cache, v_cache, block_table, cu_q, q_start, max_q=max_q, scale=scale, window=window,
            quant=quant, sinks=sinks, fp8_out=fp8_out,
        )  # fmt: skip

    def ring_attention(
        self, q: Tensor, k_new: Tensor, v_new: Tensor, k_ring: Tensor, v_ring: Tensor, slots: Tensor,
        cu_q: Tensor, q_start: Tensor, *, max_q: int, scale: float, window: int,
        rope: RopeInKernel | None = None, quant: KVQuant | None = None, sinks: Tensor | None = None,
        fp8_out: bool = False,
    ) -> Tensor:  # fmt: skip
        reference.check_sinks("ring_attention", sinks, q)  # before RoPE's store
        reference.check_fp8_out("ring_attention", fp8_out, quant)
        if rope is not None:
            q, k_new, v_new = _rope_and_store("ring_attention", rope, q, k_new, v_new, max_q, quant)
        return reference.ring_attention(
            q, k_new, v_new, k_ring, v_ring, slots, cu_q, q_start, max_q=max_q, scale=scale, window=window,
            quant=quant, sinks=sinks, fp8_out=fp8_out,
        )  # fmt: skip


def _rope_and_store(
    op: str, rope: RopeInKernel, q: Tensor, k_new: Tensor | None, v_new: Tensor | None, max_q: int,
    quant: KVQuant | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """What the Triton kernels do inside attention, in torch: the input norm's row scale (`rms_x`),
    RoPE (and the q/k norm), then the store (quantized into an FP8 cache)."""
    from shared.kernels import reference as model_reference

    k_new, v_new = check_rope_in_kernel(op, rope, q, k_new, v_new, max_q, quant)
    if rope.rms_x is not None:
        x, eps = rope.rms_x, rope.rms_eps
        q, k_new, v_new = (
            model_reference.rms_scale(t.flatten(1), x, eps).view_as(t) for t in (q, k_new, v_new)
        )
    q, k_new = model_reference.rope(
        q, k_new, rope.positions, rope.cos_sin, rope.q_weight, rope.k_weight, rope.eps
    )
    reference.store_kv(k_new, v_new, rope.k_dst, rope.v_dst, rope.store_index, quant)
    return q, k_new, v_new


class TritonOps(AttentionOps):
    """Triton kernels: CUDA, or CPU tensors under TRITON_INTERPRET=1 (tests)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here, not at module load: the interpreter is chosen when a kernel is decorated, so
        # merely importing shared.kernels.attention must not fix that choice before tests set
        # TRITON_INTERPRET.
        from shared.kernels.attention import paged_attention, ring_attention, store_kv

        self._store_kv = store_kv.store_kv
        self._paged = paged_attention.paged_attention
        self._ring = ring_attention.ring_attention

    def store_kv(
        self, k_new: Tensor, v_new: Tensor, k_dst: Tensor, v_dst: Tensor, dst_index: Tensor,
        quant: KVQuant | None = None,
    ) -> None:  # fmt: skip
        self._store_kv(k_new, v_new, k_dst, v_dst, dst_index, quant)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_q: Tensor, q_start: Tensor,
        *, max_q: int, scale: float, window: int | None, k_new: Tensor | None = None,
        v_new: Tensor | None = None, rope: RopeInKernel | None = None, quant: KVQuant | None = None,
        sinks: Tensor | None = None,
        fp8_out: bool = False,
    ) -> Tensor:  # fmt: skip
        return self._paged(
            q, k_cache, v_cache, block_table, cu_q, q_start, max_q=max_q, scale=scale, window=window,
            k_new=k_new, v_new=v_new, rope=rope, quant=quant, sinks=sinks, fp8_out=fp8_out,
        )  # fmt: skip

    def ring_attention(
        self, q: Tensor, k_new: Tensor, v_new: Tensor, k_ring: Tensor, v_ring: Tensor, slots: Tensor,
        cu_q: Tensor, q_start: Tensor, *, max_q: int, scale: float, window: int,
        rope: RopeInKernel | None = None, quant: KVQuant | None = None, sinks: Tensor | None = None,
        fp8_out: bool = False,
    ) -> Tensor:  # fmt: skip
        return self._ring(
            q, k_new, v_new, k_ring, v_ring, slots, cu_q, q_start, max_q=max_q, scale=scale, window=window,
            rope=rope, quant=quant, sinks=sinks, fp8_out=fp8_out,
        )  # fmt: skip


Backend = Literal["auto", "torch", "triton"]


def ops_for(device: torch.device | str, backend: Backend = "auto") -> AttentionOps:
    """Triton on CUDA, torch elsewhere; `backend` forces one (Triton on CPU needs TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TorchOps()
    if backend == "triton":
        from shared.kernels._launch import check_triton_device

        check_triton_device("ops_for", device)
        return TritonOps()
    raise ValueError(f"ops_for: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
