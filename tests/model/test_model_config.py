"""ModelConfig: what config_from_hf reads from config.json, and the layout override."""

from __future__ import annotations

import dataclasses

import pytest

from shared.model import (
    FULL,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    config_from_hf,
    parse_layer_pattern,
    with_layout,
)

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
S, F = SLIDING, FULL


def hf(arch: str, **kw: object) -> dict:
    return {"architectures": [arch], **BASE, **kw}


# -- architectures ---------------------------------------------------------------------------------------


def test_unsupported_architecture_is_a_clear_error_listing_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        config_from_hf(hf("GPT2LMHeadModel"))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_model_type_is_used_when_architectures_is_missing() -> None:
    d = {**BASE, "model_type": "qwen3"}
    assert config_from_hf(d).architecture == "Qwen3ForCausalLM"


def test_unsupported_activation_and_rope_type_are_rejected() -> None:
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf(hf("LlamaForCausalLM", hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        config_from_hf(hf("LlamaForCausalLM", rope_scaling={"type": "dynamic", "factor": 4.0}))


def test_old_style_rope_keys_are_read() -> None:
    cfg = config_from_hf(
        hf(
            "LlamaForCausalLM",
            rope_theta=500000.0,
            max_position_embeddings=4096,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            eos_token_id=[7, 9],
        )
    )
    assert cfg.rope_theta == 500000.0
    # Like transformers: a missing original length falls back to max_position_embeddings.
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 4096)
    assert cfg.eos_token_ids == (7, 9)
    assert cfg.head_dim == 16 and cfg.layer_types == (F,) * 4


# -- which layers slide, per architecture (as the pinned transformers decides) ----------------------------


def test_mistral_slides_on_every_layer_when_it_has_a_window() -> None:
    assert config_from_hf(hf("MistralForCausalLM", sliding_window=8)).layer_types == (S,) * 4
    assert config_from_hf(hf("MistralForCausalLM", sliding_window=None)).layer_types == (F,) * 4


def test_ministral_follows_layer_types() -> None:
    cfg = config_from_hf(hf("MinistralForCausalLM", sliding_window=8, layer_types=[S, S, S, F]))
    assert cfg.sliding_layers == (0, 1, 2) and cfg.full_layers == (3,)
    assert cfg.is_sliding(0) and not cfg.is_sliding(3)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_window_needs_use_sliding_window_and_starts_at_max_window_layers(arch: str) -> None:
    off = config_from_hf(hf(arch, sliding_window=8, max_window_layers=2))
    assert off.layer_types == (F,) * 4 and off.sliding_window is None
    on = config_from_hf(hf(arch, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert on.layer_types == (F, F, S, S) and on.sliding_window == 8
    explicit = config_from_hf(hf(arch, use_sliding_window=True, sliding_window=8, layer_types=[S, F, S, F]))
    assert explicit.layer_types == (S, F, S, F)
    with pytest.raises(ValueError, match="no sliding window"):  # transformers fails here too
        config_from_hf(hf(arch, sliding_window=8, layer_types=[S, F, S, F]))


def test_qwen_specifics() -> None:
    assert config_from_hf(hf("Qwen2ForCausalLM")).qkv_bias
    q3 = config_from_hf({**hf("Qwen3ForCausalLM"), "head_dim": None})
    assert q3.qk_norm and q3.head_dim == 128  # Qwen3Config's default head_dim


# -- ModelConfig validation --------------------------------------------------------------------------------


def small(**kw: object) -> ModelConfig:
    return dataclasses.replace(config_from_hf(hf("LlamaForCausalLM", num_hidden_layers=6)), **kw)


def test_config_rejects_inconsistent_layouts() -> None:
    with pytest.raises(ValueError, match="5 entries, model has 6"):
        small(layer_types=(F,) * 5)
    with pytest.raises(ValueError, match="sliding_window is not set"):
        small(layer_types=(S,) * 6)
    with pytest.raises(ValueError, match="positive int"):
        small(layer_types=(S,) * 6, sliding_window=0)
    with pytest.raises(ValueError, match="unknown layer types"):
        small(layer_types=("local",) * 6)


# -- layout override ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("sliding,sliding,sliding,full", (S, S, S, F, S, S)),
        ("SSSF", (S, S, S, F, S, S)),
        ("sf", (S, F, S, F, S, F)),
        ("sliding_attention, full_attention, full", (S, F, F, S, F, F)),
        ([S, F], (S, F, S, F, S, F)),
    ],
)
def test_layer_pattern_repeats_cyclically(pattern, expected) -> None:
    assert parse_layer_pattern(pattern, 6) == expected


def test_with_layout_turns_a_full_attention_model_into_a_hybrid() -> None:
    cfg = with_layout(small(), sliding_window=16, layer_types="SSSF")
    assert cfg.layer_types == (S, S, S, F, S, S) and cfg.sliding_window == 16
    assert cfg.sliding_layers == (0, 1, 2, 4, 5) and cfg.full_layers == (3,)
    assert with_layout(cfg, sliding_window=32).sliding_window == 32  # resize the window only
    all_full = with_layout(cfg, layer_types="full")
    assert all_full.sliding_layers == () and all_full.sliding_window is None
    assert with_layout(cfg) is cfg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": 16}, "no layer of LlamaForCausalLM slides; pass layer_types"),
        ({"layer_types": "SSSF"}, "neither the model nor the override sets sliding_window"),
        ({"layer_types": "sliding,local", "sliding_window": 4}, r"unknown layer type\(s\) \['local'\]"),
        ({"layer_types": "S,,F", "sliding_window": 4}, "empty entry"),
        ({"layer_types": "SFSFSFS", "sliding_window": 4}, "7 entries but the model has 6 layers"),
        ({"layer_types": "SF", "sliding_window": 0}, "positive int"),
        ({"layer_types": "SF", "sliding_window": 2.5}, "positive int"),
    ],
)
def test_with_layout_errors_say_what_is_wrong(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        with_layout(small(), **kwargs)
