"""The serving bench's agentic trace through one Engine, no services: TTFT and slow steps, pass by pass.

What `bench/serving.py` measures end to end, without gRPC, processes or transfers: each pass submits
the trace's requests at their open-loop arrival times and steps the engine. A step far above the
usual (a Triton compile for a shape not seen yet, a host sync) shows in the first pass and not in a
second one over the same trace; Triton compiles are counted from a fresh cache directory.

    python bench/engine_trace.py --rate 32 --passes 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path


def _compiled(cache: Path) -> int:
    return sum(1 for p in cache.iterdir() if p.is_dir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-pages", type=int, default=8192)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--mixed", action="store_true", help="EngineConfig.mixed (decode --mixed-steps)")
    ap.add_argument("--no-warm-up", action="store_true", help="skip Engine.warm_up (the services run it)")
    ap.add_argument("--slow-ms", type=float, default=100.0, help="print steps longer than this")
    ap.add_argument(
        "--prefix-cache", action="store_true", help="EngineConfig.prefix_cache (the services' default)"
    )
    ap.add_argument(
        "--host-profile", action="store_true", help="cProfile each pass: the host's top functions"
    )
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="triton-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # before Triton reads it: every compile lands here

    import torch

    from bench.serving import HYBRID_2B
    from shared.client.loadgen import AgenticTrace
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.kv.cache import KVConfig
    from shared.engine.sampling import SamplingParams
    from shared.serving.api.model_source import load_served_model

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    spec = args.model or "random:" + json.dumps(HYBRID_2B, separators=(",", ":"))
    loaded = load_served_model(spec, device=device, dtype=getattr(torch, args.dtype))
    kv = KVConfig(num_pages=args.num_pages, max_requests=args.max_running, dtype=getattr(torch, args.dtype),
                  device=str(device))  # fmt: skip
    cfg = EngineConfig(
        max_batch_tokens=args.max_batch_tokens, max_running=args.max_running, mixed=args.mixed,
        prefix_cache=args.prefix_cache,
    )  # fmt: skip
    t0 = time.perf_counter()
    engine = Engine(loaded.model, kv, cfg)
    built = time.perf_counter() - t0
    print(f"engine built in {built:.1f} s; {_compiled(cache)} kernels compiled", flush=True)
    if not args.no_warm_up:
        before = _compiled(cache)
        took = engine.warm_up()
        print(f"warmed up in {took:.1f} s; {_compiled(cache) - before} kernels compiled", flush=True)
    trace = AgenticTrace(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
    prompts = trace.prompts(loaded.model.cfg.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for n in range(args.passes):
        profiler = cProfile.Profile() if args.host_profile else None
        if profiler is not None:
            profiler.enable()
        before = _compiled(cache)
        start, sent, first, steps, slow = time.perf_counter(), {}, {}, [], []
        queue = list(enumerate(prompts))
        while queue or not engine.idle:
            now = time.perf_counter() - start
            while queue and queue[0][0] / args.rate <= now:
                _, prompt = queue.pop(0)
                sent[engine.add_request(prompt, params)] = now
            if engine.idle:
                time.sleep(max(0.0, queue[0][0] / args.rate - now))
                continue
            t = time.perf_counter()
            produced = engine.step()
            dt = time.perf_counter() - t
            steps.append(dt)
            if dt * 1e3 > args.slow_ms:
                slow.append(dt)
                busy = f"{len(engine.running)} running, {len(engine.waiting)} waiting"
                print(f"  pass {n}: step {len(steps)}: {dt * 1e3:.0f} ms at {now:.2f} s ({busy})", flush=True)
            for req, _ in produced:
                first.setdefault(req, time.perf_counter() - start)
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        ttft = sorted(first[r] - sent[r] for r in sent)
        row = {
            "pass": n, "requests": len(sent), "wall_s": round(time.perf_counter() - start, 3),
            "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
            "ttft_p99_ms": round(1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
            "steps": len(steps), "step_p50_ms": round(1e3 * statistics.median(steps), 2),
            "slow_steps": len(slow), "slow_s": round(sum(slow), 3), "compiled": _compiled(cache) - before,
            "computed_prompt_tokens": sum(len(r.prompt) - r.cached_tokens for r in sent),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
