"""Handoff bandwidth of the cuda_ipc backend against the GPU's own peer copy, measured side by side.

    python bench/transfer.py                       # prefill on cuda:0, decode (a real process) on cuda:1
    python bench/transfer.py --decode-device cuda:0 --tokens 1024,4096
    python bench/transfer.py --kv-cache-dtype auto,fp8_e4m3   # the bf16 cache against the FP8 one

The layout is bench/engine.py's ~2B hybrid (28 layers, 3 of 4 sliding with W=1024, 8 KV heads x 128,
page 16), its cache in the model's bf16 (`auto`) or FP8 e4m3 (`fp8_e4m3`: one byte an element, the same
rows). Each cache dtype has its own decode process, which exports its pool and reserves scattered pages;
prefill maps it and `push`es a prompt's KV (full layers: every token; sliding layers: the last W). The
dtypes run in turns at each prompt length, on the same pages. Reported per prompt length and dtype:
bytes moved and per prompt token, push time (CUDA events on prefill's stream), GB/s, and the same bytes
as one contiguous `copy_` from the prefill to the decode device (the NVLink peer copy: the floor), plus
the sliding-layer bytes saved against shipping each sliding layer's whole prompt. With both dtypes, the
FP8 cache's bytes per token and push time as shares of the bf16 one's (bytes: 0.5 exactly).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import torch

from shared.engine.kv.cache import KVCache, KVConfig
from shared.kernels.kv_quant import FP8_KV_DTYPE
from shared.model.config import config_from_hf

W, PAGE = 1024, 16
HF = {
    "architectures": ["MinistralForCausalLM"], "model_type": "ministral", "vocab_size": 128256,
    "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 6144, "sliding_window": W, "max_position_embeddings": 32768,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "rms_norm_eps": 1e-5,
}  # fmt: skip
HF["layer_types"] = HF["layer_types"] * 7
KV_DTYPES = {"auto": torch.bfloat16, "fp8_e4m3": FP8_KV_DTYPE}  # as bench/engine.py's --kv-cache-dtype


def _cache(device: str, max_tokens: int, kv_dtype: str) -> KVCache:
    pages = 2 * (max_tokens // PAGE + 1)
    kv = KVConfig(page_size=PAGE, num_pages=pages, max_requests=2, dtype=KV_DTYPES[kv_dtype], device=device)
    return KVCache(config_from_hf(HF), kv)


def _decode(device: str, max_tokens: int, kv_dtype: str, conn) -> None:  # type: ignore[no-untyped-def]
    from shared.transfer.cuda_ipc import export_pool

    torch.cuda.set_device(device)
    cache = _cache(device, max_tokens, kv_dtype)
    conn.send(export_pool(cache).to_pb().SerializeToString())
    conn.recv()  # keep the pool alive until prefill is done


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _dtypes(value: str) -> list[str]:
    names = value.split(",")
    if any(n not in KV_DTYPES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"a list of distinct values among {', '.join(KV_DTYPES)}, got {value!r}"
        )
    return names


def main() -> None:
    from shared.transfer.cuda_ipc import PeerPools, PoolExport, push

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-device", default="cuda:0")
    ap.add_argument("--decode-device", default="cuda:1")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument(
        "--kv-cache-dtype", default="auto", type=_dtypes,
        help="the KV cache's dtype: the model's bf16 (auto) or FP8 e4m3, or a list (auto,fp8_e4m3): each "
        "with its own decode process and pool, in turns at each prompt length",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    decodes = {}  # dtype -> (pipe, process): one decode process, and pool, per cache dtype
    for name in args.kv_cache_dtype:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_decode, args=(args.decode_device, max(lengths), name, child), daemon=True)
        proc.start()
        decodes[name] = (parent, proc)
    torch.cuda.set_device(args.prefill_device)
    srcs, peers = {}, {}
    for name, (parent, _) in decodes.items():
        src = srcs[name] = _cache(args.prefill_device, max(lengths), name)
        for t in (src.k_pages, src.v_pages, src.k_ring, src.v_ring):
            t.copy_(torch.randn_like(t, dtype=torch.bfloat16))  # an FP8 tensor has no normal_
        export = PoolExport.from_pb(type(PoolExport("", "", ()).to_pb()).FromString(parent.recv()))
        peers[name] = PeerPools(src.device, src).get(export)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        num_pages = next(iter(srcs.values())).cfg.num_pages
        need = next(iter(srcs.values())).pages_needed(n)
        src_pages = torch.randperm(num_pages, generator=gen)[:need].tolist()
        dst_pages = torch.randperm(num_pages, generator=gen)[:need].tolist()
        for name, src in srcs.items():  # the dtypes in turns, on the same pages
            peer = peers[name]
            moved = push(src, src_pages, 0, n, peer, dst_pages, 1, window=True)
            secs = _time(lambda: push(src, src_pages, 0, n, peer, dst_pages, 1, window=True), args.repeats)  # noqa: B023
            nbytes = sum(moved)
            a = torch.empty(nbytes, dtype=torch.uint8, device=args.prefill_device)
            b = torch.empty(nbytes, dtype=torch.uint8, device=args.decode_device)
            peer_s = _time(lambda: b.copy_(a, non_blocking=True), args.repeats)  # noqa: B023
            full_history = moved[1] // min(n, W) * n  # sliding layers shipping the whole prompt instead
            row = {"tokens": n, "kv_cache_dtype": name, "full_bytes": moved[0], "window_bytes": moved[1],
                   "bytes": nbytes, "bytes_per_token": nbytes / n, "push_ms": secs * 1e3,
                   "push_gb_s": nbytes / secs / 1e9, "peer_copy_ms": peer_s * 1e3,
                   "peer_copy_gb_s": nbytes / peer_s / 1e9, "share_of_peer_copy": peer_s / secs,
                   "window_bytes_saved": full_history - moved[1]}  # fmt: skip
            rows.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    ratios = []
    if {"auto", "fp8_e4m3"} <= set(srcs):
        by = {(r["tokens"], r["kv_cache_dtype"]): r for r in rows}
        for n in lengths:
            bf16, fp8 = by[n, "auto"], by[n, "fp8_e4m3"]
            per_token = fp8["bytes_per_token"] / bf16["bytes_per_token"]
            push_time = fp8["push_ms"] / bf16["push_ms"]
            ratios.append({"tokens": n, "fp8_over_bf16_bytes_per_token": per_token,
                           "fp8_over_bf16_push_time": push_time})  # fmt: skip
            print(f"tokens {n}: fp8_e4m3 / bf16 bytes per token {per_token:.3f} (expected 0.5), "
                  f"push time {push_time:.3f}", flush=True)  # fmt: skip
    for parent, _ in decodes.values():
        parent.send("done")
    for _, proc in decodes.values():
        proc.join(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "ratios": ratios}, f)


if __name__ == "__main__":
    main()
