"""The FP8 KV cache's element: float8 e4m3 with a static per-tensor scale per layer, K and V apart.

A stored element is `saturate(x / scale)` rounded to nearest-even in e4m3 (max 448, no infinities);
what attention reads is `stored * scale`, accumulated in fp32. Saturation, not a cast alone: e4m3fn
has no infinity, so a value past 448 cast without it would land on NaN (or, by torch's and the GPU's
satfinite casts, on 448 anyway); a NaN stays NaN, so a broken layer still shows
(`engine.logits_finite`).

Why per tensor (one K and one V scale per layer) and not per head: it is what FP8 checkpoints ship
(llm-compressor's `self_attn.k_scale` / `v_scale`, AutoFP8's `k_proj.output_scale`), what vLLM and
SGLang read, and it costs the attention loop nothing: K's scale folds into the softmax scale and V's
into the output, both host floats, so a kernel converts a loaded tile to the activation dtype (exact:
every e4m3 value is a bf16, fp16 and fp32 value) and runs its usual loop. Per-head scales would need
a calibration nobody ships and a per-row multiply in the loop. Without checkpoint scales the scale
is 1.0, vLLM's default: K and V of common models stay well inside +-448 (and saturate, not overflow,
where they do not); the price is the coarse steps of small values, which the perplexity test bounds
(tests/engine/test_fp8_kv.py).

This module is torch only (the Triton quantizer is `_round.to_e4m3`); the two agree bit for bit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

__all__ = ["FP8_KV_DTYPE", "FP8_MAX", "KVQuant", "as_bytes", "dequantize", "quantize"]

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448


def _f32(x: float) -> float:
    """x rounded to the nearest float32: a Triton kernel takes a float argument as float32, so the
    torch path multiplies by the very same value."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class KVQuant:
    """One layer's FP8 scales: K stored as saturate(k / k_scale), read as stored * k_scale; V alike."""

    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            f32 = 0.0
            if isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value):
                try:  # it and its inverse must be positive float32s
                    f32 = _f32(float(value))
                    f32 = f32 if f32 > 0 and _f32(1.0 / f32) > 0 else 0.0
                except (OverflowError, ZeroDivisionError):
                    f32 = 0.0
            if not f32 > 0:
                raise ValueError(f"KVQuant.{name} must be a positive float32 with a float32 inverse, "
                                 f"got {value!r}")  # fmt: skip
            object.__setattr__(self, name, f32)

    @property
    def inv_k(self) -> float:
        return _f32(1.0 / self.k_scale)

    @property
    def inv_v(self) -> float:
        return _f32(1.0 / self.v_scale)


def quantize(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """x (any float dtype) times inv_scale in float32, saturated to +-448 and rounded to nearest-even
    e4m3 (NaN stays NaN): what every store into an FP8 cache writes."""
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Stored e4m3 values as float32 times their scale: what attention reads."""
    return x.float() * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or an FP8 tensor's memory as uint8 (same shape): copies of raw rows (index_copy_,
    gathers) go through it, since torch implements few ops for float8 (index_copy_ on CPU has none)
    and a row's bytes need no float op."""
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t
