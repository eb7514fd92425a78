"""Micro-benchmark of the Triton attention ops against the torch reference on one GPU.

Decode (one query per sequence) is memory-bound: the figure of merit is the K/V bytes the kernel
must read divided by its time, against the card's ~4.8 TB/s. Prefill is reported in TFLOP/s of
the causal attention it computes (4 * Hq * D flops per visible query-key pair). Times are eager
(do_bench): a short one is the Python launch cost of the wrapper, not the kernel; decode runs from a
CUDA graph in the engine, where that launch cost is not paid per call.

The engine's decode shape (bench/engine.py: batch 64 at 528 tokens, W=1024) is timed first, from a
CUDA graph as the engine runs it, for ring and paged attention with split-K forced off, as the rule
picks it, and forced to a few other factors; against a copy of the same K/V bytes timed the same way
in the same run.

    PYTHONPATH=. python bench/attention.py     # on a CUDA machine; a table to stdout
    PYTHONPATH=. python bench/attention.py --engine-only  # just the engine decode shape (~1 min)
    PYTHONPATH=. python bench/attention.py --json out.json  # the same rows as JSON
    PYTHONPATH=. python bench/attention.py --rope  # engine shape: RoPE kernel + attention vs RoPE inside
    PYTHONPATH=. python bench/attention.py --contexts 2,64,272,528  # engine batch, RoPE inside, by context
    PYTHONPATH=. python bench/attention.py --kv-fp8 528,2048  # engine batch: bf16 vs FP8 pages and rings
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable

import torch
from triton.testing import do_bench, do_bench_cudagraph

from shared.kernels import KVStore
from shared.kernels._launch import Tiles, choose_tiles, fills_gpu, sm_count, split_count
from shared.kernels.attention import TorchOps, TritonOps
from shared.kernels.attention.fused_rope import RopeInKernel
from shared.kernels.attention.paged_attention import _paged_attention_kernel, paged_attention
from shared.kernels.attention.ring_attention import _ring_attention_kernel, ring_attention
from shared.kernels.kv_quant import KVQuant, quantize
from shared.kernels.rope import rope as rope_kernel

HQ, HKV, D, PAGE = 16, 8, 128, 16


def _paged_inputs(
    l0: list[int], n: list[int], dtype: torch.dtype, hq: int = HQ, hkv: int = HKV
) -> dict[str, torch.Tensor]:
    batch = len(l0)
    max_pages = math.ceil(max(a + b for a, b in zip(l0, n, strict=True)) / PAGE)
    pages = batch * max_pages
    cu = [0]
    for x in n:
        cu.append(cu[-1] + x)
    return {
        "q": torch.randn(cu[-1], hq, D, device="cuda", dtype=dtype),
        "k_cache": torch.randn(pages, PAGE, hkv, D, device="cuda", dtype=dtype),
        "v_cache": torch.randn(pages, PAGE, hkv, D, device="cuda", dtype=dtype),
        "block_table": torch.randperm(pages, device="cuda").view(batch, max_pages).int(),
        "cu_q": torch.tensor(cu, dtype=torch.int32, device="cuda"),
        "q_start": torch.tensor(l0, dtype=torch.int32, device="cuda"),
    }


def _ring_inputs(
    l0: list[int], n: list[int], window: int, dtype: torch.dtype, hq: int = HQ, hkv: int = HKV
) -> dict[str, torch.Tensor]:
    tokens = sum(n)
    return {
        "q": torch.randn(tokens, hq, D, device="cuda", dtype=dtype),
        "k_new": torch.randn(tokens, hkv, D, device="cuda", dtype=dtype),
        "v_new": torch.randn(tokens, hkv, D, device="cuda", dtype=dtype),
        "k_ring": torch.randn(len(l0), window, hkv, D, device="cuda", dtype=dtype),
        "v_ring": torch.randn(len(l0), window, hkv, D, device="cuda", dtype=dtype),
        "slots": torch.arange(len(l0), dtype=torch.int32, device="cuda"),
        "cu_q": torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda"),
        "q_start": torch.tensor(l0, dtype=torch.int32, device="cuda"),
    }


def _row(kind: str, label: str, ms_triton: float, ms_torch: float | None, work: float, unit: str) -> dict:
    return {
        "op": kind, "case": label, "triton_us": round(ms_triton * 1e3, 1),
        "torch_us": None if ms_torch is None else round(ms_torch * 1e3, 1),
        unit: round(work / (ms_triton * 1e-3) / 1e12, 2),
    }  # fmt: skip


def copy_rate(nbytes: int) -> float:
    """Bytes/s of a device copy of `nbytes`, read + write counted as bench/engine.py counts them."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_cudagraph(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


ENGINE_BATCH, ENGINE_CTX, ENGINE_WINDOW = 64, 528, 1024  # the decode step of bench/engine.py
DecodeCall = Callable[[int | None, Tiles | None], torch.Tensor]  # (num_splits, tiles) -> output


def _cos_sin() -> torch.Tensor:
    """RoPE's cos | sin table [8192, D] (base 10000), as the engine passes it to RoPE inside attention."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def _rope_inside(
    op: str, a: dict[str, torch.Tensor], ctx: int, window: int, cos_sin: torch.Tensor
) -> RopeInKernel:
    """RoPE inside a decode call over `op`'s inputs `a` (`_ring_inputs` / `_paged_inputs`, every
    sequence's new token at position ctx - 1): each token's K/V stored into its ring entry or page row,
    as the engine's decode step does. Paged inputs get the chunk's k_new and v_new here."""
    batch = a["q_start"].shape[0]
    positions = a["q_start"].long()
    if op == "ring":
        names = ("k_ring", "v_ring")
        index = torch.arange(batch, device="cuda") * window + (ctx - 1) % window
    else:
        names = ("k_cache", "v_cache")
        index = a["block_table"][:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
        heads = a["k_cache"].shape[2]
        a["k_new"] = torch.randn(batch, heads, D, device="cuda", dtype=a["q"].dtype)
        a["v_new"] = torch.randn_like(a["k_new"])
    k_dst, v_dst = (a[name].view(-1, a[name].shape[-2], D) for name in names)
    return RopeInKernel(positions, cos_sin, k_dst, v_dst, index)


def engine_decode_calls(
    hq: int = HQ, hkv: int = HKV, fp8: bool = False, rope: bool = False
) -> tuple[dict[str, DecodeCall], dict[str, int], int]:
    """Each layer's decode attention in bench/engine.py, on fresh inputs: {"ring"/"paged": call}.

    Also each op's key span as the split rule sees it, and the K/V bytes one call must read
    (64 x 528 x 8 x 128 x 2 x 2 = 138 MB). bench/attention_tune.py sweeps the same calls. `hq`/`hkv`:
    other heads (`bench/engine.py --model 8b`: 32/8); `fp8`: an FP8 cache (half the bytes); `rope`:
    RoPE inside attention, which also stores the token's K/V, as the engine's decode step calls it
    (over an FP8 cache, unsplit calls then read whole key tiles unmasked: `_launch.whole_tiles`).
    """
    dtype, scale, batch, ctx, window = torch.bfloat16, D**-0.5, ENGINE_BATCH, ENGINE_CTX, ENGINE_WINDOW
    l0, n = [ctx - 1] * batch, [1] * batch
    kv_bytes = 2 * batch * ctx * hkv * D * (1 if fp8 else 2)
    ring, paged = _ring_inputs(l0, n, window, dtype, hq, hkv), _paged_inputs(l0, n, dtype, hq, hkv)
    quant = KVQuant() if fp8 else None
    if fp8:
        ring.update({name: quantize(ring[name], 1.0) for name in ("k_ring", "v_ring")})
        paged.update({name: quantize(paged[name], 1.0) for name in ("k_cache", "v_cache")})
    inside: dict[str, dict] = {"ring": {}, "paged": {}}
    if rope:
        cos_sin = _cos_sin()
        inside = {
            op: {"rope": _rope_inside(op, a, ctx, window, cos_sin)}
            for op, a in (("ring", ring), ("paged", paged))
        }
    calls: dict[str, DecodeCall] = {
        "ring": lambda s, t=None: ring_attention(
            **ring, max_q=1, scale=scale, window=window, num_splits=s, tiles=t, quant=quant, **inside["ring"]
        ),
        "paged": lambda s, t=None: paged_attention(
            **paged, max_q=1, scale=scale, window=None, num_splits=s, tiles=t, quant=quant, **inside["paged"]
        ),
    }
    span = {"ring": window, "paged": paged["block_table"].shape[1] * PAGE}
    return calls, span, kv_bytes


def engine_decode(sweep: list[int]) -> list[dict]:
    """Each layer's decode attention in bench/engine.py, replayed from a CUDA graph.

    roofline_us is the K/V bytes (138 MB) at the copy's rate.
    """
    batch, ctx, window = ENGINE_BATCH, ENGINE_CTX, ENGINE_WINDOW
    calls, span, kv_bytes = engine_decode_calls()
    rate = copy_rate(kv_bytes)
    # What the wrappers' rule picks here (tests/attention/test_attention_gpu.py checks they agree).
    sms = sm_count(torch.cuda.current_device())
    rows = []
    for op, call in calls.items():
        full = fills_gpu(torch.device("cuda"), batch * HKV)
        block_n = choose_tiles(HQ // HKV, D, 1, f"{op}_attention", full).block_n
        auto = split_count(batch * HKV, span[op], block_n, sms)
        for splits in dict.fromkeys([1, None, *sweep]):  # unsplit, the rule, forced factors
            fn = lambda c=call, s=splits: c(s, None)
            ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
            label = "1 (old)" if splits == 1 else f"{auto} (rule)" if splits is None else f"{splits} (forced)"
            rows.append({
                "op": f"{op} decode, engine shape", "case": f"B={batch} ctx={ctx} W={window} splits={label}",
                "graph_us": round(ms * 1e3, 1), "TB/s": round(kv_bytes / (ms * 1e-3) / 1e12, 2),
                "copy_TB/s": round(rate / 1e12, 2), "roofline_us": round(kv_bytes / rate * 1e6, 1),
                "x_roofline": round(ms * 1e-3 * rate / kv_bytes, 2),
            })  # fmt: skip
    return rows


def run(with_torch: bool) -> list[dict]:
    dtype, scale = torch.bfloat16, D**-0.5
    triton_ops, torch_ops = TritonOps(), TorchOps()
    rows = []
    elt = torch.tensor([], dtype=dtype).element_size()
    for batch, ctx in [(1, 8192), (1, 32768), (8, 8192), (64, 2048), (64, 8192), (256, 4096)]:
        for window in (None, 4096):
            l0, n = [ctx - 1] * batch, [1] * batch
            args = _paged_inputs(l0, n, dtype)
            kw = {"max_q": 1, "scale": scale, "window": window}
            t = do_bench(lambda a=args, k=kw: triton_ops.paged_attention(**a, **k))
            ref = None
            if with_torch and batch * ctx <= 64 * 8192:
                ref = do_bench(lambda a=args, k=kw: torch_ops.paged_attention(**a, **k))
            keys = min(ctx, window or ctx)
            rows.append(_row("paged decode", f"B={batch} ctx={ctx} W={window}", t, ref,
                             2 * batch * keys * HKV * D * elt, "TB/s"))  # fmt: skip
    for window in (1024, 4096):
        for batch in (1, 64, 256):
            l0, n = [8191] * batch, [1] * batch
            args = _ring_inputs(l0, n, window, dtype)
            kw = {"max_q": 1, "scale": scale, "window": window}
            t = do_bench(lambda a=args, k=kw: triton_ops.ring_attention(**a, **k))
            ref = do_bench(lambda a=args, k=kw: torch_ops.ring_attention(**a, **k)) if with_torch else None
            rows.append(_row("ring decode", f"B={batch} W={window}", t, ref,
                             2 * batch * window * HKV * D * elt, "TB/s"))  # fmt: skip
    for l0, n, window in [([0], [4096], None), ([4096], [2048], None), ([0] * 4, [2048] * 4, None),
                          ([0], [8192], 1024)]:  # fmt: skip
        args = _paged_inputs(l0, n, dtype)
        kw = {"max_q": max(n), "scale": scale, "window": window}
        t = do_bench(lambda a=args, k=kw: triton_ops.paged_attention(**a, **k))
        seqs = zip(l0, n, strict=True)
        pairs = sum(sum(min(a + i + 1, window or a + i + 1) for i in range(c)) for a, c in seqs)
        label = f"L0={l0} n={n} W={window}"
        rows.append(_row("paged prefill", label, t, None, 4 * HQ * D * pairs, "TFLOP/s"))
    return rows


def _resources(kernel: object, fn: Callable[[], object], known: dict, key: tuple) -> str:
    """Registers, spills and shared memory of what `fn` compiles of `kernel` (or compiled before, as
    `key`): the compiled kernel's metadata, as bench/kernel_resources.py reads it."""
    cache = kernel.device_caches[torch.cuda.current_device()][0]  # type: ignore[attr-defined]
    before = set(cache)
    fn()
    new = [cache[k] for k in cache if k not in before]
    if new:
        k = new[-1]
        known[key] = f"regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared}"
    return known.get(key, "?")


def engine_decode_rope() -> list[dict]:
    """The engine's decode attention with RoPE applied by its own kernel (which also stores K/V) and
    then the plain attention, against the attention kernel doing both (`fused_rope.py`): one CUDA
    graph each, same inputs; with the compiled kernels' registers and shared memory."""
    dtype, scale, batch, ctx, window = torch.bfloat16, D**-0.5, ENGINE_BATCH, ENGINE_CTX, ENGINE_WINDOW
    l0, n = [ctx - 1] * batch, [1] * batch
    positions = torch.tensor(l0, dtype=torch.int64, device="cuda")
    cos_sin = _cos_sin()
    ring = _ring_inputs(l0, n, window, dtype)
    paged = _paged_inputs(l0, n, dtype)
    paged["k_new"] = torch.randn_like(ring["k_new"])
    paged["v_new"] = torch.randn_like(ring["v_new"])
    rows, known = [], {}
    kernels = {"ring": _ring_attention_kernel, "paged": _paged_attention_kernel}
    for op, args in (("ring", ring), ("paged", paged)):
        if op == "ring":
            k_dst, v_dst = args["k_ring"].view(-1, HKV, D), args["v_ring"].view(-1, HKV, D)
            index = torch.arange(batch, device="cuda") * window + (ctx - 1) % window
            attend = ring_attention
            kw = {"max_q": 1, "scale": scale, "window": window}
        else:
            k_dst, v_dst = args["k_cache"].view(-1, HKV, D), args["v_cache"].view(-1, HKV, D)
            page = args["block_table"][:, (ctx - 1) // PAGE].long()
            index = page * PAGE + (ctx - 1) % PAGE
            attend = paged_attention
            kw = {"max_q": 1, "scale": scale, "window": None}
        for norm in (False, True):
            w = [torch.rand(D, device="cuda", dtype=dtype) + 0.5 for _ in "qk"]
            weights = tuple(w) if norm else (None, None)
            plain = {k: v for k, v in args.items() if op == "ring" or k not in ("k_new", "v_new")}

            def separate(a=args, p=plain, ws=weights, at=attend, k=kw, kd=k_dst, vd=v_dst, ix=index):
                q, kr = rope_kernel(
                    a["q"], a["k_new"], positions, cos_sin, *ws, 1e-6, store=KVStore(kd, vd, ix), v=a["v_new"]
                )
                extra = {"k_new": kr} if "k_new" in p else {}
                return at(**{**p, "q": q, **extra}, **k)

            fused_rope_args = RopeInKernel(positions, cos_sin, k_dst, v_dst, index, *weights, 1e-6)

            def inside(a=args, at=attend, k=kw, r=fused_rope_args):
                return at(**a, **k, rope=r)

            label = f"B={batch} ctx={ctx}" + (" q/k norm" if norm else "")
            variants = {"RoPE kernel + attention": separate, "RoPE inside attention": inside}
            for i, (variant, fn) in enumerate(variants.items()):
                res = _resources(kernels[op], fn, known, (op, i, i and norm))
                ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
                rows.append({"op": f"{op} decode", "case": label, "variant": variant,
                             "graph_us": round(ms * 1e3, 1), "attention": res})  # fmt: skip
    return rows


def engine_decode_by_context(contexts: list[int]) -> list[dict]:
    """The engine's decode attention (batch 64, RoPE inside, default tiles) at several context lengths,
    each from a CUDA graph over three input copies (so K/V come from HBM): what a call costs beyond
    reading its K/V shows as the intercept."""
    dtype, scale, batch, window = torch.bfloat16, D**-0.5, ENGINE_BATCH, ENGINE_WINDOW
    cos_sin = _cos_sin()
    rows = []
    for ctx in contexts:
        l0, n = [ctx - 1] * batch, [1] * batch
        positions = torch.tensor(l0, dtype=torch.int64, device="cuda")
        for op in ("ring", "paged"):
            calls = []
            for _ in range(3):
                if op == "ring":
                    a = _ring_inputs(l0, n, window, dtype)
                    kd, vd = a["k_ring"].view(-1, HKV, D), a["v_ring"].view(-1, HKV, D)
                    index = torch.arange(batch, device="cuda") * window + (ctx - 1) % window
                    rope = RopeInKernel(positions, cos_sin, kd, vd, index)
                    calls.append(
                        lambda a=a, r=rope: ring_attention(**a, max_q=1, scale=scale, window=window, rope=r)
                    )
                else:
                    a = _paged_inputs(l0, n, dtype)
                    kd, vd = a["k_cache"].view(-1, HKV, D), a["v_cache"].view(-1, HKV, D)
                    index = a["block_table"][:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
                    rope = RopeInKernel(positions, cos_sin, kd, vd, index)
                    new = {"k_new": torch.randn(batch, HKV, D, device="cuda", dtype=dtype)}
                    new["v_new"] = torch.randn_like(new["k_new"])
                    calls.append(lambda a=a, r=rope, nw=new: paged_attention(
                        **a, **nw, max_q=1, scale=scale, window=None, rope=r))  # fmt: skip
            ms = do_bench_cudagraph(lambda c=calls: [f() for f in c], rep=200, return_mode="median") / 3
            kv_bytes = 2 * batch * ctx * HKV * D * torch.tensor([], dtype=dtype).element_size()
            rows.append({"op": f"{op} decode, RoPE inside", "case": f"B={batch} ctx={ctx}",
                         "graph_us": round(ms * 1e3, 2), "kv_MB": round(kv_bytes / 1e6, 1)})  # fmt: skip
    return rows


def engine_decode_fp8(contexts: list[int]) -> list[dict]:
    """The engine's decode attention (batch 64, RoPE inside, default tiles) over a bfloat16 cache and
    an FP8 one (`--kv-cache-dtype fp8_e4m3`: half the bytes to read, a conversion per element), each
    from a CUDA graph over three input copies, as `engine_decode_by_context` times it."""
    dtype, scale, batch, window = torch.bfloat16, D**-0.5, ENGINE_BATCH, ENGINE_WINDOW
    cos_sin = _cos_sin()
    rows = []
    for ctx, op, quant in itertools.product(contexts, ("ring", "paged"), (None, KVQuant())):
        l0, n = [ctx - 1] * batch, [1] * batch
        calls = []
        for _ in range(3):
            a = _ring_inputs(l0, n, window, dtype) if op == "ring" else _paged_inputs(l0, n, dtype)
            if quant is not None:
                names = ("k_ring", "v_ring") if op == "ring" else ("k_cache", "v_cache")
                a.update({name: quantize(a[name], 1.0) for name in names})
            kw = {
                "window": window if op == "ring" else None,
                "rope": _rope_inside(op, a, ctx, window, cos_sin),
            }
            attend = ring_attention if op == "ring" else paged_attention
            calls.append(lambda f=attend, a=a, k=kw, q=quant: f(**a, **k, max_q=1, scale=scale, quant=q))
        ms = do_bench_cudagraph(lambda c=calls: [f() for f in c], rep=200, return_mode="median") / 3
        keys = min(ctx, window) if op == "ring" else ctx
        kv_bytes = 2 * batch * keys * HKV * D * (1 if quant is not None else 2)
        rows.append({
            "op": f"{op} decode, RoPE inside", "case": f"B={batch} ctx={ctx}",
            "kv": "bfloat16" if quant is None else "fp8_e4m3", "graph_us": round(ms * 1e3, 2),
            "kv_MB": round(kv_bytes / 1e6, 1),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--engine-only", action="store_true", help="only the engine's decode shape")
    parser.add_argument("--splits", default="2,4,8", help="split-K factors to force at the engine shape")
    parser.add_argument("--rope", action="store_true", help="only RoPE inside attention vs a RoPE kernel")
    parser.add_argument("--contexts", help="only the engine batch at these context lengths, e.g. 2,64,528")
    parser.add_argument("--kv-fp8", help="only the engine batch over bf16 and FP8 caches at these contexts")
    opts = parser.parse_args()
    if opts.kv_fp8:
        for r in engine_decode_fp8([int(c) for c in opts.kv_fp8.split(",")]):
            print("  ".join(f"{k}={v}" for k, v in r.items()))
        return
    if opts.contexts:
        for r in engine_decode_by_context([int(c) for c in opts.contexts.split(",")]):
            print("  ".join(f"{k}={v}" for k, v in r.items()))
        return
    if opts.rope:
        for r in engine_decode_rope():
            print("  ".join(f"{k}={v}" for k, v in r.items()))
        return
    rows = engine_decode([int(x) for x in opts.splits.split(",") if x])
    if not opts.engine_only:
        rows += run(with_torch=not opts.no_torch)
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
