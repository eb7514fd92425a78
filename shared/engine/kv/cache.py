"""Device memory for KV: a paged pool for full-attention layers, per-request rings for sliding ones.

Full layers: `k_pages/v_pages [n_full, num_pages, page_size, Hkv, D]`; a request owns pages for its
whole sequence. Sliding layers: `k_ring/v_ring [n_sliding, num_slots, W, Hkv, D]` plus `ring_pos
[n_sliding, num_slots, W]` (the position stored at each ring index, -1 = empty); a request owns one
slot, so its sliding-layer memory is W tokens whatever its length. Everything is preallocated once.

`KVConfig.dtype` is what the pages and rings hold: the model's dtype, or float8 e4m3 (an FP8 cache,
`--kv-cache-dtype fp8_e4m3`) with one K and one V scale per layer (`quant`; shared/kernels/kv_quant.py):
attention quantizes what it stores and dequantizes what it reads. Whatever copies raw rows (snapshots,
transfers) moves the same bytes either way, one byte an element instead of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.host_copy import to_device
from shared.engine.kv.allocator import UnitAllocator
from shared.kernels.kv_quant import FP8_KV_DTYPE, KVQuant
from shared.model.config import ModelConfig

__all__ = ["KV_DTYPES", "KVCache", "KVConfig"]

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_KV_DTYPE)


@dataclass(frozen=True)
class KVConfig:
    page_size: int = 16
    num_pages: int = 512
    max_requests: int = 32  # window slots; also bounds the running batch
    dtype: torch.dtype = torch.float32  # the model's, or FP8_KV_DTYPE (an FP8 cache)
    device: str = "cpu"
    # An FP8 cache's scales, (k_scale, v_scale) for every layer of the model (a checkpoint's k_scale /
    # v_scale); () = 1.0 for every layer. Only with dtype FP8_KV_DTYPE.
    scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVConfig.dtype must be one of {[str(d) for d in KV_DTYPES]}, got {self.dtype}")
        if self.scales and self.dtype != FP8_KV_DTYPE:
            raise ValueError(f"KVConfig.scales are an FP8 cache's ({FP8_KV_DTYPE}), not {self.dtype}'s")
        for pair in self.scales:
            if len(pair) != 2:
                raise ValueError(f"KVConfig.scales holds (k_scale, v_scale) pairs, got {pair!r}")
            KVQuant(*pair)  # raises for a scale that is not a positive float32

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE


class KVCache:
    def __init__(self, model: ModelConfig, cfg: KVConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.full_layers = tuple(i for i in range(model.num_layers) if not model.is_sliding(i))
        self.sliding_layers = tuple(i for i in range(model.num_layers) if model.is_sliding(i))
        self.window = model.sliding_window if self.sliding_layers else 0
        # Slots per request in a ring, and the modulus of every ring index (slot * ring_len + p % ring_len):
        # W, or 1 for a model without sliding layers (its rings are never read).
        self.ring_len = max(self.window, 1)
        # layer -> index among its kind, so attention finds its tensors in O(1)
        self.kind_index = {layer: i for i, layer in enumerate(self.full_layers)}
        self.kind_index.update({layer: i for i, layer in enumerate(self.sliding_layers)})
        dev, dt, h, d = torch.device(cfg.device), cfg.dtype, model.num_kv_heads, model.head_dim
        full_shape = (len(self.full_layers), cfg.num_pages, cfg.page_size, h, d)
        # One ring more than requests: the scratch slot padded rows of a CUDA graph point at. It is
        # never handed out and stays empty (padded rows store nothing and write -1 positions).
        self.scratch_slot = cfg.max_requests
        ring_shape = (len(self.sliding_layers), cfg.max_requests + 1, self.ring_len, h, d)
        self.k_pages = torch.zeros(full_shape, dtype=dt, device=dev)
        self.v_pages = torch.zeros(full_shape, dtype=dt, device=dev)
        self.k_ring = torch.zeros(ring_shape, dtype=dt, device=dev)
        self.v_ring = torch.zeros(ring_shape, dtype=dt, device=dev)
        self.ring_pos = torch.full(ring_shape[:3], -1, dtype=torch.int32, device=dev)
        # Per-layer views made once: attention runs every layer every step, and each indexing or
        # view call costs host time. `*_l[i]` is layer i of its kind; `*_flat[i]` its rows flattened.
        self.k_pages_l, self.v_pages_l = list(self.k_pages.unbind(0)), list(self.v_pages.unbind(0))
        self.k_ring_l, self.v_ring_l = list(self.k_ring.unbind(0)), list(self.v_ring.unbind(0))
        self.ring_pos_l = list(self.ring_pos.unbind(0))
        self.k_pages_flat = [t.view(-1, h, d) for t in self.k_pages_l]
        self.v_pages_flat = [t.view(-1, h, d) for t in self.v_pages_l]
        self.k_ring_flat = [t.view(-1, h, d) for t in self.k_ring_l]
        self.v_ring_flat = [t.view(-1, h, d) for t in self.v_ring_l]
        self.ring_pos_flat = [t.view(-1) for t in self.ring_pos_l]
        self.pages = UnitAllocator(cfg.num_pages, "page")
        self.slots = UnitAllocator(cfg.max_requests, "window slot")
        # Each layer's FP8 scales (attention's `quant=`), or None for every layer of a model-dtype cache.
        self.quant: tuple[KVQuant | None, ...] = self._quant(model, cfg)
        # Each layer's V scale as a float32 [1] tensor on the device (None: a model-dtype cache): the
        # scale of attention's e4m3 output (`BatchAttention.fp8_out_scale`).
        self.v_scale_l: tuple[torch.Tensor | None, ...] = (None,) * len(self.quant)
        if cfg.fp8:
            v_scales = torch.tensor([q.v_scale for q in self.quant if q is not None], device=self.device)
            self.v_scale_l = tuple(t.view(1) for t in v_scales.unbind(0))

    @staticmethod
    def _quant(model: ModelConfig, cfg: KVConfig) -> tuple[KVQuant | None, ...]:
        if not cfg.fp8:
            return (None,) * model.num_layers
        if cfg.scales and len(cfg.scales) != model.num_layers:
            pairs, layers = len(cfg.scales), model.num_layers
            raise ValueError(f"KVConfig.scales has {pairs} (k_scale, v_scale) pairs for {layers} layers")
        return tuple(KVQuant(*pair) for pair in cfg.scales) or (KVQuant(),) * model.num_layers

    @property
    def scale_values(self) -> tuple[float, ...]:
        """Every layer's K then V scale, as float32 values (an FP8 cache's; () otherwise): what the
        transfer handshake compares."""
        return tuple(x for q in self.quant if q is not None for x in (q.k_scale, q.v_scale))

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    def is_sliding(self, layer: int) -> bool:
        return self.model.is_sliding(layer)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def forget_windows(self, slots: list[int]) -> None:
        """Mark the rings of window `slots` empty (every position absent), in one launch.

        A freed slot forgets its history before it is handed out again, so that `swa.history_present`
        can never be satisfied by another request's positions. A batch that finishes together frees
        all its slots in one step: one index_fill, not a fill per slot (on a GPU each is a launch).
        The index goes over without the host waiting for the device (`to_device`).
        """
        if len(slots) == 1:
            self.ring_pos[:, slots[0]].fill_(-1)
        elif slots:
            idx = to_device(torch.tensor(slots, dtype=torch.int64), self.ring_pos.device)
            self.ring_pos.index_fill_(1, idx, -1)

    def window_bytes_per_request(self) -> int:
        """Sliding-layer memory one request holds: fixed by W, not by its length."""
        per_token = 2 * self.model.num_kv_heads * self.model.head_dim * self.k_ring.element_size() + 4
        return len(self.sliding_layers) * self.window * per_token

    def page_bytes(self) -> int:
        return self.bytes_per_page(self.model, self.page_size, self.cfg.dtype)

    @staticmethod
    def bytes_per_page(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page takes across every full-attention layer, K and V (0 without full layers): what
        each page of `num_pages` costs, for sizing the pool before it exists."""
        n_full = sum(not model.is_sliding(i) for i in range(model.num_layers))
        return 2 * n_full * page_size * model.num_kv_heads * model.head_dim * dtype.itemsize

    @staticmethod
    def window_pool_bytes(model: ModelConfig, max_requests: int, dtype: torch.dtype) -> int:
        """Bytes of the sliding layers' rings, K, V and positions, for `max_requests` slots plus the
        scratch one: fixed by W and the slots, whatever the number of pages."""
        n_sliding = sum(model.is_sliding(i) for i in range(model.num_layers))
        if not n_sliding:
            return 0
        rows = n_sliding * (max_requests + 1) * max(model.sliding_window or 0, 1)
        return rows * (2 * model.num_kv_heads * model.head_dim * dtype.itemsize + 4)  # int32 ring_pos

    def usage(self) -> float:
        """Share of pages in use (the KV usage gauge)."""
        return self.pages.num_used / self.pages.capacity
