"""Pre-quantized Hugging Face FP8 checkpoints (`quantization_config.quant_method == "fp8"`, as
published for Qwen3 and DeepSeek): e4m3 `weight`s with float32 `weight_scale_inv` block scales
(`weight_block_size` [128, 128]) and activations quantized on the fly (`activation_scheme` "dynamic").

The projections load as they are stored (`Fp8Linear.load_tensor`); a module the model serves
unquantized (the LM head, what `modules_to_not_convert` lists, everything under `--quantization
none`) is dequantized to float32 as it streams past (`dequantize_unconverted`), then cast to the model's
dtype like any tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shared.kernels.fp8 import E4M3, dequantize
from shared.model.quant.fp8 import BLOCK, Fp8Linear
from shared.model.transformer import Transformer

__all__ = ["Fp8Checkpoint", "dequantize_unconverted", "fp8_checkpoint"]

SCALE = "weight_scale_inv"


@dataclass(frozen=True)
class Fp8Checkpoint:
    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()  # module names (substrings of them, as transformers matches)

    def keeps(self, parts: tuple[str, ...]) -> bool:
        """Whether the checkpoint stores these modules (a fused projection's parts) unquantized."""
        kept = [any(key in p for key in self.not_converted) for p in parts]
        if any(kept) and not all(kept):
            raise ValueError(
                f"FP8 checkpoint quantizes some of {list(parts)} and not the others: their fused "
                "projection cannot be served"
            )
        return all(kept)


def fp8_checkpoint(hf: dict[str, Any]) -> Fp8Checkpoint | None:
    """What a config.json's `quantization_config` says (None without one); ValueError for a
    quantization pdserve does not load."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"unsupported quantization_config.quant_method {method!r}: pdserve loads block-scaled FP8 "
            "checkpoints ('fp8') and unquantized ones"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"FP8 checkpoint with activation_scheme {qc['activation_scheme']!r}: only 'dynamic' "
            "(activations scaled per token as they come) is supported"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint in {qc['fmt']!r}: only e4m3 weights are supported")
    block = qc.get("weight_block_size")
    if block is None or [int(b) for b in block] != [BLOCK, BLOCK]:
        raise ValueError(
            f"FP8 checkpoint with weight_block_size {block!r}: only [{BLOCK}, {BLOCK}] block scales are "
            "supported (not per-tensor ones)"
        )
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Checkpoint((BLOCK, BLOCK), tuple(str(s) for s in skip))


def _served_fp8(model: Transformer, module: str) -> bool:
    target = model._target(f"{module}.weight")
    if target is None:
        return False
    owner = target[0].rpartition(".")[0]
    try:
        return isinstance(model.get_submodule(owner), Fp8Linear)
    except AttributeError:
        return False


def dequantize_unconverted(
    model: Transformer, weights: Iterable[tuple[str, torch.Tensor]], checkpoint: Fp8Checkpoint
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, with the FP8 weights of modules `model` holds unquantized replaced by
    their dequantized float32 value (a weight and its scales may come in either order, in any file)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    served: dict[str, bool] = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        fp8 = kind == SCALE or (kind == "weight" and tensor.dtype == E4M3)
        if not fp8 or served.setdefault(module, _served_fp8(model, module)):
            yield name, tensor
            continue
        part = pending.setdefault(module, {})
        part[kind] = tensor
        if len(part) == 2:
            del pending[module]
            yield f"{module}.weight", dequantize(part["weight"], part[SCALE], checkpoint.block)
    if pending:
        missing = sorted(pending)[:5]
        raise ValueError(f"FP8 checkpoint: weights without their {SCALE}, or the reverse: {missing}")
