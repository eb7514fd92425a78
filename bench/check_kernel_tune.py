"""Tile shapes for the fused check kernel against the HBM roofline (a torch copy of the same bytes).

    python bench/check_kernel_tune.py
"""

from __future__ import annotations

import torch
import triton

from invariants.kernels.check_rows import _blocks, _count_kernel
from invariants.predicates import Op, window_expected


def time_config(op, a, b, rows, counts, bits, block_r: int, block_c: int, warps: int) -> float:
    R, C = a.shape

    def run() -> None:
        _count_kernel[(triton.cdiv(R, block_r),)](
            a, b, rows, counts, bits, R, C, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            0, 0, 0, bits.shape[1], OP=int(op), HAS_ROWS=True, ASSERT=False, MSG="",
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip

    return triton.testing.do_bench(run, return_mode="median")


def main() -> None:
    counts = torch.zeros(8, dtype=torch.int64, device="cuda")
    bits = torch.zeros(8, 128, dtype=torch.int32, device="cuda")
    cases = []
    for batch, window in ((4096, 1024), (512, 4096), (64, 1024), (8, 1024)):
        lens = torch.randint(window, 4 * window, (batch,), device="cuda")
        ring = window_expected(lens, window).int()
        cases.append((f"window {batch}x{window} i32", Op.WINDOW, ring, lens[:, None]))
    x = torch.randn(256, 131072, device="cuda", dtype=torch.bfloat16)
    cases.append(("finite 256x131072 bf16", Op.FINITE, x, x))
    rows = torch.arange(4096, device="cuda", dtype=torch.int32)
    print(f"{'case':26s} {'block':>10s} {'warps':>5s} {'us':>8s} {'GB/s':>7s} {'copy GB/s':>9s}")
    for name, op, a, b in cases:
        R, C = a.shape
        nbytes = a.numel() * a.element_size()
        copy_ms = triton.testing.do_bench(a.clone, return_mode="median")
        copy_gbs = 2 * nbytes / copy_ms / 1e6  # read + write
        default = _blocks(R, C)
        configs = {default, (1, 1024), (2, 1024), (4, 1024), (8, 512), (4, 512), (1, 4096), (16, 256)}
        for block_r, block_c in sorted(configs):
            for warps in (4, 8):
                ms = time_config(op, a, b, rows, counts, bits, block_r, block_c, warps)
                mark = " <- default" if (block_r, block_c) == default and warps == 4 else ""
                gbs = nbytes / ms / 1e6
                cfg = f"{block_r:4d}x{block_c:<5d} {warps:5d}"
                print(f"{name:26s} {cfg} {1e3 * ms:8.2f} {gbs:7.0f} {copy_gbs:9.0f}{mark}")
    assert int(counts.sum()) == 0, "the tuned inputs all hold"


if __name__ == "__main__":
    main()
