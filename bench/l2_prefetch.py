"""Weights into L2 ahead of their GEMM, from a side stream of the decode step's CUDA graph: does
keeping HBM busy through the step's latency-bound stretches (small GEMMs' ramps and tails, norms,
graph-node gaps) close the gap between the step and its roofline?

The bytes a step moves do not change: each weight still comes from HBM once. What changes is when:
a side stream issues `cp.async.bulk.prefetch.L2` for the next GEMMs' weights while the main stream
runs attention and the small kernels, and the GEMMs then read L2.

    python bench/l2_prefetch.py [--layers 28] [--json l2.json]      (GPU, Hopper or later)

Part 1 times each GEMM of a layer at M=64 (cuBLAS) from HBM, with its weight prefetched into L2 20 µs
before, and from a hot L2. Part 2 runs `bench/decode_layer_pdl.py`'s stand-in chain (the engine's
bytes and kernel sequence at batch 64) with prefetch schedules; each variant's output must equal the
plain chain's bit for bit (a prefetch is only a cache hint).
"""

from __future__ import annotations

import argparse
import json

import decode_layer_pdl as chain  # bench/ sibling: the stand-in chain
import torch
import triton
import triton.language as tl


@triton.jit
def _bulk_prefetch(src, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """One `cp.async.bulk.prefetch.L2` of CHUNK bytes a lane: the copy engine fetches, no SM waits."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    at = src + tl.minimum(i.to(tl.int64) * CHUNK, nbytes - CHUNK)  # the tail overlaps: harmless
    size = tl.full([BLOCK], CHUNK, tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def prefetch(w: torch.Tensor, chunk: int, evict_last: bool) -> None:
    raw = w.view(-1).view(torch.uint8)
    chunks = triton.cdiv(raw.numel(), chunk)
    _bulk_prefetch[(triton.cdiv(chunks, 32),)](
        raw, raw.numel(), CHUNK=chunk, BLOCK=32, EVICT_LAST=evict_last, num_warps=1
    )


def graph_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, return_mode="median") / calls


def gemm_row(name: str, a: torch.Tensor, ws: list[torch.Tensor], chunk: int, delay_cycles: int) -> dict:
    """One GEMM over every layer's weight: from HBM, prefetched `delay_cycles` before, and L2-hot."""
    n = len(ws)
    out = torch.empty(chain.M, ws[0].shape[0], device="cuda", dtype=torch.bfloat16)

    def delay() -> None:
        torch.cuda._sleep(delay_cycles)  # 40,000: ~20 µs at 1.98 GHz

    def cold() -> None:
        for w in ws:
            delay()
            torch.mm(a, w.T, out=out)

    def warmed(evict_last: bool):  # type: ignore[no-untyped-def]
        def run() -> None:
            for w in ws:
                prefetch(w, chunk, evict_last)
                delay()
                torch.mm(a, w.T, out=out)

        return run

    def hot() -> None:
        for _ in ws:
            delay()
            torch.mm(a, ws[0].T, out=out)

    def sleep_only() -> None:
        for _ in ws:
            delay()

    base = graph_us(sleep_only, n)
    return {
        "gemm": name,
        "MB": round(ws[0].numel() * 2 / 1e6, 1),
        "hbm_us": round(graph_us(cold, n) - base, 2),
        "prefetched_us": round(graph_us(warmed(False), n) - base, 2),
        "prefetched_evict_last_us": round(graph_us(warmed(True), n) - base, 2),
        "l2_hot_us": round(graph_us(hot, n) - base, 2),
    }


def gemm_table(layers: list[dict[str, torch.Tensor]], chunk: int, delay_cycles: int) -> list[dict]:
    x = torch.randn(chain.M, chain.H, device="cuda", dtype=torch.bfloat16)
    xd = torch.randn(chain.M, chain.INTER, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name in chain.GEMMS:
        row = gemm_row(name, xd if name == "down" else x, [L[name] for L in layers], chunk, delay_cycles)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# Schedules: before the main stream launches kernel `hook` of layer L, the side stream prefetches
# these (layer offset, weight) pairs.
SCHEDULES = {
    "next": {"qkv": [(0, "o")], "o": [(0, "gate_up")], "gate_up": [(0, "down")], "down": [(1, "qkv")]},
    "attn": {"qkv": [(0, "o"), (0, "gate_up")], "gate_up": [(0, "down"), (1, "qkv")]},
    "attn_late": {"attn": [(0, "o"), (0, "gate_up")], "gate_up": [(0, "down")], "down": [(1, "qkv")]},
    "two_ahead": {"qkv": [(0, "o")], "attn": [(0, "gate_up")], "o": [(0, "down")], "gate_up": [(1, "qkv")]},
}


class PrefetchStep(chain.Step):
    def __init__(self, layers, schedule: str, evict_last: bool, chunk: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(layers, "cublas")
        self.plan = SCHEDULES.get(schedule, {})
        self.evict_last, self.chunk = evict_last, chunk
        self.side = torch.cuda.Stream()

    def hook(self, name: str, index: int) -> None:
        todo = [(index + off, w) for off, w in self.plan.get(name, []) if index + off < len(self.layers)]
        if not todo:
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for i, w in todo:
                prefetch(self.layers[i][w], self.chunk, self.evict_last)

    def __call__(self) -> None:
        M, H, INTER, QKV = chain.M, chain.H, chain.INTER, chain.QKV
        self.h.copy_(self.h0)
        self.res.zero_()
        if self.plan:
            self.hook("start", 0)
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                prefetch(self.layers[0]["qkv"], self.chunk, self.evict_last)
        for i, L in enumerate(self.layers):
            chain._add_norm[(M,)](self.h, self.res, L["ln1"], self.xn, HID=H, PDL=False, num_warps=8)
            self.hook("qkv", i)
            torch.mm(self.xn, L["qkv"].T, out=self.qkv)
            chain._rope_like[(M,)](self.qkv, self.q, WIDTH=QKV, HID=H, PDL=False, num_warps=8)
            self.hook("attn", i)
            chain._attention_like[(chain.ATTN_PROGRAMS,)](
                self.q, L["kv"], self.attn, chain.PER_PROGRAM, BLOCK=chain.ATTN_BLOCK, PDL=False, num_warps=4
            )  # fmt: skip
            self.hook("o", i)
            torch.mm(self.attn, L["o"].T, out=self.o)
            chain._add_norm[(M,)](self.o, self.res, L["ln2"], self.xn, HID=H, PDL=False, num_warps=8)
            self.hook("gate_up", i)
            torch.mm(self.xn, L["gate_up"].T, out=self.gu)
            chain._silu_mul[(M, INTER // 1024)](
                self.gu, self.act, INTER_=INTER, BLOCK=1024, PDL=False, num_warps=4
            )
            self.hook("down", i)
            torch.mm(self.act, L["down"].T, out=self.h)
        if self.plan:  # the side stream joins the main one before the capture ends
            torch.cuda.current_stream().wait_stream(self.side)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--chunk", type=int, default=16384, help="bytes per bulk prefetch")
    ap.add_argument(
        "--variants", default="none,next,attn,attn_late,two_ahead,next+el,attn+el,two_ahead+el,none"
    )
    ap.add_argument("--skip-gemms", action="store_true")
    ap.add_argument("--delay-cycles", type=int, default=40_000, help="between a prefetch and its GEMM")
    ap.add_argument("--json")
    args = ap.parse_args()
    tbs = chain.copy_rate()
    layers = chain.make_layers(args.layers)
    weights = sum(n * k * 2 for n, k, *_ in chain.GEMMS.values()) * args.layers
    kv = chain.ATTN_PROGRAMS * chain.PER_PROGRAM * 2 * args.layers
    floor_ms = (weights + kv) / tbs / 1e9
    print(f"copy rate {tbs:.2f} TB/s; L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB; "
          f"floor {floor_ms:.3f} ms", flush=True)  # fmt: skip
    gemms = [] if args.skip_gemms else gemm_table(layers, args.chunk, args.delay_cycles)
    rows, ref = [], None
    for variant in args.variants.split(","):
        schedule, _, el = variant.partition("+")
        step = PrefetchStep(layers, schedule, el == "el", args.chunk)
        graph = chain.capture(step)
        out = step.h.clone()
        ref = out if ref is None else ref
        ms = triton.testing.do_bench(graph.replay, return_mode="median")
        row = {"variant": variant, "step_ms": round(ms, 4), "x_floor": round(ms / floor_ms, 3),
               "equal_to_plain": torch.equal(out, ref)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbs": tbs, "floor_ms": floor_ms, "gemms": gemms, "chain": rows}, f, indent=1)


if __name__ == "__main__":
    main()
