"""Bias correction of FP8 weights quantized at load (`shared/model/quant/bias_correction.py`): the
calibration measures each projection's mean input through the unquantized model, and the corrected
projections' mean output over those inputs is the unquantized one's."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.kernels.reference import rms_norm
from shared.model.quant import quantize_model
from shared.model.quant.bias_correction import correct_biases, input_means
from shared.model.quant.fp8 import Fp8Linear, projections
from shared.serving.api.model_source import random_model_config, random_transformer

PROMPTS = [list(range(1, 30)), [5, 60, 7, 90, 11, 3, 40, 2, 2, 8]]


def _model():  # type: ignore[no-untyped-def]
    cfg = random_model_config({"layers": "SF", "window": 8, "vocab": 97, "hidden": 64, "intermediate": 128})
    return random_transformer(cfg, 0).eval()


def test_the_first_projections_mean_input_is_the_mean_of_the_normed_embeddings() -> None:
    model = _model()
    means = input_means(model, PROMPTS)
    assert set(means) == {name for name, _, _ in projections(model)}
    norm = model.layers[0].input_layernorm
    rows = [rms_norm(model.embed_tokens.weight[ids], norm.weight, norm.eps).float() for ids in PROMPTS]
    torch.testing.assert_close(means["layers.0.self_attn.qkv_proj"], torch.cat(rows).mean(0))


def test_corrected_projections_shift_the_calibration_mean_by_nothing() -> None:
    model = _model()
    means = input_means(model, PROMPTS)
    plain = quantize_model(copy.deepcopy(model), "fp8")
    corrected = correct_biases(quantize_model(copy.deepcopy(model), "fp8"), model, means)
    for name, _, _ in projections(model):
        layer, before = corrected.get_submodule(name), plain.get_submodule(name)
        assert isinstance(layer, Fp8Linear) and layer.bias is not None and before.bias is None
        torch.testing.assert_close(layer.weight.view(torch.uint8), before.weight.view(torch.uint8))
        w = model.get_submodule(name).weight.float()
        mean_in = means[name]
        shift = (layer.dequantize() - w) @ mean_in
        assert shift.abs().max() > 0  # rounding moved the mean output ...
        torch.testing.assert_close(shift + layer.bias.float(), torch.zeros_like(shift), atol=1e-5, rtol=0)


def test_a_quantized_model_cannot_be_calibrated_and_every_projection_needs_a_mean() -> None:
    model = _model()
    fp8 = quantize_model(copy.deepcopy(model), "fp8")
    with pytest.raises(ValueError, match="must be unquantized"):
        input_means(fp8, PROMPTS)
    with pytest.raises(ValueError, match="at least one prompt"):
        input_means(model, [])
    means = input_means(model, PROMPTS)
    del means["layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="no input mean for layers.1.mlp.down_proj"):
        correct_biases(fp8, model, means)
