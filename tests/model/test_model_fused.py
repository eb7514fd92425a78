"""The whole decoder through the fused Triton kernels (interpreted on CPU) against its torch path.

The kernels round where torch rounds; only a norm's float32 sum is taken in another order, which now
and then moves a bf16 value by one ulp. Logits may differ by that rounding carried through, no more.
"""

from __future__ import annotations

import pytest
import torch
from model_testutil import TINY

from shared.model import DenseAttention, Transformer, config_from_hf, pack, reference_logits, with_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CONFIGS = {
    "llama3-rope-bias": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    },
    "qwen2-qkv-bias": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3-qk-norm": {"architectures": ["Qwen3ForCausalLM"]},
}  # fmt: skip


def random_model(name: str, dtype: torch.dtype) -> Transformer:
    cfg = config_from_hf({**TINY, **CONFIGS[name]})
    cfg = with_layout(cfg, sliding_window=5, layer_types="SF")
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=DEVICE, dtype=dtype)
    model.rotary.reset_buffers(DEVICE)  # float32 tables, as the loader keeps them
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.2 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("gemm", ["cublas", "skinny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_forward_matches_torch(name: str, dtype: torch.dtype, gemm: str) -> None:
    # skinny: the layers' GEMMs through skinny_gemm where a layer has no bias; Llama's and Qwen2's
    # biased projections stay on torch's GEMM.
    model = random_model(name, dtype)
    seqs = [list(range(3, 20)), [7, 1, 4], [9]]
    model.kernel_backend = "torch"
    expected = reference_logits(model, seqs)
    model.kernel_backend, model.gemm_backend = "triton", gemm
    got = reference_logits(model, seqs)
    for a, b in zip(got, expected, strict=True):
        rel = 1e-4 if dtype == torch.float32 else 3e-2
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= rel * scale, f"max |diff| {err:.3g} exceeds {rel:g} x max |logit| {scale:.3g}"


def test_auto_backend_follows_the_device() -> None:
    """The default picks torch on CPU and Triton on CUDA; a padded graph row (position -1) is harmless."""
    model = random_model("qwen3-qk-norm", torch.float32)
    assert model.kernel_backend == "auto"
    ids, positions, cu = pack([[1, 2, 3]], DEVICE)
    positions = positions.clone()
    positions[-1] = -1
    with torch.inference_mode():
        hidden = model(ids, positions, DenseAttention(model.cfg, cu))
    assert hidden.shape == (3, TINY["hidden_size"]) and hidden.isfinite().all()
