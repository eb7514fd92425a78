"""What FP8 weights and an FP8 KV cache cost a model's perplexity on a longer text than the tests'.

The tests hold SmolLM2-135M to its bfloat16 perplexity on ~500 tokens of English prose
(tests/model/data/perplexity.txt), where the mean difference of the tokens' log-likelihoods has a
standard error of about 1%. This scores thousands of tokens, in prompts of `--chunk` tokens through
the engine's own attention (one chunk each, every position scored; FP8 pages where the cache is
FP8), and reports for FP8 weights (`--quantization`), the FP8 cache, and both: the perplexity, its
change against the unquantized model with the standard error of that change, and the mean KL
divergence of the next-token distributions from the unquantized model's.

The default text is Python's own language reference (`pydoc_data.topics`, shipped with every
CPython), read in topic order: technical English with code. `--text FILE` scores a file instead.

    PYTHONPATH=. python bench/fp8_accuracy.py                       # 4096 tokens, float32, CPU
    PYTHONPATH=. python bench/fp8_accuracy.py --dtype bfloat16 --tokens 8192
    PYTHONPATH=. python bench/fp8_accuracy.py --device cuda         # the GPU kernels
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.engine.scoring import prompt_log_probs
from shared.kernels.kv_quant import FP8_KV_DTYPE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def python_reference() -> str:
    """Python's language reference topics, in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def main() -> None:
    from shared.model import load_model
    from shared.model.quant import quantize_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens scored, from the text's start")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens a prompt")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype")
    ap.add_argument("--quantization", choices=["fp8", "fp8-block"], default="fp8", help="the weights' scales")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--text", type=Path, help="a UTF-8 file to score (default: Python's language reference)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.tokens < 2 or args.chunk < 2:
        ap.error("--tokens and --chunk must be at least 2")
    dtype = DTYPES[args.dtype]
    loaded = load_model(dtype=dtype, device=args.device)
    fp8 = quantize_model(copy.deepcopy(loaded.model), args.quantization)
    text = args.text.read_text(encoding="utf-8") if args.text else python_reference()
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    variants = {  # (model, cache dtype)
        "unquantized": (loaded.model, dtype),
        f"{args.quantization} weights": (fp8, dtype),
        "fp8 cache": (loaded.model, FP8_KV_DTYPE),
        f"{args.quantization} weights + fp8 cache": (fp8, FP8_KV_DTYPE),
    }
    nll: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    kl: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    for start in range(0, len(ids), args.chunk):
        chunk = ids[start : start + args.chunk]
        if len(chunk) < 2:
            break
        targets = torch.tensor(chunk[1:], device=args.device)
        base = None
        for name, (model, kv_dtype) in variants.items():
            lp = prompt_log_probs(loaded.config, model, chunk, kv_dtype, args.device)
            base = lp if base is None else base
            nll[name].append(F.nll_loss(lp[:-1], targets, reduction="none").cpu())
            kl[name].append((base.exp() * (base - lp)).sum(-1).cpu())
    reference = torch.cat(nll["unquantized"])
    results = []
    for name in variants:
        scored = torch.cat(nll[name])
        diff = scored - reference
        results.append({
            "variant": name, "perplexity": round(math.exp(scored.mean().item()), 3),
            "change_percent": round(100 * math.expm1(diff.mean().item()), 2),
            "standard_error_percent": round(100 * diff.std().item() / math.sqrt(len(diff)), 2),
            "mean_kl": round(torch.cat(kl[name]).mean().item(), 4),
        })  # fmt: skip
    print(f"{len(reference)} tokens scored ({args.dtype} model, {args.device}, prompts of {args.chunk})")
    for r in results:
        print(f"{r['variant']:30s} perplexity {r['perplexity']:8.3f}  {r['change_percent']:+6.2f}% "
              f"+- {r['standard_error_percent']:.2f}%  KL {r['mean_kl']:.4f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": len(reference), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
