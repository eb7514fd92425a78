"""On a GPU the forward never waits for the device, and a whole step can be captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from model_testutil import TINY, WINDOW

from invariants.testing import no_host_sync
from shared.model import DenseAttention, Transformer, config_from_hf, pack, with_layout

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def step():
    """A hybrid tiny model with random weights and one packed batch of three sequences, on the GPU."""
    cfg = config_from_hf({"architectures": ["Qwen3ForCausalLM"], **TINY})
    cfg = with_layout(cfg, sliding_window=WINDOW, layer_types="SF")
    torch.manual_seed(0)
    model = Transformer(cfg).cuda().eval().requires_grad_(False)
    seqs = [list(range(3, 3 + n)) for n in (3 * WINDOW, WINDOW + 1, 2)]
    ids, positions, cu = pack(seqs, "cuda")
    last = cu[1:] - 1  # each sequence's last token: an index tensor, not a host-side list
    attn = DenseAttention(cfg, cu)  # masks are built here, outside the step
    return model, ids, positions, attn, last


def test_forward_and_logits_make_no_host_sync(step) -> None:
    model, ids, positions, attn, last = step
    with torch.inference_mode():
        model.compute_logits(model(ids, positions, attn)[last])  # warm up outside the guard
        with no_host_sync():
            logits = model.compute_logits(model(ids, positions, attn)[last])
    assert logits.shape == (3, TINY["vocab_size"]) and logits.dtype == torch.float32


def test_step_replays_from_a_cuda_graph(step) -> None:
    model, ids, positions, attn, last = step
    static_ids = ids.clone()
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.compute_logits(model(static_ids, positions, attn)[last])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model.compute_logits(model(static_ids, positions, attn)[last])
        for shift in (1, 7):
            static_ids.copy_((ids + shift) % TINY["vocab_size"])
            graph.replay()
            eager = model.compute_logits(model(static_ids.clone(), positions, attn)[last])
            torch.testing.assert_close(static_logits, eager, rtol=1e-4, atol=1e-4)
