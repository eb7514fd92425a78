"""The model's shape and attention layout, built once from a checkpoint and frozen.

Prefill and decode compare this object at handshake, so everything that changes what a KV page means
(head counts, head_dim, dtype, which layers slide and by how much) lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling (`rope_type == "llama3"` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    qkv_bias: bool = False  # Qwen2: bias on q, k, v (not on o)
    attention_bias: bool = False  # Llama/Qwen3 `attention_bias`: bias on q, k, v and o
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, model has {self.num_layers} layers"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected {LAYER_TYPES}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def is_sliding(self, layer: int) -> bool:
        """A query at position q in a sliding layer sees keys q-W+1 .. q (W tokens, itself included)."""
        return self.layer_types[layer] == SLIDING

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)


# ---------------------------------------------------------------------------------------------------------
# Layout override


_SHORT = {"s": SLIDING, "f": FULL}
_NAMES = {"sliding": SLIDING, SLIDING: SLIDING, "swa": SLIDING, "full": FULL, FULL: FULL, **_SHORT}


def parse_layer_pattern(pattern: str | Sequence[str], num_layers: int) -> tuple[str, ...]:
    """Expand "sliding,sliding,sliding,full" (or "SSSF") cyclically over `num_layers` layers."""
    if isinstance(pattern, str):
        text = pattern.strip()
        if "," not in text and text and set(text.lower()) <= set(_SHORT):
            items = list(text)
        else:
            items = [p.strip() for p in text.split(",")]
    else:
        items = [str(p).strip() for p in pattern]
    if not items or any(not p for p in items):
        raise ValueError(f"empty entry in layer pattern {pattern!r}")
    unknown = [p for p in items if p.lower() not in _NAMES]
    if unknown:
        raise ValueError(
            f"unknown layer type(s) {unknown} in layer pattern {pattern!r}; use 'sliding'/'full' "
            "(or 'sliding_attention'/'full_attention'), comma separated, or a string of S and F like 'SSSF'"
        )
    if len(items) > num_layers:
        raise ValueError(
            f"layer pattern {pattern!r} has {len(items)} entries but the model has {num_layers} layers"
        )
    kinds = [_NAMES[p.lower()] for p in items]
    return tuple(kinds[i % len(kinds)] for i in range(num_layers))


def with_layout(
    cfg: ModelConfig,
    sliding_window: int | None = None,
    layer_types: str | Sequence[str] | None = None,
) -> ModelConfig:
    """Serve any checkpoint with another attention layout (e.g. a full-attention model as a hybrid).

    `layer_types` is a pattern repeated over the layers; `sliding_window` alone re-sizes the window of a
    model that already has sliding layers.
    """
    if sliding_window is None and layer_types is None:
        return cfg
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
    types = cfg.layer_types if layer_types is None else parse_layer_pattern(layer_types, cfg.num_layers)
    window = sliding_window if sliding_window is not None else cfg.sliding_window
    if SLIDING not in types:
        if sliding_window is not None:
            raise ValueError(
                f"sliding_window={sliding_window} given but no layer of {cfg.architecture} slides; "
                "pass layer_types too, e.g. 'sliding,sliding,sliding,full' or 'SSSF'"
            )
        window = None
    elif window is None:
        raise ValueError(
            "layer_types has sliding layers but neither the model nor the override sets sliding_window"
        )
    return dataclasses.replace(cfg, layer_types=types, sliding_window=window)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face config.json


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The defaults of the pinned transformers' config classes, for keys a config.json may omit.
_DEFAULT_MAX_POS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "MinistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    arch = archs[0] if archs else _BY_MODEL_TYPE.get(d.get("model_type", ""), d.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(d: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints use `rope_theta` and
    # `rope_scaling` (with "type" in the oldest ones).
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
    )
    return theta, scaling


def _eos(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _layout(arch: str, d: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Which layers slide, exactly as the pinned transformers' config classes decide it."""
    window = d.get("sliding_window")
    if arch == "LlamaForCausalLM":
        return (FULL,) * num_layers, None
    if arch == "MistralForCausalLM":
        # Mistral's attention reads config.sliding_window on every layer and ignores layer_types.
        return ((SLIDING if window is not None else FULL),) * num_layers, window
    if arch == "MinistralForCausalLM":
        types = d.get("layer_types") or [SLIDING if window is not None else FULL] * num_layers
    else:  # Qwen2, Qwen3: the window only exists with use_sliding_window, from layer max_window_layers on
        if not d.get("use_sliding_window", False):
            window = None
        types = d.get("layer_types") or [
            SLIDING if window is not None and i >= d.get("max_window_layers", 28) else FULL
            for i in range(num_layers)
        ]
    types = tuple(types)
    if SLIDING not in types:
        window = None
    return types, window


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""
    arch = _architecture(d)
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only silu (SwiGLU) is implemented")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    hidden, heads, layers = int(d["hidden_size"]), int(d["num_attention_heads"]), int(d["num_hidden_layers"])
    head_dim = d.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
    max_pos = int(d.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch])
    theta, scaling = _rope(d, max_pos)
    types, window = _layout(arch, d, layers)
    if SLIDING in types and window is None:
        raise ValueError(f"{arch}: layer_types has sliding layers but the config sets no sliding window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(d["intermediate_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        layer_types=types,
        sliding_window=None if window is None else int(window),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=arch == "Qwen2ForCausalLM",
        attention_bias=bool(d.get("attention_bias", False))
        and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos(d.get("eos_token_id")),
        dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
    )
