"""What would a persistent decode-layer kernel gain? The bytes of a batch-64 decode step streamed
phase by phase, as one kernel per phase in a CUDA graph (the engine's shape: every boundary a kernel
launch, ramp and tail) against one persistent kernel that streams every phase of every layer with a
grid-wide barrier between phases (what a decode-layer megakernel must do at least), against the
bytes at the copy rate.

    python bench/decode_layer_persistent.py [--layers 28] [--ctas 1,2] [--json out.json]   (GPU)

Per layer, the engine bench's bytes at batch 64, context 528 (bench/engine.py): q/k/v weights
16.8 MB, the layer's K/V 138 MB, o 8.4 MB, gate/up 50 MB, down 25 MB, each a phase that depends on
the one before (in a real layer every phase reads what the previous wrote). The kernels move bytes
and sum them (no GEMM, no attention math): so this prices the boundaries alone, the most a
persistent kernel could take off the step if its phases ran at the stream rate measured here.
Variants:
- `kernels`: one launch per phase (5 x layers kernels in one CUDA graph);
- `persistent`: one launch; every program streams its slice of a phase, then waits at a grid-wide
  barrier (a release-add on a counter, then an acquire-poll until every program has arrived);
- `kernels_pdl`: one launch per phase, each a programmatic dependent launch that releases the next
  at its start and loads its first tiles before it waits for the one before (Hopper);
- `persistent_prefetch`: the persistent launch, each program loading the next phase's first tiles
  before it arrives at the barrier (what weights allow: they depend on no earlier phase);
- `persistent_free`: the same launch without the barriers (its phases overlap: the lower bound).
The persistent grid is `--ctas` programs per SM, all resident at once (a barrier over programs that
are not resident would never open: a poll limit turns that into a reported failure, not a hang).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

# bf16 elements of each phase of a layer, in order (bench/engine.py's model at batch 64, context 528)
PHASES = {
    "qkv": (16 + 2 * 8) * 128 * 2048,
    "attention": 2 * 64 * 528 * 8 * 128,
    "o": 2048 * 2048,
    "gate_up": 2 * 6144 * 2048,
    "down": 2048 * 6144,
}
BLOCK = 8192  # elements a program loads per iteration: 16 KB, 32 B per thread of 8 warps, twice
POLL_LIMIT = 1 << 14  # polls (~10 ms) before a barrier gives up: a grid that is not all resident


@triton.jit
def _share(n, pid, nprog, BLOCK: tl.constexpr):
    """This program's slice [lo, hi) of n elements (BLOCK-aligned shares)."""
    share = tl.cdiv(tl.cdiv(n, nprog), BLOCK) * BLOCK
    lo = pid.to(tl.int64) * share
    return lo, tl.minimum(lo + share, n)


@triton.jit
def _stream(src, n, pid, nprog, acc, BLOCK: tl.constexpr, SKIP: tl.constexpr = 0):
    """Add this program's slice of src[0:n] into acc, past its first SKIP pairs of tiles."""
    lo, hi = _share(n, pid, nprog, BLOCK)
    for i in range(lo + SKIP * 2 * BLOCK, hi, 2 * BLOCK):  # two tiles in flight per iteration
        a = i + tl.arange(0, BLOCK)
        b = a + BLOCK
        x = tl.load(src + a, mask=a < hi, other=0.0, cache_modifier=".cg")
        y = tl.load(src + b, mask=b < hi, other=0.0, cache_modifier=".cg")
        acc += x.to(tl.float32) + y.to(tl.float32)
    return acc


@triton.jit
def _head(src, n, pid, nprog, BLOCK: tl.constexpr):
    """The first pair of tiles of this program's slice: what it can load before a barrier when the
    data does not depend on the phase before (a GEMM's weights, a layer's K/V history)."""
    lo, hi = _share(n, pid, nprog, BLOCK)
    a = lo + tl.arange(0, BLOCK)
    b = a + BLOCK
    x = tl.load(src + a, mask=a < hi, other=0.0, cache_modifier=".cg")
    y = tl.load(src + b, mask=b < hi, other=0.0, cache_modifier=".cg")
    return x, y


@triton.jit
def _phase_kernel(src, n, out, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = _stream(src, n, pid, tl.num_programs(0), tl.zeros([BLOCK], tl.float32), BLOCK)
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit
def _phase_kernel_pdl(src, n, out, BLOCK: tl.constexpr):
    """`_phase_kernel` as a programmatic dependent launch: it releases the next phase's launch at
    once, loads its first tiles (data no earlier kernel writes), and only then waits for the kernel
    before it to finish."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tl.extra.cuda.gdc_launch_dependents()
    x, y = _head(src, n, pid, nprog, BLOCK)
    tl.extra.cuda.gdc_wait()
    acc = _stream(src, n, pid, nprog, x.to(tl.float32) + y.to(tl.float32), BLOCK, 1)
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit
def _barrier(counter, target, failed, POLL_LIMIT: tl.constexpr):
    """Arrive, then wait until `target` programs have arrived in all (the counter only grows)."""
    tl.debug_barrier()  # every thread's work of the phase is done before the program arrives
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    polls = seen * 0
    while (seen < target) & (polls < POLL_LIMIT):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < target:
        tl.atomic_xchg(failed, 1)
    tl.debug_barrier()


@triton.jit
def _phase(n0, n1, n2, n3, n4, p: tl.constexpr):
    """Offset and size of phase p (0-4) within a layer (p is known at compile time)."""
    off = 0
    n = n0
    if p >= 1:
        off = n0
        n = n1
    if p >= 2:
        off = n0 + n1
        n = n2
    if p >= 3:
        off = n0 + n1 + n2
        n = n3
    if p >= 4:
        off = n0 + n1 + n2 + n3
        n = n4
    return off, n


@triton.jit
def _persistent_kernel(
    mem, layer_elems, n0, n1, n2, n3, n4, layers, out, counter, failed,
    BARRIERS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr, POLL_LIMIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    arrived = nprog * 0
    hx, hy = _head(mem, n0, pid, nprog, BLOCK)  # layer 0's first phase
    for layer in range(layers):
        base = mem + tl.cast(layer, tl.int64) * layer_elems
        for p in tl.static_range(5):
            off, n = _phase(n0, n1, n2, n3, n4, p)
            if PREFETCH:  # its first tiles were loaded before the barrier
                acc += hx.to(tl.float32) + hy.to(tl.float32)
                acc = _stream(base + off, n, pid, nprog, acc, BLOCK, 1)
                if p < 4:
                    n_off, n_next = _phase(n0, n1, n2, n3, n4, p + 1)
                    hx, hy = _head(base + n_off, n_next, pid, nprog, BLOCK)
                else:  # the next layer's first phase (none after the last)
                    more = layer + 1 < layers
                    hx, hy = _head(base + layer_elems, tl.where(more, n0, 0), pid, nprog, BLOCK)
            else:
                acc = _stream(base + off, n, pid, nprog, acc, BLOCK)
            if BARRIERS:
                arrived += nprog
                _barrier(counter, arrived, failed, POLL_LIMIT)
    tl.store(out + pid, tl.sum(acc, axis=0))


def graph_us(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median µs of one replay of a CUDA graph of `fn` (warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, rep=reps * 30, return_mode="median")


def copy_rate() -> float:
    """Read + write bytes/s of a 2 GiB device copy (bench/engine.py's measure, one burst)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="min")
    return 2 * x.numel() / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ctas", default="1,2", help="persistent programs per SM, e.g. 1,2")
    ap.add_argument("--grid", type=int, default=0, help="programs per phase kernel (0: 4 per SM)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = list(PHASES.values())
    layer_elems = sum(sizes)
    mem = torch.randn(args.layers * layer_elems, device="cuda", dtype=torch.bfloat16)
    total = mem.numel() * mem.element_size()
    rate = copy_rate()
    floor_us = total / rate * 1e6
    grid = args.grid or 4 * sms
    out = torch.empty(max(grid, 8 * sms), device="cuda", dtype=torch.float32)
    rows = [{"variant": "floor (bytes at the copy rate)", "step_us": round(floor_us, 1)}]

    def kernels() -> None:
        for layer in range(args.layers):
            off = layer * layer_elems
            for n in sizes:
                _phase_kernel[(grid,)](mem[off:], n, out, BLOCK=BLOCK, num_warps=8)
                off += n

    rows.append({"variant": f"kernels ({grid} programs each)", "step_us": graph_us(kernels)})

    def kernels_pdl() -> None:
        for layer in range(args.layers):
            off = layer * layer_elems
            for n in sizes:
                _phase_kernel_pdl[(grid,)](mem[off:], n, out, BLOCK=BLOCK, num_warps=8, launch_pdl=True)
                off += n

    rows.append({"variant": f"kernels_pdl ({grid} programs each)", "step_us": graph_us(kernels_pdl)})
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    failed = torch.zeros(1, device="cuda", dtype=torch.int32)
    for ctas in (int(c) for c in args.ctas.split(",")):
        for barriers, prefetch in ((True, False), (True, True), (False, False)):
            progs = ctas * sms

            def persistent(b: bool = barriers, f: bool = prefetch, p: int = progs) -> None:
                counter.zero_()  # a node of the graph: every replay starts its barriers at zero
                _persistent_kernel[(p,)](
                    mem, layer_elems, *sizes, args.layers, out, counter, failed,
                    BARRIERS=b, PREFETCH=f, BLOCK=BLOCK, POLL_LIMIT=POLL_LIMIT, num_warps=8,
                )  # fmt: skip

            kind = "_prefetch" if prefetch else "" if barriers else "_free"
            name = f"persistent{kind} ({ctas}/SM)"
            persistent()  # once, eagerly: a barrier that never opened is reported, not timed
            if failed.item():
                print(json.dumps({"variant": name, "barrier_failed": True}), flush=True)
                failed.zero_()
                continue
            rows.append({"variant": name, "step_us": graph_us(persistent)})
    for row in rows:
        us = row["step_us"]
        row |= {"per_layer_us": round(us / args.layers, 2), "x_floor": round(us / floor_us, 3)}
        row["step_us"] = round(us, 1)
        print(json.dumps(row), flush=True)
    print(f"{args.layers} layers, {total / 1e9:.2f} GB, copy rate {rate / 1e12:.2f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
