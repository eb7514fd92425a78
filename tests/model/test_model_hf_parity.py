"""Our decoder, loaded through our loader, computes the same logits as Hugging Face transformers.

Each case saves a tiny random checkpoint with transformers (safetensors), loads it with `load_model`,
and compares full-sequence logits from the dense reference attention with HF's eager attention, at
prompt lengths around the sliding window and for a mixed-length batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_testutil import WINDOW, save_hf_model

from shared.model import FULL, SLIDING, load_model, reference_logits

REL_TOL = 1e-4

CASES = {
    "llama3-rope": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small, so that the scaled, smoothed and untouched frequency bands all occur at head_dim 16.
                "original_max_position_embeddings": 16,
            },
            attention_bias=True,
        ),
        (FULL,) * 4,
    ),
    "qwen3-yarn-rope": (
        "Qwen3Config",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                # Small, so that the ramp between extrapolated and interpolated bands falls inside
                # head_dim 16; the attention factor 0.1 ln 4 + 1 scales cos and sin.
                "original_max_position_embeddings": 16,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
            },
        ),
        (FULL,) * 4,
    ),
    "mistral-all-sliding": ("MistralConfig", dict(sliding_window=WINDOW), (SLIDING,) * 4),
    "ministral-mixed": (
        "MinistralConfig",
        dict(sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING, FULL]),
        (SLIDING, FULL, SLIDING, FULL),
    ),
    "qwen2-max-window-layers": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
        (FULL, SLIDING, SLIDING, SLIDING),
    ),
    "qwen3-layer-types-qk-norm": (
        "Qwen3Config",
        dict(
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=[FULL, SLIDING, SLIDING, FULL],
            attention_bias=True,
        ),
        (FULL, SLIDING, SLIDING, FULL),
    ),
    # Mixtures of experts: 4 experts, 2 a token; Qwen3-MoE with a dense layer among them (mlp_only_layers)
    "qwen3-moe-dense-layer": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        (FULL,) * 4,
    ),
    "mixtral-all-sliding": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
        (SLIDING,) * 4,
    ),
    # gpt-oss: attention sinks, biases on q/k/v/o, the router and the experts, a clamped SwiGLU, YaRN
    "gpt-oss-sinks-yarn": (
        "GptOssConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        ),
        (SLIDING, FULL, SLIDING, FULL),
    ),
}


def assert_close_rel(ours: torch.Tensor, theirs: torch.Tensor, rel: float = REL_TOL) -> None:
    err = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} exceeds {rel:g} x max |logit| {scale:.3g}"


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config_cls, overrides, layout = CASES[request.param]
    path: Path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(path, config_cls, **overrides)
    return request.param, path, hf, layout


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_loader_reads_the_layout_transformers_uses(case) -> None:
    _, path, hf, layout = case
    loaded = load_model(path)
    assert loaded.config.layer_types == layout
    # Llama has no sliding layers, Mistral and Mixtral slide on all of them, Qwen3-MoE on none here;
    # the others say it per layer.
    hf_types = getattr(hf.config, "layer_types", None)
    if loaded.config.architecture not in ("LlamaForCausalLM", "MistralForCausalLM") and hf_types is not None:
        assert tuple(hf_types) == layout
    assert loaded.config.sliding_window == (WINDOW if SLIDING in layout else None)
    assert loaded.tokenizer is None  # random checkpoints carry no tokenizer files


@pytest.mark.parametrize("length", ["W-1", "W", "W+1", "3W+2"])
def test_logits_match_transformers(case, prompts, length: str) -> None:
    _, path, hf, _ = case
    ids = prompts[length]
    ours = reference_logits(load_model(path).model, [ids])[0]
    assert_close_rel(ours, hf_logits(hf, ids))


def test_mixed_batch_equals_each_sequence_alone(case, prompts) -> None:
    _, path, hf, _ = case
    model = load_model(path).model
    seqs = [prompts["3W+2"], prompts["W-1"], prompts["W+1"], prompts["W"]]
    batched = reference_logits(model, seqs)
    for seq, got in zip(seqs, batched, strict=True):
        alone = reference_logits(model, [seq])[0]
        assert_close_rel(got, alone, rel=1e-5)  # matmul blocking varies with T
        assert_close_rel(got, hf_logits(hf, seq))


def test_window_size_is_visible_in_the_logits(case, prompts) -> None:
    """Guard against a silent off-by-one: windows W and W+1 must give clearly different logits once the
    prompt is longer than W, far above the parity tolerance."""
    name, path, _, layout = case
    if SLIDING not in layout:
        pytest.skip("no sliding layers")
    ids = prompts["W+1"]
    exact = reference_logits(load_model(path).model, [ids])[0]
    wider = reference_logits(load_model(path, sliding_window=WINDOW + 1).model, [ids])[0]
    # Up to position W-1 both windows see the whole prefix; the last query is the first that differs.
    assert_close_rel(wider[:-1], exact[:-1], rel=1e-5)
    diff = (wider[-1] - exact[-1]).abs().max().item()
    assert diff > 100 * REL_TOL * exact.abs().max().item(), f"{name}: W and W+1 differ only by {diff:.3g}"
