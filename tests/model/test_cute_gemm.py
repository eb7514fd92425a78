"""`cute_gemm`: the decode GEMM in CuTe DSL, a programmatic dependent launch.

On a CPU machine: its config and the cases it declines (so the "cute" backend falls back to cuBLAS).
On a Hopper GPU with the `cute` extra: against torch at the decode layer's four shapes, every config
kind (split K through the cluster, x multicast), with and without the residual add; inside a CUDA
graph behind a kernel that releases it early; and no host sync around its launches."""

from __future__ import annotations

import pytest
import torch

from shared.model.kernels import cute_gemm
from shared.model.kernels._pdl import release_flag
from shared.model.kernels.cute_gemm import (
    CuteGemmConfig,
    config_for,
    cute_linear,
    cute_swiglu,
    refusal,
    shape_config,
    swiglu_config_for,
)
from shared.model.kernels.ops import kernels_for


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_n": 12}, "block_n"),
        ({"block_n": 264}, "block_n"),
        ({"block_n": 32, "split_k": 3}, "split_k"),
        ({"block_n": 32, "multicast": 2, "split_k": 2}, "multicast"),
        ({"block_n": 32, "block_k": 96}, "block_k"),
        ({"block_n": 32, "stages": 1}, "stages"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CuteGemmConfig(**kwargs)


def test_config_per_decode_shape() -> None:
    """The sweep's best: ~one program per SM, K split where the column blocks are few."""
    cfg = shape_config

    assert cfg(4096, 2048) == CuteGemmConfig(block_n=32, block_k=128, stages=6)  # q/k/v: 128 programs
    assert cfg(2048, 2048) == CuteGemmConfig(block_n=32, split_k=2, block_k=128, stages=6)  # o
    assert cfg(12288, 2048) == CuteGemmConfig(block_n=96, block_k=64, stages=9)  # gate/up
    assert cfg(2048, 6144) == CuteGemmConfig(block_n=32, split_k=2, block_k=128, stages=6)  # down
    assert cfg(100, 2048) is None  # no column block divides N
    assert cfg(2048, 2000) is None  # K not a multiple of the split K tiles


def test_declines_what_it_cannot_take() -> None:
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert config_for(torch.zeros(4, 128, dtype=torch.bfloat16), w) is None  # a CPU tensor
    assert config_for(torch.zeros(4, 128), w.float()) is None  # not bf16


def test_backend_falls_back_off_the_gpu() -> None:
    """The "cute" backend on CPU tensors: every GEMM is torch's, the same numbers."""
    kernels = kernels_for("cpu", "triton", "cute")
    layer = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, layer), torch.nn.functional.linear(x, layer.weight))
    assert swiglu_config_for(x, layer.weight) is None
    assert not release_flag(torch.device("cpu")), "the interpreter never sees griddepcontrol"


def test_backend_leaves_cublas_tuning_only_what_it_declines() -> None:
    """gemm_tuning times cuBLASLt for what cuBLAS will run: not a GEMM cute_gemm takes."""
    kernels = kernels_for("cpu", "triton", "cute")

    def layer(n: int, k: int, bias: bool = False) -> torch.nn.Linear:
        return torch.nn.Linear(k, n, bias=bias, device="meta")

    assert not kernels.takes_cublas(64, layer(4096, 2048))
    assert kernels.takes_cublas(64, layer(100, 2048)), "no column block divides N"
    assert kernels.takes_cublas(64, layer(4096, 2048, bias=True))
    assert kernels.takes_cublas(65, layer(4096, 2048)), "more rows than one wgmma tile"


def test_rejects_bad_operands_by_name() -> None:
    """What TMA and one wgmma tile cannot take is refused with the operand named, before a launch."""
    cfg = CuteGemmConfig(block_n=32)
    bf = torch.bfloat16
    w = torch.zeros(64, 128, dtype=bf)
    x = torch.zeros(4, 128, dtype=bf)
    cases = [
        (torch.zeros(65, 128, dtype=bf), w, "1 to 64 rows, got 65"),
        (torch.zeros(4, 128), w, "x must be a 2-D bf16 tensor"),
        (x, w.float(), "w must be a 2-D bf16 tensor"),
        (torch.zeros(4, 256, dtype=bf)[:, 1:129], w, "x's rows must be contiguous and 16-byte aligned"),
        (torch.zeros(4, 256, dtype=bf)[:, :127], w[:, 1:], "w's rows must be contiguous and 16-byte aligned"),
        (torch.zeros(4, 120, dtype=bf), w, "x has 120 columns, w 128"),
        (x, w, "must be on a CUDA device"),
    ]
    for a, b, why in cases:
        got = refusal(a, b)
        assert got is not None and why in got, (why, got)
        with pytest.raises(ValueError, match="cute_linear: "):
            cute_linear(a, b, cfg)


# Every kind of kernel the module builds, compiled for sm_90a in a process of its own (the target
# architecture is read from the environment): the compiler's front end and CuTe's layout algebra
# check what a GPU run would, without one. (block_n, split_k, multicast, block_k, stages, pdl,
# release_early, epilogue)
_KINDS = [
    (32, 1, 1, 128, 6, True, True, "store"),
    (32, 2, 1, 128, 6, True, True, "residual"),
    (64, 4, 1, 64, 8, True, True, "store"),
    (16, 1, 2, 128, 8, True, True, "residual"),
    (16, 1, 4, 128, 4, True, True, "store"),
    (96, 1, 1, 64, 9, False, True, "residual"),
    (32, 1, 1, 128, 6, True, False, "store"),
    (48, 1, 1, 64, 9, True, True, "swiglu"),
]
_COMPILE = """
import sys, torch, cuda.bindings.driver as cuda, cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack
from shared.model.kernels.cute_gemm import CuteGemmConfig, _build
def t(v):
    return from_dlpack(v, assumed_align=16).mark_layout_dynamic(leading_dim=1)
x, w, y = (torch.empty(*s, dtype=torch.bfloat16) for s in ((64, 2048), (4096, 2048), (64, 4096)))
for bn, split, mc, bk, stages, pdl, early, epilogue in KINDS:
    cfg = CuteGemmConfig(bn, split_k=split, multicast=mc, block_k=bk, stages=stages, pdl=pdl,
                         release_early=early)
    aux = w if epilogue == "swiglu" else y  # SwiGLU's is the up half of the weight
    cute.compile(_build(cfg, epilogue, 1e-5), t(x), t(w), t(y), t(aux), cuda.CUstream(0))
    print("compiled", bn, split, mc, epilogue, flush=True)
"""


def test_every_kernel_kind_compiles_for_the_h200_without_one() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("cutlass", reason="the cute extra (nvidia-cutlass-dsl) is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    code = f"KINDS = {_KINDS!r}\n" + _COMPILE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == len(_KINDS), out.stdout


needs_cute = pytest.mark.skipif(not cute_gemm.available(), reason="needs a Hopper GPU and the cute extra")
SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}
KINDS = {
    "chosen": None,
    "split4": CuteGemmConfig(block_n=64, split_k=4),
    "multicast2": CuteGemmConfig(block_n=32, block_k=128, multicast=2),
    "no_pdl": CuteGemmConfig(block_n=32, block_k=128, pdl=False),
}


def operands(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    r = torch.randn(rows, n, generator=gen).to("cuda", torch.bfloat16)
    return x, w, r


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 17, 64])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.gpu
@needs_cute
def test_matches_torch(shape: str, rows: int, kind: str, residual: bool) -> None:
    n, k = SHAPES[shape]
    x, w, r = operands(rows, n, k)
    cfg = KINDS[kind] or config_for(x, w)
    assert cfg is not None
    want = x.float() @ w.float().T + (r.float() if residual else 0.0)
    got = cute_linear(x, w, cfg, residual=r.clone() if residual else None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cute
def test_in_place_residual_and_strided_rows() -> None:
    """o's input is a column slice of q/k/v's output; the sum lands in the residual's storage."""
    x, w, r = operands(64, 2048, 2048)
    wide = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    wide[:, :2048] = x
    want = wide[:, :2048].float() @ w.float().T + r.float()
    out = cute_linear(wide[:, :2048], w, config_for(wide[:, :2048], w), residual=r, out=r)
    assert out.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cute
def test_graph_chain_behind_an_early_release_without_host_sync() -> None:
    """SwiGLU (released at its start) -> down + residual -> q/k/v, captured and replayed: the
    dependent launches wait for what they read, and nothing syncs the host."""
    from invariants.testing import no_host_sync
    from shared.model.kernels.silu_mul import silu_mul

    torch.manual_seed(0)
    gate_up = torch.randn(64, 12288, device="cuda", dtype=torch.bfloat16)
    down = (torch.randn(2048, 6144, device="cuda") / 6144**0.5).to(torch.bfloat16)
    qkv = (torch.randn(4096, 2048, device="cuda") / 2048**0.5).to(torch.bfloat16)
    stream = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    start = stream.clone()

    def step() -> torch.Tensor:
        act = silu_mul(gate_up)
        cute_linear(act, down, config_for(act, down), residual=stream, out=stream)
        return cute_linear(stream, qkv, config_for(stream, qkv))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    stream.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    act = torch.nn.functional.silu(gate_up[:, :6144].float()) * gate_up[:, 6144:].float()
    want_stream = start.float() + act.to(torch.bfloat16).float() @ down.float().T
    for _ in range(3):
        stream.copy_(start)
        with no_host_sync():
            graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(stream.float(), want_stream, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(out.float(), stream.float() @ qkv.float().T, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_swiglu_in_the_epilogue_matches_gemm_then_silu_mul_rms(rows: int) -> None:
    """gate/up with the activation and the row scale in its epilogue: `silu_mul_rms(x @ w.T, x)`.
    Correct, and measured 5-6% slower on the engine's step than the two launches (docs/benchmarks.md):
    not wired into the model."""
    from shared.model.kernels.silu_mul import silu_mul_rms

    x, w, _ = operands(rows, 12288, 2048)
    x = x * 3.0  # rows whose scale is far from 1
    cfg = swiglu_config_for(x, w)
    assert cfg == CuteGemmConfig(block_n=48, block_k=64, stages=9)
    want = silu_mul_rms(torch.matmul(x, w.T), x, 1e-5)
    got = cute_swiglu(x, w, cfg, 1e-5)
    assert got.shape == (rows, 6144)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
