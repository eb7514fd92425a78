"""What a service serves, from its `--model` flag: a checkpoint path, "" for the embedded default, or
(a testing aid) `random:<json>`, a tiny random-weight model with a character-level tokenizer.

The random models let service tests run real servers on CPU in milliseconds per step, and let a test
build the very same model in-process (same JSON, same seed) to compare the server with the Engine.
JSON keys, all optional: layers ("SSFS": S sliding, F full), window, vocab, hidden, heads, kv_heads,
head_dim, intermediate, max_context, seed, eos (list of ids), load_delay_s (sleep before loading, so
tests can watch readiness flip). A random model is a float32 checkpoint that `--dtype auto` serves in
float32 on every host, so that a test's in-process copy (float32 by default) is the same model.

`--dtype auto` is resolved here, where the checkpoint's own dtype is known (`auto_dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shared.model import FULL, SLIDING, LoadedModel, ModelConfig, Tokenizer, Transformer, load_model
from shared.model.moe_config import MoeConfig
from shared.model.quant import quantize_model

__all__ = [
    "RANDOM_PREFIX", "auto_dtype", "load_served_model", "random_model_config",
    "random_transformer",
]  # fmt: skip

RANDOM_PREFIX = "random:"
_PRINTABLE = [chr(c) for c in range(32, 127)]
_RANDOM_KEYS = {
    "layers", "window", "vocab", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
    "max_context", "seed", "eos", "load_delay_s", "experts", "top_k", "expert_intermediate", "sinks",
    "gpt_oss_experts",
}  # fmt: skip


def _random_spec(spec: str) -> dict[str, Any]:
    opts = json.loads(spec[len(RANDOM_PREFIX) :] or "{}")
    if not isinstance(opts, dict) or set(opts) - _RANDOM_KEYS:
        raise ValueError(f"random model options must be a JSON object with keys from {sorted(_RANDOM_KEYS)}")
    return opts


def random_model_config(opts: dict[str, Any]) -> ModelConfig:
    types = tuple({"S": SLIDING, "F": FULL}[c] for c in opts.get("layers", "SSFS"))
    return ModelConfig(
        architecture="random", vocab_size=opts.get("vocab", 97), hidden_size=opts.get("hidden", 64),
        num_layers=len(types), num_heads=opts.get("heads", 4), num_kv_heads=opts.get("kv_heads", 2),
        head_dim=opts.get("head_dim", 16), intermediate_size=opts.get("intermediate", 128),
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=opts.get("max_context", 512),
        layer_types=types, sliding_window=opts.get("window", 8) if SLIDING in types else None,
        eos_token_ids=tuple(opts.get("eos", ())), moe=_random_moe(opts, len(types)),
        attention_sinks=bool(opts.get("sinks", False)), attention_bias=bool(opts.get("sinks", False)),
    )  # fmt: skip


def _random_moe(opts: dict[str, Any], layers: int) -> MoeConfig | None:
    """ "experts": E > 0 makes every layer's MLP a mixture of E experts ("top_k" of them a token, of
    "expert_intermediate" each); "gpt_oss_experts": with gpt-oss's biases and clamped SwiGLU."""
    experts = int(opts.get("experts", 0))
    if experts <= 0:
        return None
    oai = bool(opts.get("gpt_oss_experts", False))
    return MoeConfig(
        num_experts=experts, top_k=int(opts.get("top_k", 2)),
        intermediate_size=int(opts.get("expert_intermediate", opts.get("intermediate", 128))),
        layers=tuple(range(layers)), router_bias=oai, expert_bias=oai,
        activation="swiglu_oai" if oai else "silu",
    )  # fmt: skip


def random_transformer(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Weights large enough that the logits differ visibly from token to token (and window W from
    W+1), so tests comparing two paths would see an off-by-one."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith(("sinks", "b_gate_up", "b_down")):  # gpt-oss's: logits of about 1, biases
                p.normal_(0.0, 0.5)
    return model


def _char_tokenizer(vocab: int, eos: tuple[int, ...]) -> Tokenizer:
    """Ids 0..94 are the printable ASCII characters; the rest are special tokens (<unk>, then <|i|>)."""
    chars = _PRINTABLE[: max(vocab - 1, 0)]
    specials = ["<unk>", *(f"<|{i}|>" for i in range(len(chars) + 1, vocab))]
    table = {t: i for i, t in enumerate([*chars, *specials])}
    backend = HFTokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(backend, eos_token_ids=eos)


def _random_model(spec: str, device: torch.device | str, dtype: torch.dtype) -> LoadedModel:
    opts = _random_spec(spec)
    time.sleep(float(opts.get("load_delay_s", 0)))
    cfg = dataclasses.replace(random_model_config(opts), dtype=str(dtype).removeprefix("torch."))
    model = random_transformer(cfg, int(opts.get("seed", 0))).to(device=device, dtype=dtype)
    model.rotary.reset_buffers(device)  # float32 tables, as the checkpoint loader keeps them
    model = model.eval().requires_grad_(False)
    return LoadedModel(cfg, model, _char_tokenizer(cfg.vocab_size, cfg.eos_token_ids), "random")


def auto_dtype(device: torch.device | str, stored: torch.dtype | None) -> torch.dtype:
    """`--dtype auto` for a checkpoint stored in `stored` (None: quantized, or it does not say).

    CUDA: the checkpoint's dtype, but bfloat16 for a float32 or quantized one (half the memory and the
    tensor cores' rate; training ran in bf16 for most of them), and float16 on a GPU without bfloat16.
    CPU: float32 on every host. bfloat16 runs faster on a CPU with AMX, but torch's CPU ops round each
    result to bfloat16, and there the embedded SmolLM2 answers the demo's question ("What is the
    capital of France?") with a string of French words and no Paris; `--dtype bfloat16` asks for it.
    One answer for every host also keeps a prefill and a decode resolving `auto` alike."""
    device = torch.device(device)
    if device.type == "cuda":
        if stored is torch.float16 or not torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.float16
        return torch.bfloat16
    return torch.float32


def load_served_model(
    spec: str, *, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
    quantization: str = "auto",
) -> LoadedModel:  # fmt: skip
    """`spec`: "" (embedded default), a checkpoint path (HF directory or .gguf), or `random:<json>`.
    `dtype`: a torch dtype, its name (`bfloat16`, as CommonConfig normalizes it), or `auto`.
    `quantization`: the projections' weights (`shared/model/quant`: auto, none, fp8, fp8-block); a
    random model is quantized after it is built, as a checkpoint is while it loads."""
    if spec.startswith(RANDOM_PREFIX):
        loaded = _random_model(spec, device, torch.float32 if dtype == "auto" else _dtype(dtype))
        quantize_model(loaded.model, quantization)
        return loaded
    rule = (lambda stored: auto_dtype(device, stored)) if dtype == "auto" else _dtype(dtype)
    return load_model(spec or None, dtype=rule, device=device, quantization=quantization)


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return found
