"""Mixture-of-experts layouts, read from Hugging Face configs: which layers route each token to a few
of many expert MLPs, how the router scores and weighs them, and the experts' activation.

Three families: Mixtral (every layer, softmax over the experts, the top k renormalized), Qwen3-MoE
(the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse, renormalized only with
`norm_topk_prob`; the others keep a dense MLP of `intermediate_size`), gpt-oss (every layer, a router
with a bias, the top k of the logits softmaxed among themselves, which is the renormalized softmax's
top k; experts with biases and a clamped SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MOE_ARCHITECTURES", "MoeConfig", "moe_from_hf"]

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
ACTIVATIONS = ("silu", "swiglu_oai")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeConfig:
    """num_experts experts of `intermediate_size` in each of `layers`, top_k a token. `scoring`: the
    router's "softmax" over all experts, or "sigmoid" scores; `renormalize`: the chosen weights scaled
    to sum to 1; `routed_scaling`: a factor on them. `activation`: "silu" (SwiGLU) or "swiglu_oai"
    (gpt-oss: gate clamped above at `limit`, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate))."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    scoring: str = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    # Expert parallelism (shared/model/tensor_parallel.py): the experts [start, stop) this rank holds
    # whole; None: every expert. The router still scores all num_experts.
    held: tuple[int, int] | None = None

    @property
    def held_experts(self) -> range:
        return range(*self.held) if self.held is not None else range(self.num_experts)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE: top_k must be in 1..num_experts, got {self.top_k} of {self.num_experts}")
        if self.held is not None and not 0 <= self.held[0] < self.held[1] <= self.num_experts:
            raise ValueError(f"MoE: held experts {self.held} outside 0..{self.num_experts}")
        if self.intermediate_size < 1:
            raise ValueError(f"MoE: intermediate_size must be positive, got {self.intermediate_size}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE: scoring must be one of {SCORINGS}, got {self.scoring!r}")


def moe_from_hf(arch: str, d: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """The MoE layout of a config.json dict (None for a dense architecture), as the pinned
    transformers' config classes default it."""
    every = tuple(range(num_layers))
    if arch == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=int(d.get("num_local_experts", 8)), top_k=int(d.get("num_experts_per_tok", 2)),
            intermediate_size=int(d["intermediate_size"]), layers=every,
        )  # fmt: skip
    if arch == "Qwen3MoeForCausalLM":
        # config.json files say num_experts; transformers 5's config class num_local_experts
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 128)
        step = int(d.get("decoder_sparse_step", 1))
        dense = set(d.get("mlp_only_layers") or ())
        layers = tuple(i for i in every if i not in dense and experts > 0 and (i + 1) % step == 0)
        return MoeConfig(
            num_experts=experts, top_k=int(d.get("num_experts_per_tok", 8)),
            intermediate_size=int(d.get("moe_intermediate_size", 768)), layers=layers,
            renormalize=bool(d.get("norm_topk_prob", False)),
        )  # fmt: skip
    if arch == "GptOssForCausalLM":
        return MoeConfig(
            num_experts=int(d.get("num_local_experts", 128)),
            top_k=int(d.get("num_experts_per_tok", d.get("experts_per_token", 4))),
            intermediate_size=int(d["intermediate_size"]), layers=every, router_bias=True, expert_bias=True,
            activation="swiglu_oai", alpha=float(d.get("swiglu_alpha", 1.702)),
            limit=float(d.get("swiglu_limit", 7.0)),
        )  # fmt: skip
    return None
