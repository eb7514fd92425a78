"""Host-side launch choices shared by the Triton attention wrappers (tile sizes, split-K count)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from shared.kernels.kv_quant import KVQuant

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_device(op: str, device: torch.device) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{op}: the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"triton is imported), got {device}"
    )


def f32_dot(dtype: torch.dtype) -> bool:
    """Whether attend_block must take its exact-fp32 path (see its docstring)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Tiles:
    group_p2: int  # query heads per kv head, rounded up to a power of two
    block_q: int  # queries per tile
    block_m: int  # rows per tile = block_q * group_p2 (>= 16: the smallest tensor-core tile)
    block_n: int  # keys per step
    block_d: int  # head dim rounded up to a power of two
    num_warps: int
    num_stages: int
    # A cap on each thread's registers (Triton's `maxnreg`), so that more programs share an SM and
    # hide each other's latency, at the price of spills; None leaves the count to the compiler.
    # choose_tiles sets none; bench/attention_tune.py sweeps it.
    max_registers: int | None = None

    def launch_options(self) -> dict[str, int]:
        """The compile options a launch passes with these tiles."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def q_blocks(self, max_q: int) -> int:
        return math.ceil(max_q / self.block_q)


def choose_tiles(
    group: int, head_dim: int, max_q: int, op: str = "", fills_gpu: bool = False, *, kv_fp8: bool = False
) -> Tiles:
    """The tiles of a call: `op` names the kernel ("ring_attention" or "paged_attention"), `fills_gpu`
    whether its unsplit programs fill the GPU on their own (`fills_gpu`); both matter to decode only."""
    group_p2 = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    if interpreting():  # small tiles: the interpreter's cost grows with the tile, not the launch
        target_m, block_n, warps, stages = 16, 16, 4, 1
    elif max_q == 1:
        # bench/attention_tune.py at the engine's decode shape, then with RoPE inside at batch 64, 16
        # and 1: the ring's 16-key tiles on 2 warps are faster at every batch; paged attention's 64
        # keys on 2 stages only in one full wave of programs, and slower below it. An FP8 cache's
        # tiles hold half the bytes: twice the ring's keys, and paged attention on 2 warps
        # (`--heads 32,8 --kv-fp8`: 0.85x and 0.67x the bf16 tiles' time on FP8 pages and rings).
        target_m = 16
        if op == "ring_attention":
            block_n, warps, stages = (32, 2, 3) if kv_fp8 else (16, 2, 3)
        elif fills_gpu:
            block_n, warps, stages = (64, 2, 2) if kv_fp8 else (64, 4, 2)
        else:
            block_n, warps, stages = 32, 4, 3
    else:
        target_m = 64 if block_d <= 128 else 32
        block_n, warps, stages = (64, 4, 2) if block_d <= 128 else (32, 8, 2)
    block_q = max(1, min(next_pow2(max_q), target_m // group_p2))
    block_m = max(16, block_q * group_p2)
    return Tiles(group_p2, block_q, block_m, block_n, block_d, warps, stages)


def resolve_tiles(
    op: str,
    tiles: Tiles | None,
    group: int,
    head_dim: int,
    max_q: int,
    fills_gpu: bool = False,
    *,
    kv_fp8: bool = False,
) -> Tiles:
    """`choose_tiles` for the shape, or the caller's `tiles` checked (bench/attention_tune.py forces them).

    A forced Tiles may differ only in block_n, num_warps, num_stages and max_registers: the row layout
    (group_p2, block_q, block_m, block_d) is what the kernels' query rows and key ranges assume for the
    shape.
    """
    chosen = choose_tiles(group, head_dim, max_q, op, fills_gpu, kv_fp8=kv_fp8)
    if tiles is None:
        return chosen
    if not isinstance(tiles, Tiles):
        raise ValueError(f"{op}: tiles must be a Tiles, got {type(tiles).__name__}")
    for field in ("group_p2", "block_q", "block_m", "block_d"):
        want, got = getattr(chosen, field), getattr(tiles, field)
        if got != want or not _is_int(got):
            raise ValueError(
                f"{op}: tiles.{field} must be {want} (as choose_tiles gives for group={group}, "
                f"head_dim={head_dim}, max_q={max_q}), got {got!r}"
            )
    n = tiles.block_n
    if not _is_int(n) or n < 16 or n & (n - 1):  # 16: the smallest tensor-core tile of tl.dot
        raise ValueError(f"{op}: tiles.block_n must be a power of two >= 16, got {n!r}")
    if not _is_int(tiles.num_warps) or tiles.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{op}: tiles.num_warps must be one of 1, 2, 4, 8, 16, got {tiles.num_warps!r}")
    if not _is_int(tiles.num_stages) or tiles.num_stages < 1:
        raise ValueError(f"{op}: tiles.num_stages must be an int >= 1, got {tiles.num_stages!r}")
    cap = tiles.max_registers
    if cap is not None and (not _is_int(cap) or not MIN_REGISTERS <= cap <= MAX_REGISTERS):
        raise ValueError(
            f"{op}: tiles.max_registers must be None or an int in [{MIN_REGISTERS}, {MAX_REGISTERS}], "
            f"got {cap!r}"
        )
    return tiles


# The register caps a forced Tiles may ask for: 255 is the most a thread holds, and fewer than 32 leave
# no room for a tensor-core tile's operands (ptxas refuses the ring kernel below 28).
MIN_REGISTERS, MAX_REGISTERS = 32, 255


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Split-K (flash-decoding) rule, from host sizes only so that one batch shape always gets one graph.
#
# A decode-shaped call (every chunk in one query tile) has one program per (sequence, kv head), each
# streaming all its keys alone, and a lone program cannot keep enough loads in flight to draw its
# share of bandwidth. At decode tiles (32 keys in three pipeline stages, say: 48 KB of K and V a
# program; `choose_tiles` picks the actual ones) an SM holds ~4 programs, so 64 sequences x 8 kv heads
# = 512 programs fill an H200's 132 SMs in one wave: unsplit, a layer then comes close to the time a
# copy of the same bytes takes, and split in two it is slower, its partial rows and merge costing more
# than they bring.
# The rule: S is the smallest power of two with programs x S >= PROGRAMS_PER_SM x SMs, lowered
# until every split keeps MIN_TILES_PER_SPLIT key tiles of the host-side key bound (a shorter split
# is mostly pipeline prologue), and at most MAX_SPLITS. Batch 64 x 8 heads gets S = 1; batch 1
# splits by length, up to 32. bench/attention_tune.py times S = 1, 2, 4 beside the rule's.
PROGRAMS_PER_SM = 3
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 32


def fills_gpu(device: torch.device, programs: int) -> bool:
    """Whether `programs` unsplit decode programs ((sequence, kv head) pairs) fill the GPU alone: at
    least PROGRAMS_PER_SM a multiprocessor, where the split rule splits nothing for their count."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return programs >= PROGRAMS_PER_SM * sm_count(index)


def split_count(programs: int, key_span: int, block_n: int, sms: int) -> int:
    """The split-K factor for `programs` unsplit programs that each read at most `key_span` keys.

    `key_span` is a host-side upper bound (the block table's capacity, or the window): the lengths
    themselves live on the device. A power of two: fewer distinct compiled kernels and graphs.
    """
    want = math.ceil(PROGRAMS_PER_SM * sms / max(programs, 1))
    by_length = key_span // (MIN_TILES_PER_SPLIT * block_n)
    if want <= 1 or by_length <= 1:
        return 1
    up = next_pow2(min(want, MAX_SPLITS))  # reach the target program count...
    down = 1 << (min(by_length, MAX_SPLITS).bit_length() - 1)  # ...but keep every split long enough
    return min(up, down)


def choose_splits(
    op: str, device: torch.device, num_splits: int | None, tiles: Tiles, max_q: int, programs: int,
    key_span: int,
) -> int:  # fmt: skip
    """`num_splits` checked when the caller forces it, else `split_count` for decode-shaped calls.

    `programs` counts (sequence, kv head) pairs. Only a call whose every chunk fits one query tile
    splits: prefill and long chunks already have a program per query tile, and their grids (and
    results) stay exactly as without split-K.
    """
    if num_splits is not None:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ValueError(f"{op}: num_splits must be a positive int, got {num_splits!r}")
        return num_splits
    if tiles.q_blocks(max_q) != 1 or device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return split_count(programs, key_span, tiles.block_n, sm_count(index))


def whole_tiles(rope_inside: bool, kv_fp8: bool, num_splits: int) -> bool:
    """Whether a decode attention call reads its whole key tiles unmasked (the kernels' WHOLE_TILES):
    with RoPE inside (a decode: the query is the newest position and sees every key of its range),
    over an FP8 cache, unsplit. Over a bf16 cache the unmasked loop needs registers enough to lower
    occupancy, and a split's few tiles gain less than its extra masked tail costs
    (docs/performance.md, "FP8")."""
    return rope_inside and kv_fp8 and num_splits == 1


def softmax_scale(scale: float, quant: KVQuant | None) -> float:
    """The attention kernels' score scale, in the log2 domain; an FP8 cache's K scale folded in (its
    keys are read as stored, unscaled)."""
    if quant is None:
        return float(scale) * LOG2E
    return float(scale) * LOG2E * quant.k_scale


def quant_args(quant: KVQuant | None, fp8_out: bool = False) -> tuple[float, float, float]:
    """The attention kernels' (v_scale, inv_k, inv_v): V's scale for the output (1.0 for an e4m3
    output, which stays in V's codes), and the inverses a store into an FP8 cache quantizes with (1.0,
    never read, without `quant`)."""
    if quant is None:
        return (1.0, 1.0, 1.0)
    return (1.0 if fp8_out else quant.v_scale, quant.inv_k, quant.inv_v)
