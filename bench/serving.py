"""Disaggregated (prefill on GPU 0, decode on GPU 1) against colocated (decode alone on one GPU,
prefilling locally) at the same open-loop load: TTFT / inter-token latency p50/p99 and tok/s.

    python bench/serving.py --model 'random:{"layers":"SSSF"*7,...}' --rates 1,2,4 --json serving.json

Runs on the two-GPU machine (each service sees one GPU through CUDA_VISIBLE_DEVICES); on CPU it
still runs, as a smoke test, with `--device cpu` and a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from shared.client.loadgen import AgenticTrace, run_load
from shared.client.up import Service

HYBRID_2B = {"layers": "SSSF" * 7, "window": 1024, "vocab": 32000, "hidden": 2048, "heads": 16,
             "kv_heads": 8, "head_dim": 128, "intermediate": 6144, "max_context": 8192}  # fmt: skip


MODES = ("colocated", "colocated-mixed", "disaggregated", "disaggregated-cuda_ipc")


def start(mode: str, model: str, device: str, extra: list[str], decode_extra: list[str]) -> list[Service]:
    """colocated: decode alone on GPU 0, prompts first. colocated-mixed: the same with --mixed-steps
    (decode in every step beside the prompt chunks). disaggregated: prefill on GPU 0, decode on GPU 1,
    KV inline. disaggregated-cuda_ipc: the same with both GPUs visible to both, prefill writing into
    decode's pool."""
    common = ["--model", model, *extra]
    if mode in ("colocated", "colocated-mixed"):
        gpu0 = {"CUDA_VISIBLE_DEVICES": "0"}
        mixed = ["--mixed-steps"] if mode == "colocated-mixed" else []
        decode = Service(
            "decode", "127.0.0.1", 0, [*common, *mixed, *decode_extra, "--device", device], env=gpu0
        )
        return [decode]
    ipc = mode == "disaggregated-cuda_ipc"
    if device == "cpu":
        devices, prefill_dev, decode_dev = ("", ""), "cpu", "cpu"
    elif ipc:  # cuda_ipc maps decode's GPU into prefill's process: both see both GPUs
        devices, prefill_dev, decode_dev = ("0,1", "0,1"), "cuda:0", "cuda:1"
    else:
        devices, prefill_dev, decode_dev = ("0", "1"), "cuda", "cuda"
    env = [{"CUDA_VISIBLE_DEVICES": d} if d else {} for d in devices]
    prefill = Service("prefill", "127.0.0.1", 0, [*common, "--device", prefill_dev], env=env[0])
    if not prefill.wait_ready(600):
        raise SystemExit("prefill did not start")
    remote = ["--prefill-target", prefill.target, "--local-prefill-max-tokens", "0"]
    remote += ["--kv-transfer", "cuda_ipc"] if ipc else []
    decode_args = [*common, *decode_extra, "--device", decode_dev, *remote]
    decode = Service("decode", "127.0.0.1", 0, [*decode_args], env=env[1])
    return [decode, prefill]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:" + json.dumps(HYBRID_2B, separators=(",", ":")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument(
        "--modes",
        default="colocated,disaggregated,disaggregated-cuda_ipc",
        help="of " + ", ".join(MODES),
    )
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--service-args", default="--num-pages 8192 --max-running 64 --max-batch-tokens 8192")
    ap.add_argument("--decode-args", default="", help="decode's only (write --decode-args=--flag)")
    ap.add_argument("--json")
    args = ap.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    trace = AgenticTrace(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
    extra = ["--dtype", args.dtype, *args.service_args.split()]
    rows = []
    for mode in args.modes.split(","):
        children = start(mode, args.model, args.device, extra, args.decode_args.split())
        try:
            if not children[0].wait_ready(600):
                raise SystemExit(f"{mode}: decode did not start")
            # Warm-up, not reported: the first prompts of each length compile the prefill kernels.
            warm = AgenticTrace(2, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
            asyncio.run(run_load(children[0].target, warm, 4.0))
            for rate in (float(r) for r in args.rates.split(",")):
                result = asyncio.run(run_load(children[0].target, trace, rate)).as_dict()
                rows.append({"mode": mode, **result})
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}
                print(json.dumps(shown), flush=True)
        finally:
            for child in children:
                child.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
