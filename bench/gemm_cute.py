"""The decode step's GEMMs on `cute_gemm` (CuTe DSL, programmatic dependent launches) against cuBLAS.

    python bench/gemm_cute.py                  # the four decode shapes at M=64: a config sweep, then a chain
    python bench/gemm_cute.py --shapes o --rows 64,16

Part 1, per shape: a CUDA graph of one GEMM over each of 28 distinct weights (a layer's weight from
HBM, as a decode step reads it), µs a GEMM: cuBLAS (torch.matmul) against each config of the sweep,
launched plainly and as programmatic dependent launches (the next GEMM streams its weights into this
one's tail), against the weight's copy floor. Part 2: 28 layers of q/k/v -> o + residual -> gate/up ->
down + residual, the dependencies of a layer, cuBLAS against `config_for`'s picks with and without
PDL. Needs a Hopper GPU and the `cute` extra (`nvidia-cutlass-dsl`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from bench.gemm_decode import SHAPES as DECODE_SHAPES
from bench.gemm_decode import copy_rate, graph_us
from shared.model.kernels.cute_gemm import CuteGemmConfig, available, config_for, cute_linear

SHAPES = {name: nk for name, nk in DECODE_SHAPES.items() if name != "lm_head"}  # a layer's four
LAYERS = 28
# (block_n, split_k, block_k, stages, multicast): around one program per SM, and config_for's pick.
SWEEP = {
    "qkv": [(32, 1, 128, 4, 1), (32, 1, 128, 6, 1), (32, 1, 128, 8, 1), (32, 1, 128, 6, 2),
            (64, 2, 128, 4, 1)],
    "o": [(32, 2, 128, 4, 1), (32, 2, 128, 6, 1), (16, 1, 128, 8, 4), (16, 1, 128, 8, 2), (64, 4, 64, 8, 1)],
    "gate_up": [(96, 1, 64, 8, 1), (96, 1, 64, 9, 1), (96, 1, 64, 8, 2), (96, 1, 128, 4, 2),
                (64, 1, 64, 8, 1)],
    "down": [(32, 2, 64, 8, 1), (32, 2, 128, 4, 1), (32, 2, 128, 6, 1), (16, 1, 128, 8, 4),
             (64, 4, 128, 4, 1)],
}  # fmt: skip


def weights(name: str) -> list[torch.Tensor]:
    n, k = SHAPES[name]
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]


def isolated(name: str, rows: int, tbs: float) -> dict[str, float]:
    n, k = SHAPES[name]
    ws = weights(name)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    res = {"floor": n * k * 2 / tbs / 1e6}
    res["cublas"] = graph_us(lambda: [torch.matmul(x, w.T, out=y) for w in ws], LAYERS)
    for bn, split, bk, stages, mc in SWEEP[name]:
        for pdl in (False, True):
            cfg = CuteGemmConfig(bn, split_k=split, block_k=bk, stages=stages, multicast=mc, pdl=pdl)
            key = f"n{bn} split{split} k{bk} stages{stages} mc{mc}" + (" pdl" if pdl else "")
            res[key] = graph_us(lambda cfg=cfg: [cute_linear(x, w, cfg, out=y) for w in ws], LAYERS)
    return res


def chain(rows: int, pdl: bool) -> dict[str, float]:
    """µs a layer: cuBLAS, and config_for's picks (`pdl` or not), over 28 layers' distinct weights."""
    ws = {name: weights(name) for name in SHAPES}
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    qkv = torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.empty(rows, 12288, device="cuda", dtype=torch.bfloat16)

    def cfg(a: torch.Tensor, w: torch.Tensor) -> CuteGemmConfig:
        c = config_for(a, w)
        assert c is not None
        return dataclasses.replace(c, pdl=pdl)

    def cublas() -> None:
        for i in range(LAYERS):
            torch.matmul(x, ws["qkv"][i].T, out=qkv)
            x.addmm_(qkv[:, :2048], ws["o"][i].T)
            torch.matmul(x, ws["gate_up"][i].T, out=gu)
            x.addmm_(gu[:, :6144], ws["down"][i].T)

    def cute() -> None:
        for i in range(LAYERS):
            cute_linear(x, ws["qkv"][i], cfg(x, ws["qkv"][i]), out=qkv)
            cute_linear(qkv[:, :2048], ws["o"][i], cfg(qkv[:, :2048], ws["o"][i]), residual=x, out=x)
            cute_linear(x, ws["gate_up"][i], cfg(x, ws["gate_up"][i]), out=gu)
            cute_linear(gu[:, :6144], ws["down"][i], cfg(gu[:, :6144], ws["down"][i]), residual=x, out=x)

    return {"cublas": graph_us(cublas, LAYERS), "cute": graph_us(cute, LAYERS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="64")
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not available():
        raise SystemExit("gemm_cute.py needs a Hopper GPU and the cute extra (nvidia-cutlass-dsl)")
    tbs = copy_rate()
    print(f"copy rate {tbs:.2f} TB/s")
    out: dict[str, object] = {"copy_tbs": tbs}
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            res = isolated(name, rows, tbs)
            out[f"{name}@{rows}"] = res
            ranked = sorted((v, k) for k, v in res.items() if k not in ("floor", "cublas"))
            print(f"{name} M={rows}: floor {res['floor']:.2f} us, cuBLAS {res['cublas']:.2f}; best:")
            for v, k in ranked[:4]:
                print(f"    {k:36s} {v:6.2f} us  x{v / res['cublas']:.3f} cuBLAS")
        if not args.no_chain:
            for pdl in (False, True):
                res = chain(rows, pdl)
                out[f"chain@{rows}{' pdl' if pdl else ''}"] = res
                ratio = res["cute"] / res["cublas"]
                cub, cut = res["cublas"], res["cute"]
                print(f"chain M={rows} pdl={pdl}: cuBLAS {cub:.2f} us a layer, cute {cut:.2f} (x{ratio:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
