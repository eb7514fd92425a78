"""The fused check kernel against the HBM roofline (a torch copy of the same bytes), per shape.

Kernel time comes from a CUDA graph of 20 checks (host launch cost excluded: that is measured by
`invariants_overhead.py --profile`).

    python bench/check_kernel_tune.py
"""

from __future__ import annotations

import argparse

import torch
import triton

from invariants import Checker, Invariant, Severity, predicates
from invariants.kernels.check_rows import plan
from invariants.predicates import window_expected

INV = Invariant("bench.check_kernel", Severity.SOFTEN, "kernel timing")


def cases():
    for batch, window in ((4096, 1024), (512, 4096), (64, 1024), (8, 1024)):
        lens = torch.randint(window, 4 * window, (batch,), device="cuda")
        ring = window_expected(lens, window).int()
        yield f"window {batch}x{window} i32", predicates.window_positions(ring, lens), ring
    for batch in (256, 64, 8):
        x = torch.randn(batch, 131072, device="cuda", dtype=torch.bfloat16)
        yield f"finite {batch}x131072 bf16", predicates.finite(x), x
    ids = torch.randint(0, 100, (4096, 1), device="cuda")
    yield "in_range 4096x1 i64", predicates.in_range(ids, 0, 128), ids


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    checker = Checker("cuda")
    rows = torch.arange(4096, device="cuda", dtype=torch.int32)
    print(f"{'case':24s} {'plan (br,bc,warps,splits)':>26s} {'us':>8s} {'GB/s':>7s}", "copy us  copy GB/s")
    for name, pred, a in cases():
        R, C = a.shape
        nbytes = a.numel() * a.element_size()
        ids = rows[:R]
        checker.check(INV, pred, ids, crash=False)  # compile outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                checker.check(INV, pred, ids, crash=False)
        ms = triton.testing.do_bench(graph.replay, return_mode="median") / 20
        copy_ms = triton.testing.do_bench(a.clone, return_mode="median")
        br, bc, warps, splits, _ = plan(R, C, checker.scratch.shape[0])
        print(
            f"{name:24s} {f'{br},{bc},{warps},{splits}':>26s} {1e3 * ms:8.2f} {nbytes / ms / 1e6:7.0f} "
            f"{1e3 * copy_ms:8.2f} {2 * nbytes / copy_ms / 1e6:9.0f}"
        )
    assert not checker.drain(), "every timed input holds"


if __name__ == "__main__":
    main()
