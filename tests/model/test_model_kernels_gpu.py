"""The fused kernels at the bench model's full size on a GPU: against the torch reference on the same
device, replayed from a CUDA graph, and enqueued without a host sync."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import assert_matches

from invariants.testing import no_host_sync
from shared.kernels import TorchKernels, TritonKernels
from shared.model import Transformer, config_from_hf
from shared.model.reference import DenseAttention, pack

pytestmark = pytest.mark.gpu

H, HQ, HKV, D, INTER, POSITIONS = 2048, 16, 8, 128, 6144, 8192
BF16 = torch.bfloat16


class Inputs:
    """One layer's elementwise inputs for T tokens, bf16, laid out as the model has them."""

    def __init__(self, tokens: int) -> None:
        torch.manual_seed(tokens)
        dev = "cuda"
        self.x = torch.randn(tokens, H, device=dev, dtype=BF16)
        self.residual = 4 * torch.randn(tokens, H, device=dev, dtype=BF16)
        self.w = (1 + 0.2 * torch.randn(H, device=dev)).to(BF16)
        qkv = 2 * torch.randn(tokens, (HQ + 2 * HKV) * D, device=dev, dtype=BF16)
        q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        self.q, self.k = q.view(tokens, HQ, D), k.view(tokens, HKV, D)
        self.positions = torch.randint(0, POSITIONS, (tokens,), device=dev)
        self.positions[-1] = -1  # a CUDA-graph padding row
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
        freqs = torch.arange(POSITIONS, device=dev).float()[:, None] * inv[None, :]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.qw = (1 + 0.2 * torch.randn(D, device=dev)).to(BF16)
        self.kw = (1 + 0.2 * torch.randn(D, device=dev)).to(BF16)
        self.gate_up = 3 * torch.randn(tokens, 2 * INTER, device=dev, dtype=BF16)

    def run(self, kernels: TorchKernels | TritonKernels) -> list[torch.Tensor]:
        return [
            kernels.rms_norm(self.x, self.w, 1e-5),
            *kernels.rope(self.q, self.k, self.positions, self.cos_sin),
            *kernels.rope(self.q, self.k, self.positions, self.cos_sin, self.qw, self.kw, 1e-6),
            kernels.silu_mul(self.gate_up),
        ]


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_full_size_matches_reference(tokens: int) -> None:
    inputs = Inputs(tokens)
    for got, expected in zip(inputs.run(TritonKernels()), inputs.run(TorchKernels()), strict=True):
        assert_matches(got, expected)


def test_kernels_replay_from_a_cuda_graph_without_host_sync() -> None:
    inputs, triton_kernels = Inputs(64), TritonKernels()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs.run(triton_kernels)  # compile outside the capture and the guard
    torch.cuda.current_stream().wait_stream(side)
    with no_host_sync():
        inputs.run(triton_kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = inputs.run(triton_kernels)
    for source in (inputs.x, inputs.residual, inputs.gate_up):
        source.copy_(torch.randn_like(source))
    inputs.positions.copy_(torch.randint(0, POSITIONS, inputs.positions.shape, device="cuda"))
    graph.replay()
    for got, expected in zip(static, inputs.run(TorchKernels()), strict=True):
        assert_matches(got, expected)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_bf16_model_logits_match_the_torch_path(arch: str) -> None:
    """Two layers of the bench model's shape: the fused forward against the unfused one."""
    cfg = config_from_hf({
        "architectures": [arch], "vocab_size": 32000, "hidden_size": H, "num_hidden_layers": 2,
        "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "intermediate_size": INTER,
        "max_position_embeddings": POSITIONS, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
    })  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(device="cuda", dtype=BF16)
    model.rotary.reset_buffers("cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    model.eval().requires_grad_(False)
    ids, positions, cu = pack([list(range(5, 900)), [3] * 7, [11]], "cuda")
    attn = DenseAttention(cfg, cu)
    with torch.inference_mode():
        model.kernel_backend = "torch"
        expected = model.compute_logits(model(ids, positions, attn))
        model.kernel_backend = "auto"
        got = model.compute_logits(model(ids, positions, attn))
    err, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert err <= 3e-2 * scale, f"max |diff| {err:.3g} vs max |logit| {scale:.3g}"
