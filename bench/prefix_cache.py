"""The prefix cache on against off, side by side, under the agentic trace of bench/serving.py.

    python bench/prefix_cache.py --modes colocated --rates 2,4,8,16,32 --json prefix.json
    python bench/prefix_cache.py --modes disaggregated --rates 2,4,8,16,32

On one GPU: colocated is decode alone, prefilling locally; disaggregated is prefill and decode on the
same GPU with cuda_ipc (decode asks for every prompt: --local-prefill-max-tokens 0). For each mode the
cache's two settings run in turns (off, then on), each over the whole rate sweep, every rate with a
trace of its own (another seed: no rate reads what an earlier one cached). Per rate: TTFT and
inter-token p50/p99, requests/s, and the prompt tokens the prefilling service computed: the trace's
prompt tokens minus those it read from its cache (its /metrics). The summary gives, per mode: computed
tokens on/off, TTFT p50 on/off at each rate, and the highest sustainable rate of each (every request
served and TTFT p99 within --ttft-slo: past it the queue grows without bound).

On CPU it runs as a smoke test with `--device cpu` and a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import urllib.request
from dataclasses import replace

from bench.serving import HYBRID_2B
from shared.client.loadgen import AgenticTrace, run_load
from shared.client.up import Service

MODES = ("colocated", "disaggregated")


def start(mode: str, cache: bool, args: argparse.Namespace) -> list[Service]:
    """The services of `mode`, the prefilling one first; each with /metrics on a free port."""
    env = {"CUDA_VISIBLE_DEVICES": "0"} if args.device != "cpu" else {}
    common = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--metrics-port", "0"]
    common += [*args.service_args.split(), *([] if cache else ["--no-prefix-cache"])]
    if mode == "colocated":
        return [Service("decode", "127.0.0.1", 0, common, env=env)]
    prefill = Service("prefill", "127.0.0.1", 0, common, env=env)
    if not prefill.wait_ready(600):
        raise SystemExit(f"prefill did not start:\n{chr(10).join(prefill.tail)}")
    remote = ["--prefill-target", prefill.target, "--local-prefill-max-tokens", "0"]
    remote += ["--kv-transfer", "cuda_ipc"] if args.device != "cpu" else []
    return [prefill, Service("decode", "127.0.0.1", 0, [*common, *remote], env=env)]


def metrics_url(service: Service) -> str:
    for line in service.tail:
        if " metrics on " in line:
            return f"http://{line.rsplit(' ', 1)[1]}/metrics"
    raise SystemExit(f"{service.role}: no metrics line")


def hit_tokens(url: str) -> float:
    """Prompt tokens one service has read from its prefix cache so far (its /metrics)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r"^pdserve_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def run_mode(mode: str, cache: bool, args: argparse.Namespace, trace: AgenticTrace) -> list[dict]:
    services = start(mode, cache, args)
    rows = []
    try:
        decode = services[-1]
        if not decode.wait_ready(600):
            raise SystemExit(f"{mode}: decode did not start:\n{chr(10).join(decode.tail)}")
        url = metrics_url(services[0])
        # Warm-up, not reported: the first prompts of each length compile the prefill kernels.
        warm = replace(trace, sessions=2, seed=10_000)
        asyncio.run(run_load(decode.target, warm, 4.0))
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            sent = replace(trace, seed=i + 1)
            prompt_tokens = sum(map(len, sent.prompts(2)))  # lengths do not depend on the vocabulary
            before = hit_tokens(url)
            result = asyncio.run(run_load(decode.target, sent, rate)).as_dict()
            hit = hit_tokens(url) - before
            row = {"mode": mode, "prefix_cache": cache, **result, "prompt_tokens": prompt_tokens,
                   "computed_prompt_tokens": prompt_tokens - hit}  # fmt: skip
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    finally:
        for service in services:
            service.stop()
    return rows


def sustainable(rows: list[dict], slo: float) -> float:
    """The highest rate at which every request was served with TTFT p99 within `slo` seconds (0: none)."""
    ok = [r["rate"] for r in rows if not r["errors"] and r["ttft_p99"] <= slo]
    return max(ok, default=0.0)


def summary(mode: str, off: list[dict], on: list[dict], slo: float) -> dict:
    computed = [sum(r["computed_prompt_tokens"] for r in rows) for rows in (off, on)]
    ttft = {r_off["rate"]: (r_off["ttft_p50"], r_on["ttft_p50"]) for r_off, r_on in zip(off, on, strict=True)}
    rate_off, rate_on = sustainable(off, slo), sustainable(on, slo)
    return {
        "mode": mode,
        "computed_prompt_tokens_off": computed[0],
        "computed_prompt_tokens_on": computed[1],
        "computed_fewer": 1 - computed[1] / max(computed[0], 1),
        "ttft_p50_off_over_on": {rate: off_s / max(on_s, 1e-9) for rate, (off_s, on_s) in ttft.items()},
        "sustainable_rate_off": rate_off,
        "sustainable_rate_on": rate_on,
        "sustainable_ratio": rate_on / rate_off if rate_off else float("inf"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:" + json.dumps(HYBRID_2B, separators=(",", ":")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    ap.add_argument("--rates", default="2,4,8,16,32")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="seconds: TTFT p99 of a sustainable rate")
    ap.add_argument(
        "--service-args", default="--num-pages 49152 --max-running 64 --max-batch-tokens 8192",
        help="to every service (both share the GPU in disaggregated mode: size the pools for two)",
    )  # fmt: skip
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(set(modes) - set(MODES))}; known: {', '.join(MODES)}")
    trace = AgenticTrace(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
    rows, summaries = [], []
    for mode in modes:
        off = run_mode(mode, False, args, trace)
        on = run_mode(mode, True, args, trace)
        rows += off + on
        summaries.append(summary(mode, off, on, args.ttft_slo))
        print(json.dumps(summaries[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summaries}, f, indent=1)


if __name__ == "__main__":
    main()
