"""The model's shape and attention layout, built once from a checkpoint and frozen.

Prefill and decode compare this object at handshake, so everything that changes what a KV page means
(head counts, head_dim, dtype, which layers slide and by how much) lives here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.model.moe_config import MOE_ARCHITECTURES, MoeConfig, moe_from_hf

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, Hugging Face's `rope_type`: "llama3" (Llama 3.1: long wavelengths slowed
    by `factor`, a smooth ramp between the bands), "linear" (every frequency divided by `factor`:
    Gemma 3's global layers; the band fields unused) or "yarn" (gpt-oss, Qwen's long contexts: the
    frequencies between `beta_fast` and `beta_slow` rotations over the original context ramped from
    extrapolated to interpolated, and cos/sin scaled by `attention_factor`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


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
    # Gemma 3 (config_from_hf says where each comes from). The local layers' RoPE base, None: every
    # layer rotates with rope_theta and rope_scaling. `rope_local_layers`: the layers that use it, the
    # checkpoint's sliding ones (kept when `with_layout` changes which layers slide: the weights were
    # trained with these bases).
    rope_local_theta: float | None = None
    rope_local_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    unit_offset_norms: bool = False  # every RMSNorm scales by (1 + weight); loaded as 1 + weight
    sandwich_norms: bool = False  # a norm on each sublayer's output too, before its residual add
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the dtype as HF does
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    moe: MoeConfig | None = None  # mixture-of-experts layers (shared/model/moe_config.py)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax, no value

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
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if any(not 0 <= i < self.num_layers for i in self.rope_local_layers):
            raise ValueError(f"rope_local_layers {self.rope_local_layers} name layers the model lacks")
        if self.rope_local_layers and self.rope_local_theta is None:
            raise ValueError("rope_local_layers given without rope_local_theta")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.layers):
            raise ValueError(f"MoE layers {self.moe.layers} name layers the model lacks")

    def is_moe(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.layers

    @property
    def attn_scale(self) -> float:
        """What attention multiplies q.k by: 1/sqrt(head_dim) (torch's SDPA default), or Gemma's
        query_pre_attn_scalar**-0.5, each computed as the reference computes it."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return 1.0 / math.sqrt(self.head_dim)

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
    "Gemma3ForCausalLM",
    *MOE_ARCHITECTURES,
)
_BY_MODEL_TYPE = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# The defaults of the pinned transformers' config classes, for keys a config.json may omit.
_DEFAULT_MAX_POS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "MinistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "Gemma3ForCausalLM": 131072,
    "MixtralForCausalLM": 4096 * 32,
    "Qwen3MoeForCausalLM": 32768,
    "GptOssForCausalLM": 131072,
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
    if rope_type == "linear":
        return theta, RopeScaling(factor=float(params["factor"]), rope_type="linear")
    if rope_type == "yarn":
        return theta, _yarn(params, max_pos)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
    )
    return theta, scaling


def _yarn(params: dict[str, Any], max_pos: int) -> RopeScaling:
    """YaRN's parameters as Hugging Face reads them; the attention factor (the cos/sin scale) from
    `attention_factor`, else from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(
        factor=factor, original_max_position_embeddings=original, rope_type="yarn",
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), attention_factor=float(attention),
    )  # fmt: skip


def _eos(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _layout(arch: str, d: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Which layers slide, exactly as the pinned transformers' config classes decide it."""
    window = d.get("sliding_window")
    if arch == "LlamaForCausalLM":
        return (FULL,) * num_layers, None
    if arch == "GptOssForCausalLM":  # sliding and full layers in turn, the first sliding
        types = d.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        return tuple(types), window if SLIDING in types else None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
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


def _gemma3(d: dict[str, Any], num_layers: int, max_pos: int) -> dict[str, Any]:
    """Gemma 3's fields, as the pinned transformers' Gemma3TextConfig and Gemma3ForCausalLM read them:
    the layout from `layer_types`, else `sliding_window_pattern` (every Nth layer full); RoPE per layer
    type (transformers 5's `rope_parameters` by type, or the older `rope_theta` with `rope_scaling` for
    the full layers and `rope_local_base_freq` for the sliding ones); (1 + w) norms around both
    sublayers, q/k norms, GELU-tanh, embeddings scaled by sqrt(hidden), query_pre_attn_scalar."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported: it is not causal")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints set it to null)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; supported: gelu_pytorch_tanh")
    pattern = int(d.get("sliding_window_pattern") or 6)
    types = tuple(d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)])
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full, local = dict(d.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    theta, scaling = _rope({"rope_parameters": full}, max_pos)
    local_theta, local_scaling = _rope({"rope_parameters": local}, max_pos)
    if local_scaling is not None:
        raise ValueError("Gemma 3: RoPE scaling on the sliding layers is not supported")
    softcap = d.get("final_logit_softcapping")
    return dict(
        layer_types=types,
        sliding_window=d.get("sliding_window", 4096) if SLIDING in types else None,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        rope_local_layers=tuple(i for i, t in enumerate(types) if t == SLIDING),
        hidden_act="gelu_tanh",
        unit_offset_norms=True,
        sandwich_norms=True,
        scale_embeddings=True,
        qk_norm=True,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""
    arch = _architecture(d)
    if arch == "Gemma3ForCausalLM":
        return _config(arch, d, **_gemma3(d, int(d["num_hidden_layers"]), _max_pos(arch, d)))
    if d.get("hidden_act", "silu") != "silu" and arch != "GptOssForCausalLM":  # its experts' own SwiGLU
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only silu (SwiGLU) is implemented")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    theta, scaling = _rope(d, _max_pos(arch, d))
    types, window = _layout(arch, d, int(d["num_hidden_layers"]))
    return _config(
        arch, d, rope_theta=theta, rope_scaling=scaling, layer_types=types, sliding_window=window,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), qkv_bias=arch == "Qwen2ForCausalLM",
        moe=moe_from_hf(arch, d, int(d["num_hidden_layers"])), attention_sinks=arch == "GptOssForCausalLM",
    )  # fmt: skip


def _attention_bias(arch: str, d: dict[str, Any]) -> bool:
    """Bias on q, k, v and o, where the architecture reads `attention_bias` (gpt-oss: on by default)."""
    if arch == "GptOssForCausalLM":
        return bool(d.get("attention_bias", True))
    readers = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
    return arch in readers and bool(d.get("attention_bias", False))


def _max_pos(arch: str, d: dict[str, Any]) -> int:
    return int(d.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch])


def _config(arch: str, d: dict[str, Any], **family: Any) -> ModelConfig:
    """The fields every architecture reads alike, and the family's own (`family`)."""
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    defaults = {"Qwen3ForCausalLM": 128, "GptOssForCausalLM": 64}  # the config classes' (else hidden/heads)
    head_dim = d.get("head_dim") or defaults.get(arch, hidden // heads)
    window = family.pop("sliding_window")
    if SLIDING in family["layer_types"] and window is None:
        raise ValueError(f"{arch}: layer_types has sliding layers but the config sets no sliding window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(d["intermediate_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_max_pos(arch, d),
        sliding_window=None if window is None else int(window),
        attention_bias=_attention_bias(arch, d),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos(d.get("eos_token_id")),
        dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
        **family,
    )
