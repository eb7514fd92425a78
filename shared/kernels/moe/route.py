"""The router of a mixture-of-experts layer: router logits -> (routing weights, expert ids) per token.

Plain torch on the device (a [T, E] problem is tiny): no host read, no shape that depends on a value,
so it runs inside a CUDA graph. Selection is a stable descending sort over the E scores rather than
`torch.topk`, whose order among equal scores is unspecified: equal scores go to the lower expert id,
the same ids on every device and run.

The checkpoints it serves:

- softmax, renormalize=True: Qwen3-MoE (norm_topk_prob=True), Mixtral. gpt-oss takes top-k of the
  logits and a softmax over those k: the same weights (softmax is monotone, and p_i / sum of the
  chosen p = exp(l_i) / sum of the chosen exp(l)), up to float32 rounding.
- softmax, renormalize=False: Qwen2-MoE and Qwen3-MoE with norm_topk_prob=False.
- sigmoid with a bias and a scaling: DeepSeek-V3 / Kimi K2 (`e_score_correction_bias`,
  `routed_scaling_factor`, norm_topk_prob=True) without group-limited selection (n_group = 1).
"""

from __future__ import annotations

import torch

from shared.kernels._checks import FLOAT_DTYPES, check_dims, check_dtype, fail

__all__ = ["SCORINGS", "route"]

SCORINGS = ("softmax", "sigmoid")


def route(
    logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
    bias: torch.Tensor | None = None, scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The top_k experts of each token and their weights, from logits [T, E] (any float dtype).

    Returns (weights [T, top_k] float32, ids [T, top_k] int32), each row's ids in descending order of
    weight (equal weights: the lower id first).

    scoring "softmax": scores = softmax(logits) over all E in float32; the top_k scores are chosen,
    and are the weights. scoring "sigmoid": scores = sigmoid(logits) in float32. With `bias` ([E]
    float32) experts are chosen by scores + bias, but weighted by their unbiased scores. Then, with
    `renormalize`, the chosen weights are divided by their sum (they add up to 1), and last multiplied
    by `scaling`.
    """
    op = "route"
    check_dims(op, "logits", logits, 2, "[T, E]")
    check_dtype(op, "logits", logits, FLOAT_DTYPES)
    experts = logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        fail(op, f"top_k must be a Python int in [1, E = {experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        fail(op, f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(scaling, float | int) or isinstance(scaling, bool):
        fail(op, f"scaling must be a Python float, got {scaling!r}")
    if bias is not None:
        check_dims(op, "bias", bias, 1, "[E]")
        check_dtype(op, "bias", bias, (torch.float32,))
        if bias.shape[0] != experts:
            fail(op, f"bias must have E = {experts} entries, got {bias.shape[0]}")
        if bias.device != logits.device:
            fail(op, f"bias must be on logits' device {logits.device}, got {bias.device}")
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choose = scores if bias is None else scores + bias
    ids = torch.sort(choose, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if bias is not None:
        # Chosen by the biased scores, ordered by the weights: ids ascending, then a stable sort by
        # weight, so that equal weights keep the lower id first.
        ids = ids.sort(dim=-1).values
        by_weight = scores.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices
        ids = ids.gather(1, by_weight)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * float(scaling)
    return weights, ids.to(torch.int32)
