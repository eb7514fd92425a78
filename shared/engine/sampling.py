"""The engine's sampler: per-request parameters, their per-batch device tensors, and a sync-free `sample`.

`sample` never reads the device from the host (no `.item()`, no `torch.multinomial`, no boolean-mask
indexing, no data-dependent shapes), so the scheduler can prepare step N+1 while step N runs. Every
decision that needs data is made on the host once per batch composition (`SamplingBatch.build`): which
rows are greedy, whether any row filters, whether any row is seeded.

Drawing a token uses the exponential race (gpt-fast, SGLang): argmax_i p_i / E_i with E_i ~ Exp(1) picks
i with probability p_i. It runs in log space, argmax_i (x_i + g_i) with Gumbel noise g = -log E, which
needs no normalisation and cannot overflow. Filters are applied in vLLM's (v0) order: temperature, then
top-k, then top-p on the top-k-renormalised distribution, then min-p (its ratio to the top token is the
same before and after renormalising). vLLM v1 applies min-p before top-k/top-p; SGLang's top-p does not
renormalise after top-k.

Non-finite logits do not crash: NaN counts as -inf and +inf as the largest float (tokens at +inf share
the row's mass); a row with nothing finite gives some token id in range. Greedy rows take a plain argmax
of the raw logits, the same in the all-greedy fast path and in a mixed batch (argmax picks a NaN if there
is one: the invariants library guards finiteness upstream, and the fast path launches nothing more).

What costs: seeded rows pay an int64 hash over [B, V], and top-k/top-p a [B, V] sort (as vLLM's
torch path); all-greedy batches pay one argmax. docs/performance.md has the figures.
On CUDA every argmax here is `argmax_rows` (shared/kernels/argmax.py: the same indices, the
vocabulary split over the SMs); on CPU it is torch.argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.host_copy import to_device
from shared.kernels.sampling import gumbel_noise, to_int64_seed

__all__ = ["GREEDY_EPS", "TOP_K_OFF", "SamplingBatch", "SamplingParams", "sample"]

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below this is greedy (logits / T would overflow)
TOP_K_OFF = 2**31 - 1  # how a row without top-k is stored on the device: every rank is below it


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, as a gRPC client sends them (names and defaults follow vLLM).

    `temperature` 0 is greedy; `top_k` 0 or -1 is off; `top_p` 1 is off; `min_p` 0 is off. A `seed` makes
    the request's tokens a function of (seed, position, logits) alone. `stop` strings and
    `stop_token_ids` end the request (the detokenizer and scheduler act on them; `sample` does not).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists from a client become tuples, so params stay hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be an int >= 1, or 0 or -1 for off, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        if not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature ~0, or top-k of 1 (the same token, without the filter kernels)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1


def _row_values(p: SamplingParams) -> tuple[list[float], list[int]]:
    """One row's (temperature, top_p, min_p, log_min_p) and (seed, top_k, greedy, seeded) as stored.

    Greedy rows get neutral values, so they neither pay for nor switch on the filter kernels.
    """
    if p.greedy:
        return [1.0, 1.0, 0.0, -math.inf], [0, TOP_K_OFF, 1, 1]
    log_min_p = math.log(p.min_p) if p.min_p > 0 else -math.inf
    seed = 0 if p.seed is None else to_int64_seed(p.seed)
    top_k = p.top_k if p.top_k > 0 else TOP_K_OFF
    floats = [float(p.temperature), float(p.top_p), float(p.min_p), log_min_p]
    return floats, [seed, top_k, 0, int(p.seed is not None)]


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """One batch composition's sampling parameters as [B] device tensors, plus host-side facts about them.

    Built once when the set of running requests changes, not per step. Greedy rows hold neutral values
    (temperature 1, no filters) so they never force the filter kernels on the batch. The host-side bools
    pick which kernels `sample` launches; reading them costs no sync.
    """

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int32; TOP_K_OFF when off
    top_p: torch.Tensor  # [B] float32; 1.0 when off
    min_p: torch.Tensor  # [B] float32; 0.0 when off
    log_min_p: torch.Tensor  # [B] float32; log(min_p), -inf when off (min-p compares in log space)
    seed: torch.Tensor  # [B] int64; mod 2**64 as int64, 0 on unseeded rows
    greedy: torch.Tensor  # [B] bool
    seeded: torch.Tensor  # [B] bool; True on greedy rows too (their noise is unused: this spares a draw)
    size: int
    all_greedy: bool
    any_greedy: bool
    any_seeded: bool  # some sampled row has a seed: the hash runs
    all_seeded: bool  # every sampled row has a seed: the generator is not drawn from
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @property
    def needs_sort(self) -> bool:
        return self.use_top_k or self.use_top_p

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        """Pack `params` (one per row) on the host and copy them to `device` without blocking."""
        device = torch.device(device)
        rows = [_row_values(p) for p in params]
        sampled = [p for p in params if not p.greedy]
        # Column-major on the host, so each [B] field is a contiguous row of one [4, B] copy.
        host_f = torch.tensor([f for f, _ in rows], dtype=torch.float32).reshape(-1, 4).T.contiguous()
        host_i = torch.tensor([i for _, i in rows], dtype=torch.int64).reshape(-1, 4).T.contiguous()
        dev_f, dev_i = to_device(host_f, device), to_device(host_i, device)
        return cls(
            temperature=dev_f[0],
            top_k=dev_i[1].to(torch.int32),
            top_p=dev_f[1],
            min_p=dev_f[2],
            log_min_p=dev_f[3],
            seed=dev_i[0],
            greedy=dev_i[2].bool(),
            seeded=dev_i[3].bool(),
            size=len(params),
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            any_seeded=any(p.seed is not None for p in sampled),
            all_seeded=all(p.seed is not None for p in sampled),
            use_top_k=any(p.top_k > 1 for p in sampled),
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
        )


def _keep_sorted(xs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] bool: which tokens of each row, in descending-logit order, survive top-k, top-p, min-p."""
    rel = xs - xs[:, :1]  # log of each token's probability relative to the row's top token
    rank = torch.arange(xs.shape[1], device=xs.device)
    keep = rank[None, :] < batch.top_k[:, None]
    if batch.use_top_p:
        e = rel.exp() * keep  # unnormalised, after top-k's cut: top-p sees the renormalised mass
        c = e.cumsum(dim=-1)
        # A token stays if the mass strictly before it is below top_p: the smallest set reaching top_p.
        # top_p == 1 keeps everything, also the tail where float32 cumsum has stopped growing.
        keep &= ((c - e) < batch.top_p[:, None] * c[:, -1:]) | (batch.top_p[:, None] >= 1.0)
    if batch.use_min_p:
        keep &= rel >= batch.log_min_p[:, None]
    return keep


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`: on CUDA the vocabulary-split kernel (same indices; torch's reduction leaves
    most SMs idle at decode batch sizes), on CPU torch's own. Imported on first use: the model's kernel
    package is heavy, and clients import this module for `SamplingParams`."""
    if not x.is_cuda:
        return x.argmax(dim=-1)
    from shared.kernels.argmax import argmax_rows

    return argmax_rows(x)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row: [B, V] logits -> [B] int64 token ids, on the logits' device, no host sync.

    `positions` [B] int64 is the position of the token whose logits each row holds (the last token fed);
    with the seed it keys a seeded row's noise, so prefill and decode must pass the same convention.
    Unseeded rows draw from `generator` (the engine's, on the logits' device; None: torch's default).
    """
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(f"logits must be [B={batch.size}, V], got {tuple(logits.shape)}")
    if positions.shape != (batch.size,) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be [B={batch.size}] int64, got {tuple(positions.shape)} {positions.dtype}"
        )
    if logits.device != batch.device or positions.device != batch.device:
        raise ValueError(
            f"logits on {logits.device}, positions on {positions.device}, batch on {batch.device}"
        )
    if batch.size == 0 or batch.all_greedy:
        return _argmax(logits)

    x = logits.float() / batch.temperature[:, None]
    big = torch.finfo(torch.float32).max
    x = torch.nan_to_num_(x, nan=-math.inf, posinf=big, neginf=-math.inf)
    g = gumbel_noise(
        (batch.size, logits.shape[1]),
        seeds=batch.seed,
        positions=positions,
        seeded=batch.seeded,
        any_seeded=batch.any_seeded,
        all_seeded=batch.all_seeded,
        generator=generator,
    )
    if batch.needs_sort:
        # Stable, so tied logits keep vocab order: a row's draw does not depend on the sort's tie-breaking.
        xs, order = x.sort(dim=-1, descending=True, stable=True)
        scores = (xs + g.gather(1, order)).masked_fill_(~_keep_sorted(xs, batch), -math.inf)
        tokens = order.gather(1, _argmax(scores)[:, None]).squeeze(1)
    else:
        scores = x + g
        if batch.use_min_p:
            rel = x - x.amax(dim=-1, keepdim=True)
            scores.masked_fill_(rel < batch.log_min_p[:, None], -math.inf)
        tokens = _argmax(scores)
    if batch.any_greedy:
        tokens = torch.where(batch.greedy, _argmax(logits), tokens)
    return tokens
