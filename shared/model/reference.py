"""Dense ground-truth attention for whole sequences: slow, simple, and obviously right.

Parity tests compare the model against Hugging Face through it, and engine tests compare paged
attention against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from shared.model.config import ModelConfig
from shared.model.layers import RopeArgs
from shared.model.transformer import Transformer


def build_masks(
    cu_seqlens: torch.Tensor, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean [T, T] masks (True = may attend): causal within each sequence, and that AND the window."""
    total = int(cu_seqlens[-1])
    idx = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:], idx, right=True)  # which sequence each token belongs to
    q, k = idx[:, None], idx[None, :]
    causal = (seq[:, None] == seq[None, :]) & (k <= q)
    if sliding_window is None:
        return causal, None
    # Hugging Face: key kv is visible from q when kv > q - W, i.e. q-W+1 .. q (W keys, q included).
    return causal, causal & (k > q - sliding_window)


class DenseAttention:
    """An `AttentionFn` for a batch of complete sequences laid end to end (cu_seqlens: [B+1], from 0)."""

    def __init__(self, cfg: ModelConfig, cu_seqlens: torch.Tensor) -> None:
        self.cfg = cfg
        self.full_mask, self.sliding_mask = build_masks(cu_seqlens, cfg.sliding_window)

    def store_target(self, layer: int) -> None:
        return None  # no cache: k and v are used as they come

    def takes_rope(self, layer: int) -> bool:
        return False  # the model's RoPE kernel rotates q and k first

    def fp8_out_scale(self, layer: int) -> None:
        return None  # no FP8 cache: the output is q's dtype

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeArgs | None = None,
        sinks: torch.Tensor | None = None, fp8_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if rope is not None or fp8_out:
            raise ValueError("DenseAttention takes q and k after RoPE and gives q's dtype")
        mask = self.sliding_mask if self.cfg.is_sliding(layer) else self.full_mask
        group = q.shape[1] // k.shape[1]
        q, k, v = q.transpose(0, 1), k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.cfg.attn_scale)
            return out.transpose(0, 1)
        # gpt-oss, as Hugging Face computes it: each head's sink logit joins the softmax, then its
        # probability is dropped (it has no value).
        scores = (q @ k.transpose(1, 2)) * self.cfg.attn_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return (probs.to(v.dtype) @ v).transpose(0, 1)


def pack(
    seqs: Sequence[Sequence[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten sequences into (input_ids [T], positions [T], cu_seqlens [B+1])."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("need at least one sequence, and no empty ones")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = lens.cumsum(0)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens.tolist()])
    return ids.to(device), positions.to(device), cu.to(device)


@torch.inference_mode()
@torch.no_grad()
def reference_logits(model: Transformer, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Float32 logits [len_i, vocab] at every position of every sequence, all run as one batch (no
    autograd graph: a reference is read, never differentiated)."""
    device = model.embed_tokens.weight.device
    ids, positions, cu = pack(seqs, device)
    hidden = model(ids, positions, DenseAttention(model.cfg, cu))
    logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in seqs]))
