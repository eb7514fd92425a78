"""A short fingerprint of a loaded model's weights and tokenizer, for two services that must serve
the same model: a layout that agrees (names, shapes, dtypes) says nothing about the numbers, and a
prefill with the same layout but other weights hands over KV that decodes as garbage.

What is hashed: every parameter's name, shape and dtype, and a sample of its bytes (the first and the
last `SAMPLE` bytes, and as many spread through it): cheap at start-up (a few MB read, whatever the
model's size) and different for any two checkpoints that are not copies of each other, trained or
quantized apart. The tokenizer's whole definition and its chat template are hashed too. Take it
before anything rewrites the weights in place (`Transformer.fold_norms`).

A model served with quantized weights (`Transformer.quantization`) has its quantization in front
("fp8-block:3f2a..."), so that a handshake between an FP8 and an unquantized service of one
checkpoint names why their weights differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from shared.model.tokenizer import Tokenizer
from shared.model.transformer import Transformer

__all__ = ["fingerprint"]

SAMPLE = 4096  # bytes per probe
PROBES = 8  # probes per tensor beside its first and last bytes


def _sample(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1).view(torch.uint8) if t.numel() else t.detach().reshape(-1)
    n = flat.numel()
    if n <= SAMPLE * (PROBES + 2):
        return flat.cpu().numpy().tobytes()
    starts = [0, n - SAMPLE, *((n - SAMPLE) * (i + 1) // (PROBES + 1) for i in range(PROBES))]
    return b"".join(flat[s : s + SAMPLE].cpu().numpy().tobytes() for s in starts)


@torch.no_grad()
def fingerprint(
    model: Transformer, tokenizer: Tokenizer | None, *,
    served: tuple[str, Sequence[tuple[str, Callable[[], torch.Tensor]]]] | None = None,
) -> str:  # fmt: skip
    """A hex digest of the model's weights (sampled) and its tokenizer, after the quantization if any;
    equal for the same checkpoint loaded in the same dtype and quantization, on any device. `served`:
    (quantization, its parameters by name) for a model still unquantized that is served quantized
    (`shared/model/quant/fp8.py` `quantized_parameters`): the digest is the quantized model's."""
    quantization = getattr(model, "quantization", "none")
    if served is not None:
        quantization, params = served
    else:
        params = [(name, lambda p=p: p) for name, p in model.named_parameters()]
    h = hashlib.blake2b(digest_size=16)
    for name, get in sorted(params, key=lambda item: item[0]):
        p = get()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(_sample(p.contiguous()))
    if tokenizer is not None:
        h.update(tokenizer.backend.to_str().encode())
        h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest() if quantization == "none" else f"{quantization}:{h.hexdigest()}"
