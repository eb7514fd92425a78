"""Bias correction for FP8 weights quantized from a model's own weights: each projection's output
shifted back by what rounding its weights moves it on average.

Rounding W to e4m3 changes a projection's output by (W_q - W) x. Over the tokens a model sees, x has
a mean mu per input channel (far from zero in a few channels of the residual stream and of the
norms' outputs), so part of that change is the constant (W_q - W) mu, the same for every token. The
correction is the bias -(W_q - W) mu, added in the GEMM's epilogue as any bias is, where mu is
measured on calibration prompts through the unquantized model (Nagel et al., "Data-Free Quantization
Through Weight Equalization and Bias Correction", 2019, corrects the same term). Only the shift is
corrected: what varies with the token stays, and an FP8 checkpoint's weights (no W to compare with)
get none.

`input_means` runs the calibration; `correct_biases` writes the biases into the quantized model.
bench/fp8_accuracy.py `--bias-correction` measures what it does to perplexity (docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from shared.kernels.ops import ModelKernels
from shared.model.quant.fp8 import Fp8Linear, projections
from shared.model.reference import reference_logits
from shared.model.transformer import Transformer

__all__ = ["correct_biases", "input_means"]


class _Recorder:
    """The model's kernels, summing each projection's input rows on their way into its GEMM."""

    def __init__(
        self, inner: ModelKernels, names: dict[int, str], sums: dict[str, Tensor], rows: dict[str, int]
    ):
        self._inner, self._names, self._sums, self._rows = inner, names, sums, rows

    def __getattr__(self, attr: str) -> object:
        return getattr(self._inner, attr)

    def _record(self, layer: nn.Linear, x: Tensor) -> None:
        name = self._names.get(id(layer))
        if name is not None:
            flat = x.detach().float().reshape(-1, x.shape[-1])
            self._sums[name] = self._sums.get(name, 0) + flat.sum(0)
            self._rows[name] = self._rows.get(name, 0) + flat.shape[0]

    def linear(self, x: Tensor, layer: nn.Linear) -> Tensor:
        self._record(layer, x)
        return self._inner.linear(x, layer)

    def linear_add(self, x: Tensor, layer: nn.Linear, residual: Tensor) -> Tensor:
        self._record(layer, x)
        return self._inner.linear_add(x, layer, residual)


@torch.no_grad()  # the means are ordinary tensors, usable beside weights that track gradients
def input_means(model: Transformer, prompts: Sequence[list[int]]) -> dict[str, Tensor]:
    """Each projection's mean input row (float32 [in_features], by its module name, as
    `fp8.projections` names them) over every token of `prompts`, each a prompt of its own through the
    unquantized `model` (dense attention, `reference_logits`)."""
    if model.quantization != "none":
        raise ValueError(f"input_means: the model must be unquantized, got {model.quantization}")
    if not prompts or not all(prompts):
        raise ValueError("input_means: give at least one prompt, each of at least one token")
    names = {id(model.get_submodule(name)): name for name, _, _ in projections(model)}
    sums: dict[str, Tensor] = {}
    rows: dict[str, int] = {}
    factory = model.kernel_factory
    model.kernel_factory = lambda *a: _Recorder(factory(*a), names, sums, rows)  # type: ignore[assignment,return-value]
    try:
        for ids in prompts:
            reference_logits(model, [ids])
    finally:
        model.kernel_factory = factory  # type: ignore[method-assign]
    missing = sorted(set(names.values()) - set(sums))
    if missing:
        raise RuntimeError(f"input_means: no input reached {', '.join(missing[:3])}")
    return {name: sums[name] / rows[name] for name in sums}


@torch.no_grad()
def correct_biases(quantized: Transformer, reference: Transformer, means: dict[str, Tensor]) -> Transformer:
    """Give each `Fp8Linear` of `quantized` the bias that cancels its rounding's mean shift, -(W_q - W)
    mu with W its projection in `reference` (the unquantized model it was quantized from) and mu its
    input mean (`input_means`), added to any bias it has; in the bias's dtype (the model's), in place."""
    for name, _, _ in projections(quantized):
        layer = quantized.get_submodule(name)
        if not isinstance(layer, Fp8Linear):
            continue
        if name not in means:
            raise ValueError(f"correct_biases: no input mean for {name}")
        w = reference.get_submodule(name).weight.float()
        shift = (layer.dequantize() - w) @ means[name].to(w.device)
        dtype = reference.embed_tokens.weight.dtype if layer.bias is None else layer.bias.dtype
        bias = -shift if layer.bias is None else layer.bias.float() - shift
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return quantized
