"""GGUF checkpoints (llama.cpp's format): config from metadata, weights dequantized at load.

Dequantization is gguf's own; tensor names come from gguf's name map. The one transform we have to undo
ourselves is llama.cpp's Q/K row permutation for llama-arch models, done exactly as transformers'
GGUF loader undoes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.model.config import ModelConfig, config_from_hf

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# general.file_type (llama.cpp's LlamaFileType) of the unquantized encodings; every other is quantized.
_FILE_DTYPES = {0: torch.float32, 1: torch.float16, 32: torch.bfloat16}


def gguf_file_dtype(meta: dict[str, Any]) -> torch.dtype | None:
    """The dtype the file stores its weights in; None when quantized (or general.file_type is absent)."""
    kind = meta.get("general.file_type")
    return None if kind is None else _FILE_DTYPES.get(int(kind))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key -> value of a GGUFReader's header, strings decoded and arrays as lists."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config_dict(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A Hugging Face config.json equivalent of GGUF metadata, so one code path validates both."""
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    return {
        "architectures": [_ARCHS[arch]],
        "vocab_size": int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "intermediate_size": int(get("feed_forward_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two RoPE halves of each head (for its GPT-J style rotation):
    # rows (head, 2, dim/2) -> (head, dim/2, 2). Swapping back restores Hugging Face's rotate_half layout.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _name_map(arch: str, cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, from gguf's own table of standard names."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, cfg.num_layers)
    hf_modules = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        hf_modules += [
            f"{p}.input_layernorm",
            f"{p}.post_attention_layernorm",
            f"{p}.self_attn.o_proj",
            f"{p}.self_attn.q_proj",
            f"{p}.self_attn.k_proj",
            f"{p}.self_attn.v_proj",
            f"{p}.self_attn.q_norm",
            f"{p}.self_attn.k_norm",
            f"{p}.mlp.gate_proj",
            f"{p}.mlp.up_proj",
            f"{p}.mlp.down_proj",
        ]
    out = {}
    for hf in hf_modules:
        gguf_name = table.get_name(hf)
        if gguf_name is not None:
            out[gguf_name] = hf
    return out


def gguf_weights(
    reader: Any, arch: str, cfg: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, dequantized tensor) for every weight of the file."""
    from gguf import dequantize

    names = _name_map(arch, cfg)
    for tensor in reader.tensors:
        module, _, kind = tensor.name.rpartition(".")
        if module not in names:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a {arch} model")
        w = dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama" and module.endswith(".attn_q"):
            w = _unpermute(w, cfg.num_heads)
        elif arch == "llama" and module.endswith(".attn_k"):
            w = _unpermute(w, cfg.num_kv_heads)
        if not w.flags.writeable:  # unquantized tensors are views of the read-only memory map
            w = w.copy()
        yield f"{names[module]}.{kind}", torch.from_numpy(np.ascontiguousarray(w)).to(dtype)


def open_gguf(path: str | Path) -> tuple[Any, dict[str, Any], ModelConfig]:
    """(reader, metadata, config) of a GGUF file; tensors are read lazily from the memory map."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    cfg = config_from_hf(hf_config_dict(meta, {t.name for t in reader.tensors}))
    return reader, meta, cfg
