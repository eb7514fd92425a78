"""The benchmarks under bench/ stay runnable: device time is scarce, and a script that fails to start
on the GPU machine wastes it. Every script parses `--help` without CUDA; the ones that also run on CPU
(the serving bench's two modes with a tiny model, the engine's host-side bench, under the `perf`
marker, the kernels' sm_90 resource and load-placement checks) run end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
TINY = {"layers": "SF", "window": 16, "vocab": 256, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
        "intermediate": 128, "max_context": 512}  # fmt: skip


def _run(*args: str, timeout: float, compiled: bool = False) -> subprocess.CompletedProcess[str]:
    """`compiled`: without TRITON_INTERPRET (the suite sets it), so that Triton compiles the kernels."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if compiled:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_starts(script: str) -> None:
    out = _run(f"bench/{script}", "--help", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


@pytest.mark.perf
def test_the_decode_attention_kernels_compile_for_the_h200_without_one() -> None:
    # Compiling for sm_90 here catches what the interpreter lets through (it runs Python, not the
    # compiler's front end) before a GPU run does.
    out = _run("bench/kernel_resources.py", timeout=600, compiled=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if "registers" in line]
    assert len(rows) == 16 and all("shared" in row and "prologue" in row for row in rows), out.stdout
    # The engine's decode path (RoPE inside, the folded norm's row scale), over a cache in the model's
    # dtype or FP8, keeps its prologue free of layout trips through shared memory: the row scale's
    # reduction and the rotated query rows' store are its only barriers (each trip is a barrier in
    # every program of a step at once). Over an FP8 cache the query tile's one trip into the float16
    # dots' layout comes before the unmasked key loop's first copy too, the third.
    engine_path = [row for row in rows if "row scale" in row or "FP8 cache + RoPE" in row]
    barriers = {row: int(re.search(r"(\d+) barriers", row).group(1)) for row in engine_path}
    assert len(barriers) == 4, engine_path
    assert all(n <= (3 if "FP8" in row else 2) for row, n in barriers.items()), engine_path
    # The 8B's FP8 decode path under a register cap compiles to at most the cap; uncapped it needs more
    # (the rows bench/kernel_resources.py reports for `Tiles.max_registers`).
    regs = {
        " ".join(row.split(" registers")[0].split()): int(re.search(r"registers\s+(\d+)", row).group(1))
        for row in rows
    }
    for op in ("ring", "paged"):
        assert regs[f"{op} 8B FP8 decode, cap 128"] <= 128 < regs[f"{op} 8B FP8 decode, no cap"], rows


@pytest.mark.perf
def test_the_fp8_decode_kernels_read_their_weights_before_waiting_for_the_kernel_before() -> None:
    # Under programmatic dependent launch a kernel runs its start while the kernel before still does:
    # the norm's weight and the GEMM's weight scales, which no kernel of the step writes, are read
    # there, and nothing but the residual addend is read between the GEMM's K loop and its store.
    out = _run("bench/kernel_resources.py", timeout=600, compiled=True)
    assert out.returncode == 0, out.stderr[-2000:]
    loads = {
        line.split(" loads ")[0].strip(): tuple(int(n) for n in re.findall(r"(?:wait|release)\s+(\d+)", line))
        for line in out.stdout.splitlines()
        if line.startswith("fp8 ")
    }
    kernels = {"fp8 rms_norm_quant", "fp8 skinny_gemm q/k/v", "fp8 skinny_gemm o + residual"}
    assert loads.keys() == kernels, out.stdout
    assert loads["fp8 rms_norm_quant"][0] > 0, out.stdout
    before, after = loads["fp8 skinny_gemm q/k/v"]
    assert before > 0 and after == 0, out.stdout
    assert loads["fp8 skinny_gemm o + residual"][0] == before, out.stdout


def test_the_serving_bench_compares_colocated_and_disaggregated_on_cpu(tmp_path: Path) -> None:
    assert "unknown modes" in _run("bench/serving.py", "--modes", "colocated,typo", timeout=120).stderr
    rows_file = tmp_path / "serving.json"
    out = _run(
        "bench/serving.py", "--device", "cpu", "--dtype", "float32", "--model", "random:" + json.dumps(TINY),
        "--rates", "20", "--sessions", "2", "--turns", "2", "--prefix-tokens", "24", "--turn-tokens", "8",
        "--output-tokens", "3", "--modes", "colocated,colocated-mixed,disaggregated",
        "--service-args", "--num-pages 128 --max-running 4 --max-batch-tokens 128", "--json", str(rows_file),
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [r["mode"] for r in rows] == ["colocated", "colocated-mixed", "disaggregated"]
    for r in rows:
        assert r["requests"] == 4 and r["errors"] == {}, r
        assert 0 < r["ttft_p50"] <= r["ttft_p99"] and r["output_tok_s"] > 0


def test_the_prefix_cache_bench_compares_the_cache_off_and_on_on_cpu(tmp_path: Path) -> None:
    out_file = tmp_path / "prefix.json"
    out = _run(
        "bench/prefix_cache.py", "--device", "cpu", "--dtype", "float32",
        "--model", "random:" + json.dumps(TINY),
        "--rates", "20", "--sessions", "2", "--turns", "2", "--prefix-tokens", "32", "--turn-tokens", "16",
        "--output-tokens", "2", "--modes", "colocated,disaggregated",
        "--service-args", "--num-pages 256 --max-running 4 --max-batch-tokens 128 --page-size 4",
        "--json", str(out_file), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_file.read_text())
    assert [(r["mode"], r["prefix_cache"]) for r in result["rows"]] == [
        ("colocated", False), ("colocated", True), ("disaggregated", False), ("disaggregated", True)
    ]  # fmt: skip
    for r in result["rows"]:
        assert r["requests"] == 4 and r["errors"] == {}, r
        assert r["prompt_tokens"] > 0
        assert (r["computed_prompt_tokens"] < r["prompt_tokens"]) == r["prefix_cache"], r
    assert all(s["computed_fewer"] > 0 for s in result["summary"])


def test_the_engine_host_bench_runs_on_cpu() -> None:
    out = _run("bench/engine_host.py", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows and all(r["step_us"] > 0 and r["launch_us"] > 0 for r in rows), rows


def test_the_engine_trace_bench_runs_two_passes_on_cpu() -> None:
    out = _run(
        "bench/engine_trace.py", "--device", "cpu", "--dtype", "float32",
        "--model", "random:" + json.dumps(TINY), "--sessions", "3", "--turns", "2", "--prefix-tokens", "24",
        "--turn-tokens", "8", "--output-tokens", "3", "--num-pages", "128", "--max-running", "4",
        "--max-batch-tokens", "128", "--rate", "50",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["pass"] for r in rows] == [0, 1]
    assert all(r["requests"] == 6 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] for r in rows), rows


def test_the_decode_ablation_skips_only_the_families_it_is_asked_to() -> None:
    from bench.decode_ablation import Skipper
    from shared.kernels.skinny_gemm import skinny_gemm

    x, w_o, w_up = torch.randn(4, 16), torch.randn(8, 16), torch.randn(12, 16)
    with Skipper({"o": (8, 16), "gate_up": (12, 16)}) as skipper:
        with skipper.skipping(("o",)):
            skipped = skinny_gemm(x, w_o, add=torch.zeros(4, 8))
            kept = skinny_gemm(x, w_up, add=torch.zeros(4, 12))
        after = skinny_gemm(x, w_o, add=torch.zeros(4, 8))
    assert torch.equal(skipped, torch.zeros(4, 8))  # the o GEMM never ran: its addend is untouched
    torch.testing.assert_close(kept, x @ w_up.T)
    torch.testing.assert_close(after, x @ w_o.T)
    restored = skinny_gemm(x, w_o, add=torch.zeros(4, 8))  # outside the context: the kernel as it was
    torch.testing.assert_close(restored, x @ w_o.T)
    kernel = sys.modules["shared.kernels.skinny_gemm"]._skinny_gemm_kernel
    assert "run" not in vars(kernel)  # its class's method again, as instrumentation patching it expects


def test_the_fp8_accuracy_bench_scores_every_variant_against_the_unquantized_model(tmp_path: Path) -> None:
    """bench/fp8_accuracy.py on the embedded SmolLM2, a few prompts of Python's language reference:
    the unquantized row is the reference itself, and every FP8 variant diverges from it."""
    out_json = tmp_path / "acc.json"
    out = _run(
        "bench/fp8_accuracy.py", "--tokens", "48", "--chunk", "24", "--json", str(out_json), timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    assert result["tokens"] == 46  # two prompts of 24, each scoring its 23 next tokens
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["unquantized", "fp8 weights", "fp8 cache", "fp8 weights + fp8 cache"]
    assert rows["unquantized"]["change_percent"] == 0 and rows["unquantized"]["mean_kl"] == 0
    assert 0 < rows["fp8 cache"]["mean_kl"] < rows["fp8 weights"]["mean_kl"], rows
    assert all(5 < row["perplexity"] < 500 for row in rows.values()), rows  # the model reads English
