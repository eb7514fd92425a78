"""An FP8 KV cache's per-layer scales from the checkpoint `--model` names, when it ships them.

FP8 checkpoints made with a KV cache scheme carry one K and one V scale per attention layer:
llm-compressor's `model.layers.N.self_attn.k_scale` / `v_scale`, AutoFP8's older
`model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (scalars: stored = x / scale,
the convention of vLLM, which reads the same names). Only the safetensors headers' names and those
scalars are read. A checkpoint without them (every GGUF, the embedded default, `random:`) gets 1.0
everywhere (`KVConfig.scales` empty); one that has them for some layers only is refused, since
guessing the rest would store those layers' K/V at a scale nothing calibrated.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.kernels.kv_quant import KVQuant
from shared.model.transformer import KV_SCALE_NAME

__all__ = ["checkpoint_kv_scales"]

_NAME = KV_SCALE_NAME


def checkpoint_kv_scales(model: str, num_layers: int) -> tuple[tuple[float, float], ...]:
    """(k_scale, v_scale) of every layer from the Hugging Face directory `model`, or () when it ships
    none (or is not a directory: the embedded default, a GGUF file, a random model). ValueError for
    scales that do not cover every layer once, or are not positive scalars."""
    path = Path(model) if model else None
    if path is None or not path.is_dir() or not (path / "config.json").exists():
        return ()
    from safetensors import safe_open

    found: dict[tuple[int, str], float] = {}
    for file in _files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open handles have keys(), not iteration
                m = _NAME.match(name)
                if m is None:
                    continue
                layer, kind = int(m.group(1)), m.group(2) or m.group(3)
                t = f.get_tensor(name)
                if t.numel() != 1:
                    raise ValueError(
                        f"{name}: a per-tensor KV scale must be one value, got shape {tuple(t.shape)}"
                    )
                value = float(t.float().reshape(()))
                if not value > 0 or (layer, kind) in found or layer >= num_layers:
                    raise ValueError(f"{name}: a KV scale must be positive, once, for a layer of the model; "
                                     f"got {value}")  # fmt: skip
                found[(layer, kind)] = value
    if not found:
        return ()
    missing = [f"{k}_scale of layer {i}" for i in range(num_layers) for k in "kv" if (i, k) not in found]
    if missing:
        raise ValueError(
            f"the checkpoint's KV cache scales cover {len(found)} of {2 * num_layers} (K and V of every "
            f"layer); missing e.g. {missing[:3]}: give a checkpoint with all of them, or none (1.0)"
        )
    scales = tuple((found[(i, "k")], found[(i, "v")]) for i in range(num_layers))
    for i, pair in enumerate(scales):
        try:
            KVQuant(*pair)
        except ValueError as e:
            raise ValueError(f"layer {i}'s KV scales {pair}: {e}") from e
    return scales


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))
