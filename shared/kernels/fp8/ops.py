"""The decoder's kernels for a model with FP8 projections: `ModelKernels` whose GEMMs take an
FP8 layer (`shared/model/quant/fp8.py` `Fp8Linear`) and whose norms can write FP8 for the GEMM after
them. A model picks these when it is quantized (`Transformer.kernel_factory`), so a bf16 model's
kernels, and its forward, are the plain ones.

An FP8 layer is anything that is not an `nn.Linear` and has `weight` [N, K] e4m3, `weight_scale_inv`
float32 block scales, `block` (bn, bk) and `bias`; its activations are quantized per token in bk-column
groups (`reference.quantize`), by the norm before it (`rms_norm_quant`) or by `quantize` here.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import nn

from shared.kernels.fp8 import reference
from shared.kernels.fp8.reference import Fp8Act
from shared.kernels.ops import Backend, Gemm, ModelKernels, TorchKernels, TritonKernels, kernels_for
from shared.kernels.skinny_gemm import Scales, skinny_gemm

# Decode-sized batches go to the skinny GEMM, FP8 operands and all (`--gemm cublas`: to cuBLAS's scaled
# GEMM instead, where it takes the layer): it reads the weights in one kernel with the residual add
# and the bias inside, where cuBLAS's FP8 GEMM at these rows needs an add kernel after it.
_SKINNY_ROWS = 64

__all__ = ["Fp8Kernels", "Fp8Layer", "Fp8TorchKernels", "Fp8TritonKernels", "check_device", "fp8_kernels_for"]

Tensor = torch.Tensor


class Fp8Layer(Protocol):
    weight: Tensor  # [N, K] float8_e4m3fn
    weight_scale_inv: Tensor  # [ceil(N / bn), ceil(K / bk)] float32: value = weight * scale
    block: tuple[int, int]  # (bn, bk); bk is also the activations' group
    bias: Tensor | None


class Fp8Kernels(ModelKernels):
    """`ModelKernels` whose `linear` and `linear_add` also take FP8 layers (any other layer goes to the
    plain kernels), with the FP8 activation ops."""

    def linear(self, x: Tensor | Fp8Act, layer: nn.Module) -> Tensor:
        if isinstance(layer, nn.Linear):
            return super().linear(x, layer)
        return self.fp8_gemm(self._quantized(x, layer), layer)

    def linear_add(self, x: Tensor | Fp8Act, layer: nn.Module, residual: Tensor) -> Tensor:
        if isinstance(layer, nn.Linear):
            return super().linear_add(x, layer, residual)
        return self.fp8_gemm(self._quantized(x, layer), layer, residual)

    def head(self, x: Tensor, layer: nn.Module) -> Tensor:  # type: ignore[override]
        if isinstance(layer, nn.Linear):
            return super().head(x, layer)
        return self.fp8_gemm(self._quantized(x, layer), layer)  # an FP8 head (--quantize-lm-head)

    def takes_cublas(self, rows: int, layer: nn.Linear) -> bool:
        return isinstance(layer, nn.Linear) and super().takes_cublas(rows, layer)

    def takes_fp8(self, layer: nn.Module) -> bool:
        return not isinstance(layer, nn.Linear)

    def fp8_codes(self, codes: Tensor, scale: Tensor, dtype: torch.dtype, layer: nn.Module) -> Fp8Act:
        """codes [T, K] e4m3 at one scale (a float32 [1] tensor on their device) as the FP8 `layer`'s
        input, its output in `dtype`: the scale stands for every token and group. A decode batch's
        GEMM (the skinny kernel) reads it through zero strides; more rows get the column-major scales
        a quantizer writes."""
        rows, size = codes.shape
        group = min(layer.block[1], size)  # type: ignore[union-attr]
        groups = -(-size // group)
        scales = scale.view(1, 1).expand(rows, groups)
        if rows > _SKINNY_ROWS:
            scales = scales.t().contiguous().t()
        return Fp8Act(codes, scales, group, dtype)

    def _quantized(self, x: Tensor | Fp8Act, layer: Fp8Layer) -> Fp8Act:
        return x if isinstance(x, Fp8Act) else self.quantize(x, layer.block[1])

    def quantize(self, x: Tensor, group: int) -> Fp8Act:
        """x [T, K] quantized per token in `group`-column groups."""
        return reference.quantize(x, group)

    def rms_norm_quant(self, x: Tensor, weight: Tensor, eps: float, group: int) -> Fp8Act:
        """`rms_norm(x, weight, eps)` quantized as `quantize` would, for the FP8 GEMM after the norm."""
        return reference.rms_norm_quant(x, weight, eps, group)

    def glu(self, gate_up: Tensor, gelu: bool, before: nn.Module) -> Tensor | Fp8Act:  # type: ignore[override]
        if isinstance(before, nn.Linear):
            return super().glu(gate_up, gelu, before)
        return self.glu_quant(gate_up, before.block[1], gelu)  # type: ignore[union-attr]

    def glu_quant(self, gate_up: Tensor, group: int, gelu: bool) -> Fp8Act:
        """`glu`'s activation quantized as `quantize` would, for the FP8 down projection."""
        return reference.glu_quant(gate_up, group, gelu)

    def fp8_gemm(self, a: Fp8Act, layer: Fp8Layer, residual: Tensor | None = None) -> Tensor:
        """a @ layer's weight^T (+ bias), or with `residual` (consumed) residual + that: `reference.gemm`."""
        return reference.gemm(a, layer.weight, layer.weight_scale_inv, layer.block, layer.bias, residual)


class Fp8TorchKernels(Fp8Kernels, TorchKernels):
    """The CPU path and the reference: activations quantized and both sides dequantized to float32
    (`reference.py`), so that the results are what the GPU's FP8 GEMMs compute, up to summation order."""

    name = "torch-fp8"


class Fp8TritonKernels(Fp8Kernels, TritonKernels):
    """Triton quantizers; cuBLASLt's scaled GEMMs (`torch._scaled_mm`) where they take the layer, the
    Triton FP8 GEMM elsewhere (and on CPU tensors, interpreted)."""

    name = "triton-fp8"

    def __init__(self, gemm: Gemm = "auto") -> None:
        super().__init__(gemm)
        from shared.kernels.fp8 import gemm as fp8_gemm
        from shared.kernels.fp8 import glu_quant, quant, rms_norm_quant, scaled_mm

        self._quantize, self._rms_norm_quant = quant.quantize, rms_norm_quant.rms_norm_quant
        self._glu_quant = glu_quant.glu_quant
        self._triton_gemm, self._scaled_mm, self._skinny_gemm = fp8_gemm.gemm, scaled_mm, skinny_gemm

    def quantize(self, x: Tensor, group: int) -> Fp8Act:
        return self._quantize(x, group)

    def rms_norm_quant(self, x: Tensor, weight: Tensor, eps: float, group: int) -> Fp8Act:
        return self._rms_norm_quant(x, weight, eps, group)

    def glu_quant(self, gate_up: Tensor, group: int, gelu: bool) -> Fp8Act:
        return self._glu_quant(gate_up, group, gelu)

    def _on_cublas(self, layer: Fp8Layer) -> bool:
        """Whether cuBLASLt runs this layer's GEMMs: decided once a layer, by its shapes and (once a
        device) whether `torch._scaled_mm` runs that scaling right there."""
        use = getattr(layer, "fp8_cublas", None)
        if use is None:
            w, block, mm = layer.weight, layer.block, self._scaled_mm
            use = mm.takes(w, block) and mm.supported(w.device, mm.kind_of(block, w.shape[1]))
            layer.fp8_cublas = use  # type: ignore[attr-defined]
        return use

    def fp8_gemm(self, a: Fp8Act, layer: Fp8Layer, residual: Tensor | None = None) -> Tensor:
        if a.shape[0] <= _SKINNY_ROWS and self.gemm != "cublas":
            scales = Scales(a.scale, a.group, layer.weight_scale_inv, layer.block, a.dtype, layer.bias)
            return self._skinny_gemm(a.data, layer.weight, add=residual, scales=scales)
        # cuBLAS for 16-bit activations (what `scaled_mm.supported` probes); a float32 model's, Triton
        if a.dtype != torch.float32 and self._on_cublas(layer):
            out = self._scaled_mm.scaled_mm(a, layer.weight, layer.weight_scale_inv, layer.block, layer.bias)
            return out if residual is None else residual.add_(out)
        return self._triton_gemm(a, layer.weight, layer.weight_scale_inv, layer.block, layer.bias, residual)


def check_device(device: torch.device | str) -> None:
    """ValueError for a GPU without FP8 tensor cores (compute capability below 8.9: Ada, Hopper and
    later have them); any CPU is fine (the reference kernels)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"FP8 weights need a GPU with FP8 tensor cores (compute capability 8.9 or later), and "
            f"{device} is {major}.{minor}: serve it with --quantization none"
        )


@functools.cache
def _instance(backend: str, gemm: Gemm) -> Fp8Kernels:
    return Fp8TorchKernels() if backend == "torch" else Fp8TritonKernels(gemm)


def fp8_kernels_for(device: torch.device | str, backend: Backend = "auto", gemm: Gemm = "auto") -> Fp8Kernels:
    """`kernels_for` for a model with FP8 layers: the same choice of torch or Triton kernels (and the
    same errors), their FP8 versions."""
    chosen = kernels_for(device, backend, gemm)
    return _instance(chosen.name, chosen.gemm if chosen.name == "triton" else "auto")
