"""The whole decoder through the fused Triton kernels (interpreted on CPU) against its torch path.

The kernels round where torch rounds; only a norm's float32 sum is taken in another order, which now
and then moves a bf16 value by one ulp. Logits may differ by that rounding carried through, no more.
"""

from __future__ import annotations

import functools

import pytest
import torch
from model_testutil import TINY

from shared.kernels import kernels_for
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
    # GeGLU, sandwich norms (the output norms stay when the others fold), a local RoPE table
    "gemma3": {"architectures": ["Gemma3ForCausalLM"]},
}  # fmt: skip
# No bias anywhere: every norm folds (test_folded_norms_give_the_same_logits).
UNBIASED = {"llama-plain": {"architectures": ["LlamaForCausalLM"]}}


def random_model(name: str, dtype: torch.dtype) -> Transformer:
    cfg = config_from_hf({**TINY, **{**CONFIGS, **UNBIASED}[name]})
    cfg = with_layout(cfg, sliding_window=5, layer_types="SF")
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=DEVICE, dtype=dtype)
    model.rotary.reset_buffers(DEVICE)  # float32 tables, as the loader keeps them
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.2 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


SEQS = [list(range(3, 20)), [7, 1, 4], [9]]


@functools.cache
def unfolded_logits(name: str, dtype: torch.dtype, backend: str, gemm: str = "auto") -> list[torch.Tensor]:
    """`reference_logits` over SEQS of `random_model(name, dtype)` (deterministic) through `backend`'s
    kernels, computed once a module: both tests below compare against it (read only), and through the
    interpreted Triton kernels it costs a few seconds."""
    model = random_model(name, dtype)
    model.kernel_backend, model.gemm_backend = backend, gemm
    return reference_logits(model, SEQS)


@pytest.mark.parametrize("gemm", ["cublas", "skinny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_forward_matches_torch(name: str, dtype: torch.dtype, gemm: str) -> None:
    # skinny: the layers' GEMMs through skinny_gemm where a layer has no bias; Llama's and Qwen2's
    # biased projections stay on torch's GEMM.
    expected = unfolded_logits(name, dtype, "torch")
    got = unfolded_logits(name, dtype, "triton", gemm)
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


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*CONFIGS, *UNBIASED])
def test_folded_norms_give_the_same_logits(name: str, dtype: torch.dtype, backend: str) -> None:
    """The norms' weights inside the GEMMs after them (no norm kernel; the adds inside the o and down
    GEMMs): the unfolded model's logits in float32; in bf16, which rounds elsewhere, as close to the
    float32 model as the unfolded one is. Q/K/V with a bias keep their input norm. Folding twice
    changes nothing more."""
    model = random_model(name, dtype)
    model.kernel_backend = backend
    # The unfolded model through the default GEMMs ("auto"): at SEQS' rows, torch's for every layer
    # (asserted), i.e. the "cublas" run test_triton_forward_matches_torch compares too.
    kernels, rows = kernels_for(DEVICE, backend), sum(map(len, SEQS))
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert backend == "torch" or all(kernels.takes_cublas(rows, m) for m in linears)
    unfolded = unfolded_logits(name, dtype, backend, "cublas" if backend == "triton" else "auto")
    model.fold_norms()
    folded_weights = [p.clone() for p in model.parameters()]
    model.fold_norms()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), folded_weights, strict=True))
    has_bias = model.layers[0].self_attn.qkv_proj.bias is not None
    assert all(layer.mlp_norm_folded and layer.attn_norm_folded != has_bias for layer in model.layers)
    folded = reference_logits(model, SEQS)
    if dtype == torch.float32:
        assert max_rel_diff(folded, unfolded) <= 1e-4
    else:
        truth = unfolded_logits(name, torch.float32, "auto")
        assert max_rel_diff(folded, truth) <= 1.5 * max_rel_diff(unfolded, truth)


def test_a_folded_model_takes_no_weights() -> None:
    model = random_model("qwen2-qkv-bias", torch.float32)
    weights = [(f"model.{n}", p.detach().clone()) for n, p in model.named_parameters()]
    model.fold_norms()
    with pytest.raises(ValueError, match="norms are folded"):
        model.load_weights(weights)
