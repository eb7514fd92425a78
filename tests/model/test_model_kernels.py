"""The fused Triton kernels (interpreted on CPU, compiled on CUDA) against the torch reference, on small
and odd shapes: rows strided like the views the model passes, sizes that are not powers of two."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import assert_matches

from shared.kernels import KVStore, TorchKernels, TritonKernels, kernels_for, reference
from shared.kernels.rms_norm import rms_norm, rms_scale
from shared.kernels.rope import rope
from shared.kernels.silu_mul import gelu_tanh_mul, gelu_tanh_mul_rms, silu_mul, silu_mul_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def norm_weight(size: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return 1.0 + rand(size, dtype=dtype, scale=0.2, seed=seed)


def rope_table(positions: int, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(1, 1), (7, 33), (5, 100), (3, 256)])
def test_rms_norm_matches_reference(rows: int, size: int, dtype: torch.dtype) -> None:
    wide = rand(rows, size + 5, dtype=dtype, scale=3.0)
    x = wide[:, 2 : 2 + size]  # strided rows, as a slice of a wider activation
    w = norm_weight(size, dtype)
    assert_matches(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_rms_norm_eps_dominates_a_zero_row() -> None:
    x = torch.zeros(2, 16, device=DEVICE)
    x[1] = 1e-4
    w = torch.ones(16, device=DEVICE)
    assert_matches(rms_norm(x, w, 1e-2), reference.rms_norm(x, w, 1e-2))
    assert not rms_norm(x, w, 1e-2).isnan().any()


def qk_views(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model has them: strided views of one fused qkv projection's output."""
    qkv = rand(tokens, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=4)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(tokens, hq, d), k.view(tokens, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    ("tokens", "hq", "hkv", "d"), [(1, 1, 1, 2), (6, 3, 1, 10), (9, 4, 2, 16), (3, 8, 8, 64)]
)
def test_rope_matches_reference(
    tokens: int, hq: int, hkv: int, d: int, qk_norm: bool, dtype: torch.dtype
) -> None:
    q, k = qk_views(tokens, hq, hkv, d, dtype)
    table = rope_table(40, d)
    # -1 is a CUDA-graph padding row (torch indexing wraps it to the last row); 39 the table's last.
    positions = torch.tensor([0, 39, -1, 17, 5, 23, 1, 2, 3][:tokens], device=DEVICE)
    weights = (norm_weight(d, dtype, seed=5), norm_weight(d, dtype, seed=6)) if qk_norm else (None, None)
    got = rope(q, k, positions, table, *weights, eps=1e-6)
    expected = reference.rope(q, k, positions, table, *weights, eps=1e-6)
    for actual, ref in zip(got, expected, strict=True):
        assert actual.is_contiguous()
        assert_matches(actual, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("tokens", "hq", "hkv", "d"), [(1, 1, 1, 2), (6, 3, 1, 10), (5, 4, 2, 16)])
def test_rope_store_writes_the_rotated_k_and_v_where_store_kv_would(
    tokens: int, hq: int, hkv: int, d: int, qk_norm: bool, dtype: torch.dtype
) -> None:
    qkv = rand(tokens, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=4)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    table = rope_table(40, d)
    positions = torch.tensor([0, 39, -1, 17, 5, 23][:tokens], device=DEVICE)
    # Scattered cache rows; -1 (padding, a skipped token) stores nothing.
    index = torch.tensor([7, 2, -1, 11, 0, 5][:tokens], device=DEVICE)
    weights = (norm_weight(d, dtype, seed=5), norm_weight(d, dtype, seed=6)) if qk_norm else (None, None)

    def cache() -> KVStore:
        stale = rand(12, hkv, d, dtype=dtype, seed=9)  # what the skipped and untouched rows keep
        return KVStore(stale, stale.clone(), index)

    got_store, want_store = cache(), cache()
    got = TritonKernels().rope_store(q, k, v, positions, table, got_store, *weights, eps=1e-6)
    want = TorchKernels().rope_store(q, k, v, positions, table, want_store, *weights, eps=1e-6)
    for actual, ref in zip(got, want, strict=True):
        assert_matches(actual, ref)
    assert_matches(got_store.k_dst, want_store.k_dst)
    assert torch.equal(got_store.v_dst, want_store.v_dst)  # v is copied, never rounded
    kept = index[index >= 0]
    assert torch.equal(got_store.k_dst[kept], got[1][index >= 0])  # the cache holds what attention gets


def test_rope_store_refuses_a_store_that_does_not_fit() -> None:
    q, k = qk_views(3, 2, 1, 8, torch.float32)
    table, positions = rope_table(10, 8), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    rows = torch.zeros(5, 1, 8, device=DEVICE)
    store = KVStore(rows, rows.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="needs v shaped like k"):
        rope(q, k, positions, table, store=store, v=torch.zeros(3, 2, 8, device=DEVICE))
    bad = KVStore(torch.zeros(5, 2, 8, device=DEVICE), torch.zeros(5, 2, 8, device=DEVICE), store.index)
    with pytest.raises(ValueError, match="do not match rows"):
        rope(q, k, positions, table, store=bad, v=torch.zeros_like(k))


def test_rope_takes_int32_positions_and_clamps_past_the_table() -> None:
    q, k = qk_views(3, 2, 1, 8, torch.float32)
    table = rope_table(10, 8)
    got = rope(q, k, torch.tensor([3, 9, 0], dtype=torch.int32, device=DEVICE), table)
    expected = reference.rope(q, k, torch.tensor([3, 9, 0], device=DEVICE), table)
    for actual, ref in zip(got, expected, strict=True):
        assert_matches(actual, ref)
    # Past the end, torch would raise; the kernel must not read out of bounds (it uses the last row).
    past, last = (rope(q, k, torch.tensor([p] * 3, device=DEVICE), table)[0] for p in (10_000, 9))
    assert torch.equal(past, last)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(1, 1), (3, 7), (4, 1500)])
def test_silu_mul_matches_reference(rows: int, size: int, dtype: torch.dtype) -> None:
    gate_up = rand(rows, 2 * size, dtype=dtype, scale=4.0, seed=7)
    assert_matches(silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width", "hidden"), [(1, 1, 1), (3, 40, 33), (5, 1500, 100)])
def test_rms_scale_matches_reference(rows: int, width: int, hidden: int, dtype: torch.dtype) -> None:
    """A GEMM's output scaled by its input rows' norm (q/k/v of a folded input norm), strided rows."""
    y = rand(rows, width + 3, dtype=dtype, scale=4.0, seed=9)[:, 1 : 1 + width]
    x = rand(rows, hidden, dtype=dtype, scale=30.0, seed=10)
    assert_matches(rms_scale(y, x, 1e-6), reference.rms_scale(y, x, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size", "hidden"), [(1, 1, 1), (3, 7, 33), (4, 1500, 100)])
def test_silu_mul_rms_matches_reference(rows: int, size: int, hidden: int, dtype: torch.dtype) -> None:
    """The MLP's activation with the norm's row scale of x (strided rows, as the residual stream's)."""
    gate_up = rand(rows, 2 * size, dtype=dtype, scale=4.0, seed=7)
    x = rand(rows, hidden + 5, dtype=dtype, scale=30.0, seed=8)[:, 2 : 2 + hidden]
    got = silu_mul_rms(gate_up, x, 1e-5)
    assert_matches(got, reference.silu_mul_rms(gate_up, x, 1e-5))
    # The row scale is the RMSNorm's: gate_up of x equals gate_up of its norm, scaled.
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_matches(reference.silu_mul_rms(gate_up, x, 1e-5), silu_mul((gate_up.float() * rstd).to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size", "hidden"), [(1, 1, 1), (3, 7, 33), (4, 1500, 100)])
def test_gelu_tanh_mul_matches_reference(rows: int, size: int, hidden: int, dtype: torch.dtype) -> None:
    """Gemma's GeGLU: GELU's tanh approximation as torch computes it, alone and after a folded norm."""
    gate_up = rand(rows, 2 * size, dtype=dtype, scale=4.0, seed=7)
    assert_matches(gelu_tanh_mul(gate_up), reference.gelu_tanh_mul(gate_up))
    x = rand(rows, hidden + 5, dtype=dtype, scale=30.0, seed=8)[:, 2 : 2 + hidden]
    assert_matches(gelu_tanh_mul_rms(gate_up, x, 1e-5), reference.gelu_tanh_mul_rms(gate_up, x, 1e-5))


def test_gelu_tanh_mul_saturates_without_nan() -> None:
    gate_up = torch.tensor([[-200.0, -12.0, 0.0, 90.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    out = gelu_tanh_mul(gate_up)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.gelu_tanh_mul(gate_up))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreting
def test_silu_mul_saturates_without_nan() -> None:
    gate_up = torch.tensor([[-200.0, 0.0, 90.0, 2.0, 3.0, 4.0]], device=DEVICE)
    out = silu_mul(gate_up)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.silu_mul(gate_up))


def test_empty_batches() -> None:
    w = torch.ones(8, device=DEVICE)
    assert rms_norm(torch.zeros(0, 8, device=DEVICE), w, 1e-6).shape == (0, 8)
    assert silu_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)
    empty = torch.zeros(0, 8, device=DEVICE)
    assert silu_mul_rms(empty, torch.zeros(0, 3, device=DEVICE), 1e-6).shape == (0, 4)
    q, k = rope(torch.zeros(0, 2, 4, device=DEVICE), torch.zeros(0, 1, 4, device=DEVICE),
                torch.zeros(0, dtype=torch.int64, device=DEVICE), rope_table(4, 4))  # fmt: skip
    assert q.shape == (0, 2, 4) and k.shape == (0, 1, 4)


def _rope_args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": torch.zeros(3, 2, 8), "k": torch.zeros(3, 1, 8), "positions": torch.zeros(3, dtype=torch.int64),
        "cos_sin": torch.zeros(10, 8),
    }  # fmt: skip
    args.update(change)
    return {n: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
            for n, v in args.items()}  # fmt: skip


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: rms_norm(torch.zeros(2, 3, 4), torch.ones(4), 1e-6), r"x must be \[T, H\]"),
        (lambda: rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-6), "weight must have 4 entries"),
        (lambda: rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.float16), 1e-6), "weight dtype"),
        (lambda: rms_norm(torch.zeros(4, 2).t(), torch.ones(4), 1e-6), "contiguous last dimension"),
        (lambda: rms_norm(torch.zeros(2, 4, dtype=torch.int32), torch.ones(4), 1e-6), "x must have dtype"),
        (lambda: rms_norm(torch.zeros(2, 4), torch.ones(4), -1.0), "eps must be"),
        (lambda: rms_norm(torch.zeros(2, 4), torch.ones(4, device="meta"), 1e-6), "one device"),
        (lambda: silu_mul(torch.zeros(2, 5)), "equal width"),
        (lambda: silu_mul(torch.zeros(10)), r"gate_up must be \[T, 2I\]"),
        (lambda: silu_mul_rms(torch.zeros(2, 8), torch.zeros(3, 4), 1e-6), "must have gate_up's 2 rows"),
        (lambda: rms_scale(torch.zeros(2, 8), torch.zeros(3, 4), 1e-6), "must have y's 2 rows"),
        (lambda: rms_scale(torch.zeros(2, 8), torch.zeros(2, 4), -1.0), "eps must be"),
        (lambda: silu_mul_rms(torch.zeros(2, 8), torch.zeros(2, 4, dtype=torch.float16), 1e-6), "dtype"),
        (lambda: silu_mul_rms(torch.zeros(2, 8), torch.zeros(2, 4), -1.0), "eps must be"),
        (lambda: silu_mul_rms(torch.zeros(2, 8), torch.zeros(4, 2).t(), 1e-6), "contiguous last dimension"),
        (lambda: rope(**_rope_args(k=torch.zeros(3, 1, 6))), "k .* must be"),
        (lambda: rope(**_rope_args(k=torch.zeros(3, 1, 8, dtype=torch.float16))), "k dtype"),
        (lambda: rope(**_rope_args(positions=torch.zeros(4, dtype=torch.int64))), "positions has 4"),
        (lambda: rope(**_rope_args(positions=torch.zeros(3))), "positions must have dtype"),
        (lambda: rope(**_rope_args(cos_sin=torch.zeros(10, 6))), "cos_sin must be"),
        (
            lambda: rope(
                **_rope_args(q=torch.zeros(3, 2, 7), k=torch.zeros(3, 1, 7), cos_sin=torch.zeros(10, 7))
            ),
            "head dim must be even",
        ),
        (lambda: rope(**_rope_args(q_weight=torch.ones(8))), "both q_weight and k_weight"),
        (lambda: rope(**_rope_args(q_weight=torch.ones(8), k_weight=torch.ones(4))), "k_weight must have 8"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_kernels_for_picks_by_device() -> None:
    assert isinstance(kernels_for("cpu"), TorchKernels)
    if torch.cuda.is_available():  # compiled kernels (conftest sets the interpreter only without CUDA)
        assert isinstance(kernels_for("cuda"), TritonKernels)
        with pytest.raises(ValueError, match="need CUDA tensors"):
            kernels_for("cpu", "triton")
    else:
        assert isinstance(kernels_for("cpu", "triton"), TritonKernels)  # the interpreter
    with pytest.raises(ValueError, match="backend must be"):
        kernels_for("cpu", "cuda")  # type: ignore[arg-type]
