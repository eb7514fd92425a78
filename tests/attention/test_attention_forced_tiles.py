"""Forced launch tiles (the seam bench/attention_tune.py sweeps): same results, and bad tiles refused.

On CPU the kernels run in the interpreter, whose default is 16-key tiles; 32- and 64-key tiles there
change how the keys are walked and split (whole tiles per split), not what is computed.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attn_testutil import assert_close, make_batch, naive_attention
from cases import SPECS

from shared.kernels._launch import Tiles, choose_tiles, resolve_tiles
from shared.kernels.attention.paged_attention import paged_attention
from shared.kernels.attention.ring_attention import ring_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
HQ, HKV, D = 4, 2, 16


def forced(max_q: int, **change: object) -> Tiles:
    return dataclasses.replace(choose_tiles(HQ // HKV, D, max_q), **change)  # type: ignore[arg-type]


def run(op: str, b, tiles: Tiles | None, num_splits: int | None = None) -> torch.Tensor:
    kw = {"max_q": b.max_q, "scale": b.scale, "num_splits": num_splits, "tiles": tiles}
    if op == "ring":
        return ring_attention(*b.ring_args(), window=b.window, **kw)
    return paged_attention(*b.paged_args(), window=b.window, **kw)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize(
    "change",
    [
        {"block_n": 32, "num_warps": 2},
        {"block_n": 64, "num_warps": 8, "num_stages": 3},
        {"block_n": 32, "num_warps": 2, "max_registers": 128},
    ],
)
@pytest.mark.parametrize("op", ["ring", "paged"])
def test_forced_tiles_match_default(op: str, change: dict, num_splits: int | None) -> None:
    """Decode over rings and caches of 0-100 keys: one to several key tiles of each size."""
    specs = [(0, 1), (5, 1), (23, 1), (40, 1), (100, 1)]
    b = make_batch(specs, hq=HQ, hkv=HKV, d=D, page_size=4, window=40, device=DEVICE)
    tiles = forced(1, **change)
    assert tiles != choose_tiles(HQ // HKV, D, 1)
    default = run(op, b, None, num_splits)
    out = run(op, b, tiles, num_splits)
    assert_close(out, naive_attention(b))
    assert_close(out, default)


@pytest.mark.parametrize("op", ["ring", "paged"])
def test_forced_tiles_on_chunks(op: str) -> None:
    """Chunks over several query tiles (prefill-shaped calls) with a forced key tile."""
    b = make_batch(SPECS["mixed"], hq=HQ, hkv=HKV, d=D, page_size=4, window=5, device=DEVICE)
    out = run(op, b, forced(b.max_q, block_n=32, num_warps=2, num_stages=2))
    assert_close(out, naive_attention(b))


def test_default_path_unchanged() -> None:
    for group, head_dim, max_q in [(2, 16, 1), (2, 128, 1), (3, 24, 9), (8, 128, 512)]:
        assert resolve_tiles("op", None, group, head_dim, max_q) == choose_tiles(group, head_dim, max_q)


BAD: list[tuple[dict, str]] = [
    ({"block_n": 24}, "tiles.block_n"),
    ({"block_n": 8}, "tiles.block_n"),
    ({"block_n": 32.0}, "tiles.block_n"),
    ({"num_warps": 3}, "tiles.num_warps"),
    ({"num_warps": 32}, "tiles.num_warps"),
    ({"num_warps": True}, "tiles.num_warps"),
    ({"num_stages": 0}, "tiles.num_stages"),
    ({"block_m": 32}, "tiles.block_m"),
    ({"block_q": 2}, "tiles.block_q"),
    ({"block_d": 32}, "tiles.block_d"),
    ({"group_p2": 4}, "tiles.group_p2"),
    ({"max_registers": 24}, "tiles.max_registers"),
    ({"max_registers": 256}, "tiles.max_registers"),
    ({"max_registers": 128.0}, "tiles.max_registers"),
    ({"max_registers": False}, "tiles.max_registers"),
]


@pytest.mark.parametrize(("change", "field"), BAD)
@pytest.mark.parametrize("op", ["ring", "paged"])
def test_bad_tiles_name_the_field(op: str, change: dict, field: str) -> None:
    b = make_batch([(5, 1), (9, 1)], hq=HQ, hkv=HKV, d=D, page_size=4, window=8, device=DEVICE)
    with pytest.raises(ValueError, match=rf"{op}_attention: {field} must"):
        run(op, b, forced(1, **change))


def test_a_register_cap_reaches_the_compiler_only_when_set() -> None:
    """choose_tiles leaves registers to the compiler; a forced cap is passed on as Triton's maxnreg."""
    chosen = choose_tiles(HQ // HKV, D, 1)
    assert chosen.max_registers is None
    assert chosen.launch_options() == {"num_warps": chosen.num_warps, "num_stages": chosen.num_stages}
    capped = forced(1, max_registers=128).launch_options()
    assert capped == {"num_warps": chosen.num_warps, "num_stages": chosen.num_stages, "maxnreg": 128}


def test_tiles_must_be_tiles() -> None:
    with pytest.raises(ValueError, match="tiles must be a Tiles"):
        resolve_tiles("op", (16, 1, 16, 64, 16, 4, 2), 2, 16, 1)  # type: ignore[arg-type]


def test_tune_bench_help_without_cuda() -> None:
    """bench/attention_tune.py imports and parses its flags on a machine without a GPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "bench/attention_tune.py", "--help"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for flag in ("--quick", "--json", "--budget-s", "--max-registers", "--rope"):
        assert flag in proc.stdout
