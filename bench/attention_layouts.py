"""FP8 decode attention over three K/V layouts, at the 8B's batch-64 decode shape, on one GPU.

Minimal decode kernels (the engine's online softmax, `_online_softmax.attend_block`, without the RoPE
prologue: q given, every key visible) read the same FP8 K and V laid out three ways:

- `std`: the cache's, a key's kv heads side by side (ring [slots, W, Hkv, D], page [P, page, Hkv, D]);
- `hm`: each kv head's keys contiguous (ring [slots, Hkv, W, D], page [P, Hkv, page, D]);
- `vt`: K as `hm`, V transposed in BLOCK_N-key blocks (ring [slots, Hkv, W/BLOCK_N, D, BLOCK_N]) or
  per page ([P, Hkv, D, page]), keys contiguous: the P.V operand is loaded in whole words, where
  Triton gathers an 8-bit V operand a byte at a time.

Each is timed from a CUDA graph over `--copies` input copies (one copy of few keys stays in L2: the
kernels' time without HBM binding them), beside the engine's ring and paged kernels with RoPE inside.
The outputs of the three layouts are compared with each other and with a float32 reference first.

    PYTHONPATH=. python bench/attention_layouts.py                    # 528 keys, three copies
    PYTHONPATH=. python bench/attention_layouts.py --contexts 128 --copies 1 --mini-only
    PYTHONPATH=. python bench/attention_layouts.py --sass  # no GPU: sm_90 instructions a loop pass
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from shared.kernels.attention._online_softmax import attend_block

HQ, HKV, D, W, PAGE, BATCH = 32, 8, 128, 1024, 16, 64
GROUP = HQ // HKV
LOG2E = 1.4426950408889634
LAYOUTS = ("std", "hm", "vt")


@triton.jit
def _mini_ring(
    q_ptr, k_ptr, v_ptr, out_ptr, n_ptr, stride_ks, stride_ki, stride_kh, stride_vs, stride_vx, stride_vh,
    qk_scale, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    VT: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, kv head) over ring entries 0..n-1: whole tiles unmasked, the last
    masked. VT: V is [slots, Hkv, W/BLOCK_N, D, BLOCK_N] (stride_vx: a block), else [slots, W, Hkv, D]
    (stride_vx: an entry)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(n_ptr + b)
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP
    rows = (b * GROUP * tl.num_programs(1) + kvh * GROUP + r)[:, None] * D
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows + d[None, :], mask=row_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kb = k_ptr + b.to(tl.int64) * stride_ks + kvh * stride_kh
    vb = v_ptr + b.to(tl.int64) * stride_vs + kvh * stride_vh
    nn = tl.arange(0, BLOCK_N)
    n_whole = n // BLOCK_N * BLOCK_N
    for t0 in range(0, n_whole, BLOCK_N):
        t = t0 + nn
        k = tl.load(kb + t[:, None] * stride_ki + d[None, :]).to(tl.float16)
        if VT:
            v = tl.trans(tl.load(vb + (t0 // BLOCK_N) * stride_vx + d[:, None] * BLOCK_N + nn[None, :]))
        else:
            v = tl.load(vb + t[:, None] * stride_vx + d[None, :])
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v.to(tl.float16), True, qk_scale, False, True)
    if n_whole < n:
        t = n_whole + nn
        ok = t < n
        k = tl.load(kb + t[:, None] * stride_ki + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        if VT:
            at = vb + (n_whole // BLOCK_N) * stride_vx + d[:, None] * BLOCK_N + nn[None, :]
            v = tl.trans(tl.load(at, mask=ok[None, :], other=0.0))
        else:
            v = tl.load(vb + t[:, None] * stride_vx + d[None, :], mask=ok[:, None], other=0.0)
        v = v.to(tl.float16)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, ok[None, :], qk_scale, False, True)
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows + d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _paged_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, b, kvh, t0, n, stride_kp, stride_ks, stride_kh, stride_vp,
    stride_vx, stride_vh, stride_bt, qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, VT: tl.constexpr,
):  # fmt: skip
    t = t0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    ok = t < n
    page = tl.load(bt_ptr + b * stride_bt + t // PAGE, mask=ok, other=0).to(tl.int64)
    kb = page * stride_kp + (t % PAGE) * stride_ks + kvh * stride_kh
    if VT:  # a page's V is [Hkv, D, PAGE]: runs of PAGE contiguous keys the compiler cannot see
        va = (page * stride_vp + kvh * stride_vh + (t % PAGE))[None, :] + d[:, None] * PAGE
        va = tl.max_contiguous(tl.multiple_of(va, [PAGE, PAGE]), [1, PAGE])
    else:
        va = (page * stride_vp + (t % PAGE) * stride_vx + kvh * stride_vh)[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + kb[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        if VT:
            v = tl.trans(tl.load(v_ptr + va, mask=ok[None, :], other=0.0))
        else:
            v = tl.load(v_ptr + va, mask=ok[:, None], other=0.0)
        visible = ok[None, :]
    else:
        k = tl.load(k_ptr + kb[:, None] + d[None, :])
        v = tl.load(v_ptr + va)
        if VT:
            v = tl.trans(v)
        visible = True
    return attend_block(acc, m_i, l_i, q, k.to(tl.float16), v.to(tl.float16), visible, qk_scale, False, True)


@triton.jit
def _mini_paged(
    q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, n_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vx,
    stride_vh, stride_bt, qk_scale, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, PAGE: tl.constexpr, VT: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, kv head) over its n keys through the block table. VT: V pages are
    [P, Hkv, D, PAGE] (stride_vx unused), else [P, PAGE, Hkv, D]."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(n_ptr + b)
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP
    rows = (b * GROUP * tl.num_programs(1) + kvh * GROUP + r)[:, None] * D
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows + d[None, :], mask=row_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_whole = n // BLOCK_N * BLOCK_N
    for t0 in range(0, n_whole, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, b, kvh, t0, n, stride_kp, stride_ks, stride_kh, stride_vp,
            stride_vx, stride_vh, stride_bt, qk_scale, False, BLOCK_N, D, PAGE, VT,
        )  # fmt: skip
    if n_whole < n:
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_ptr, b, kvh, n_whole, n, stride_kp, stride_ks, stride_kh,
            stride_vp, stride_vx, stride_vh, stride_bt, qk_scale, True, BLOCK_N, D, PAGE, VT,
        )  # fmt: skip
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows + d[None, :], out, mask=row_ok[:, None])


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """The same logical [., keys, Hkv, D] tensor with each kv head's keys contiguous in memory."""
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def ring_inputs(batch: int, ctx: int, block_n: int, device: str) -> dict[str, torch.Tensor]:
    k = _fp8(torch.randn(batch, W, HKV, D, device=device))
    v = _fp8(torch.randn(batch, W, HKV, D, device=device))
    blocks = v.view(torch.uint8).view(batch, W // block_n, block_n, HKV, D).permute(0, 3, 1, 4, 2)
    return {
        "q": torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16), "k": k, "v": v,
        "k_hm": _head_major(k), "v_hm": _head_major(v),
        "v_t": blocks.contiguous().view(torch.float8_e4m3fn),
        "n": torch.full((batch,), ctx, dtype=torch.int32, device=device),
    }  # fmt: skip


def paged_inputs(batch: int, ctx: int, device: str) -> dict[str, torch.Tensor]:
    per_seq = math.ceil(ctx / PAGE)
    k = _fp8(torch.randn(batch * per_seq, PAGE, HKV, D, device=device))
    v = _fp8(torch.randn(batch * per_seq, PAGE, HKV, D, device=device))
    return {
        "q": torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16), "k": k, "v": v,
        "k_hm": _head_major(k), "v_hm": _head_major(v),
        "v_t": v.view(torch.uint8).permute(0, 2, 3, 1).contiguous().view(torch.float8_e4m3fn),
        "bt": torch.randperm(batch * per_seq, device=device).view(batch, per_seq).int(),
        "n": torch.full((batch,), ctx, dtype=torch.int32, device=device),
    }  # fmt: skip


def run_ring(x: dict[str, torch.Tensor], out: torch.Tensor, layout: str, block_n: int = 32) -> None:
    k = x["k"] if layout == "std" else x["k_hm"]
    if layout == "vt":
        v, sv = x["v_t"], (x["v_t"].stride(0), x["v_t"].stride(2), x["v_t"].stride(1))
    else:
        v = x["v"] if layout == "std" else x["v_hm"]
        sv = (v.stride(0), v.stride(1), v.stride(2))
    _mini_ring[(x["q"].shape[0], HKV)](
        x["q"], k, v, out, x["n"], k.stride(0), k.stride(1), k.stride(2), *sv, D**-0.5 * LOG2E,
        GROUP=GROUP, BLOCK_M=16, BLOCK_N=block_n, D=D, VT=layout == "vt", num_warps=2, num_stages=3,
    )  # fmt: skip


def run_paged(x: dict[str, torch.Tensor], out: torch.Tensor, layout: str) -> None:
    k = x["k"] if layout == "std" else x["k_hm"]
    if layout == "vt":
        v, sv = x["v_t"], (x["v_t"].stride(0), 0, x["v_t"].stride(1))
    else:
        v = x["v"] if layout == "std" else x["v_hm"]
        sv = (v.stride(0), v.stride(1), v.stride(2))
    _mini_paged[(x["q"].shape[0], HKV)](
        x["q"], k, v, x["bt"], out, x["n"], k.stride(0), k.stride(1), k.stride(2), *sv, x["bt"].stride(0),
        D**-0.5 * LOG2E, GROUP=GROUP, BLOCK_M=16, BLOCK_N=64, D=D, PAGE=PAGE, VT=layout == "vt",
        num_warps=2, num_stages=2,
    )  # fmt: skip


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """float32 attention of each sequence's query heads over its first n keys (k, v [B, keys, Hkv, D])."""
    outs = []
    for b in range(q.shape[0]):
        kk = k[b, : n[b]].float().repeat_interleave(GROUP, dim=1)
        vv = v[b, : n[b]].float().repeat_interleave(GROUP, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].float(), kk) * D**-0.5
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


def check(batch: int, ctx: int, device: str) -> None:
    """Every layout's output against the reference (and the layouts' against each other: equal)."""
    ring, paged = ring_inputs(batch, ctx, 32, device), paged_inputs(batch, ctx, device)
    per_seq = paged["bt"].shape[1]
    paged_k = paged["k"][paged["bt"].long()].view(batch, per_seq * PAGE, HKV, D)
    paged_v = paged["v"][paged["bt"].long()].view(batch, per_seq * PAGE, HKV, D)
    for op, x, run, ref in (
        ("ring", ring, run_ring, reference(ring["q"], ring["k"], ring["v"], ring["n"])),
        ("paged", paged, run_paged, reference(paged["q"], paged_k, paged_v, paged["n"])),
    ):
        outs = {}
        for layout in LAYOUTS:
            outs[layout] = torch.empty_like(x["q"])
            run(x, outs[layout], layout)
            err = (outs[layout].float() - ref).abs().max().item()
            if err > 2e-2:
                raise SystemExit(f"{op} {layout}: max error {err} against the float32 reference")
        if not all(torch.equal(outs["std"], o) for o in outs.values()):
            raise SystemExit(f"{op}: the layouts' outputs differ")


def engine_kernels(ctx: int) -> dict[str, float]:
    """The engine's FP8 ring and paged decode attention with RoPE inside, as `bench/attention.py
    --kv-fp8` times them, at the 8B's heads: us a call."""
    from triton.testing import do_bench_cudagraph

    from bench.attention import _paged_inputs, _ring_inputs
    from shared.kernels.attention.fused_rope import RopeInKernel
    from shared.kernels.attention.paged_attention import paged_attention
    from shared.kernels.attention.ring_attention import ring_attention
    from shared.kernels.kv_quant import KVQuant, quantize

    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    l0, new = [ctx - 1] * BATCH, [1] * BATCH
    positions = torch.tensor(l0, dtype=torch.int64, device="cuda")
    times = {}
    for op in ("ring", "paged"):
        calls = []
        for _ in range(3):
            if op == "ring":
                a, names = _ring_inputs(l0, new, W, torch.bfloat16, HQ, HKV), ("k_ring", "v_ring")
                index = torch.arange(BATCH, device="cuda") * W + (ctx - 1) % W
                kw: dict = {"window": W}
            else:
                a, names = _paged_inputs(l0, new, torch.bfloat16, HQ, HKV), ("k_cache", "v_cache")
                index = a["block_table"][:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
                a["k_new"] = torch.randn(BATCH, HKV, D, device="cuda", dtype=torch.bfloat16)
                a["v_new"] = torch.randn_like(a["k_new"])
                kw = {"window": None}
            a.update({name: quantize(a[name], 1.0) for name in names})
            caches = (a[name].view(-1, HKV, D) for name in names)
            kw["rope"] = RopeInKernel(positions, cos_sin, *caches, index)
            attend = ring_attention if op == "ring" else paged_attention
            calls.append(lambda f=attend, a=a, k=kw: f(**a, **k, max_q=1, scale=D**-0.5, quant=KVQuant()))
        ms = do_bench_cudagraph(lambda c=calls: [g() for g in c], rep=200, return_mode="median") / 3
        times[op] = ms * 1e3
    return times


def sass() -> None:
    """Each mini kernel compiled for sm_90 on this machine (no GPU needed): its shared memory and a key
    loop pass's SASS instructions a warp (`bench/kernel_resources.py`'s count)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.kernel_resources import sass_counts

    types = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "n_ptr": "*i32", "bt_ptr": "*i32"}
    for name, fn, consts, warps, stages in (
        ("ring", _mini_ring, {"GROUP": GROUP, "BLOCK_M": 16, "BLOCK_N": 32, "D": D}, 2, 3),
        ("paged", _mini_paged, {"GROUP": GROUP, "BLOCK_M": 16, "BLOCK_N": 64, "D": D, "PAGE": PAGE}, 2, 2),
    ):
        for vt in (False, True):
            c = {**consts, "VT": vt}
            sig = {
                a: "constexpr" if a in c else types.get(a, "*bf16") if a.endswith("_ptr") else
                "fp32" if a == "qk_scale" else "i32"
                for a in fn.arg_names
            }  # fmt: skip
            hints = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a][0] in "*i"}
            src = ASTSource(fn=fn, signature=sig, constexprs=c, attrs=hints)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                    "num_stages": stages})  # fmt: skip
            label = "vt" if vt else "std"
            print(f"{name} {label}: shared {kernel.metadata.shared} B  {sass_counts(kernel.asm['cubin'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="528", help="keys a sequence holds, comma-separated")
    ap.add_argument("--copies", type=int, default=3, help="input copies a CUDA graph replays in turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mini-only", action="store_true", help="skip the engine's kernels")
    ap.add_argument("--sass", action="store_true", help="only compile for sm_90 and count instructions")
    args = ap.parse_args()
    if args.sass:
        sass()
        return
    from triton.testing import do_bench_cudagraph

    print(torch.cuda.get_device_name(), flush=True)
    check(4, 70, "cuda")
    for ctx in (int(c) for c in args.contexts.split(",")):
        rings = [ring_inputs(BATCH, ctx, 32, "cuda") for _ in range(args.copies)]
        pageds = [paged_inputs(BATCH, ctx, "cuda") for _ in range(args.copies)]
        outs = [torch.empty_like(rings[0]["q"]) for _ in range(args.copies)]
        for rnd in range(args.rounds):
            for layout in LAYOUTS:
                for op, xs, run in (("ring", rings, run_ring), ("paged", pageds, run_paged)):

                    def replay(xs=xs, run=run, lay=layout, outs=outs) -> None:
                        for x, o in zip(xs, outs, strict=True):
                            run(x, o, lay)

                    ms = do_bench_cudagraph(replay, rep=200, return_mode="median") / args.copies
                    print(f"ctx {ctx} round {rnd} {op} {layout}: {ms * 1e3:.2f} us", flush=True)
        if not args.mini_only:
            for op, us in engine_kernels(ctx).items():
                print(f"ctx {ctx} engine {op} (RoPE inside): {us:.2f} us", flush=True)
        kv = torch.empty(2 * BATCH * ctx * HKV * D, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(kv)
        ms = do_bench_cudagraph(lambda kv=kv, dst=dst: dst.copy_(kv), rep=200, return_mode="median")
        floor = ms * 1e3 / 2  # read and write
        print(f"ctx {ctx} copy floor of the K/V ({kv.numel() / 1e6:.1f} MB): {floor:.2f} us", flush=True)


if __name__ == "__main__":
    main()
