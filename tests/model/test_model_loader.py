"""load_model on Hugging Face directories: sharded safetensors, dtype, layout override, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_testutil import WINDOW, save_hf_model

from shared.model import FULL, SLIDING, load_model, reference_logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_hf_model(path, "LlamaConfig")
    return path


def test_sharded_checkpoint_loads_like_a_single_file(llama_dir: Path, tmp_path: Path) -> None:
    hf = save_hf_model(tmp_path, "LlamaConfig")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = list(range(10))
    sharded = reference_logits(load_model(tmp_path).model, [ids])[0]
    single = reference_logits(load_model(llama_dir).model, [ids])[0]
    torch.testing.assert_close(sharded, single, rtol=0, atol=0)


def test_bfloat16_load_records_the_dtype_and_stays_close(llama_dir: Path) -> None:
    ids = list(range(12))
    ref = reference_logits(load_model(llama_dir).model, [ids])[0]
    loaded = load_model(llama_dir, dtype=torch.bfloat16)
    assert loaded.config.dtype == "bfloat16"
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.rotary.cos_sin.dtype == torch.float32  # tables are never rounded
    got = reference_logits(loaded.model, [ids])[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_full_attention_checkpoint_served_as_a_hybrid(llama_dir: Path) -> None:
    plain = load_model(llama_dir)
    hybrid = load_model(llama_dir, sliding_window=WINDOW, layer_types="sliding,full")
    assert hybrid.config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert hybrid.config.sliding_window == WINDOW
    ids = list(range(3 * WINDOW))
    a = reference_logits(plain.model, [ids])[0]
    b = reference_logits(hybrid.model, [ids])[0]
    # Until the window is full nothing falls out of it; after that the sliding layers see less.
    torch.testing.assert_close(b[:WINDOW], a[:WINDOW], rtol=1e-5, atol=1e-5)
    assert (b[WINDOW:] - a[WINDOW:]).abs().max() > 1e-2


def test_generation_config_adds_stop_tokens(llama_dir: Path, tmp_path: Path) -> None:
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert load_model(tmp_path).config.eos_token_ids == (2, 5)


def test_tied_checkpoint_shares_embedding_and_head(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "Qwen2Config", tie_word_embeddings=True)
    model = load_model(tmp_path).model
    assert model.lm_head.weight is model.embed_tokens.weight


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"neither a model directory nor a \.gguf file"):
        load_model(tmp_path / "weights.bin")


def test_checkpoint_missing_a_tensor_is_rejected(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.self_attn\.qkv_proj"):
        load_model(tmp_path)
