"""Experiment: per-channel FP8 weight scales searched for the least squared error, against amax / 448.

Each row's scale is taken from `--candidates` values amax / 448 * 2^(i / n), i = 0..n-1 (no
clipping: the largest weight stays inside +-448), the one whose e4m3 rounding leaves the row's
smallest squared error. Scored on five texts (the tests' prose, two stretches of Python's language
reference, the GPL version 3, argparse's source) as bench/fp8_accuracy.py scores one: perplexity
change with its standard error, and the mean KL divergence from the unquantized model.

    PYTHONPATH=. python bench/fp8_scale_search.py --dtype float32 --candidates 64,32
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import shared.model.quant.fp8 as fp8_module
from bench.fp8_accuracy import DTYPES, python_reference
from shared.engine.scoring import prompt_log_probs
from shared.kernels.fp8 import E4M3, FP8_MAX
from shared.kernels.kv_quant import FP8_KV_DTYPE

Quantizer = Callable[[torch.Tensor, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]


def searched(n: int, fallback: Quantizer) -> Quantizer:
    def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if block != (1, w.shape[1]):
            return fallback(w, block)
        w = w.float()
        amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12)
        best_q = best_s = best_err = None
        for i in range(n):
            s = amax / FP8_MAX * 2 ** (i / n)
            q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
            err = (q.float() * s - w).pow(2).sum(1, keepdim=True)
            if best_err is None:
                best_q, best_s, best_err = q, s, err
                continue
            better = err < best_err
            best_q, best_s = torch.where(better, q, best_q), torch.where(better, s, best_s)
            best_err = torch.where(better, err, best_err)
        assert best_q is not None and best_s is not None
        return best_q, best_s

    return quantize_weight


def main() -> None:
    from shared.model import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--candidates", default="64", help="comma-separated numbers of candidate scales")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    loaded = load_model(dtype=dtype, device="cpu")

    def enc(text: str) -> list[int]:
        return loaded.tokenizer.encode(text, add_special_tokens=False)

    reference = enc(python_reference())
    texts = {
        "prose": [enc((Path(__file__).parents[1] / "tests/model/data/perplexity.txt").read_text())],
        "pyref": [reference[i : i + 1024] for i in (0, 1024)],
        "pyref2": [reference[i : i + 1024] for i in (16384, 17408)],
        "gpl": [enc(Path("/usr/share/common-licenses/GPL-3").read_text())[i : i + 1024] for i in (0, 1024)],
        "code": [enc(inspect.getsource(argparse))[i : i + 1024] for i in (2048, 3072)],
    }

    def log_probs(model: torch.nn.Module, kv: torch.dtype) -> dict[str, list[torch.Tensor]]:
        return {
            k: [prompt_log_probs(loaded.config, model, c, kv, "cpu") for c in v] for k, v in texts.items()
        }

    base = log_probs(loaded.model, dtype)

    def report(name: str, model: torch.nn.Module, kv: torch.dtype) -> None:
        out, cells, kls = log_probs(model, kv), [], []
        for k, chunks in texts.items():
            pairs = zip(base[k], out[k], strict=True)
            kl = torch.cat([(b.exp() * (b - o)).sum(-1) for b, o in pairs]).mean().item()
            d = torch.cat([
                F.nll_loss(o[:-1], torch.tensor(c[1:]), reduction="none")
                - F.nll_loss(b[:-1], torch.tensor(c[1:]), reduction="none")
                for b, o, c in zip(base[k], out[k], chunks, strict=True)
            ])  # fmt: skip
            se = 100 * d.std().item() / math.sqrt(len(d))
            cells.append(f"{k} KL {kl:.4f} {100 * math.expm1(d.mean().item()):+.2f}+-{se:.2f}%")
            kls.append(kl)
        print(f"{name:26s} mean KL {sum(kls) / len(kls):.4f} | " + " | ".join(cells), flush=True)

    print({k: sum(len(c) for c in v) for k, v in texts.items()})
    report("fp8 cache", loaded.model, FP8_KV_DTYPE)
    original = fp8_module.quantize_weight
    variants = [("amax", original)] + [
        (f"mse{n}", searched(int(n), original)) for n in args.candidates.split(",")
    ]
    for name, quantizer in variants:
        fp8_module.quantize_weight = quantizer
        model = copy.deepcopy(loaded.model)
        fp8_module.convert(model, "fp8")
        fp8_module.quantize_weight = original
        report(f"fp8 weights {name}", model, dtype)
        report(f"fp8 weights {name} + cache", model, FP8_KV_DTYPE)


if __name__ == "__main__":
    main()
