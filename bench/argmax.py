"""Greedy argmax over decode logits: torch.argmax against `argmax_rows` (the vocabulary split over
many programs), each against reading the logits at the copy rate measured in the same run.

Cases: bf16 [64, 128256] (a batch-64 decode step of the engine bench's model), bf16 [1, 128256],
fp32 [16, 128256] (the sampler's scores). Each implementation is timed from a CUDA graph of one call
per distinct copy of the logits (enough copies to exceed the L2 cache, so reads come from HBM; `--hot`
reuses one tensor, as when the lm_head's output is still in L2), replayed `--replays` times between
two CUDA events; warmed up and captured on one side stream, as the engine captures. `eager_us` is
back-to-back eager calls (the runner launches the argmax outside the step's graph): the larger of
the host's launch cost and the kernel. Every result is checked equal to torch.argmax. `--sweep`
adds tile widths and split counts around the default rule.

    PYTHONPATH=. python bench/argmax.py [--sweep] [--hot] [--json argmax.json]   (~20 s; --sweep ~1 min)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

CASES = ((64, torch.bfloat16), (1, torch.bfloat16), (16, torch.float32))
VOCAB = 128256
L2_BYTES = 50 << 20  # an H200's L2 (the copies' total is kept above twice this)


def copy_rate(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, read + write counted (as bench/engine.py counts)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) * 1e-3)


def graph_us(fn: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor], replays: int) -> float:
    """µs per call: one graph of a call per input, replayed `replays` times between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture, on the capture stream
        for x in inputs:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for x in inputs:
            fn(x)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * len(inputs))


def eager_us(fn: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor], calls: int) -> float:
    for x in inputs[:2]:
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(inputs[i % len(inputs)])
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def configs(rows: int, dtype: torch.dtype, sweep: bool) -> list[tuple[str, int | None, int | None]]:
    """(label, num_splits, block): the default rule, then with --sweep tiles of 2-16 KB and split
    counts from half to four times the rule's."""
    from shared.kernels._launch import sm_count
    from shared.kernels.argmax import MAX_SPLITS, choose_block, choose_splits

    sms = sm_count(torch.cuda.current_device())
    block = choose_block(dtype)
    rule = choose_splits(rows, VOCAB, block, sms)
    out: list[tuple[str, int | None, int | None]] = [(f"triton default S={rule} block={block}", None, None)]
    if sweep:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        for tile_bytes in (2048, 4096, 8192, 16384):
            b = tile_bytes // itemsize
            s_rule = choose_splits(rows, VOCAB, b, sms)
            for s in sorted({max(1, s_rule // 2), *(min(MAX_SPLITS, k * s_rule) for k in (1, 2, 4))}):
                if (s, b) != (rule, block):
                    out.append((f"triton S={s} block={b}", s, b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=200, help="graph replays timed per implementation")
    ap.add_argument("--sweep", action="store_true", help="also time other tile widths and split counts")
    ap.add_argument("--hot", action="store_true", help="one logits tensor, read from L2 after the first call")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from shared.kernels.argmax import argmax_rows

    rate = copy_rate()
    print(
        f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s (read + write); floor: bytes read / it"
    )
    head = ("case", "impl", "graph_us", "eager_us", "floor_us", "x floor", "equal")
    print("{:18s} {:34s} {:>9s} {:>9s} {:>9s} {:>8s}  {}".format(*head))
    rows = []
    for batch, dtype in CASES:
        nbytes = batch * VOCAB * torch.tensor([], dtype=dtype).element_size()
        copies = 1 if args.hot else max(2, min(512, -(-2 * L2_BYTES // nbytes)))
        gen = torch.Generator(device="cuda").manual_seed(batch)
        inputs = [torch.randn(batch, VOCAB, device="cuda", generator=gen).to(dtype) for _ in range(copies)]
        want = [x.argmax(dim=-1) for x in inputs]
        floor_us = nbytes / rate * 1e6
        case = f"{batch}x{VOCAB} {str(dtype).removeprefix('torch.')}"
        impls: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
            ("torch.argmax", lambda x: x.argmax(dim=-1))
        ]
        for label, splits, block in configs(batch, dtype, args.sweep):
            impls.append((label, lambda x, s=splits, b=block: argmax_rows(x, num_splits=s, block=b)))
        for label, fn in impls:
            equal = all(torch.equal(fn(x), w) for x, w in zip(inputs, want, strict=True))
            g_us = graph_us(fn, inputs, args.replays)
            e_us = eager_us(fn, inputs, 100)
            ratio = g_us / floor_us
            print(f"{case:18s} {label:34s} {g_us:9.2f} {e_us:9.2f} {floor_us:9.2f} {ratio:8.2f}  {equal}")
            rows.append({"case": case, "impl": label, "graph_us": round(g_us, 2), "eager_us": round(e_us, 2),
                         "floor_us": round(floor_us, 2), "equal": equal, "copies": copies})  # fmt: skip
        del inputs, want
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_TB/s": round(rate / 1e12, 3), "rows": rows}, f, indent=1)
    if not all(r["equal"] for r in rows):
        raise SystemExit("argmax_rows disagreed with torch.argmax")


if __name__ == "__main__":
    main()
