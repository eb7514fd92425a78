"""Sweep of launch configurations for ring and paged decode attention at the engine's decode shape (one GPU).

The shape is bench/engine.py's decode step (batch 64, context 528, W=1024, Hq=16, Hkv=8, D=128, bf16;
`bench.attention.engine_decode_calls`; `--rope`: with RoPE inside, as the engine calls it). Every
(block_n, num_warps, num_stages, splits, max_registers) is timed from a
CUDA graph, as `bench/attention.py --engine-only` times it, against a copy of the same 138 MB of K/V
timed the same way in the same run (the floor). The current default (`choose_tiles` and the split
rule, through the wrappers' default path) goes first; a config that fails to compile or launch (out of
shared memory, say) or whose output differs from the default's is reported as skipped. At the end the
default and each op's best are timed again, longer (rep 200 ms as bench/attention.py), side by side.

Kernels are compiled first by a pool of processes into Triton's on-disk cache (the full sweep is 216
compiles, each far longer than timing the config), so that the timing loop only loads them; --budget-s
stops the sweep early (the rest reported as not reached) should that take longer than planned.

    PYTHONPATH=. python bench/attention_tune.py           # full sweep: 2 x 108 configs, ~90 s
    PYTHONPATH=. python bench/attention_tune.py --quick   # 2 x 24 configs, ~35 s
    PYTHONPATH=. python bench/attention_tune.py --json tune.json  # the rows and the summary as JSON too
    PYTHONPATH=. python bench/attention_tune.py --heads 32,8 --kv-fp8  # the ~8B's heads, an FP8 cache
    PYTHONPATH=. python bench/attention_tune.py --heads 32,8 --kv-fp8 --rope --splits 1,2 \
        --max-registers 0,128  # the 8B's FP8 decode path; a register cap (0: the compiler's count)

A register cap (Triton's maxnreg, `Tiles.max_registers`) trades spills for programs an SM: at batch
64 the 8B's 512 (sequence, kv head) programs fill an SM four deep, so a cap pays only beside a split
that gives the SMs more programs to hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass

import torch
from triton.testing import do_bench_cudagraph

from bench.attention import ENGINE_BATCH, HKV, HQ, D, copy_rate, engine_decode_calls
from shared.kernels._launch import Tiles, choose_tiles, fills_gpu, sm_count, split_count

FULL = {
    "block_n": "32,64,128",
    "warps": "2,4,8",
    "stages": "1,2,3,4",
    "splits": "1,2,4",
    "max_registers": "0",
}
QUICK = {"block_n": "32,64,128", "warps": "4,8", "stages": "2,3", "splits": "2,4", "max_registers": "0"}
ATOL = 3e-2  # bf16 (tests/attention/attn_testutil.py): any config must agree with the default this well


@dataclass(frozen=True)
class Config:
    op: str  # "ring" or "paged"
    block_n: int
    num_warps: int
    num_stages: int
    splits: int
    max_registers: int | None = None  # None: the compiler's count
    group: int = HQ // HKV  # query heads per KV head
    kv_fp8: bool = False

    def label(self) -> str:
        regs = "" if self.max_registers is None else f" regs<={self.max_registers}"
        return f"bn={self.block_n} warps={self.num_warps} stages={self.num_stages} splits={self.splits}{regs}"

    def tiles(self) -> Tiles:
        base = choose_tiles(self.group, D, 1, kv_fp8=self.kv_fp8)
        return dataclasses.replace(
            base, block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
            max_registers=self.max_registers,
        )  # fmt: skip


def default_configs(span: dict[str, int], hq: int, hkv: int, kv_fp8: bool) -> dict[str, Config]:
    """What the wrappers pick at the engine shape when nothing is forced."""
    sms = sm_count(torch.cuda.current_device())
    configs = {}
    for op, key_span in span.items():
        full = fills_gpu(torch.device("cuda"), ENGINE_BATCH * hkv)
        tiles = choose_tiles(hq // hkv, D, 1, f"{op}_attention", full, kv_fp8=kv_fp8)
        splits = split_count(ENGINE_BATCH * hkv, key_span, tiles.block_n, sms)
        configs[op] = Config(
            op,
            tiles.block_n,
            tiles.num_warps,
            tiles.num_stages,
            splits,
            tiles.max_registers,
            hq // hkv,
            kv_fp8,
        )
    return configs


def sweep_order(defaults: dict[str, Config], grid: dict[str, list[int]]) -> list[Config]:
    """The defaults first, then every grid point, the ops interleaved (a cut-short sweep covers both)."""
    caps = [cap or None for cap in grid["max_registers"]]  # 0: the compiler's count
    points = list(itertools.product(grid["block_n"], grid["warps"], grid["stages"], grid["splits"], caps))
    per_op = [[Config(op, *p, d.group, d.kv_fp8) for p in points] for op, d in defaults.items()]
    return list(dict.fromkeys([*defaults.values(), *itertools.chain(*zip(*per_op, strict=True))]))


@functools.cache
def _worker_calls(hq: int, hkv: int, kv_fp8: bool, rope: bool) -> dict:
    return engine_decode_calls(hq, hkv, kv_fp8, rope)[0]


def _compile(cfg: Config, hkv: int, rope: bool) -> None:
    """In a pool process: run `cfg` once so that its kernels land in Triton's on-disk cache."""
    try:
        _worker_calls(cfg.group * hkv, hkv, cfg.kv_fp8, rope)[cfg.op](cfg.splits, cfg.tiles())
        torch.cuda.synchronize()
    except Exception:
        pass  # the timing loop meets the same failure and reports it


def precompile(configs: list[Config], hkv: int, rope: bool, jobs: int, timeout_s: float) -> None:
    if jobs < 1:
        return
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    pool = ProcessPoolExecutor(jobs, mp_context=ctx)
    # The slowest compiles first (big key tiles on few warps, deep pipelines), so no worker ends alone.
    slowest_first = sorted(configs, key=lambda c: c.block_n * c.num_stages / c.num_warps, reverse=True)
    futures = [pool.submit(_compile, c, hkv, rope) for c in slowest_first]
    _, pending = wait(futures, timeout=timeout_s)
    if pending:
        print(f"precompile: {len(pending)} of {len(configs)} configs not compiled within {timeout_s:.0f} s")
    pool.shutdown(wait=True, cancel_futures=True)


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120] if text else ''}"


def measure(call, splits: int | None, tiles: Tiles | None, ref: torch.Tensor | None, rep: int) -> dict:
    """{"us": ...} or {"skipped": why}: one eager call (compiles, checks the output), then a graph's time."""
    try:
        out = call(splits, tiles)
        torch.cuda.synchronize()
    except Exception as e:  # out of shared memory or registers, a compile error
        return {"skipped": _short(e)}
    if ref is not None and not torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=ATOL):
        return {"skipped": f"wrong result (max diff {(out.float() - ref.float()).abs().max().item():.3g})"}
    ms = do_bench_cudagraph(lambda: call(splits, tiles), rep=rep, return_mode="median")
    return {"us": ms * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller sweep: " + str(QUICK))
    parser.add_argument("--block-n", help=f"block_n values (default {FULL['block_n']})")
    parser.add_argument("--warps", help=f"num_warps values (default {FULL['warps']})")
    parser.add_argument("--stages", help=f"num_stages values (default {FULL['stages']})")
    parser.add_argument("--splits", help=f"split-K factors (default {FULL['splits']})")
    parser.add_argument(
        "--max-registers", help=f"register caps a thread, 0 for none (default {FULL['max_registers']})"
    )
    parser.add_argument("--rope", action="store_true", help="RoPE inside attention, as the engine's decode")
    parser.add_argument("--ops", default="ring,paged", help="which decode ops to sweep")
    parser.add_argument("--rep", type=int, default=20, help="ms of kernels per timing in the sweep")
    parser.add_argument("--jobs", type=int, default=min(16, max(1, (os.cpu_count() or 2) - 1)),
                        help="compile processes (0: compile in the timing loop)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=130.0, help="stop sweeping after this many seconds")
    parser.add_argument("--heads", default=f"{HQ},{HKV}", help="query heads, KV heads (~8B: 32,8)")
    parser.add_argument("--kv-fp8", action="store_true", help="an FP8 cache (--kv-cache-dtype fp8_e4m3)")
    parser.add_argument("--json", help="also write the rows and the summary to this file")
    opts = parser.parse_args()
    hq, hkv = (int(x) for x in opts.heads.split(","))
    start = time.monotonic()
    base = QUICK if opts.quick else FULL
    grid = {
        k: [int(x) for x in (getattr(opts, k) or base[k]).split(",") if x]
        for k in ("block_n", "warps", "stages", "splits", "max_registers")
    }
    ops = [op for op in opts.ops.split(",") if op]

    calls, span, kv_bytes = engine_decode_calls(hq, hkv, opts.kv_fp8, opts.rope)
    calls = {op: calls[op] for op in ops}
    defaults = default_configs({op: span[op] for op in ops}, hq, hkv, opts.kv_fp8)
    configs = sweep_order(defaults, grid)
    print(f"{len(configs)} configs; compiling with {opts.jobs} processes")
    precompile(configs, hkv, opts.rope, opts.jobs, timeout_s=opts.budget_s / 2)
    rate = copy_rate(kv_bytes)
    floor_us = kv_bytes / rate * 1e6
    print(f"copy floor: {kv_bytes / 1e6:.0f} MB in {floor_us:.1f} us ({rate / 1e12:.2f} TB/s); "
          f"compiled in {time.monotonic() - start:.0f} s")  # fmt: skip

    def stats(us: float) -> dict:
        return {"us": round(us, 1), "TB/s": round(kv_bytes / us / 1e6, 2), "x_floor": round(us / floor_us, 2)}

    refs = {op: call(None, None) for op, call in calls.items()}  # the default path's output
    rows: list[dict] = []
    for cfg in configs:
        is_default = cfg == defaults[cfg.op]
        row = {"op": cfg.op, **dataclasses.asdict(cfg), "default": is_default}
        if not is_default and time.monotonic() - start > opts.budget_s:
            row["skipped"] = "not reached (--budget-s)"
        else:  # the default is timed through the wrappers' default path, nothing forced
            forced = (None, None) if is_default else (cfg.splits, cfg.tiles())
            got = measure(calls[cfg.op], *forced, ref=refs[cfg.op], rep=opts.rep)
            row |= stats(got["us"]) if "us" in got else got
        rows.append(row)
        if "skipped" in row:
            tail = f"skipped: {row['skipped']}"
        else:
            tail = f"{row['us']:7.1f} us  {row['TB/s']:.2f} TB/s  x{row['x_floor']:.2f} floor"
        print(f"{cfg.op:5s} {cfg.label():42s} {'(default) ' if is_default else ''}{tail}", flush=True)

    summary = []
    for op in ops:
        timed = [r for r in rows if r["op"] == op and "us" in r]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["us"])
        best_cfg = Config(op, best["block_n"], best["num_warps"], best["num_stages"], best["splits"],
                          best["max_registers"], hq // hkv, opts.kv_fp8)  # fmt: skip
        again = {}  # the default and the best timed again, longer, one after the other
        for name, forced in (("default", (None, None)), ("best", (best_cfg.splits, best_cfg.tiles()))):
            again[name] = stats(measure(calls[op], *forced, ref=None, rep=200)["us"])
        ratio = round(again["best"]["us"] / again["default"]["us"], 3)
        summary.append({"op": op, "default": defaults[op].label(), "best": best_cfg.label(),
                        "default_rep200": again["default"], "best_rep200": again["best"],
                        "best_over_default": ratio})  # fmt: skip
    print(f"\nsummary (rep 200 ms; floor {floor_us:.1f} us at {rate / 1e12:.2f} TB/s):")
    for s in summary:
        for name in ("default", "best"):
            t = s[f"{name}_rep200"]
            print(f"{s['op']:5s} {name:7s} {s[name]:42s} {t['us']:7.1f} us  {t['TB/s']:.2f} TB/s  "
                  f"x{t['x_floor']:.2f} floor")  # fmt: skip
        print(f"{s['op']:5s} best / default = {s['best_over_default']:.3f}")
    print(f"total {time.monotonic() - start:.0f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            copy = {
                "MB": round(kv_bytes / 1e6, 1),
                "TB/s": round(rate / 1e12, 2),
                "floor_us": round(floor_us, 1),
            }
            json.dump({"copy": copy, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
