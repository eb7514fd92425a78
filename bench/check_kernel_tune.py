"""The fused check kernel against the HBM roofline (a torch copy of the same bytes), per shape.

Kernel time comes from a CUDA graph of 20 checks (host launch cost excluded: that is measured by
`invariants_overhead.py --profile`). `--sweep` times every tile of the window check instead, on
inputs read from HBM (a graph over 8 distinct copies, more than L2 holds) beside a read-only
reduction (`amax`) of the same bytes: the floor a check kernel can reach. `--grouped` times
`batched_checks`' one launch over 40 rings (`launch_grouped`: its default tile, every tile with
`--tiles`) against the 40 one-check launches and against one `amax` over all their bytes, each tile
first checked to count and attribute what the torch reference does on rings with planted failures
and uneven row counts ("same").

    python bench/check_kernel_tune.py [--sweep] [--grouped [--tiles]]
"""

from __future__ import annotations

import argparse

import torch
import triton

from invariants import Checker, Invariant, Severity, predicates
from invariants.kernels import check_rows
from invariants.kernels.check_rows import grouped_plan, plan
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


def _graph_ms(fn, calls: int) -> float:
    fn()  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") / calls


def _tiles(window: int):
    for bc in (512, 1024, 2048, 4096):
        for br in (1, 2, 4, 8):
            for warps in (4, 8, 16):
                if bc <= window and 32 * warps <= br * bc <= 16384:
                    yield br, bc, warps


def sweep_case(checker: Checker, batch: int, window: int, copies: int = 8) -> None:
    """Every (rows, cols, warps) tile of one window shape, each input read from HBM."""
    lens = [torch.randint(window, 4 * window, (batch,), device="cuda") for _ in range(copies)]
    rings = [window_expected(x, window).int() for x in lens]
    preds = [predicates.window_positions(r, x) for r, x in zip(rings, lens, strict=True)]
    ids = torch.arange(batch, device="cuda", dtype=torch.int32)
    nbytes = rings[0].numel() * 4

    def checks() -> None:
        for p in preds:
            checker.check(INV, p, ids, crash=False)

    amax_ms = _graph_ms(lambda: [torch.amax(r) for r in rings], 1) / copies
    results = []
    for br, bc, warps in _tiles(window):
        chunk = -(-window // bc) * bc
        check_rows.plan = lambda *_, t=(br, bc, warps, 1, chunk): t
        results.append((_graph_ms(checks, 1) / copies, br, bc, warps))
        print(f"window {batch}x{window} {f'{br},{bc},{warps}':>14s} {1e3 * results[-1][0]:7.2f} us")
    check_rows.plan = plan
    default = _graph_ms(checks, 1) / copies
    ms, br, bc, warps = min(results)
    print(
        f"window {batch}x{window} i32 from HBM: best tile {br},{bc},{warps} {1e3 * ms:.2f} us "
        f"({nbytes / ms / 1e6:.0f} GB/s); default {plan(batch, window, 1 << 20)[:3]} {1e3 * default:.2f} us; "
        f"amax of the same bytes {1e3 * amax_ms:.2f} us ({nbytes / amax_ms / 1e6:.0f} GB/s)"
    )


def planted(whole: torch.Tensor, lens: torch.Tensor, ids: torch.Tensor, slots: int):
    """Checks of `whole`'s kind (same width and strides) with failures planted: an eighth of the
    rows, fewer in some layers (row blocks past a short check's end idle), two bad rows in most
    layers, the last row in some. Returns the pending checks and the torch reference's counts and
    bits."""
    layers, batch, window = whole.shape
    rings = whole[:, : batch // 8].clone()
    pending = []
    counts = torch.zeros(slots, dtype=torch.int64)
    bits = torch.zeros(slots, (batch + 31) // 32, dtype=torch.int64)
    for i in range(layers):
        rows = batch // 8 - 5 * (i % 4)
        for r in {(37 * i) % rows, (11 * i + 3) % rows} if i % 5 else {rows - 1}:
            rings[i, r, (13 * i) % window] = -7  # no ring slot ever holds -7
        pred = predicates.window_positions(rings[i, :rows], lens[:rows])
        slot = 1 + i % 3
        bad = (~pred.row_ok()).nonzero().flatten().cpu()
        counts[slot] += bad.numel()
        for r in ids[:rows].cpu()[bad].tolist():
            bits[slot, r // 32] |= 1 << (r % 32)
        pending.append((pred, ids[:rows], slot))
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)  # int32 bit patterns
    return pending, counts, bits


def grouped_case(
    checker: Checker, batch: int = 4096, window: int = 1024, layers: int = 40, tiles: bool = False
) -> None:
    """One grouped launch over `layers` rings (the default tile, or each tile) vs one check per ring
    vs one read of them all; each grouped tile first checked against the torch reference."""
    lens = torch.randint(window, 4 * window, (batch,), device="cuda")
    whole = window_expected(lens, window).int().expand(layers, -1, -1).contiguous()
    preds = [predicates.window_positions(r, lens) for r in whole.unbind(0)]
    ids = torch.arange(batch, device="cuda", dtype=torch.int32)
    pending = [(p, ids, checker.slot(INV)) for p in preds]
    nbytes = whole.numel() * 4
    keep: list[torch.Tensor] = []  # the host tables a captured upload reads
    check_pending, want_counts, want_bits = planted(whole, lens, ids, checker.counts.shape[0])
    assert want_bits.shape == checker.bits.shape
    mismatched: list[str] = []

    def grouped() -> None:
        keep.extend(check_rows.launch_grouped(pending, counts=checker.counts, bits=checker.bits)[1])

    def one_by_one() -> None:
        for p in preds:
            checker.check(INV, p, ids, crash=False)

    def same_as_reference() -> str:
        """Whether the current tile counts and attributes the planted failures as the torch reference
        does."""
        counts, bits = torch.zeros_like(checker.counts), torch.zeros_like(checker.bits)
        check_rows.launch_grouped(check_pending, counts=counts, bits=bits)
        if torch.equal(counts.cpu(), want_counts) and torch.equal(bits.cpu(), want_bits):
            return "same"
        return "MISMATCH"

    def report(name: str, ms: float, same: str = "") -> None:
        rate = nbytes / ms / 1e6
        print(
            f"grouped {layers}x{batch}x{window} {name:>44s} {1e3 * ms:8.1f} us {rate:6.0f} GB/s {same}",
            flush=True,
        )

    def timed(name: str) -> None:
        same = same_as_reference()
        mismatched.extend([name] * (same != "same"))
        report(name, _graph_ms(grouped, 1), same)

    report("amax of all bytes", _graph_ms(lambda: torch.amax(whole), 1))
    report("one launch per check", _graph_ms(one_by_one, 1))
    if tiles:
        for br, bc, warps in _tiles(window):
            for evict in ("", "evict_first") if warps == 4 else ("",):
                check_rows.grouped_plan = lambda *_, t=(br, bc, warps, evict): t
                timed(f"grouped {br},{bc},{warps}{',' * bool(evict)}{evict}")
        check_rows.grouped_plan = grouped_plan
    timed(f"grouped default {grouped_plan(batch, window)}")
    assert not mismatched, f"not counted as the torch reference counts: {mismatched}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every tile of the window check from HBM")
    parser.add_argument("--grouped", action="store_true", help="time the grouped launch of batched_checks")
    parser.add_argument("--tiles", action="store_true", help="with --grouped: time every tile")
    args = parser.parse_args()
    checker = Checker("cuda")
    if args.grouped:
        grouped_case(checker, tiles=args.tiles)
        assert not checker.drain(), "every timed input holds"
        return
    if args.sweep:
        for batch, window in ((4096, 1024), (512, 4096)):
            sweep_case(checker, batch, window)
        assert not checker.drain(), "every timed input holds"
        return
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
