"""A decode step's kernel chain at batch 64 in one CUDA graph, with and without programmatic dependent
launch (PDL): can overlapping each kernel's start with the tail of the one before it, and loading a
GEMM's weights before it waits for its input, close the gap between the engine's step and its
roofline? (docs/benchmarks.md, "Engine decode and prefill": the small GEMMs take 6-7 µs for 2-4 µs
of weights, a ramp and a tail that no tiling of one GEMM removes.)

    python bench/decode_layer_pdl.py [--layers 28] [--json pdl.json]      (GPU, Hopper or later)

Per layer, the engine's shapes at batch 64 (hidden 2048, 16/8 heads x 128, intermediate 6144):
add + RMSNorm -> q/k/v GEMM -> RoPE stand-in -> attention stand-in (streams 138 MB of K/V, what a
sliding layer's attention reads at batch 64) -> o GEMM -> add + RMSNorm -> gate/up GEMM -> SwiGLU ->
down GEMM. The stand-ins move the engine's bytes, not its math. Variants:
- `cublas`: torch's GEMMs, Triton for the rest (the engine today);
- `cublas_pdl`: the same, the Triton kernels launched with PDL (they wait in-kernel);
- `triton`: every GEMM a Triton skinny GEMM (`skinny_gemm`'s tiling, best configs of
  `bench/gemm_decode.py`);
- `triton_pdl`: every kernel launched with PDL, each releasing the next at its start;
- `triton_pdl_prefetch`: and each GEMM prefetches its weight slice into L2 before its wait.
Each PDL variant's output is compared with its plain variant's (`equal_to_plain`: bit for bit, as
waiting in-kernel before touching the step's data should give).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

M, H, HQ, KV_HEAD_DIM, INTER = 64, 2048, 16, 128, 6144
QKV = (16 + 2 * 8) * 128
KV_BYTES = 138 << 20  # a sliding layer's K/V read at batch 64 (W = 1024, 8 KV heads x 128, bf16)
ATTN_PROGRAMS, ATTN_BLOCK = 512, 4096
PER_PROGRAM = KV_BYTES // 2 // ATTN_PROGRAMS // ATTN_BLOCK * ATTN_BLOCK  # bf16 elements
GEMMS = {  # name: (N, K, block_n, block_k, split_k, stages): bench/gemm_decode.py's best at M=64
    "qkv": (QKV, H, 32, 256, 1, 4),
    "o": (H, H, 16, 256, 1, 4),
    "gate_up": (2 * INTER, H, 32, 128, 1, 3),
    "down": (H, INTER, 32, 128, 4, 4),
}


@triton.jit
def _start(PDL: tl.constexpr):
    if PDL:  # let the next kernel launch now; wait for the previous one's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _add_norm(x_ptr, res_ptr, w_ptr, out_ptr, HID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HID)
    w = tl.load(w_ptr + cols).to(tl.float32)  # a weight: no wait needed
    _start(PDL)
    x = tl.load(x_ptr + row * HID + cols).to(tl.float32) + tl.load(res_ptr + row * HID + cols).to(tl.float32)
    tl.store(res_ptr + row * HID + cols, x.to(res_ptr.dtype.element_ty))
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / HID + 1e-5) * w
    tl.store(out_ptr + row * HID + cols, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _rope_like(qkv_ptr, q_ptr, WIDTH: tl.constexpr, HID: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HID)
    _start(PDL)
    q = tl.load(qkv_ptr + row * WIDTH + cols).to(tl.float32)
    k = tl.load(qkv_ptr + row * WIDTH + HID + cols).to(tl.float32)
    tl.store(q_ptr + row * HID + cols, (0.5 * q + 0.25 * k).to(q_ptr.dtype.element_ty))


@triton.jit
def _attention_like(q_ptr, kv_ptr, out_ptr, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    base = kv_ptr + pid.to(tl.int64) * per_program
    _start(PDL)  # the newest K/V comes from the kernel before: read nothing before the wait
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    row, c = pid // 8, (pid % 8) * 256 + tl.arange(0, 256)
    q = tl.load(q_ptr + row * 2048 + c).to(tl.float32)
    tl.store(out_ptr + row * 2048 + c, (q + 1e-6 * tl.sum(acc, axis=0)).to(out_ptr.dtype.element_ty))


@triton.jit
def _silu_mul(gu_ptr, out_ptr, INTER_: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _start(PDL)
    g = tl.load(gu_ptr + row * 2 * INTER_ + cols).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * INTER_ + INTER_ + cols).to(tl.float32)
    tl.store(out_ptr + row * INTER_ + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemm(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M_, N, K, k_chunk,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_first = pid_k * k_chunk
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    if PREFETCH:  # this program's weight slice into L2, one prefetch per 128-byte line
        lines = tl.arange(0, 16) * 64  # bf16: 64 elements a line
        for k0 in range(k_first, k_first + k_chunk, 16 * 64):
            at = w_rows + tl.minimum(k0 + lines, k_first + k_chunk - 1)[None, :]
            tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [at],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
    _start(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_chunk, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :])
        w = tl.load(w_rows + rk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty))
    else:
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc)
        tl.debug_barrier()
        if tl.atomic_add(ticket_ptr + pid_n, 1) == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(ticket_ptr + pid_n, 0)


def make_layers(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(n):
        layer = {
            name: torch.randn(nn, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
            for name, (nn, k, *_) in GEMMS.items()
        }
        layer["ln1"] = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        layer["ln2"] = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        layer["kv"] = torch.randn(
            ATTN_PROGRAMS * PER_PROGRAM, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        layers.append(layer)
    return layers


class Step:
    """The chain over every layer with static buffers, so that a CUDA graph can capture it."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], variant: str) -> None:
        self.layers, self.variant = layers, variant
        self.pdl = variant.endswith("_pdl") or "_pdl_" in variant
        self.triton_gemm = variant.startswith("triton")
        self.prefetch = variant.endswith("prefetch")
        z = lambda *s: torch.zeros(*s, device="cuda", dtype=torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(1)  # one input for every variant: outputs compare
        self.h0 = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.h, self.res, self.xn, self.qkv, self.q, self.attn = (
            z(M, H),
            z(M, H),
            z(M, H),
            z(M, QKV),
            z(M, H),
            z(M, H),
        )
        self.o, self.gu, self.act = z(M, H), z(M, 2 * INTER), z(M, INTER)
        self.part = torch.empty(4 * M * H, device="cuda", dtype=torch.float32)
        self.ticket = torch.zeros(4096, device="cuda", dtype=torch.int32)

    def gemm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, name: str) -> None:
        if not self.triton_gemm:
            torch.mm(x, w.T, out=out)
            return
        n, k, bn, bk, split, stages = GEMMS[name]
        _gemm[(n // bn, split)](
            x, w, out, self.part, self.ticket, M, n, k, k // split, SPLIT_K=split, BLOCK_M=M, BLOCK_N=bn,
            BLOCK_K=bk, PDL=self.pdl, PREFETCH=self.prefetch, num_warps=4, num_stages=stages,
            launch_pdl=self.pdl,
        )  # fmt: skip

    def __call__(self) -> None:
        pdl = {"PDL": self.pdl, "launch_pdl": self.pdl}
        self.h.copy_(self.h0)
        self.res.zero_()
        for L in self.layers:
            _add_norm[(M,)](self.h, self.res, L["ln1"], self.xn, HID=H, num_warps=8, **pdl)
            self.gemm(self.xn, L["qkv"], self.qkv, "qkv")
            _rope_like[(M,)](self.qkv, self.q, WIDTH=QKV, HID=H, num_warps=8, **pdl)
            _attention_like[(ATTN_PROGRAMS,)](
                self.q, L["kv"], self.attn, PER_PROGRAM, BLOCK=ATTN_BLOCK, num_warps=4, **pdl
            )
            self.gemm(self.attn, L["o"], self.o, "o")
            _add_norm[(M,)](self.o, self.res, L["ln2"], self.xn, HID=H, num_warps=8, **pdl)
            self.gemm(self.xn, L["gate_up"], self.gu, "gate_up")
            _silu_mul[(M, INTER // 1024)](self.gu, self.act, INTER_=INTER, BLOCK=1024, num_warps=4, **pdl)
            self.gemm(self.act, L["down"], self.h, "down")


def capture(step: Step) -> torch.cuda.CUDAGraph:
    """Compile the step's kernels, capture it in a graph and replay it once (its output is then in
    `step.h`)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def copy_rate() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone(), return_mode="median")
    return 2 * x.numel() / ms / 1e9  # TB/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--variants", default="cublas,cublas_pdl,triton,triton_pdl,triton_pdl_prefetch")
    ap.add_argument("--json")
    args = ap.parse_args()
    tbs = copy_rate()
    layers = make_layers(args.layers)
    weights = sum(n * k * 2 for n, k, *_ in GEMMS.values()) * args.layers
    kv = ATTN_PROGRAMS * PER_PROGRAM * 2 * args.layers
    floor_ms = (weights + kv) / tbs / 1e9
    print(f"copy rate {tbs:.2f} TB/s; {args.layers} layers read {weights / 1e9:.2f} GB of weights and "
          f"{kv / 1e9:.2f} GB of K/V: floor {floor_ms:.3f} ms", flush=True)  # fmt: skip
    rows, outputs = [], {}
    for variant in args.variants.split(","):
        step = Step(layers, variant)
        graph = capture(step)
        outputs[variant] = step.h.clone()
        ms = triton.testing.do_bench(graph.replay, return_mode="median")
        plain = variant.replace("_pdl_prefetch", "").replace("_pdl", "")
        same = (
            None
            if plain not in outputs or plain == variant
            else torch.equal(outputs[variant], outputs[plain])
        )
        row = {
            "variant": variant,
            "step_ms": round(ms, 4),
            "x_floor": round(ms / floor_ms, 3),
            "equal_to_plain": same,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if "cublas" in outputs and "triton" in outputs:
        diff = (outputs["cublas"].float() - outputs["triton"].float()).abs().max().item()
        print(
            f"max |cublas - triton| {diff:.3g} (max |h| {outputs['cublas'].float().abs().max().item():.3g})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbs": tbs, "floor_ms": floor_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
