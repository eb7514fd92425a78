"""Throughput of the `inline` KV handoff (KV bytes in the Prefill gRPC stream), on CPU.

    python bench/inline_transfer.py services   # real prefill + decode processes on loopback
    python bench/inline_transfer.py inprocess  # stage -> chunks -> protobuf -> receive, one process

`services` starts the two services (`random:` model whose KV is large per token and cheap to compute:
32 KV heads x 128, tiny hidden; float32) and sends prompts one at a time through decode's public
Generate with max_tokens=1. The handoff of each request runs from the end of prefill's forward to the
first token at the client, which decode sends only once every chunk is written into its cache and the
request admitted; GB/s is the KV bytes over that time. Spans (PDSERVE_TEST_SPAN_FILE) split it:
extract (stage on prefill's scheduler thread), send (prefill's stream, first chunk to PrefillDone),
receive (decode's stream) and the tail after PrefillDone (chunks still being written, admission, the
first token back). `--base DIR` runs the same services from another checkout (e.g. `git archive HEAD`
unpacked) in the same run, for a side-by-side comparison.

`inprocess` runs the H200 serving shape (28 layers SSSF x 7, window 1024, 8 KV heads x 128, bf16, page
16, 4096-token prompt: 117 MB of full layers + 88 MB of window) through the same functions without
gRPC: stage, the sender's messages serialized, parsed and received as decode does, timing each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERVICE_MODEL = {"layers": "SSSF" * 7, "window": 128, "vocab": 128, "hidden": 64, "heads": 32, "kv_heads": 32,
                 "head_dim": 128, "intermediate": 64, "max_context": 4096}  # fmt: skip
H200_SHAPE = {"layers": "SSSF" * 7, "window": 1024, "heads": 8, "kv_heads": 8, "head_dim": 128}


# ---- services ----


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_services(root: Path, args: argparse.Namespace, label: str) -> dict[str, Any]:
    from shared.client.client import Client
    from shared.client.up import Service

    model = "random:" + json.dumps(json.loads(args.model), separators=(",", ":"))
    common = ["--model", model, "--dtype", args.dtype, "--device", "cpu", "--no-metrics",
              "--num-pages", str(args.num_pages), "--max-batch-tokens", str(args.prompt_tokens)]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="inline_bench_"))
    env = {
        "PYTHONPATH": str(root),
        "PDSERVE_INVARIANT_CHECK": "off",
        **dict(e.split("=", 1) for e in args.env),
    }
    cwd = os.getcwd()
    os.chdir(root)  # `python -m prefill_service` imports from the checkout being measured
    try:
        prefill = Service(
            "prefill", "127.0.0.1", 0, [*common], env={**env, "PDSERVE_TEST_SPAN_FILE": str(tmp / "p")}
        )
        if not prefill.wait_ready(300):
            raise SystemExit("prefill did not start")
        remote = [
            "--prefill-target",
            prefill.target,
            "--local-prefill-max-tokens",
            "0",
            "--prefill-timeout",
            "600",
        ]
        decode = Service(
            "decode",
            "127.0.0.1",
            0,
            [*common, *remote],
            env={**env, "PDSERVE_TEST_SPAN_FILE": str(tmp / "d")},
        )
    finally:
        os.chdir(cwd)
    try:
        if not decode.wait_ready(300):
            raise SystemExit("decode did not start")
        vocab = json.loads(args.model).get("vocab", 97)
        rng = random.Random(0)
        firsts: dict[str, int] = {}
        with Client(decode.target) as client:
            for i in range(args.warmup + args.requests):
                rid = f"{label}-{i}"
                prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
                stream = client.generate(prompt, request_id=rid, max_tokens=1, temperature=0.0, timeout=600)
                for _ in stream:
                    firsts.setdefault(rid, time.time_ns())
                if i >= args.warmup:
                    print(f"  {label}: request {i - args.warmup + 1}/{args.requests} done", flush=True)
    finally:
        for child in (decode, prefill):
            child.stop()
    spans = _spans(tmp / "p") + _spans(tmp / "d")
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    rows = []
    for i in range(args.warmup, args.warmup + args.requests):
        rid = f"{label}-{i}"
        trace = next(
            t for t in by_trace.values() if any(s["attributes"].get("gen_ai.response.id") == rid for s in t)
        )
        named = {(s["service"], s["name"]): s for s in trace}
        fwd = named[("pdserve-prefill", "prefill.forward")]
        extract = named[("pdserve-prefill", "kv.extract")]
        send = named[("pdserve-prefill", "kv.transfer")]
        recv = named[("pdserve-decode", "kv.transfer")]
        nbytes = recv["attributes"]["pdserve.kv.bytes"]
        handoff = (firsts[rid] - fwd["end_ns"]) / 1e9
        rows.append({
            "bytes": nbytes, "handoff_s": handoff, "gbps": nbytes / handoff / 1e9,
            "forward_s": (fwd["end_ns"] - fwd["start_ns"]) / 1e9,
            "extract_s": (extract["end_ns"] - extract["start_ns"]) / 1e9,
            "send_s": (send["end_ns"] - send["start_ns"]) / 1e9,
            "receive_s": (recv["end_ns"] - recv["start_ns"]) / 1e9,
            "tail_s": (firsts[rid] - recv["end_ns"]) / 1e9,
        })  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"label": label, "requests": rows, "median": med}


def services(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [(ROOT, "this")]
    if args.base:
        runs.insert(0, (Path(args.base).resolve(), "base"))
    out = [_run_services(root, args, label) for root, label in runs]
    print(f"\n{args.requests} sequential requests of {args.prompt_tokens} tokens, {args.dtype}, {args.model}")
    print(f"{'tree':6} {'MB':>6} {'GB/s':>6} {'handoff':>8} {'extract':>8} {'send':>8} {'receive':>8} "
          f"{'tail':>8} {'forward':>8}   (medians, seconds)")  # fmt: skip
    for r in out:
        m = r["median"]
        cols = [m[k] for k in ("handoff_s", "extract_s", "send_s", "receive_s", "tail_s", "forward_s")]
        head = f"{r['label']:6} {m['bytes'] / 1e6:6.0f} {m['gbps']:6.2f} "
        print(head + " ".join(f"{c:8.3f}" for c in cols))
    return out


# ---- in-process ----


def inprocess(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from shared.engine.kv.cache import KVCache, KVConfig
    from shared.pb.pdserve.v1 import prefill_pb2 as pb
    from shared.serving.api.model_source import random_model_config
    from shared.transfer import inline
    from shared.transfer.base import Chunk, KVLayout

    def _response(c: Chunk) -> pb.PrefillResponse:
        return c.response() if hasattr(c, "response") else pb.PrefillResponse(chunk=c.to_pb())

    torch.set_num_threads(1)  # as a service thread sees it: the other core runs the other side
    cfg = random_model_config(json.loads(args.shape))
    n = args.prompt_tokens
    dtype = getattr(torch, args.dtype)
    kvc = KVConfig(page_size=16, num_pages=n // 16 + 8, max_requests=2, dtype=dtype)
    src, dst = KVCache(cfg, kvc), KVCache(cfg, kvc)
    for t in (src.k_pages, src.v_pages, src.k_ring, src.v_ring):
        t.normal_()
    pages = list(range(n // 16 + 1))
    dpages = list(reversed(pages))  # the receiver's pages differ from the sender's
    assembler = getattr(inline, "ChunkAssembler", None)  # the batched receiver, where this tree has one
    layout = KVLayout.of(dst, "bench")
    out = []
    for rep in range(args.warmup + args.requests):
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        staged = inline.stage(src, pages, 0, n)
        t["stage"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # What prefill's servicer yields, serialized as gRPC does: the sender's host work per byte.
        wire = [_response(c).SerializeToString() for c in staged.chunks(args.chunk_bytes)]
        t["send"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        msgs = [pb.PrefillResponse.FromString(w) for w in wire]
        t["parse"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        inline.begin_receive(dst, 1)
        if assembler is not None:  # what decode's prefill client does, then its scheduler thread
            kv, ready = assembler(layout, n), []
            for m in msgs:
                c = m.chunk
                ready += kv.add(c.layer, c.window, c.token_start, c.token_count, c.k, c.v)
            ready += kv.finish()
            t["receive"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for b in ready:
                inline.apply_batch(dst, dpages, 1, b)
        else:
            chunks = [Chunk.from_pb(m.chunk) for m in msgs]
            t["receive"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for c in chunks:
                inline.apply_chunk(dst, dpages, 1, c)
        t["apply"] = time.perf_counter() - t0
        nbytes = sum(len(w) for w in wire)
        if rep >= args.warmup:
            out.append({"bytes": nbytes, "chunks": len(wire), **t})
    keys = ("stage", "send", "parse", "receive", "apply")
    med = {k: statistics.median(r[k] for r in out) for k in keys}
    nbytes, chunks = out[0]["bytes"], out[0]["chunks"]
    total = sum(med.values())
    print(f"\n{n} tokens, shape {args.shape}, {args.dtype}: {nbytes / 1e6:.0f} MB in {chunks} messages")
    print(f"{'phase':8} {'ms':>8} {'GB/s':>7}   (medians of {args.requests}; one thread)")
    for k in keys:
        print(f"{k:8} {med[k] * 1e3:8.1f} {nbytes / med[k] / 1e9:7.2f}")
    print(f"{'total':8} {total * 1e3:8.1f} {nbytes / total / 1e9:7.2f}")
    print(f"{'apply':8} {med['apply'] * 1e3:8.1f} ms on decode's scheduler thread per request")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("services", "inprocess"))
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, help="default: 512 (services), 4096 (inprocess)")
    ap.add_argument("--dtype", help="default: float32 (services), bfloat16 (inprocess)")
    ap.add_argument("--model", default=json.dumps(SERVICE_MODEL), help="services: the random: model JSON")
    ap.add_argument("--num-pages", type=int, default=256, help="services: KV pages per service")
    ap.add_argument("--env", action="append", default=[], help="services: KEY=VALUE for both services")
    ap.add_argument("--base", help="services: also run this checkout's services first (side by side)")
    ap.add_argument("--shape", default=json.dumps(H200_SHAPE), help="inprocess: the model's KV layout JSON")
    ap.add_argument(
        "--chunk-bytes", type=int, default=0, help="inprocess: max k + v bytes per chunk (0: default)"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    svc = args.mode == "services"
    args.prompt_tokens = args.prompt_tokens or (512 if svc else 4096)
    args.dtype = args.dtype or ("float32" if svc else "bfloat16")
    print("command:", " ".join([sys.executable, *sys.argv]))
    result = services(args) if svc else inprocess(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
