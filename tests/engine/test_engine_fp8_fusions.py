"""An FP8 model's decode steps with the quantizers fused into the kernels before the GEMMs
(`fp8_kernels_for(..., fused_attn_quant=True, fused_glu_quant=True)`), through the engine and the
Triton kernels (interpreted): attention hands the o projection its output quantized per (token, head),
the gate/up GEMM hands the down projection its activation quantized per column block, and the greedy
tokens follow the unquantized model at least as closely as per-token activations do."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from engine_testutil import random_tokens, reference, tiny_config, tiny_model

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.kernels.attention import ops_for
from shared.kernels.fp8 import Fp8Act, fp8_kernels_for
from shared.kernels.fp8.ops import Fp8Kernels
from shared.model.quant import quantize_model

CFG = tiny_config("SF", vocab=97)
PROMPTS = [random_tokens(5 + i, seed=i) for i in range(3)]


def generate(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, **mode: bool) -> tuple[list, list]:
    """Greedy tokens of PROMPTS through a Triton-kernel engine with `mode`'s FP8 kernels, and the
    activation groups each FP8 `linear_add` (the o and down projections) was handed (0: 16-bit rows)."""
    model = copy.deepcopy(model)
    model.kernel_factory = functools.partial(fp8_kernels_for, **mode)
    model.kernel_backend = "triton"
    kv = KVConfig(page_size=16, num_pages=64, max_requests=4, device="cpu", dtype=torch.bfloat16)
    engine = Engine(model, kv, EngineConfig(cuda_graph_sizes=()))
    engine.runner.ops = ops_for("cpu", backend="triton")
    handed: list[int] = []
    linear_add = Fp8Kernels.linear_add

    def spy(self: Fp8Kernels, x: object, layer: torch.nn.Module, residual: torch.Tensor) -> torch.Tensor:
        handed.append(x.group if isinstance(x, Fp8Act) else 0)
        return linear_add(self, x, layer, residual)  # type: ignore[arg-type]

    monkeypatch.setattr(Fp8Kernels, "linear_add", spy)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    monkeypatch.undo()
    return [o.output for o in outs], handed


def agreement(truth: torch.nn.Module, outputs: list[list[int]]) -> int:
    """How many generated tokens are the unquantized model's own greedy choice at that position."""
    hits = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        logits = reference(truth, prompt + out[:-1])
        hits += sum(int(logits[len(prompt) - 1 + i].argmax()) == tok for i, tok in enumerate(out))
    return hits


def test_fused_quantizers_hand_the_gemms_their_own_groups_and_follow_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    truth = tiny_model(CFG)
    fp8 = quantize_model(copy.deepcopy(truth).to(torch.bfloat16), "fp8")
    plain, plain_groups = generate(fp8, monkeypatch)
    fused, fused_groups = generate(fp8, monkeypatch, fused_attn_quant=True, fused_glu_quant=True)
    head, inter = CFG.head_dim, CFG.intermediate_size
    # By default the o projection gets attention's 16-bit rows (0: its caller quantizes them per token)
    # and the down projection the SwiGLU quantizer's per-token groups (`inter` wide); with the fusions
    # decode steps hand over per-head and per-32-column groups (pointer loads: `gate_up_glu.glu_group`).
    assert set(plain_groups) == {0, inter}
    assert {head, 32} <= set(fused_groups)
    assert agreement(truth, fused) >= agreement(truth, plain)
