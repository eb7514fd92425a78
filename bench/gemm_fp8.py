"""The decode step's FP8 GEMMs at M = 64 / 16 / 1: the skinny GEMM with FP8 operands (its default, its
pointer loads' default, and a sweep of configs) against cuBLAS's scaled GEMM (`torch._scaled_mm`,
per-token x per-channel scales, plus the residual add the o and down projections need), the Triton
FP8 GEMM and bf16 cuBLAS, each against reading its weights at the copy rate.

Shapes: `gemm_decode.py`'s (the engine bench's ~2B hybrid; `--model 8b` its ~8B), weights [N, K] e4m3
with per-channel scales (`--block 128` for 128x128 blocks and 128-column activation groups). Every
timing is a CUDA graph over enough weight copies that they come from HBM, as in a decode step.

    python bench/gemm_fp8.py [--rows 64,16,1] [--shapes qkv,o,gate_up,down] [--no-sweep] [--json f]
                             [--sweep-loads tma|pointers] [--verbose]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from bench.gemm_decode import SHAPES, copy_rate, graph_us
from shared.kernels.fp8 import reference as ref
from shared.kernels.fp8.gemm import gemm as triton_fp8_gemm
from shared.kernels.fp8.quant import quantize
from shared.kernels.fp8.scaled_mm import scaled_mm
from shared.kernels.skinny_gemm import GemmConfig, Scales, choose_config, skinny_gemm

RESIDUAL = ("o", "down")  # the projections whose output is added to the residual stream
# --model 8b: bench/engine.py's ~8B (Llama 3 8B's widths)
SHAPES_8B = {
    "qkv": ((32 + 2 * 8) * 128, 4096),
    "o": (4096, 4096),
    "gate_up": (2 * 14336, 4096),
    "down": (4096, 14336),
}


def sweep(n: int, k: int, group: int | None, tma: bool):  # type: ignore[no-untyped-def]
    """Column block x K tile x K split x pipeline, kept to 64-1024 programs and to shared memory;
    with `tma` descriptor loads (K tiles of at most 256 columns, deeper pipelines)."""
    tiles = (group,) if group else (128, 256) if tma else (128, 256, 512)
    stages = (3, 4, 5, 6, 8) if tma else (3, 4)
    for bn, bk, s, st in itertools.product((16, 32, 64, 128), tiles, (1, 2, 4, 8), stages):
        programs = triton.cdiv(n, bn) * s
        if 64 <= programs <= 1024 and st * bk * (64 + bn) <= 192 << 10 and k // s >= bk:
            warps = 8 if bn == 128 else 4
            yield GemmConfig(block_n=bn, block_k=bk, split_k=s, num_warps=warps, num_stages=st, tma=tma)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,16,1", help="M values")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--block", type=int, default=0, help="0: per-channel scales; 128: 128x128 blocks")
    ap.add_argument("--no-sweep", action="store_true", help="the defaults and the libraries only")
    ap.add_argument(
        "--sweep-loads",
        choices=["tma", "pointers"],
        default="tma",
        help="the sweep's loads: tensor descriptors (Hopper's default) or pointers",
    )
    ap.add_argument("--verbose", action="store_true", help="every config of the sweep, not only the best")
    ap.add_argument("--model", choices=["2b", "8b"], default="2b", help="bench/engine.py's model's shapes")
    ap.add_argument("--json")
    args = ap.parse_args()
    tbs = copy_rate()
    print(f"copy rate {tbs:.2f} TB/s", flush=True)
    rows = []
    shapes = SHAPES_8B if args.model == "8b" else SHAPES
    for name in args.shapes.split(","):
        n, k = shapes[name]
        block = (args.block, args.block) if args.block else (1, k)
        group = args.block or None
        copies = max(1, -(-(256 << 20) // (n * k)))
        layers = [
            ref.quantize_weight(torch.randn(n, k, device="cuda") / k**0.5, block) for _ in range(copies)
        ]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, copies // 2))]
        for m in (int(r) for r in args.rows.split(",")):
            floor = n * k / tbs / 1e6
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = quantize(x, block[1])
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            add = name in RESIDUAL
            want = ref.gemm(a, *layers[0], block).float()

            def skinny(cfg: GemmConfig | None, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
                scales = Scales(a.scale, a.group, ws, block, torch.bfloat16)  # noqa: B023
                return skinny_gemm(a.data, wq, cfg, add=res if add else None, scales=scales)  # noqa: B023

            def cublas(wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
                out = scaled_mm(a, wq, ws, block)  # noqa: B023
                return res.add_(out) if add else out  # noqa: B023

            def triton_gemm(wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
                return triton_fp8_gemm(a, wq, ws, block, None, res if add else None)  # noqa: B023

            timed = {"bf16 cuBLAS": graph_us(lambda: [torch.mm(x, w.T) for w in bf16], len(bf16))}  # noqa: B023
            try:
                before = res.float()  # cublas() adds into res
                torch.testing.assert_close(cublas(*layers[0]).float() - (before if add else 0), want,
                                           rtol=3e-2, atol=3e-2 * want.abs().max().item())  # fmt: skip
                timed["scaled_mm"] = graph_us(lambda: [cublas(*layer) for layer in layers], copies)  # noqa: B023
            except RuntimeError as exc:
                print(f"  scaled_mm: {str(exc).splitlines()[0]}")
            timed["triton"] = graph_us(lambda: [triton_gemm(*layer) for layer in layers], copies)  # noqa: B023
            if m <= 64:
                # the default as skinny_gemm picks it (descriptor loads on Hopper), and the pointer loads'
                pointers = choose_config(m, n, k, itemsize=1, group=group)
                timed["skinny default"] = graph_us(lambda: [skinny(None, *lr) for lr in layers], copies)  # noqa: B023
                timed["skinny pointers"] = graph_us(lambda: [skinny(pointers, *lr) for lr in layers], copies)  # noqa: B023
                best = None
                for cfg in () if args.no_sweep else sweep(n, k, group, args.sweep_loads == "tma"):
                    try:
                        us = graph_us(lambda: [skinny(cfg, *lr) for lr in layers], copies)  # noqa: B023
                    except Exception as exc:  # a config Triton cannot fit
                        print(f"  {cfg}: {type(exc).__name__}")
                        continue
                    if args.verbose:
                        print(f"  {us:7.2f} us x{us / floor:4.2f} {cfg}", flush=True)
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is not None:
                    timed["skinny best"] = best[0]
                    print(f"  best {best[1]}", flush=True)
            row = {"shape": name, "M": m, "N": n, "K": k, "block": block, "floor_us": round(floor, 2)}
            rows.append(row | {key: round(us, 2) for key, us in timed.items()})
            shown = "  ".join(f"{key} {us:6.2f} us x{us / floor:4.2f}" for key, us in timed.items())
            print(f"{name:8s} M={m:<3d} floor {floor:6.2f} us  {shown}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
