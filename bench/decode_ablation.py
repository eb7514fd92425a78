"""Where a decode step goes, kernel family by kernel family: each family's launches skipped in turn,
the step timed without them. Under programmatic dependent launch (`shared/kernels/_pdl.py`) a kernel
starts while the one before it runs and waits inside, so the profiler's durations overlap (`bench/
engine.py --profile`: a quantizer "takes" the attention before it); what a family costs the step is
the step's time with it minus the step's time without it. The tokens are wrong while a family is
skipped; the step's time is what is measured.

    python bench/decode_ablation.py --model 8b --quantization fp8 --kv-cache-dtype fp8_e4m3 --quantize-lm-head
    python bench/decode_ablation.py --model 8b --families quantizers,attention --rounds 3

Families: the FP8 norms' quantizers (`norm_quant`), the SwiGLU's (`glu_quant`), attention output's
(`quantize`: over a cache in the model's dtype only; over an FP8 cache attention writes e4m3 codes
and no quantizer runs), ring and paged attention, and each projection's skinny GEMM by its weight's shape
(`qkv`, `o`, `gate_up`, `down`, `head`: a bf16 model's GEMMs at more than 16 rows run on cuBLAS,
which this cannot skip). Each row gives the step without the family (every round), what skipping it
saved against the baseline (best against best), the family's launches a step, and that per launch.
Rounds run every variant in turn, the baseline first.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import bench.engine
from bench.engine import KV_DTYPES, MODELS, bench_engine, copy_bandwidth, make_models

KERNELS = {  # family -> (module, kernel name)
    "norm_quant": ("shared.kernels.fp8.rms_norm_quant", "_rms_norm_quant_kernel"),
    "quantize": ("shared.kernels.fp8.quant", "_quant_kernel"),
    "glu_quant": ("shared.kernels.fp8.glu_quant", "_glu_quant_kernel"),
    "ring": ("shared.kernels.attention.ring_attention", "_ring_attention_kernel"),
    "paged": ("shared.kernels.attention.paged_attention", "_paged_attention_kernel"),
}
GEMMS = ("qkv", "o", "gate_up", "down", "head")
GROUPS = {
    "quantizers": ("norm_quant", "quantize", "glu_quant"),
    "attention": ("ring", "paged"),
    "gemms": GEMMS,
}


class Skipper:
    """While entered, the families' Triton kernels go through a wrapper: a launch of a family in `skip`
    does nothing, and each family's launches inside a CUDA graph capture are counted. Leaving restores
    the kernels."""

    def __init__(self, gemm_shapes: dict[str, tuple[int, int]]) -> None:
        self.skip: set[str] = set()
        self.launches: dict[str, int] = {}
        self._by_shape = {shape: name for name, shape in gemm_shapes.items()}
        self._wrapped: list[tuple[Any, Any]] = []

    def __enter__(self) -> Skipper:
        import importlib

        for family, (module, name) in KERNELS.items():
            self._wrap(getattr(importlib.import_module(module), name), lambda args, f=family: f)
        gemm = importlib.import_module("shared.kernels.skinny_gemm")._skinny_gemm_kernel
        n_at, k_at = gemm.arg_names.index("N"), gemm.arg_names.index("K")
        self._wrap(gemm, lambda args: self._by_shape.get((int(args[n_at]), int(args[k_at]))))
        return self

    def __exit__(self, *exc: object) -> None:
        # The kernel as it was: its own attribute put back, or none, so that its class's `run` (which
        # other instrumentation may patch) is what a launch calls again.
        for kernel, own in reversed(self._wrapped):
            if own is None:
                del kernel.run
            else:
                kernel.run = own
        self._wrapped = []

    def _wrap(self, kernel: Any, family_of: Callable[[tuple], str | None]) -> None:  # type: ignore[type-arg]
        run = kernel.run
        self._wrapped.append((kernel, vars(kernel).get("run")))

        def launch(*args: Any, **kwargs: Any) -> Any:
            family = family_of(args)
            if family is not None:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    self.launches[family] = self.launches.get(family, 0) + 1  # a graph: one step's launches
                if family in self.skip:
                    return None
            return run(*args, **kwargs)

        kernel.run = launch

    @contextmanager
    def skipping(self, families: tuple[str, ...]) -> Iterator[None]:
        self.skip, self.launches = set(families), {}
        try:
            yield
        finally:
            self.skip = set()


def gemm_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each projection's weight shape (N, K) in the model's first layer, and the LM head's."""
    layer = model.layers[0]  # type: ignore[index]
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "head": model.lm_head}  # fmt: skip
    return {name: tuple(m.weight.shape) for name, m in mods.items()}  # type: ignore[misc]


def main() -> None:
    from shared.model.quant.fp8 import quantize_head, quantize_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quantization", choices=["none", "fp8", "fp8-block"], default="fp8")
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="fp8_e4m3")
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument(
        "--families", default="norm_quant,quantize,glu_quant,quantizers,ring,paged,qkv,o,gate_up,down,head",
        help="comma list of families, or of groups: "
        + ", ".join(f"{g} ({'+'.join(f)})" for g, f in GROUPS.items()),
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    known = set(KERNELS) | set(GEMMS) | set(GROUPS)
    wanted = [f for f in args.families.split(",") if f]
    if unknown := [f for f in wanted if f not in known]:
        ap.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    bandwidth = copy_bandwidth()
    cfg, model, _ = make_models(False, MODELS[args.model])
    quantize_model(model, args.quantization)
    if args.quantize_lm_head and args.quantization != "none":
        quantize_head(model)
    # Each engine captures only the batch's graph: a quicker warm-up, and the launches counted while it
    # captures are one step's.
    plain = bench.engine.engine_config
    bench.engine.engine_config = lambda **kw: plain(**({"cuda_graph_sizes": (args.batch,)} | kw))
    variants = [("baseline", ())] + [(f, GROUPS.get(f, (f,))) for f in wanted]
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.model} {args.quantization} weights, "
          f"{args.kv_cache_dtype} KV, batch {args.batch}", flush=True)  # fmt: skip
    steps: dict[str, list[float]] = {name: [] for name, _ in variants}
    launches: dict[str, int] = {}
    with Skipper(gemm_shapes(model)) as skipper:
        for _ in range(args.rounds):
            for name, families in variants:
                with skipper.skipping(families):
                    row = bench_engine(model, cfg, args.batch, args.prompt, args.steps, bandwidth,
                                       kv_dtype=KV_DTYPES[args.kv_cache_dtype])  # fmt: skip
                    launches[name] = sum(skipper.launches.get(f, 0) for f in families)
                if name != "baseline" and not launches[name]:
                    print(f"{name}: no launches in the decode step's graph (cuBLAS GEMMs, or none here)")
                steps[name].append(row["steady_step_ms"])
    base = min(steps["baseline"])
    rows = []
    for name, _ in variants:
        best = min(steps[name])
        saved = base - best if name != "baseline" else 0.0
        count = launches[name]
        out = {"family": name, "steady_step_ms": [round(s, 3) for s in steps[name]],
               "saved_ms": round(saved, 3), "launches_a_step": count,
               "us_a_launch": round(1e3 * saved / count, 2) if count else None}  # fmt: skip
        rows.append(out)
        print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PDSERVE_INVARIANT_CHECK", "off")
    main()
