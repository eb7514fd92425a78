"""FP8 projections through the runner: in a decode step the attention kernels write the o projection's
input quantized (one scale a token and kv head, `ModelKernels.o_quant_group`), so no quantizer runs
for it; a prefill chunk's attention output is quantized after it. Either way the logits are what the
torch FP8 kernels compute, which quantize attention's output in the same groups after it. On CPU the
Triton kernels run in the interpreter."""

from __future__ import annotations

import pytest
import torch

from shared.engine.batch import Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.kernels.attention import ops_for
from shared.kernels.fp8 import Fp8Act, fp8_kernels_for
from shared.model.quant import quantize_model
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model
from tests.engine.test_engine_parity import PAGE, Seq, run

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def runner_for(backend: str, device: str) -> tuple[ModelRunner, list[Seq]]:
    # CPU: float32, as the interpreter's bf16 casts truncate where torch's round and FP8's rounding
    # edges magnify that; CUDA: bf16, as served
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg = tiny_config("SSFS", heads=6, kv_heads=2)  # three query heads of 16 a kv head
    model = quantize_model(tiny_model(cfg).to(device=device, dtype=dtype), "fp8")
    model.kernel_backend = backend
    cache = KVCache(cfg, KVConfig(page_size=PAGE, num_pages=32, max_requests=2, dtype=dtype, device=device))
    runner = ModelRunner(model, cache, ops_for(cache.device, backend=backend))
    seqs = [Seq(cache, 0, random_tokens(W + 6, seed=4)), Seq(cache, 1, random_tokens(W + 6, seed=5))]
    return runner, seqs


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: up to the order of float sums; bf16 on a GPU: within 3% of the largest logit (a value
    rounded the other way before it is quantized moves an e4m3 code by a step)."""
    if got.dtype == torch.float32 and got.device.type == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.03 * want.float().abs().max().item(), err


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_quantizes_the_o_projections_input(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = fp8_kernels_for(device, "triton")
    quantized: list[int] = []  # the groups of every quantizer launch
    plain = kernels.quantize

    def counted(x: torch.Tensor, group: int) -> Fp8Act:
        quantized.append(group)
        return plain(x, group)

    monkeypatch.setattr(kernels, "quantize", counted)
    (ours, seqs), (torch_runner, torch_seqs) = runner_for("triton", device), runner_for("torch", device)
    got = run(ours, [seqs[0].chunk(W + 2), seqs[1].chunk(3)], Mode.EXTEND)
    assert quantized == [3 * 16] * 4, quantized  # every layer's o input: attention's groups, after it
    close(got, run(torch_runner, [torch_seqs[0].chunk(W + 2), torch_seqs[1].chunk(3)], Mode.EXTEND))
    for _ in range(3):
        quantized.clear()
        got = run(ours, [s.chunk(1) for s in seqs], Mode.DECODE)
        assert quantized == []  # attention wrote the o projection's input quantized
        close(got, run(torch_runner, [s.chunk(1) for s in torch_seqs], Mode.DECODE))
