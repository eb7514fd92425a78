"""The decode step's GEMMs at M = 64 / 16 / 1: cuBLAS (both of torch's BLAS back ends) against
`skinny_gemm`'s default and a sweep of its configs, each against reading its weights at the copy rate.

Shapes: the engine bench's ~2B hybrid (hidden 2048, 16/8 heads x 128, intermediate 6144, vocab
128256), weights [N, K] bf16. Every timing is a CUDA graph over enough distinct weight copies that
they come from HBM, as in a decode step (each layer's weights are read once).

    python bench/gemm_decode.py [--rows 64,16,1] [--quick] [--json gemm.json]   (~2 min at M=64)
    python bench/gemm_decode.py --shapes o --quick --residual-add   (+ cuBLAS with the residual add)
    python bench/gemm_decode.py --split-n 2,4 --no-sweep   (+ cuBLAS over N/P-column blocks on P streams)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from shared.kernels.skinny_gemm import GemmConfig, choose_config, skinny_gemm

SHAPES = {  # name: (N, K)
    "qkv": ((16 + 2 * 8) * 128, 2048),
    "o": (2048, 2048),
    "gate_up": (2 * 6144, 2048),
    "down": (2048, 6144),
    "lm_head": (128256, 2048),
}


def graph_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # compile, allocate
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, return_mode="median") / calls


def split_n_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, streams: list) -> None:  # type: ignore[type-arg]
    """out = x @ w.T as len(streams) column blocks, each on its own stream: the blocks run side by
    side when one cuBLAS launch at M=64 leaves some of the 132 SMs idle."""
    main = torch.cuda.current_stream()
    cols = -(-w.shape[0] // len(streams))
    for i, side in enumerate(streams):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            a, b = i * cols, min((i + 1) * cols, w.shape[0])
            torch.mm(x, w[a:b].T, out=out[:, a:b])
    for side in streams:
        main.wait_stream(side)


def problems(shapes: str, rows: str, tbs: float):  # type: ignore[no-untyped-def]
    """(shape name, M, weight copies, floor µs, x) for each of the comma-separated `shapes` and `rows`:
    enough bf16 copies of the weight that together they exceed L2 (each GEMM of a graph over them reads
    its weight from HBM, as a decode step does), its floor at `tbs` TB/s, and a random [M, K] input."""
    for name in shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(1, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in (int(r) for r in rows.split(",")):
            yield name, m, ws, nbytes / tbs / 1e6, torch.randn(m, k, device="cuda", dtype=torch.bfloat16)


def copy_rate() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone(), return_mode="median")
    return 2 * x.numel() / ms / 1e9  # TB/s, read + write


def sweep(mode: str, n: int, k: int):  # type: ignore[no-untyped-def]
    """Configs to time. "full": 48 (column block, K tile, K split, pipeline stages, 4 warps);
    "quick": 12; "deep": wider column blocks, deeper pipelines and 8 warps, kept to a grid of 100-640
    programs and to what fits in shared memory (a profile shows cuBLAS's M=64 kernels leaving some of
    the 132 SMs idle and the skinny kernel's DRAM far from busy: too few weight bytes in flight)."""
    if mode == "wide":  # wide column blocks on 4 warps, short K tiles: each program re-reads x less
        for bn, bk, s, st in itertools.product((64, 128), (32, 64, 128), (2, 4, 8, 16), (3, 4, 6)):
            programs = triton.cdiv(n, bn) * s
            smem = st * bk * 2 * (64 + bn)
            if 100 <= programs <= 1024 and smem <= 200 << 10 and k // s >= 2 * bk:
                yield GemmConfig(block_n=bn, block_k=bk, split_k=s, num_warps=4, num_stages=st)
        return
    if mode == "deep":
        for bn, bk, s, warps, st in itertools.product(
            (32, 64, 128), (64, 128), (1, 2, 4, 8, 16), (4, 8), (4, 6)
        ):
            programs = triton.cdiv(n, bn) * s
            smem = st * bk * 2 * (64 + bn)
            fits = 100 <= programs <= 640 and smem <= 200 << 10 and k // s >= 2 * bk
            if not fits or (warps == 8) != (bn >= 64):
                continue
            yield GemmConfig(block_n=bn, block_k=bk, split_k=s, num_warps=warps, num_stages=st)
        return
    block_n = (16, 32, 64) if mode == "full" else (32,)
    stages = (3, 4) if mode == "full" else (4,)
    for bn, bk, s, st in itertools.product(block_n, (128, 256), (1, 2, 4, 8), stages):
        yield GemmConfig(block_n=bn, block_k=bk, split_k=s, num_warps=4, num_stages=st)


def _compile_share(args: tuple[list[tuple[str, int, GemmConfig]], int]) -> int:
    """A worker process: launch each (shape, M, config) once, so that Triton's disk cache holds it."""
    jobs, _ = args
    done = 0
    for name, m, cfg in jobs:
        n, k = SHAPES[name]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            skinny_gemm(x, w, cfg)
            done += 1
        except Exception:  # a config Triton cannot fit: the timing pass skips it too
            pass
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[str, int, GemmConfig]], procs: int) -> None:
    """Compiling is slow, one core a config: spread the configs over worker processes first."""
    import multiprocessing as mp

    shares = [(jobs[i::procs], i) for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        done = sum(pool.map(_compile_share, shares))
    print(f"precompiled {done} of {len(jobs)} configs in {procs} processes", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64", help="M values, e.g. 64,16,1")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="12 configs per shape instead of 48")
    ap.add_argument("--deep", action="store_true", help="wide blocks, deep pipelines, 8 warps (see sweep)")
    ap.add_argument("--wide", action="store_true", help="64-128 column blocks on 4 warps, K tiles 32-128")
    ap.add_argument("--compile-procs", type=int, default=0, help="precompile the sweep in N processes")
    ap.add_argument("--residual-add", action="store_true",
                    help="also cuBLAS adding a residual: addmm out of place, addmm_ in place")  # fmt: skip
    ap.add_argument("--split-n", default="", help="also cuBLAS over P column blocks on P streams, e.g. 2,4")
    ap.add_argument("--no-sweep", action="store_true", help="cuBLAS (and --split-n) only")
    ap.add_argument("--json")
    args = ap.parse_args()
    mode = "wide" if args.wide else "deep" if args.deep else "quick" if args.quick else "full"
    if args.compile_procs:
        jobs = [(name, int(m), cfg) for name in args.shapes.split(",") for m in args.rows.split(",")
                for cfg in sweep(mode, *SHAPES[name])]  # fmt: skip
        precompile(jobs, args.compile_procs)
    tbs = copy_rate()
    print(f"copy rate {tbs:.2f} TB/s")
    rows = []
    for name, m, ws, floor_us, x in problems(args.shapes, args.rows, tbs):
        n, k = SHAPES[name]
        copies = len(ws)
        ref = x.float() @ ws[0].float().T

        def torch_gemm(w: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, w.T)  # noqa: B023

        def ours(w: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
            return skinny_gemm(x, w, cfg)  # noqa: B023

        timed = {}
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            timed[lib] = graph_us(lambda: [torch_gemm(w) for w in ws], copies)  # noqa: B023
        for parts in (int(p) for p in args.split_n.split(",") if p):
            streams = [torch.cuda.Stream() for _ in range(parts)]
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            pairs_o = list(zip(ws, outs, strict=True))
            split_n_gemm(x, ws[0], outs[0], streams)
            torch.testing.assert_close(outs[0].float(), ref, rtol=3e-2, atol=3e-2)
            run = lambda: [split_n_gemm(x, w, o, streams) for w, o in pairs_o]  # noqa: B023
            timed[f"cublas/{parts} streams"] = graph_us(run, copies)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        if args.no_sweep:
            row = {"shape": name, "M": m, "floor_us": round(floor_us, 2)} | timed
            rows.append(row)
            print(f"{name:8s} M={m:<3d} floor {floor_us:7.2f} us  "
                  + "  ".join(f"{k} {v:7.2f}" for k, v in timed.items()), flush=True)  # fmt: skip
            continue
        if args.residual_add:  # ModelKernels.linear_add: the o and down projections' residual add
            res = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            pairs = list(zip(res, ws, strict=True))
            timed["addmm"] = graph_us(lambda: [torch.addmm(r, x, w.T) for r, w in pairs], copies)  # noqa: B023
            timed["addmm_"] = graph_us(lambda: [r.addmm_(x, w.T) for r, w in pairs], copies)  # noqa: B023
        default = choose_config(m, n, k)
        torch.testing.assert_close(ours(ws[0], default).float(), ref, rtol=3e-2, atol=3e-2)
        timed["skinny default"] = graph_us(lambda: [ours(w, default) for w in ws], copies)  # noqa: B023
        best, ranked = None, []
        for cfg in sweep(mode, n, k):
            try:
                us = graph_us(lambda: [ours(w, cfg) for w in ws], copies)  # noqa: B023
            except Exception as exc:  # a config Triton cannot fit (shared memory): skipped
                print(f"  {name} M={m} {cfg}: {type(exc).__name__}")
                continue
            ranked.append((us, cfg))
            if best is None or us < best[0]:
                best = (us, cfg)
        if best is not None:
            torch.testing.assert_close(ours(ws[0], best[1]).float(), ref, rtol=3e-2, atol=3e-2)
            timed["skinny best"] = best[0]
        row = {"shape": name, "M": m, "N": n, "K": k, "floor_us": round(floor_us, 2)}
        row |= {key: round(us, 2) for key, us in timed.items()}
        row["best_config"] = None if best is None else best[1].__dict__
        rows.append(row)
        shown = "  ".join(f"{key} {us:7.2f} us x{us / floor_us:4.2f}" for key, us in timed.items())
        print(f"{name:8s} M={m:<3d} floor {floor_us:7.2f} us  {shown}", flush=True)
        for us, cfg in sorted(ranked, key=lambda r: r[0])[:5]:
            print(f"         {us:7.2f} us  {cfg}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
