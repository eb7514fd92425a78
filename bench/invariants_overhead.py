"""What an SWA history check costs a decode step: none / naive / deferred flag / invariants OFF|WARN|STRICT
and WARN with the checks on a side stream (`inv_warn_conc`: the step inside `invariants.concurrent_checks`)
or launched together at the step's end (`inv_warn_batched`: inside `invariants.batched_checks`, one
kernel for all 40 windows).

A synthetic step of 40 layers; each layer does an MLP-sized matmul pair and checks its sliding-window
ring (positions [batch, W]) against the request lengths. Scenarios: `cpu-bound` (batch 8),
`gpu-bound` (batch 4096, MLP only: the check's 16 MB per layer is at its costliest relative to the
step) and `swa-decode` (batch 512, each layer also attends over its window's K/V, as a sliding
layer does: the history the check guards is read by the step anyway). The loop runs ahead like a
real scheduler: it enqueues step N+1, then waits for step N's event. Reported per variant: step
time, host enqueue time per step, and host syncs per step (PyTorch's sync debug mode, counted over one step).

    python bench/invariants_overhead.py            # on a CUDA machine; writes a table to stdout
    # a subset (`none` always runs first, as the baseline of vs_none):
    python bench/invariants_overhead.py --scenarios gpu-bound --variants inv_warn,inv_warn_batched
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import invariants
from invariants import expect, predicates
from invariants.predicates import window_expected
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT

LAYERS = 40
WINDOW = 1024


@dataclass
class Setup:
    batch: int
    hidden: int
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    pos: list[torch.Tensor]  # per layer [batch, W]
    lens: torch.Tensor
    kv: tuple[torch.Tensor, torch.Tensor] | None  # window K/V [batch, heads, W, head_dim], shared by layers
    slots: torch.Tensor
    flag: torch.Tensor


def make_setup(batch: int, hidden: int, attention: bool = False) -> Setup:
    dev = "cuda"
    lens = torch.randint(WINDOW, 4 * WINDOW, (batch,), device=dev)
    ring = window_expected(lens, WINDOW).to(torch.int32)
    return Setup(
        batch, hidden,
        x=torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16),
        w1=torch.randn(hidden, 4 * hidden, device=dev, dtype=torch.bfloat16) / hidden**0.5,
        w2=torch.randn(4 * hidden, hidden, device=dev, dtype=torch.bfloat16) / (4 * hidden) ** 0.5,
        pos=list(ring.expand(LAYERS, -1, -1).contiguous().unbind(0)),
        kv=tuple(torch.randn(batch, 8, WINDOW, 128, device=dev, dtype=torch.bfloat16) for _ in "kv")
        if attention else None,
        lens=lens, slots=torch.arange(batch, device=dev, dtype=torch.int32),
        flag=torch.zeros((), dtype=torch.bool, device=dev),
    )  # fmt: skip


def layer_work(s: Setup, h: torch.Tensor) -> torch.Tensor:
    if s.kv is not None:  # decode attention of one query per request over its window
        q = h[:, : 8 * 128].reshape(s.batch, 8, 1, 128)
        o = torch.nn.functional.scaled_dot_product_attention(q, *s.kv)
        h = h + o.reshape(s.batch, -1).repeat(1, s.hidden // (8 * 128))
    return torch.nn.functional.silu(h @ s.w1) @ s.w2


def step_none(s: Setup) -> torch.Tensor:
    h = s.x
    for _ in range(LAYERS):
        h = layer_work(s, h)
    return h


def step_naive(s: Setup) -> torch.Tensor:
    # The original: boolean-mask indexing and torch.equal, three host syncs per layer.
    h = s.x
    expected = window_expected(s.lens, WINDOW)
    for layer in range(LAYERS):
        present = s.pos[layer] >= 0
        if not torch.equal(s.pos[layer][present].long(), expected[present]):
            raise AssertionError("swa history missing")
        h = layer_work(s, h)
    return h


def step_deferred(s: Setup) -> torch.Tensor:
    # The usual fix: a device flag per layer (several small torch kernels), read once per step.
    h = s.x
    expected = window_expected(s.lens, WINDOW)
    for layer in range(LAYERS):
        s.flag |= (s.pos[layer] != expected).any()
        h = layer_work(s, h)
    return h


def step_invariants(s: Setup) -> torch.Tensor:
    h = s.x
    for layer in range(LAYERS):
        pos = s.pos[layer]
        expect(SWA_HISTORY_PRESENT, lambda pos=pos: predicates.window_positions(pos, s.lens), rows=s.slots)
        h = layer_work(s, h)
    return h


def step_concurrent(s: Setup) -> torch.Tensor:
    # What the runner does: the layer loop inside the block, each check forked beside the layers.
    with invariants.concurrent_checks(s.x.device):
        return step_invariants(s)


def step_batched(s: Setup) -> torch.Tensor:
    # The layers' checks deferred to the step's end: one grouped launch for all 40 windows.
    with invariants.batched_checks(s.x.device):
        return step_invariants(s)


VARIANTS: dict[str, tuple[Callable[[Setup], torch.Tensor], str | None]] = {
    "none": (step_none, None),
    "naive": (step_naive, None),
    "deferred": (step_deferred, None),
    "inv_off": (step_invariants, "off"),
    "inv_warn": (step_invariants, "warn"),
    "inv_warn_conc": (step_concurrent, "warn"),
    "inv_warn_batched": (step_batched, "warn"),
    "inv_strict": (step_invariants, "strict"),
}


def count_syncs(fn: Callable[[], object]) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_loop(step: Callable[[], object], after: Callable[[], object], steps: int) -> tuple[float, float]:
    """Run ahead by one step; returns (ms per step, host enqueue ms per step)."""
    events: list[torch.cuda.Event] = []
    enqueue = 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        e0 = time.perf_counter()
        step()
        ev = torch.cuda.Event()
        ev.record()
        enqueue += time.perf_counter() - e0
        events.append(ev)
        if len(events) > 1:
            events.pop(0).synchronize()  # the scheduler waits for step N's output here
            after()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return 1e3 * total / steps, 1e3 * enqueue / steps


@dataclass
class Prepared:
    """One variant ready to time: its step (a graph's replay, or the eager step), its after-wait work,
    its level, its syncs per step."""

    name: str
    graph: bool
    step: Callable[[], object]
    after: Callable[[], object]
    level: str
    syncs: int


def prepare(s: Setup, name: str, graph: bool) -> Prepared | None:
    fn, level = VARIANTS[name]
    checker = invariants.checker("cuda")
    if name == "naive" and graph:
        return None  # a host sync cannot be captured
    with invariants.levels(level or "off"):
        step = lambda: fn(s)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        syncs = count_syncs(step)
        if name == "deferred":
            after = lambda: bool(s.flag)
            syncs += 1
        else:
            after = checker.poll
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            step = g.replay
            syncs = 0 if name != "deferred" else 1
        checker.drain()
    return Prepared(name, graph, step, after, level or "off", syncs)


def measure_round_robin(todo: list[Prepared], steps: int, repeats: int) -> list[dict[str, object]]:
    """Time every variant `repeats` times, in turns (none, a, b, none, a, b, ...), so that drift of the
    shared GPU's clocks and neighbours hits every variant alike; report medians."""
    times: dict[str, list[tuple[float, float]]] = {p.name: [] for p in todo}
    checker = invariants.checker("cuda")
    for _ in range(repeats):
        for p in todo:
            with invariants.levels(p.level):
                times[p.name].append(run_loop(p.step, p.after, steps))
                checker.drain()
    rows = []
    for p in todo:
        ts = times[p.name]
        rows.append({
            "variant": p.name, "graph": p.graph, "step_ms": statistics.median(t[0] for t in ts),
            "spread_ms": max(t[0] for t in ts) - min(t[0] for t in ts),
            "enqueue_ms": statistics.median(t[1] for t in ts), "syncs_per_step": p.syncs,
        })  # fmt: skip
    return rows


def profile_enqueue(calls: int = 2000) -> None:
    """Where the host time of one WARN check goes (cProfile over many expect() calls)."""
    import cProfile
    import pstats

    s = make_setup(8, 256)
    pos = s.pos[0]
    with invariants.levels("warn"):
        for _ in range(10):
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, s.lens), rows=s.slots)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, s.lens), rows=s.slots)
        per_call = (time.perf_counter() - t0) / calls
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, s.lens), rows=s.slots)
        prof.disable()
        torch.cuda.synchronize()
    print(f"host time per WARN expect(): {1e6 * per_call:.1f} us")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


SCENARIOS = {"cpu-bound": (8, False), "gpu-bound": (4096, False), "swa-decode": (512, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="cpu-bound,gpu-bound,swa-decode", help=", ".join(SCENARIOS))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ", ".join(VARIANTS))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--profile", action="store_true", help="profile the host side of one check and exit")
    args = ap.parse_args()
    variants = ["none"] + [v for v in args.variants.split(",") if v and v != "none"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    torch.manual_seed(0)
    invariants.checker("cuda")
    if args.profile:
        profile_enqueue()
        return
    rows = []
    for scenario in args.scenarios.split(","):
        batch, attention = SCENARIOS[scenario]
        s = make_setup(batch, args.hidden, attention)
        for graph in (False, True):
            todo = [p for p in (prepare(s, name, graph) for name in variants) if p is not None]
            base = None
            for r in measure_round_robin(todo, args.steps, args.repeats):
                base = base or r["step_ms"]
                r["vs_none"] = r["step_ms"] / base
                r["scenario"], r["batch"] = scenario, s.batch
                rows.append(r)
                mode = "graph" if graph else "eager"
                print(
                    f"{scenario:10s} {mode} {r['variant']:18s} step {r['step_ms']:8.3f} ms "
                    f"(±{r['spread_ms']:.3f})  enqueue {r['enqueue_ms']:8.3f} ms  "
                    f"syncs/step {r['syncs_per_step']:4d}  x{r['vs_none']:.4f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
