"""Quantized weights: FP8 (e4m3) projections with block or per-channel scales, made at load from a
bf16 checkpoint (`fp8.py`) or read from a Hugging Face FP8 checkpoint (`checkpoint.py`). The kernels
are `shared/kernels/fp8/`; docs/quantization.md says what is served how."""

from __future__ import annotations

from shared.model.quant.checkpoint import Fp8Checkpoint, dequantize_unconverted, fp8_checkpoint
from shared.model.quant.fp8 import (
    QUANTIZATIONS,
    Fp8Linear,
    Fp8RMSNorm,
    convert,
    quantize_head,
    quantize_model,
    quantized_parameters,
)

__all__ = [
    "QUANTIZATIONS", "Fp8Checkpoint", "Fp8Linear", "Fp8RMSNorm", "convert", "dequantize_unconverted",
    "fp8_checkpoint", "quantize_head", "quantize_model", "quantized_parameters", "served_quantization",
]  # fmt: skip


def served_quantization(quantization: str, checkpoint: Fp8Checkpoint | None) -> str:
    """The quantization a checkpoint is served with under `--quantization`: an FP8 checkpoint stays FP8
    (its 128 x 128 blocks: "fp8-block") unless "none" asks for it dequantized; any other checkpoint is
    served as asked ("auto": unquantized)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return "none"
    if checkpoint is not None:
        return "fp8-block"
    return "none" if quantization == "auto" else quantization
