"""Decode and prefill throughput of the Engine on a ~2B hybrid model, against Hugging Face
`generate` on the same weights and against the HBM roofline.

    python bench/engine.py                     # batches 1,16,64; prompt 512; 64 decode steps
    python bench/engine.py --batches 64 --no-hf
    python bench/engine.py --batches 64 --no-hf --prefill-prompt 0 --kernels torch   # unfused, to compare
    python bench/engine.py --batches 64,16,1 --no-hf --gemm cublas,skinny   # the layers' GEMMs, A/B
    python bench/engine.py --batches 64,1 --no-hf --rope-in-attention on,off  # decode's RoPE, A/B
    python bench/engine.py --batches 64 --no-hf --window tpot,synced   # the decode window, A/B
    python bench/engine.py --batches 64 --no-hf --prefill-prompt 0 --page-size 16,64   # KV page, A/B
    python bench/engine.py --batches 64 --no-hf --prefill-prompt 0 --window synced --settle 0,0.5
    python bench/engine.py --batches 64,1 --no-hf --prefill-prompt 0 --prefix-cache on,off,on,off
    python bench/engine.py --batches 64,1 --no-hf --quantization none,fp8 --kv-cache-dtype auto,fp8_e4m3
    python bench/engine.py --model 8b --batches 64,1 --no-hf --quantization none,fp8 --kv-cache-dtype fp8_e4m3

Model: hidden 2048, 28 layers, 16/8 heads x 128, intermediate 6144, 3 of 4 layers sliding (W=1024),
vocab 128256, random bf16 weights (~1.9B parameters); `--model 8b` the same layers at Llama 3 8B's
widths, `--model gemma3-1b` Gemma 3 1B's shape, `--model moe-20b` gpt-oss-20b's. The roofline of a
decode step is the bytes it must read (weights but the embedding table, plus each sequence's K/V:
whole context on full layers, at most W on sliding ones) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time

import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.kernels.kv_quant import FP8_KV_DTYPE
from shared.model.config import config_from_hf
from shared.model.quant import quantize_head, quantize_model
from shared.model.transformer import Transformer

W = 1024
HF_CONFIG = {
    "architectures": ["MinistralForCausalLM"], "model_type": "ministral", "vocab_size": 128256,
    "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 6144, "sliding_window": W, "max_position_embeddings": 8192,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 7,
    "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
# --model: the ~2B above, or an ~8B of Llama 3 8B's widths with the same hybrid layers (hidden 4096, 32
# layers, 32/8 heads x 128, intermediate 14336: ~8.0B parameters), where a decode step's GEMMs are
# large enough to be bound by the bytes they read rather than by the latency of each launch.
# "moe-20b": gpt-oss-20b's shape (21B parameters, 3.6B active a token): 24 layers of hidden 2880, 64/8
# heads x 64 with sinks, sliding (W = 128) and full in turns, 32 experts of 2880, 4 a token, YaRN.
# "gemma3-1b": Gemma 3 1B's shape (1.0B parameters, 0.3B of them the tied embedding / LM head): 26 layers
# of hidden 1152, 4 heads x 256 over one KV head, five local layers (W = 512, RoPE base 10k) to a global
# one (1M), GELU-tanh MLP of 6912, q/k norms, a vocabulary of 262144.
MODELS = {
    "moe-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
        },
        "attention_bias": True, "torch_dtype": "bfloat16",
    },
    "2b": HF_CONFIG,
    "gemma3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 6912, "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "8b": HF_CONFIG | {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 14336,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
    },
}  # fmt: skip


def copy_bandwidth(bursts: int = 5) -> float:
    """The device's copy rate (read + write, bytes/s): the best of `bursts` bursts of ten 2 GiB copies,
    each timed by CUDA events. One burst moves from one process to the next by more than the changes
    it judges; the best is the rate the device can reach, so the roofline is the stricter one."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    best = 0.0
    for _ in range(bursts):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            y.copy_(x)
        end.record()
        end.synchronize()
        best = max(best, 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3))
    return best


def make_models(with_hf: bool, shape: dict = HF_CONFIG):  # type: ignore[type-arg]
    cfg = config_from_hf(shape)
    hf = None
    if with_hf:
        import transformers

        fields = {k: v for k, v in shape.items() if k != "architectures"}
        hf_cfg = transformers.AutoConfig.for_model(**fields)
        with torch.device("cuda"):  # initialized on the GPU: 21B random weights on the host take minutes
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
        source = hf.state_dict().items()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built on the GPU in bf16: the MoE's 21B would not fit twice
    try:
        with torch.device("cuda"):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    if hf is not None:
        model.load_weights(source)
    else:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02)
    model.rotary.reset_buffers("cuda")  # fp32 tables computed afresh: .to(bf16) above rounded them
    return cfg, model.eval(), hf


def dense_params(cfg) -> int:
    """Parameters a token multiplies through, the embedding table aside (the LM head included): from
    the layout, so an FP8 model (its scales are parameters too) counts the same FLOPs."""
    h, qk, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    total = cfg.vocab_size * h
    for i in range(cfg.num_layers):  # a mixture of experts: the k experts a token goes through
        mlp = (
            3 * h * cfg.moe.intermediate_size * cfg.moe.top_k
            if cfg.is_moe(i)
            else 3 * h * cfg.intermediate_size
        )
        total += h * (qk + 2 * kv) + qk * h + mlp
    return total


def decode_roofline_bytes(model, batch: int, ctx: int, kv_bytes: int = 2) -> int:
    """The bytes a decode step must read: every weight but the embedding table, as stored (e4m3 weights
    and their scales for an FP8 model), and each sequence's K/V at `kv_bytes` an element. Of a mixture
    of experts' weights, those of the experts the batch reads: E (1 - (1 - k / E)^batch) of E, the
    expected number of distinct experts `batch` tokens pick under uniform routing (random weights)."""
    cfg = model.cfg
    per_tok_layer = 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes
    read = 1.0
    if cfg.moe is not None:
        e, k = cfg.moe.num_experts, cfg.moe.top_k
        read = 1 - (1 - k / e) ** batch  # the share of each layer's experts the step reads
    weights = 0.0
    head_is_embedding = model.lm_head.weight is model.embed_tokens.weight  # tied, not an FP8 head
    for n, p in model.named_parameters():  # a tied LM head is listed once, as the embedding table
        if "embed" not in n or head_is_embedding:
            expert = any(n.endswith(s) for s in (".w_gate_up", ".w_down", ".b_gate_up", ".b_down"))
            weights += p.numel() * p.element_size() * (read if expert else 1.0)
    window = cfg.sliding_window or ctx
    kv = 0
    for layer in range(cfg.num_layers):
        kv += batch * (min(ctx, window) if cfg.is_sliding(layer) else ctx) * per_tok_layer
    return int(weights + kv)


KV_DTYPES = {"auto": torch.bfloat16, "fp8_e4m3": FP8_KV_DTYPE}
FOLD_NORMS = True  # --fold-norms: EngineConfig.fold_norms for every engine of the run


def engine_config(**kw: object) -> EngineConfig:
    """The run's engines: 8192-token steps, the norms folded or not as --fold-norms says."""
    return EngineConfig(max_batch_tokens=8192, fold_norms=FOLD_NORMS, **kw)  # type: ignore[arg-type]


def bench_engine(
    model,
    cfg,
    batch: int,
    prompt_len: int,
    steps: int,
    bandwidth: float,
    rope_in_attention: bool = True,
    window: str = "tpot",
    tune_gemms: bool = True,
    page_size: int = 16,
    prefix_cache: bool = False,
    settle: float = 0.0,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """One engine's prefill and decode of `batch` prompts. `window` "tpot" times the decode from the
    call that hands every request its first token to the call that hands the last ones (a client's
    time per output token: `decode_step_ms` is that window over the tokens after the first). "synced"
    drains the device between prefill and decode, so that the first decode call builds and launches its
    batch while the device idles, the window over the device steps it sees (calls - 1)."""
    pages = batch * ((prompt_len + steps + page_size) // page_size + 1) + 16
    kv = KVConfig(page_size=page_size, num_pages=pages, max_requests=batch, dtype=kv_dtype, device="cuda")
    engine_cfg = engine_config(
        max_running=batch,
        rope_in_attention=rope_in_attention,
        tune_gemms=tune_gemms,
        prefix_cache=prefix_cache,
    )
    engine = Engine(model, kv, engine_cfg)
    # As a service does before it reports ready (shared/serving/runtime.py): kernels compiled, and the
    # host's pinned staging blocks allocated, before the first request (a decode step that has to
    # allocate one waits for the allocation).
    engine.warm_up()
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while any(r.phase.value == "prefill" or not r.output for r in reqs):
        engine.step()
    # Every request has its first token: the step() that delivered them waited for the prefill. The
    # first decode step is already queued behind it (overlap scheduling launches before it completes).
    t1 = time.perf_counter()
    prefill_s = t1 - t0
    if window == "synced":
        torch.cuda.synchronize()
        # A decode service's GPU does not prefill: give the clocks the power cap lowered during the
        # prefill `settle` seconds to come back first.
        time.sleep(settle)
        t1 = time.perf_counter()
    done0 = sum(len(r.output) for r in reqs)
    decode_steps, marks = 0, []
    while not all(r.finished for r in reqs):  # up to the call that hands out the last tokens
        engine.step()
        decode_steps += 1
        marks.append(time.perf_counter())
    decode_s = time.perf_counter() - t1
    engine.flush()  # after the window: what finished gives its KV back (Engine.free_finished)
    assert engine.idle
    # Steady state: each step() returns once the step before it is done, so in the middle of the run
    # the time between returns is the device's step. The ends hold the first batch's build and the
    # last step's drain, which a longer generation spreads thinner.
    trim = max(2, len(marks) // 8)
    mid = marks[trim : len(marks) - trim]
    steady_s = (mid[-1] - mid[0]) / (len(mid) - 1) if len(mid) > 1 else float("nan")
    # The ends' share of the whole: the first call (with "synced", a batch built while the device idles)
    # and the last (the drain: every request finished; their KV is freed after it), against a steady step.
    gaps = [b - a for a, b in zip([t1, *marks], marks, strict=False)]
    ends_ms = [round(1e3 * g, 3) for g in (*gaps[:2], *gaps[-2:])]  # (intervals_ms: all of them)
    tokens = sum(len(r.output) for r in reqs) - done0
    ctx = prompt_len + steps // 2
    roof_s = (
        decode_roofline_bytes(model, batch, ctx, torch.empty((), dtype=kv_dtype).element_size()) / bandwidth
    )
    # tpot: over the tokens each request received after its first (all requests alike here)
    per = decode_steps - 1 if window == "synced" else tokens // batch
    step_s = decode_s / max(per, 1)
    return {"batch": batch, "window": window, "settle_s": settle, "prefill_s": prefill_s,
            "prefill_tok_s": batch * prompt_len / prefill_s,
            "decode_step_ms": 1e3 * step_s, "decode_tok_s": tokens / decode_s,
            "steady_step_ms": 1e3 * steady_s, "roofline_step_ms": 1e3 * roof_s,
            "x_roofline": step_s / roof_s, "steady_x_roofline": steady_s / roof_s,
            "decode_steps": decode_steps, "ends_ms": ends_ms,
            "intervals_ms": [round(1e3 * g, 3) for g in gaps]}  # fmt: skip


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0)


def bench_prefill(
    model, cfg, prompt_len: int, count: int, peak: float, kv_dtype: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """Prefill of `count` prompts of `prompt_len` tokens, chunked at 8192 tokens a step, as a share of
    the in-run bf16 matmul peak (FLOPs: 2 x non-embedding parameters per token, plus causal attention
    over the window on sliding layers and the whole prefix on full ones)."""
    pages = count * (prompt_len // 16 + 2) + 16
    kv = KVConfig(page_size=16, num_pages=pages, max_requests=count, dtype=kv_dtype, device="cuda")
    engine = Engine(model, kv, engine_config(max_running=count))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _rep in range(2):  # the first round warms up Triton's autotuning and the allocator
        reqs = [engine.add_request(torch.randint(0, cfg.vocab_size, (prompt_len,)).tolist(), sp)
                for _ in range(count)]  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not engine.idle:
            engine.step()
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        assert all(len(r.output) == 1 for r in reqs)
    dense = dense_params(cfg)
    qk = cfg.num_heads * cfg.head_dim
    attn = 0
    for layer in range(cfg.num_layers):
        span = min(prompt_len, W) if cfg.is_sliding(layer) else prompt_len
        # QK^T and PV, 2 FLOPs per MAC, over the keys each query sees (causal: about half the span).
        keys = sum(min(q + 1, span) for q in range(0, prompt_len, 64)) * 64
        attn += 2 * 2 * qk * keys
    flops = count * (2 * dense * prompt_len + attn)
    return {"prefill_prompt": prompt_len, "prompts": count, "prefill_s": secs,
            "prefill_tok_s": count * prompt_len / secs, "prefill_tflops": flops / secs / 1e12,
            "peak_tflops": peak / 1e12, "share_of_peak": flops / secs / peak}  # fmt: skip


def profile_decode(
    model, cfg, batch: int, prompt_len: int, steps: int = 8, kv_dtype: torch.dtype = torch.bfloat16,
    eager: bool = True,
) -> None:  # fmt: skip
    """Kernel time per decode step, by kernel: where the step goes against the roofline (from CUDA
    graphs, then eager unless `eager` is False)."""
    from torch.profiler import ProfilerActivity, profile

    for sizes in ((batch,), ()) if eager else ((batch,),):
        pages = batch * ((prompt_len + 64) // 16 + 1) + 16
        kv = KVConfig(page_size=16, num_pages=pages, max_requests=batch, dtype=kv_dtype, device="cuda")
        ecfg = engine_config(max_running=batch, cuda_graph_sizes=sizes)
        engine = Engine(model, kv, ecfg)
        prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        reqs = [engine.add_request(p, sp) for p in prompts]
        while any(not r.output for r in reqs):
            engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        label = "graphs" if sizes else "eager"
        what = f"{model.quantization} weights, {kv_dtype} KV"
        print(f"--- decode batch {batch}, {label}, {steps} steps, {what} ---")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
        print_timeline(prof, steps)
        while not engine.idle:
            engine.step()


def print_timeline(prof, steps: int) -> None:  # type: ignore[no-untyped-def]
    """The GPU's timeline, kernel by kernel: how long each kind runs and how long the GPU sat idle
    before it, per step; then the span of the profiled steps against their busy time, and the
    longest gaps with the ops on either side (a host wait, a launch outside the graph)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e),
        key=lambda e: float(e["ts"]),
    )
    kinds: dict[str, list[float]] = {}
    end, busy, idle, prev, gaps = None, 0.0, 0.0, "", []
    for e in gpu:
        ts, dur = float(e["ts"]), float(e["dur"])  # microseconds, as the trace format has them
        gap = 0.0 if end is None else max(0.0, ts - end)
        name = e["cat"] + ":" + e["name"][:60]
        row = kinds.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += dur
        row[2] += gap
        busy, idle = busy + dur, idle + gap
        gaps.append((gap, prev, name))
        end, prev = max(end or 0.0, ts + dur), name
    span = end - float(gpu[0]["ts"]) if gpu else 0.0
    print(f"timeline per step: {len(gpu) / steps:.0f} GPU ops, busy {busy / steps:.1f} us, idle between "
          f"ops {idle / steps:.1f} us, span {span / steps:.1f} us")  # fmt: skip
    print(f"{'op':64s} {'per step':>8s} {'us each':>8s} {'gap before':>10s}")
    for name, (n, dur, gap) in sorted(kinds.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
        print(f"{name:64s} {n / steps:8.1f} {dur / n:8.2f} {gap / n:10.2f}")
    print("longest gaps (us, after -> before):")
    for gap, after, before in sorted(gaps, reverse=True)[: 2 * steps]:
        print(f"  {gap:8.2f}  {after[:50]} -> {before[:50]}")


def bench_hf(hf, cfg, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda")
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    step_s = ((t2 - t1) - (t1 - t0)) / (steps - 1)  # subtract the prefill
    return {"batch": batch, "hf_decode_step_ms": 1e3 * step_s, "hf_decode_tok_s": batch / step_s}


def one_of(*allowed: str):  # type: ignore[no-untyped-def]
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(" or ".join(allowed))
        return value

    return parse


def at_least(kind: type, low: float):  # type: ignore[no-untyped-def]
    def parse(value: str):  # type: ignore[no-untyped-def]
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise ValueError(f"{'an' if kind is int else 'a'} {kind.__name__} of at least {low}")
        return number

    return parse


def comma_list(parse):  # type: ignore[no-untyped-def]
    """An argparse `type` for an option whose comma-separated values are each a variant of the run."""

    def convert(value: str) -> list:  # type: ignore[type-arg]
        try:
            return [parse(v) for v in value.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"each value must be {e}, got {value!r}") from None

    return convert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--prefill-prompt", type=int, default=4096, help="0: skip the prefill benchmark")
    ap.add_argument(
        "--profile", type=int, default=0,
        help="profile decode at this batch (graphs and eager; with several --quantization values, each "
        "model and KV dtype from graphs)",
    )  # fmt: skip
    ap.add_argument("--kernels", choices=["auto", "torch"], default="auto",
                    help="fused Triton elementwise ops (auto, on CUDA) or unfused torch")  # fmt: skip
    ap.add_argument(
        "--gemm",
        default="auto",
        type=comma_list(one_of("auto", "cublas", "skinny")),
        help="GEMMs at <= 64 rows: auto (skinny to 16 rows), cublas, skinny, or a list",
    )
    ap.add_argument(
        "--rope-in-attention",
        default="on",
        type=comma_list(one_of("on", "off")),
        help="decode's RoPE + K/V store inside the attention kernels (on) or in a kernel of its own (off)",
    )
    ap.add_argument(
        "--window", default="tpot", type=comma_list(one_of("tpot", "synced")),
        help="decode_step_ms's window: tpot (first token to last, a client's time per output token) or "
        "synced (the device drained after prefill), or a list",
    )  # fmt: skip
    ap.add_argument(
        "--tune-gemms", default="on", type=comma_list(one_of("on", "off")),
        help="EngineConfig.tune_gemms: cuBLASLt's fastest algorithm per decode GEMM (on) or torch's (off), "
        "or a list (each choice is printed: logging at INFO)",
    )  # fmt: skip
    ap.add_argument(
        "--page-size", default="16", type=comma_list(at_least(int, 1)),
        help="tokens per KV page of the decode engines (the services' default is 16), or a list",
    )  # fmt: skip
    ap.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with FP8 --quantization values: the LM head FP8 too (--quantize-lm-head of the services)",
    )
    ap.add_argument(
        "--quantization", default="none", type=comma_list(one_of("none", "fp8", "fp8-block")),
        help="the model's projections as they are (none), FP8 with per-channel (fp8) or 128x128 block scales "
        "(fp8-block), or a list: each on a model of its own, its decode and prefill rows in turn",
    )  # fmt: skip
    ap.add_argument(
        "--kv-cache-dtype", default="auto", type=comma_list(one_of("auto", "fp8_e4m3")),
        help="the KV cache's dtype: the model's (auto) or FP8 e4m3 (one scale per layer), or a list",
    )  # fmt: skip
    ap.add_argument(
        "--prefix-cache", default="off", type=comma_list(one_of("on", "off")),
        help="EngineConfig.prefix_cache (the services' default is on), or a list: decode with the cache's "
        "bookkeeping against without",
    )  # fmt: skip
    ap.add_argument(
        "--settle", default="0", type=comma_list(at_least(float, 0.0)),
        help="with --window synced: seconds the device idles between the prefill and the decode (the "
        "clocks recover from the prefill's power cap), or a list",
    )  # fmt: skip
    ap.add_argument(
        "--model", choices=sorted(MODELS), default="2b",
        help="the ~2B hybrid, an ~8B one of Llama 3 8B's widths (the same layer pattern), or gpt-oss-20b's "
        "shape (moe-20b: 32 experts, 4 a token, attention sinks)",
    )  # fmt: skip
    ap.add_argument(
        "--fold-norms", choices=["on", "off"], default="on",
        help="each layer's RMSNorm weights folded into the GEMMs after them (EngineConfig.fold_norms); "
        "one value a run: the fold changes the model",
    )  # fmt: skip
    args = ap.parse_args()
    global FOLD_NORMS
    FOLD_NORMS = args.fold_norms == "on"
    ropes, windows, tunes, gemms = args.rope_in_attention, args.window, args.tune_gemms, args.gemm
    page_sizes, settles, caches = args.page_size, args.settle, args.prefix_cache
    kv_dtypes = args.kv_cache_dtype
    if max(settles) > 0 and windows != ["synced"]:
        ap.error(f"--settle: more than 0 only with --window synced, got {','.join(map(str, settles))!r}")
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("shared.model.gemm_tuning").setLevel(logging.INFO)
    bandwidth = copy_bandwidth()
    rows = []
    cfg, model, hf = make_models(not args.no_hf, MODELS[args.model])
    peak = matmul_peak() if args.prefill_prompt else 0.0
    for qi, quant in enumerate(args.quantization):  # each quantization on a model of its own
        if qi:
            del model
            torch.cuda.empty_cache()
            cfg, model, _ = make_models(False, MODELS[args.model])
        quantize_model(model, quant)
        if args.quantize_lm_head and quant != "none":
            quantize_head(model)
        model.kernel_backend = args.kernels
        params = sum(p.numel() for p in model.parameters()) / 1e9
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; params {params:.2f}B; kernels {args.kernels}; "
              f"quantization {quant}", flush=True)  # fmt: skip
        variants = list(
            itertools.product(gemms, ropes, windows, tunes, page_sizes, settles, caches, kv_dtypes)
        )
        for gemm, rope, window, tune, page, settle, cache, kv_name in variants:  # side by side
            model.gemm_backend = gemm
            for batch in (int(b) for b in args.batches.split(",")):
                measured = bench_engine(
                    model, cfg, batch, args.prompt, args.steps, bandwidth, rope == "on", window,
                    tune_gemms=tune == "on", page_size=page, settle=settle, prefix_cache=cache == "on",
                    kv_dtype=KV_DTYPES[kv_name],
                )  # fmt: skip
                row = {"quantization": quant, "kv_cache_dtype": kv_name, "gemm": gemm,
                       "rope_in_attention": rope, "tune_gemms": tune, "page_size": page,
                       "prefix_cache": cache, **measured}  # fmt: skip
                first = (gemm, rope, window, tune, page, settle, cache, kv_name) == variants[0]
                if hf is not None and qi == 0 and first:
                    row.update(bench_hf(hf, cfg, batch, args.prompt, min(args.steps, 32)))
                rows.append(row)
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                shown.pop("intervals_ms", None)  # every decode interval: in --json's rows
                print(json.dumps(shown), flush=True)
        model.gemm_backend = gemms[-1]
        for kv_name in kv_dtypes if args.prefill_prompt else ():
            row = bench_prefill(model, cfg, args.prefill_prompt, 4, peak, KV_DTYPES[kv_name])
            row = {"quantization": quant, "kv_cache_dtype": kv_name, **row}
            rows.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
        for kv_name in kv_dtypes if args.profile and len(args.quantization) > 1 else ():
            profile_decode(model, cfg, args.profile, args.prompt, kv_dtype=KV_DTYPES[kv_name], eager=False)
    if args.profile and len(args.quantization) == 1:
        profile_decode(model, cfg, args.profile, args.prompt, kv_dtype=KV_DTYPES[kv_dtypes[-1]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "kernels": args.kernels, "rows": rows}, f)  # fmt: skip


if __name__ == "__main__":
    main()
