"""One model name per checkpoint, however it is spelled: GetModelInfo and decode's handshake with
prefill name the checkpoint, not the spelling of --model (the embedded default and its own path, a
relative and an absolute path, a symlink). Also `--dtype auto` from the checkpoint's dtype, and the
progress a load shows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2
from safetensors.torch import save_file

from decode_service.servicer import SERVICE_NAME as GENERATION
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.model import DEFAULT_MODEL_NAME, default_gguf_path, load_model
from shared.model.loader import checkpoint_name
from shared.serving.api.model_source import auto_dtype, load_served_model
from tests.services.service_testutil import ServerProcess, stop_all, wait_health

SERVING = health_pb2.HealthCheckResponse.SERVING


def write_tiny_llama(path: Path, dtype: str = "float32") -> Path:
    """A random Llama checkpoint as Hugging Face saves one: config.json + model.safetensors."""
    vocab, hidden, layers, heads, kv_heads, head_dim, inter = 97, 32, 2, 4, 2, 8, 64
    path.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": inter,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "torch_dtype": dtype,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: (0.2 * torch.randn(*shape, generator=gen)).to(getattr(torch, dtype))
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": 1 + rand(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_gguf_file_is_named_by_its_file_whatever_the_spelling(tmp_path: Path, monkeypatch) -> None:
    try:
        real = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.chdir(real.parent)
    (tmp_path / "model.gguf").symlink_to(real)
    spellings = [real, str(real), real.name, f"./{real.name}", tmp_path / "model.gguf"]
    assert {checkpoint_name(s) for s in spellings} == {DEFAULT_MODEL_NAME} == {"SmolLM2-135M-Instruct"}


@pytest.mark.parametrize(
    ("file", "name"),
    [("Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B"), ("llama-3.2-1b-instruct-bf16.gguf", "llama-3.2-1b-instruct"),
     ("Mistral-7B-v0.3.IQ2_XXS.gguf", "Mistral-7B-v0.3"), ("tiny.gguf", "tiny"), ("Q4_0.gguf", "Q4_0")],
)  # fmt: skip
def test_the_encoding_tag_is_not_part_of_a_gguf_name(tmp_path: Path, file: str, name: str) -> None:
    (tmp_path / file).write_bytes(b"")
    assert checkpoint_name(tmp_path / file) == name


def test_a_directory_is_named_by_its_resolved_name(tmp_path: Path, monkeypatch) -> None:
    model = write_tiny_llama(tmp_path / "tiny-llama")
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(model)
    assert {checkpoint_name(s) for s in (model, f"{model}/", ".", "../tiny-llama", tmp_path / "link")} == {
        "tiny-llama"
    }
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert checkpoint_name(snapshot) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert load_model(".").name == "tiny-llama"


def test_prefill_and_decode_given_two_spellings_of_one_checkpoint_pair(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny-llama")
    (tmp_path / "served").symlink_to(model)
    prefill = ServerProcess(str(model) + "/", "--no-metrics", module="prefill_service", service=PREFILL)
    # Ready only once its handshake with prefill, which compares the model names, has passed.
    decode = ServerProcess(
        str(tmp_path / "served"), "--no-metrics", "--prefill-target", prefill.target,
        "--local-prefill-max-tokens", "0",
    )  # fmt: skip
    try:
        with Client(decode.target) as client:
            assert client.model_info().model_name == "tiny-llama"
            done = client.complete(list(range(1, 30)), max_tokens=3, temperature=0.0, ignore_eos=True)
            assert done.usage.completion_tokens == 3
    finally:
        stop_all(decode, prefill)


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_dtype_auto_follows_the_checkpoint_and_the_device(tmp_path: Path, stored: str) -> None:
    model = write_tiny_llama(tmp_path / "m", dtype=stored)
    assert load_served_model(str(model), dtype="auto").config.dtype == "float32"  # on every CPU
    assert load_served_model(str(model), dtype="bfloat16").config.dtype == "bfloat16"
    assert load_served_model("random:{}", dtype="auto").config.dtype == "float32"  # the tests' oracle
    assert auto_dtype("cpu", getattr(torch, stored)) == torch.float32


def test_a_load_shows_progress_on_request_and_none_otherwise(tmp_path: Path, capfd, caplog) -> None:
    model = write_tiny_llama(tmp_path / "m")
    load_model(model, progress=True)
    assert "loading m" in capfd.readouterr().err  # tqdm's bar on stderr
    load_model(model, progress=False)
    assert capfd.readouterr().err == ""
    with caplog.at_level("INFO", logger="shared.model.loader"):
        load_model(model)  # stderr is not a terminal here: no bar, a log line at the end
    assert capfd.readouterr().err == ""
    assert any("loading m: 20 tensors in" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_the_embedded_default_and_its_path_pair() -> None:
    """`--model ""` and `--model <the embedded file>` are one checkpoint: decode pairs with prefill."""
    try:
        path = str(default_gguf_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    common = ("--device", "cpu", "--num-pages", "64", "--max-running", "2", "--no-metrics")
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}  # two loads at once share the cores
    prefill = ServerProcess("", *common, module="prefill_service", service=PREFILL, env=env, wait_ready=False)
    decode = ServerProcess(path, *common, "--prefill-target", prefill.target, env=env, wait_ready=False)
    try:
        wait_health(decode.target, GENERATION, SERVING, timeout=240)  # the handshake passed
        with Client(decode.target) as client:
            assert client.model_info().model_name == DEFAULT_MODEL_NAME
    finally:
        stop_all(decode, prefill)
