"""Synthetic Hugging Face checkpoints for the FP8 weight tests: config.json + safetensors, bf16, or FP8
as published for Qwen3 and DeepSeek (e4m3 `weight` + float32 `weight_scale_inv` per 128x128 block,
`quantization_config` {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic})."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.kernels.fp8 import reference as ref

BLOCK = (128, 128)
PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    arch: str = "Qwen3ForCausalLM"
    vocab: int = 97
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    inter: int = 384


@dataclass
class Checkpoint:
    path: Path
    shape: Shape
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def dequantized(self, module: str) -> torch.Tensor:
        """The float32 value of checkpoint module `module`'s weight (FP8 ones dequantized)."""
        w = self.tensors[f"{module}.weight"]
        scale = self.tensors.get(f"{module}.weight_scale_inv")
        return w.float() if scale is None else ref.dequantize(w, scale, BLOCK)


def write_checkpoint(
    path: Path, shape: Shape = Shape(), *, fp8: bool = True, fp8_lm_head: bool = False,
    not_converted: tuple[str, ...] = (), std: float = 0.05, kv_scales: bool = False,
) -> Checkpoint:  # fmt: skip
    """A random checkpoint in bf16; with `fp8` its projections in e4m3 with block scales (and the LM
    head too with `fp8_lm_head`), except modules whose name contains an entry of `not_converted`;
    with `kv_scales` an FP8 KV cache's per-layer k_scale and v_scale as llm-compressor names them."""
    s = shape
    path.mkdir(parents=True)
    config: dict = {
        "architectures": [s.arch], "vocab_size": s.vocab, "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.inter, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": list(not_converted) or None,
        }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int, scale: float = std) -> torch.Tensor:
        # rows and columns of different ranges, so that block scales differ
        w = torch.randn(*dims, generator=gen) * scale
        if len(dims) == 2:
            rows, cols = torch.rand(dims[0], 1, generator=gen), torch.rand(1, dims[1], generator=gen)
            w = w * (0.5 + rows) * (0.5 + cols)
        return w.to(torch.bfloat16)

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dims = {
        "self_attn.q_proj": (q, s.hidden), "self_attn.k_proj": (kv, s.hidden),
        "self_attn.v_proj": (kv, s.hidden), "self_attn.o_proj": (s.hidden, q),
        "mlp.gate_proj": (s.inter, s.hidden), "mlp.up_proj": (s.inter, s.hidden),
        "mlp.down_proj": (s.hidden, s.inter),
    }  # fmt: skip
    tensors = {"model.embed_tokens.weight": rand(s.vocab, s.hidden, scale=1.0)}
    tensors["lm_head.weight"] = rand(s.vocab, s.hidden)
    tensors["model.norm.weight"] = 1 + rand(s.hidden, scale=0.1)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1 + rand(s.hidden, scale=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1 + rand(s.hidden, scale=0.1)
        if s.arch == "Qwen3ForCausalLM":
            tensors[p + "self_attn.q_norm.weight"] = 1 + rand(s.head_dim, scale=0.1)
            tensors[p + "self_attn.k_norm.weight"] = 1 + rand(s.head_dim, scale=0.1)
        for name in PROJECTIONS:
            tensors[p + name + ".weight"] = rand(*dims[name])
        if kv_scales:
            tensors[p + "self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
            tensors[p + "self_attn.v_scale"] = torch.tensor(0.02 * (i + 1))
    if fp8:
        modules = [n.removesuffix(".weight") for n in tensors if any(p in n for p in PROJECTIONS)]
        modules += ["lm_head"] if fp8_lm_head else []
        for m in modules:
            if not any(key in m for key in not_converted):
                w, scale = ref.quantize_weight(tensors[f"{m}.weight"].float(), BLOCK)
                tensors[f"{m}.weight"], tensors[f"{m}.weight_scale_inv"] = w, scale
    save_file(tensors, str(path / "model.safetensors"))
    return Checkpoint(path, shape, tensors)
