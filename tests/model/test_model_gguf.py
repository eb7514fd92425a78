"""GGUF files load into the same model as the safetensors checkpoint they were converted from.

The files are written here the way llama.cpp's converter writes them (names, metadata, and its q/k row
permutation for llama-arch models), in F32 so that the comparison is exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from model_testutil import WINDOW, save_hf_model, write_gguf

from shared.model import load_model, reference_logits

CASES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_matches_the_safetensors_checkpoint(arch: str, tmp_path: Path) -> None:
    config_cls, overrides = CASES[arch]
    hf = save_hf_model(tmp_path, config_cls, **overrides)
    write_gguf(tmp_path / "model.gguf", hf, arch)
    from_dir, from_gguf = load_model(tmp_path), load_model(tmp_path / "model.gguf")
    # The tokenizer's bos/eos stand in for config.json's; GGUF stores eps as float32.
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_dir.config.rms_norm_eps, rel=1e-6)
    ignore = {"bos_token_id": None, "eos_token_ids": (), "rms_norm_eps": 0.0}
    assert dataclasses.replace(from_gguf.config, **ignore) == dataclasses.replace(from_dir.config, **ignore)
    ids = list(range(3 * WINDOW))
    a = reference_logits(from_dir.model, [ids])[0]
    b = reference_logits(from_gguf.model, [ids])[0]
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert from_gguf.tokenizer is not None and from_gguf.tokenizer.encode("!#") == [0, 2]


def test_gguf_with_an_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3, gemma3"
    ):
        load_model(tmp_path / "m.gguf")
