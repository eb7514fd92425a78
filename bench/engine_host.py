"""Host time of a steady-state decode step, the forward excluded (CPU only, no GPU needed).

    python bench/engine_host.py                        # batches 1,16,64; prompt 512; page 16
    python bench/engine_host.py --batches 64 --profile 64

A real Engine over a tiny random model whose `runner.forward` is replaced by a stub that returns a
token per row at once, so what is timed is everything `Engine.step` does around the forward: admit,
schedule, building the decode batch into CUDA-graph-shaped static buffers (graph sizes as
bench/engine.py's, table width for an 8192-token context: the layout of the 1.9B bench), the input
gather of overlap scheduling, sampling prep, postprocess and the invariant checker's poll. On a GPU
the uploads add a pinned staging copy and two non-blocking copies per step.

Columns (microseconds, median over the decode steps of the best of `--repeat` engines): `step_us` the
whole `Engine.step`, `launch_us` its launch half (decode batch build and upload, the input gather,
sampling prep; the rest is admit, schedule and postprocess), `recompose_us` the incremental build
alone on a step whose rows changed (laid out anew, block table gathered and uploaded whole);
`finish_us` the call that completes the last step, where the whole batch finishes, and `free_us` the
`Engine.free_finished` after it that gives back their KV (each the least of the row's engines).

Decode batches take the engine's incremental path (a persistent page table, per-composition host
buffers: `shared/engine/decode_batch.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.cuda_graph import packed_buffers
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.runner import ForwardOutput
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import random_model_config, random_transformer

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class _StaticShim:
    """What DecodeGraphs does on the host, for a tree whose DecodeGraphs refuses a CPU cache."""

    def __init__(self, cache, sizes: list[int], max_pages: int) -> None:
        self.cache, self.sizes, self.max_pages = cache, sorted(sizes), max_pages
        self.static, self.raw = {}, {}
        for s in sizes:
            self.raw[s], buf32, buf64 = packed_buffers(s, max_pages, cache.device)
            self.static[s] = ForwardBatch.build(
                [], Mode.DECODE, cache, pad_to=s, table_width=max_pages, into=(buf32, buf64)
            )

    def prepare(self, items: list[ChunkItem]) -> ForwardBatch | None:
        size = next((s for s in self.sizes if s >= len(items)), None)
        if size is None:
            return None
        return ForwardBatch.build(items, Mode.DECODE, self.cache, pad_to=size, table_width=self.max_pages,
                                  into=self.static[size].buffers)  # fmt: skip

    def replay(self, batch: ForwardBatch) -> None:
        return None


def make_engine(batch: int, prompt: int, steps: int) -> Engine:
    cfg = random_model_config({"layers": "SSSF", "window": 1024, "max_context": 8192, "vocab": 1000})
    pages = batch * ((prompt + steps + 16) // 16 + 1) + 16
    kv = KVConfig(page_size=16, num_pages=pages, max_requests=batch)
    engine = Engine(random_transformer(cfg), kv, EngineConfig(max_batch_tokens=8192, max_running=batch))
    sizes = [s for s in GRAPH_SIZES if s <= batch]
    max_pages = engine.cache.pages_needed(engine.max_context())
    try:
        engine.runner.capture_decode_graphs(sizes, max_pages)  # on CPU: static buffers, nothing captured
    except ValueError:
        engine.runner.graphs = _StaticShim(engine.cache, sizes, max_pages)
    zeros = torch.zeros(max(GRAPH_SIZES), dtype=torch.int64)

    def forward(fb: ForwardBatch, sampling, *, return_logits: bool = False) -> ForwardOutput:
        return ForwardOutput(zeros[: fb.num_real], None, None)

    engine.runner.forward = forward
    return engine


def measure(batch: int, prompt: int, steps: int, profile: bool = False) -> dict[str, float]:
    """Median and p90 host time of a decode step (and of its batch build) over one engine's decode."""
    engine = make_engine(batch, prompt, steps)
    build: list[float] = []
    inner = engine._launch

    def launch(*plan):  # decode batch build and upload, input gather, sampling prep, bookkeeping
        t0 = time.perf_counter()
        out = inner(*plan)
        build.append(time.perf_counter() - t0)
        return out

    engine._launch = launch
    gen = torch.Generator().manual_seed(batch)
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    prompts = torch.randint(0, 1000, (batch, prompt), generator=gen).tolist()
    reqs = [engine.add_request(p, sp) for p in prompts]
    while any(not r.output for r in reqs):  # prefill
        engine.step()
    for _ in range(8):  # warm up: every request decoding, the static buffers' composition settled
        engine.step()
    times: list[float] = []
    build.clear()
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    while all(len(r.output) + r.pending < r.params.max_tokens for r in reqs):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    compose = recompose_times(engine, reqs)
    finish = 0.0
    while not all(r.finished for r in reqs):  # the step whose completion finishes every request
        t0 = time.perf_counter()
        engine.step()
        finish = max(finish, time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.free_finished()  # their KV, after the last tokens were returned
    free = time.perf_counter() - t0
    assert engine.idle
    engine.check_idle_integrity()
    p90 = sorted(times)[int(0.9 * len(times))]
    return {"batch": batch, "steps": len(times),
            "step_us": 1e6 * statistics.median(times), "step_p90_us": 1e6 * p90,
            "launch_us": 1e6 * statistics.median(build),
            "recompose_us": 1e6 * statistics.median(compose) if compose else None,
            "finish_us": 1e6 * finish, "free_us": 1e6 * free}  # fmt: skip


def recompose_times(engine: Engine, reqs: list, n: int = 50) -> list[float]:
    """The incremental batch build on a step whose rows changed (a request joined or left): laid out
    anew, block table gathered and uploaded whole. Between two steps, so nothing is in its way."""
    times = []
    for _ in range(n):
        engine.decoder._rows = None
        t0 = time.perf_counter()
        engine.decoder.build(list(reqs), engine.runner.graphs, None)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="engines per row; the row with the best median")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the decode steps at this batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for batch in (int(b) for b in args.batches.split(",")):
        runs = [measure(batch, args.prompt, args.steps, args.profile == batch) for _ in range(args.repeat)]
        row = min(runs, key=lambda r: r["step_us"])  # shared machines: noise only ever adds
        row["finish_us"] = min(r["finish_us"] for r in runs)
        row["free_us"] = min(r["free_us"] for r in runs)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
