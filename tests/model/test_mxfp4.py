"""gpt-oss checkpoints with MXFP4 experts (`*_blocks`, `*_scales`): dequantized at load to the values
transformers' own dequantization gives, and the model then computes transformers' logits."""

from __future__ import annotations

import torch
from model_testutil import save_hf_model
from safetensors.torch import load_file, save_file

from shared.model import load_model, reference_logits
from shared.model.mxfp4 import dequantize_mxfp4


def _random_mxfp4(*rows: int, groups: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (*rows, groups, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(123, 128, (*rows, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantization_is_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(3, 8, groups=4, gen=torch.Generator().manual_seed(0))
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 8, 128)
    # transformers' answer is [E, in, out], its experts' layout; the checkpoint's rows are outputs
    assert torch.equal(got.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # 0x21: the low nibble (0.5) first, then the high one (1.0), times 2^(128 - 127)
    one = dequantize_mxfp4(
        torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8)
    )
    assert one[:2].tolist() == [1.0, 2.0]


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_computes_transformers_logits(tmp_path) -> None:
    hidden, inter, experts = 64, 64, 4  # MXFP4 groups of 32 along each input
    hf = save_hf_model(
        tmp_path, "GptOssConfig", num_local_experts=experts, num_experts_per_tok=2, intermediate_size=inter,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            for name, (outs, ins) in {
                "gate_up_proj": (2 * inter, hidden),
                "down_proj": (hidden, inter),
            }.items():
                blocks, scales = _random_mxfp4(experts, outs, groups=ins // 32, gen=gen)
                scales = scales - 4  # values of about 0.1, a checkpoint's own range
                weight = dequantize_mxfp4(blocks, scales)
                getattr(layer.mlp.experts, name).copy_(weight.transpose(1, 2))  # HF's [E, in, out]
                del tensors[p + name]
                tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = blocks, scales
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = [3, 17, 42, 5, 9, 60, 11, 2, 33]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = reference_logits(load_model(tmp_path).model, [ids])[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
