"""The decoder's kernel seam: one interface, torch on CPU and fused Triton kernels on CUDA.

Mirrors shared/kernels/attention/ops.py: `kernels_for(device)` picks the implementation, and a backend can be
forced (Triton on CPU needs TRITON_INTERPRET=1, as the tests set). Neither implementation reads a
value on the host, so a forward through either stays sync-free and CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import moe, reference
from shared.kernels.attention import reference as attention_reference
from shared.kernels.kv_store import KVStore
from shared.kernels.lt_gemm import LtGemm

Tensor = torch.Tensor
Backend = Literal["auto", "torch", "triton"]
# The layers' GEMMs: torch's (cuBLAS on a GPU), or `skinny_gemm` for batches of at most 64 rows
# ("skinny"), or ("auto", the default) at most 16 rows, and at most 64 for deep weights (K >= 2N, the
# down projection), where cuBLAS splits K and reduces in a kernel of its own. Decode steps of 1 and 16
# rows are faster with it, from the gate/up and down projections; q/k/v and o alone are a little
# slower.
Gemm = Literal["auto", "cublas", "skinny"]
_SKINNY_ROWS = {"auto": 16, "skinny": 64, "cublas": 0}
_DEEP_ROWS = {"auto": 64, "skinny": 64, "cublas": 0}  # for K >= 2N


class ModelKernels(ABC):
    name: str
    gemm: Gemm = "cublas"

    def linear(self, x: Tensor, layer: nn.Linear) -> Tensor:
        """`layer(x)`: torch's GEMM (cuBLAS on a GPU)."""
        return F.linear(x, layer.weight, layer.bias)

    def linear_add(self, x: Tensor, layer: nn.Linear, residual: Tensor) -> Tensor:
        """`residual + layer(x)`, the add inside the GEMM (rounded once, not after each). The caller
        gives `residual` up: an implementation may write the sum into it."""
        out = torch.addmm(residual, x, layer.weight.t())
        return out if layer.bias is None else out + layer.bias

    def head(self, x: Tensor, layer: nn.Linear) -> Tensor:
        """The LM head's `layer(x)`: torch's GEMM at every batch size (never the skinny kernel)."""
        return F.linear(x, layer.weight, layer.bias)

    def takes_fp8(self, layer: nn.Module) -> bool:
        """Whether `layer` is an FP8 projection whose input may come as e4m3 codes (`fp8_codes`)."""
        return False

    def fp8_codes(self, codes: Tensor, scale: Tensor, dtype: torch.dtype, layer: nn.Module) -> Any:
        """codes [T, K] e4m3 at one scale (a float32 [1] tensor) as `layer`'s input (an FP8 kernels'
        `Fp8Act`, shared/kernels/fp8), its output in `dtype`: only for a layer `takes_fp8` holds for."""
        raise NotImplementedError(f"{self.name} kernels take no FP8 projection")

    def takes_cublas(self, rows: int, layer: nn.Linear) -> bool:
        """Whether `linear` hands `rows` rows through `layer` to cuBLAS, where a GEMM tuned for the
        shape (`shared/model/gemm_tuning.py`) can take its place. The torch kernels keep torch's."""
        return False

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [T, H] -> LlamaRMSNorm(x), a new tensor."""

    @abstractmethod
    def rope(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """q [T, Hq, D] and k [T, Hkv, D] rotated to `positions` (per-head RMSNorm first with weights)."""

    @abstractmethod
    def rope_store(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, store: KVStore,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """`rope`, and the rotated k and v [T, Hkv, D] stored as `store` says (the KV cache write)."""

    def route(
        self, logits: Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
        scaling: float = 1.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """A mixture of experts' router: each token's top_k experts and their float32 weights
        (`shared/kernels/moe/route.py`, torch ops on any device: it is tiny)."""
        return moe.route(logits, top_k, scoring=scoring, renormalize=renormalize, scaling=scaling)

    def experts(
        self, x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, ids: Tensor, *,
        activation: str = "silu", b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
        alpha: float = 1.702, limit: float = 7.0, partial: bool = False,
    ) -> Tensor:  # fmt: skip
        """The routed experts' weighted sum for each token (`shared/kernels/moe`): the torch reference
        here, one fused Triton op in the Triton kernels. `partial`: an id may be E, an expert another
        rank holds (expert parallelism), which adds nothing here."""
        return moe.reference.fused_moe(
            x, w_gate_up, w_down, weights, ids, activation=activation, b_gate_up=b_gate_up, b_down=b_down,
            alpha=alpha, limit=limit,
        )  # fmt: skip

    def glu(self, gate_up: Tensor, gelu: bool, before: nn.Module) -> Tensor:
        """The MLP's activation, silu(gate) * up (gelu: `gelu_tanh_mul`), as the projection after it
        (`before`) takes its input: here 16-bit rows (FP8 kernels: quantized ones)."""
        return self.gelu_tanh_mul(gate_up) if gelu else self.silu_mul(gate_up)

    @abstractmethod
    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""

    @abstractmethod
    def rms_scale(self, y: Tensor, x: Tensor, eps: float) -> Tensor:
        """y [T, N] with each row times rsqrt(mean(x^2) + eps) of x [T, H]: a GEMM's output as if it
        had read rms_norm(x), when its weight holds the norm's weight (`fold_norms`)."""

    @abstractmethod
    def silu_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        """`silu_mul` of gate_up's rows each scaled by rsqrt(mean(x^2) + eps) of x [T, H] first: the
        RMSNorm before an MLP whose gate_up weight holds the norm's weight (`fold_norms`)."""

    @abstractmethod
    def gelu_tanh_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU)."""

    @abstractmethod
    def gelu_tanh_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        """`gelu_tanh_mul` after the row scale of a folded norm, as `silu_mul_rms`."""


class TorchKernels(ModelKernels):
    """Plain torch ops (any device): the CPU path and the reference of the Triton kernels."""

    name = "torch"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return reference.rms_norm(x, weight, eps)

    def rope(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return reference.rope(q, k, positions, cos_sin, q_weight, k_weight, eps)

    def rope_store(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, store: KVStore,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        q, k = reference.rope(q, k, positions, cos_sin, q_weight, k_weight, eps)
        attention_reference.store_kv(k, v, store.k_dst, store.v_dst, store.index, store.quant)
        return q, k

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return reference.silu_mul(gate_up)

    def rms_scale(self, y: Tensor, x: Tensor, eps: float) -> Tensor:
        return reference.rms_scale(y, x, eps)

    def silu_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        return reference.silu_mul_rms(gate_up, x, eps)

    def gelu_tanh_mul(self, gate_up: Tensor) -> Tensor:
        return reference.gelu_tanh_mul(gate_up)

    def gelu_tanh_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        return reference.gelu_tanh_mul_rms(gate_up, x, eps)


class TritonKernels(ModelKernels):
    """Fused Triton kernels: CUDA, or CPU tensors under TRITON_INTERPRET=1 (tests)."""

    name = "triton"

    def __init__(self, gemm: Gemm = "auto") -> None:
        # Imported here, not at module load: the interpreter is chosen when a kernel is decorated.
        from shared.kernels import rms_norm, rope, silu_mul, skinny_gemm

        self._rms_norm = rms_norm.rms_norm
        self._rms_scale = rms_norm.rms_scale
        self._rope, self._silu_mul, self._silu_mul_rms = rope.rope, silu_mul.silu_mul, silu_mul.silu_mul_rms
        self._gelu_tanh_mul, self._gelu_tanh_mul_rms = silu_mul.gelu_tanh_mul, silu_mul.gelu_tanh_mul_rms
        self._skinny_gemm, self.gemm = skinny_gemm.skinny_gemm, gemm

    def _skinny(self, x: Tensor, layer: nn.Linear) -> bool:
        """skinny_gemm takes it: few rows, no bias, rows contiguous along K; else torch's GEMM."""
        w = layer.weight
        rows = _DEEP_ROWS[self.gemm] if w.shape[1] >= 2 * w.shape[0] else _SKINNY_ROWS[self.gemm]
        return (
            layer.bias is None and x.dim() == 2 and 0 < x.shape[0] <= rows
            and x.dtype == w.dtype and x.stride(-1) == 1 and w.stride(-1) == 1
        )  # fmt: skip

    def takes_cublas(self, rows: int, layer: nn.Linear) -> bool:
        w = layer.weight
        rows_ok = rows > (_DEEP_ROWS[self.gemm] if w.shape[1] >= 2 * w.shape[0] else _SKINNY_ROWS[self.gemm])
        return rows_ok or layer.bias is not None

    @staticmethod
    def _tuned(x: Tensor, layer: nn.Linear) -> LtGemm | None:
        """The cuBLASLt GEMM `gemm_tuning.tune` set on `layer` for x's rows, if any takes x."""
        gemm = getattr(layer, "lt_gemms", {}).get(x.shape[0]) if x.dim() == 2 else None
        return gemm if gemm is not None and layer.bias is None and gemm.takes(x, layer.weight) else None

    def _cublas(self, x: Tensor, layer: nn.Linear) -> Tensor:
        gemm = self._tuned(x, layer)
        return gemm(x, layer.weight) if gemm is not None else F.linear(x, layer.weight, layer.bias)

    def linear(self, x: Tensor, layer: nn.Linear) -> Tensor:
        if self._skinny(x, layer):
            return self._skinny_gemm(x, layer.weight)
        return self._cublas(x, layer)

    def head(self, x: Tensor, layer: nn.Linear) -> Tensor:
        return self._cublas(x, layer)

    def linear_add(self, x: Tensor, layer: nn.Linear, residual: Tensor) -> Tensor:
        # The GEMM `linear` would take, writing the sum into residual's storage: cuBLAS out of place
        # (C read as a separate input) is slower than the plain GEMM, in place as fast.
        if self._skinny(x, layer) and residual.stride(-1) == 1:
            return self._skinny_gemm(x, layer.weight, add=residual)
        gemm = self._tuned(x, layer)
        if gemm is not None and residual.is_contiguous():
            return gemm(x, layer.weight, residual, residual=residual)
        out = residual.addmm_(x, layer.weight.t())
        return out if layer.bias is None else out.add_(layer.bias)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._rms_norm(x, weight, eps)

    def rope(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return self._rope(q, k, positions, cos_sin, q_weight, k_weight, eps)

    def rope_store(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, store: KVStore,
        q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return self._rope(q, k, positions, cos_sin, q_weight, k_weight, eps, store=store, v=v)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self._silu_mul(gate_up)

    def rms_scale(self, y: Tensor, x: Tensor, eps: float) -> Tensor:
        return self._rms_scale(y, x, eps)

    def silu_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        return self._silu_mul_rms(gate_up, x, eps)

    def gelu_tanh_mul(self, gate_up: Tensor) -> Tensor:
        return self._gelu_tanh_mul(gate_up)

    def experts(
        self, x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, ids: Tensor, *,
        activation: str = "silu", b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
        alpha: float = 1.702, limit: float = 7.0, partial: bool = False,
    ) -> Tensor:  # fmt: skip
        fused = moe.fused_moe_for(x.device, "triton")
        return fused(
            x, w_gate_up, w_down, weights, ids, activation=activation, b_gate_up=b_gate_up, b_down=b_down,
            alpha=alpha, limit=limit, partial=partial,
        )  # fmt: skip

    def gelu_tanh_mul_rms(self, gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
        return self._gelu_tanh_mul_rms(gate_up, x, eps)


@functools.cache
def _instance(backend: str, gemm: Gemm = "auto") -> ModelKernels:
    return TorchKernels() if backend == "torch" else TritonKernels(gemm)


def kernels_for(device: torch.device | str, backend: Backend = "auto", gemm: Gemm = "auto") -> ModelKernels:
    """Triton on CUDA, torch elsewhere; `backend` forces one. `gemm` picks the Triton path's GEMMs
    (the torch path always uses torch's). Instances are shared (they hold no state)."""
    device = torch.device(device)
    if gemm not in _SKINNY_ROWS:
        raise ValueError(f"kernels_for: gemm must be 'auto', 'cublas' or 'skinny', got {gemm!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return _instance("torch")
    if backend == "triton":
        from shared.kernels._launch import check_triton_device

        check_triton_device("kernels_for", device)
        return _instance("triton", gemm)
    raise ValueError(f"kernels_for: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
