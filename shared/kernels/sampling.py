"""Sampling noise made on the device: a counter hash for seeded rows, the engine's generator for the rest.

Seeded rows need noise that is a pure function of (seed, position, vocab index), so a request draws the
same tokens whatever batch it shares and whatever its row; a stateful generator cannot give that (its
stream depends on what else was drawn). The hash is splitmix64: a row key from (seed, position), then
element v is `fmix64(key + (v + 1) * golden)`, the splitmix64 stream at counter v. It is written in int64
torch ops, which wrap on overflow on CPU and CUDA alike; int64 right shifts are arithmetic, so logical
shifts are emulated with a mask. The same inputs give the same bits on every device.

Both sources give uniforms on the grid (m + 0.5) / 2**23, strictly inside (0, 1) and exact in float32,
so the Gumbel noise -log(-log u) is always finite: a u of exactly 0 or 1 would make a token lose or win
whatever its probability. Cost: the hash is ~15 elementwise passes over [B, V] int64 (a fused Triton
kernel would make it one); rows without a seed take one `torch.rand` pass instead.
"""

from __future__ import annotations

import torch

__all__ = ["gumbel_noise", "hashed_uniform", "row_keys", "to_int64_seed"]

_BITS = 23  # 23, not 24: (2**24 - 0.5) rounds to 2**24 in float32, which would give u == 1
_SCALE = 2.0**-_BITS
_U_MIN = 0.5 * _SCALE  # the grid's ends, for clamping torch.rand onto (0, 1)
_U_MAX = 1.0 - 0.5 * _SCALE


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 torch stores (constants above 2**63 do not fit otherwise)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_SALT = _signed(0xD1B54A32D192ED03)  # keeps (seed, position) = (0, 0) away from the all-zero key


def to_int64_seed(seed: int) -> int:
    """Any Python int seed, reduced mod 2**64 and stored as int64 (what `SamplingBatch` holds)."""
    return _signed(seed)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)  # logical shift: clear the sign bits `>>` copied in


def _fmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; updates `z` in place (callers pass a fresh tensor)."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shr(z, 31))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 stream keys, one per (seed, position); both [B] int64 on the same device."""
    return _fmix(_fmix(seeds ^ _SALT) ^ positions)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms on (0, 1), a pure function of (seed, position, vocab index)."""
    counters = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64).mul_(_GOLDEN)
    bits = _fmix(row_keys(seeds, positions)[:, None] + counters)
    return _shr(bits, 64 - _BITS).to(torch.float32).add_(0.5).mul_(_SCALE)


def gumbel_noise(
    shape: tuple[int, int],
    *,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    seeded: torch.Tensor,
    any_seeded: bool,
    all_seeded: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[B, V] float32 Gumbel(0, 1) noise: hashed on `seeded` rows, from `generator` on the others.

    `any_seeded` / `all_seeded` are host-side facts about `seeded` (known when the batch was built), so
    only the sources a batch needs are computed and nothing is read back from the device.
    """
    vocab = shape[1]
    u: torch.Tensor | None = None
    if any_seeded:
        u = hashed_uniform(seeds, positions, vocab)
    if not all_seeded:
        drawn = torch.rand(shape, generator=generator, device=seeds.device).clamp_(_U_MIN, _U_MAX)
        u = drawn if u is None else torch.where(seeded[:, None], u, drawn)
    assert u is not None, "all_seeded without any_seeded: an empty batch"
    return u.log_().neg_().log_().neg_()
