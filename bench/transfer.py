"""Handoff bandwidth of the cuda_ipc backend against the GPU's own peer copy, measured side by side.

    python bench/transfer.py                       # prefill on cuda:0, decode (a real process) on cuda:1
    python bench/transfer.py --decode-device cuda:0 --tokens 1024,4096

The layout is bench/engine.py's ~2B hybrid (28 layers, 3 of 4 sliding with W=1024, 8 KV heads x 128,
bf16, page 16). Decode runs in its own process, exports its pool and reserves scattered pages; prefill
maps it and `push`es a prompt's KV (full layers: every token; sliding layers: the last W). Reported per
prompt length: bytes moved, push time (CUDA events on prefill's stream), GB/s, and the same bytes as
one contiguous `copy_` from cuda:0 to cuda:1 (the NVLink peer copy), plus the sliding-layer bytes saved
against shipping each sliding layer's whole prompt.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import torch

from shared.engine.kv.cache import KVCache, KVConfig
from shared.model.config import config_from_hf

W, PAGE = 1024, 16
HF = {
    "architectures": ["MinistralForCausalLM"], "model_type": "ministral", "vocab_size": 128256,
    "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 6144, "sliding_window": W, "max_position_embeddings": 32768,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "rms_norm_eps": 1e-5,
}  # fmt: skip
HF["layer_types"] = HF["layer_types"] * 7


def _cache(device: str, max_tokens: int) -> KVCache:
    pages = 2 * (max_tokens // PAGE + 1)
    kv = KVConfig(page_size=PAGE, num_pages=pages, max_requests=2, dtype=torch.bfloat16, device=device)
    return KVCache(config_from_hf(HF), kv)


def _decode(device: str, max_tokens: int, conn) -> None:  # type: ignore[no-untyped-def]
    from shared.transfer.cuda_ipc import export_pool

    torch.cuda.set_device(device)
    cache = _cache(device, max_tokens)
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


def main() -> None:
    from shared.transfer.cuda_ipc import PeerPools, PoolExport, push

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-device", default="cuda:0")
    ap.add_argument("--decode-device", default="cuda:1")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode, args=(args.decode_device, max(lengths), child), daemon=True)
    proc.start()
    torch.cuda.set_device(args.prefill_device)
    src = _cache(args.prefill_device, max(lengths))
    for t in (src.k_pages, src.v_pages, src.k_ring, src.v_ring):
        t.normal_()
    export = PoolExport.from_pb(type(PoolExport("", "", ()).to_pb()).FromString(parent.recv()))
    peer = PeerPools(src.device, src).get(export)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        need = src.pages_needed(n)
        src_pages = torch.randperm(src.cfg.num_pages, generator=gen)[:need].tolist()
        dst_pages = torch.randperm(src.cfg.num_pages, generator=gen)[:need].tolist()
        moved = push(src, src_pages, 0, n, peer, dst_pages, 1, window=True)
        secs = _time(lambda: push(src, src_pages, 0, n, peer, dst_pages, 1, window=True), args.repeats)  # noqa: B023
        nbytes = sum(moved)
        a = torch.empty(nbytes, dtype=torch.uint8, device=args.prefill_device)
        b = torch.empty(nbytes, dtype=torch.uint8, device=args.decode_device)
        peer_s = _time(lambda: b.copy_(a, non_blocking=True), args.repeats)  # noqa: B023
        full_history = moved[1] // min(n, W) * n  # sliding layers shipping the whole prompt instead
        row = {"tokens": n, "full_bytes": moved[0], "window_bytes": moved[1], "push_ms": secs * 1e3,
               "push_gb_s": nbytes / secs / 1e9, "peer_copy_gb_s": nbytes / peer_s / 1e9,
               "share_of_peer_copy": peer_s / secs,
               "window_bytes_saved": full_history - moved[1]}  # fmt: skip
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    parent.send("done")
    proc.join(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()
