"""Host-side launch choices shared by the Triton attention wrappers (tile sizes, split-K count)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

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

    def q_blocks(self, max_q: int) -> int:
        return math.ceil(max_q / self.block_q)


def choose_tiles(group: int, head_dim: int, max_q: int) -> Tiles:
    group_p2 = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    if interpreting():  # small tiles: the interpreter's cost grows with the tile, not the launch
        target_m, block_n, warps, stages = 16, 16, 4, 1
    elif max_q == 1:
        target_m, block_n, warps, stages = 16, 64, 4, 2
    else:
        target_m = 64 if block_d <= 128 else 32
        block_n, warps, stages = (64, 4, 2) if block_d <= 128 else (32, 8, 2)
    block_q = max(1, min(next_pow2(max_q), target_m // group_p2))
    block_m = max(16, block_q * group_p2)
    return Tiles(group_p2, block_q, block_m, block_n, block_d, warps, stages)


def choose_splits(device: torch.device, programs: int, key_span: int, max_q: int) -> int:
    """Split-K (flash-decoding) factor from host sizes only, so one batch shape always gets one graph.

    Decode with few (sequence, kv head) programs and long contexts leaves most SMs idle; splitting
    each program's keys over several programs fills them, and a small merge kernel combines the
    partial softmaxes. `key_span` is an upper bound on the keys one program reads (the block table's
    capacity, or the window).
    """
    if max_q != 1 or device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = sm_count(index)
    if programs >= sms:  # already a full wave: measured on an H200, splitting gains nothing there
        return 1
    want = math.ceil(4 * sms / max(programs, 1))  # about four waves of short programs
    by_length = math.ceil(key_span / 256)  # keep at least ~256 keys (4 blocks) per split
    n = max(1, min(want, by_length, 32))
    return 1 << (n.bit_length() - 1)  # a power of two: fewer distinct compiled kernels
