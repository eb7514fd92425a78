"""cuBLASLt's algorithms for the decode step's GEMMs at M = 64 / 16 / 1, each timed, against torch.mm.

torch runs cuBLAS's one top heuristic. This bench asks cuBLASLt (nvmath-python's bindings, the `gpu`
extra) for up to 64 algorithms its heuristic ranks for the shape, then re-tries the first `--vary` of
them with split-K factors and reduction schemes the heuristic did not list, and times every one
cuBLASLt accepts in a CUDA graph over enough weight copies that they come from HBM (as
`bench/gemm_decode.py` times cuBLAS and the skinny kernel). The engine's tuning
(`shared/model/gemm_tuning.py`) tries the first 16 that do not split K.

    python bench/gemm_lt.py [--rows 64] [--shapes qkv,o,gate_up,down,lm_head] [--json lt.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gemm_decode import SHAPES, copy_rate, graph_us, problems
from shared.kernels.lt_gemm import candidates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--vary", type=int, default=8, help="heuristic picks re-tried with other split-K factors")
    ap.add_argument("--top", type=int, default=6, help="rows of the ranking to print per shape")
    ap.add_argument("--json")
    args = ap.parse_args()
    tbs = copy_rate()
    print(f"copy rate {tbs:.2f} TB/s", flush=True)
    rows = []
    for name, m, ws, floor_us, x in problems(args.shapes, args.rows, tbs):
        n, k = SHAPES[name]
        copies = len(ws)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.mm(x, ws[0].T)
        torch_us = graph_us(lambda: [torch.mm(x, w.T, out=out) for w in ws], copies)  # noqa: B023
        ranked = []
        for gemm in candidates(m, n, k, count=64, vary=args.vary):
            gemm(x, ws[0], out)
            if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                print(f"  {name} M={m} {gemm.label}: wrong result, skipped", flush=True)
                continue
            us = graph_us(lambda g=gemm: [g(x, w, out) for w in ws], copies)  # noqa: B023
            ranked.append((us, gemm.label))
        ranked.sort()
        best = ranked[0] if ranked else (float("nan"), "none")
        print(f"{name:8s} M={m:<3d} floor {floor_us:7.2f} us  torch.mm {torch_us:7.2f}  "
              f"best lt {best[0]:7.2f} ({len(ranked)} algos)", flush=True)  # fmt: skip
        for us, label in ranked[: args.top]:
            print(f"         {us:7.2f} us  {label}", flush=True)
        ranking = [(round(us, 2), label) for us, label in ranked]
        rows.append(
            {"shape": name, "M": m, "floor_us": round(floor_us, 2), "torch_mm_us": round(torch_us, 2),
             "ranked": ranking}
        )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
