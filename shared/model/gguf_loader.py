"""GGUF checkpoints (llama.cpp's format): config from metadata, weights dequantized at load.

Dequantization is gguf's own; tensor names come from gguf's name map. Two transforms of llama.cpp's
converter are undone here, exactly as transformers' GGUF loader undoes them: the Q/K row permutation of
llama-arch models, and Gemma's norm weights, which it stores as 1 + w.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.model.config import FULL, SLIDING, ModelConfig, config_from_hf

_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
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
    if scaling not in (None, "none") and (arch, scaling) != ("gemma3", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    family = _gemma3(get, int(get("block_count")), hidden // heads, int(head_dim)) if arch == "gemma3" else {}
    return family | {
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


def _gemma3(get: Callable[..., Any], layers: int, hidden_per_head: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 file leaves to llama.cpp's code, filled in as llama.cpp does (llama-model.cpp):
    without a sliding window every layer is full; with one, every 6th layer is, unless the file says the
    pattern; the local layers' RoPE base is 10000 unless the file says it; attention scales by
    1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B (its 62 layers). The global layers' linear
    RoPE scaling (4B and up) is the file's."""
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", 6)
    if not window:
        types = [FULL] * layers
    elif isinstance(pattern, list):  # per layer: true = sliding
        types = [SLIDING if p else FULL for p in pattern]
    else:
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers)]
    out: dict[str, Any] = {
        "layer_types": types,
        "sliding_window": int(window) if window else None,
        "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": hidden_per_head if layers == 62 else head_dim,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    factor = float(get("rope.scaling.factor", 1.0))
    if get("rope.scaling.type") == "linear" and factor != 1.0:
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return out


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
        if cfg.sandwich_norms:  # only here: elsewhere these names map to the norm before the MLP too
            hf_modules += [f"{p}.pre_feedforward_layernorm", f"{p}.post_feedforward_layernorm"]
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
        elif cfg.unit_offset_norms and module.endswith("norm"):
            w = w - 1.0  # llama.cpp stored Gemma's 1 + w; the checkpoint's w, as transformers loads it
        if not w.flags.writeable:  # unquantized tensors are views of the read-only memory map
            w = w.copy()
        yield f"{names[module]}.{kind}", torch.from_numpy(np.ascontiguousarray(w)).to(dtype)


def _reader(path: str | Path) -> Any:
    """gguf's GGUFReader, its views of the file plain ndarrays rather than np.memmap ones.

    The reader makes a view of every metadata value, each element of an array included: for Gemma 3's
    262144-token vocabulary a million of them, and a memmap view costs several times a plain one
    (its __getitem__ and __array_finalize__). Same memory map, same laziness; the header of
    gemma-3-270m-q4_k_m.gguf parsed in 7 s instead of 16-20 s on a shared 2-core host."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)  # keeps the memmap alive as its base

    return Reader(str(path))


def open_gguf(path: str | Path) -> tuple[Any, dict[str, Any], ModelConfig]:
    """(reader, metadata, config) of a GGUF file; tensors are read lazily from the memory map."""
    reader = _reader(path)
    meta = read_metadata(reader)
    cfg = config_from_hf(hf_config_dict(meta, {t.name for t in reader.tensors}))
    return reader, meta, cfg
