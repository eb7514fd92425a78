"""The AttentionOps seam: backend choice, argument errors, and ring vs paged agreement."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import make_batch
from cases import SPECS

from shared.kernels.attention import AttentionOps, TorchOps, TritonOps, ops_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def ops(request: pytest.FixtureRequest) -> AttentionOps:
    return ops_for(DEVICE, backend=request.param)


def test_ops_for_picks_by_device() -> None:
    assert isinstance(ops_for("cpu"), TorchOps)
    if torch.cuda.is_available():
        assert isinstance(ops_for("cuda"), TritonOps)
        assert isinstance(ops_for("cuda", backend="torch"), TorchOps)
    else:
        assert isinstance(ops_for(torch.device("cpu"), backend="triton"), TritonOps)  # the interpreter
    with pytest.raises(ValueError, match="backend must be"):
        ops_for("cpu", backend="cudnn")  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [1, 5, 8, 64])
@pytest.mark.parametrize("case", list(SPECS))
def test_ring_equals_paged_with_window(ops: AttentionOps, case: str, window: int) -> None:
    """Same semantics, two storage layouts: the ring plus the chunk == the whole history in pages."""
    b = make_batch(SPECS[case], hq=4, hkv=2, page_size=4, window=window, device=DEVICE)
    ring = ops.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window)
    paged = ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window)
    torch.testing.assert_close(ring, paged, atol=1e-5, rtol=1e-5)


def _paged_call(ops: AttentionOps, **change: object) -> None:
    b = make_batch(SPECS["mixed"], window=5, device=DEVICE)
    names = ["q", "k_cache", "v_cache", "block_table", "cu_q", "q_start"]
    args = dict(zip(names, b.paged_args(), strict=True))
    kwargs: dict[str, object] = {"max_q": b.max_q, "scale": b.scale, "window": 5}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    ops.paged_attention(*args.values(), **kwargs)  # type: ignore[arg-type]


def _ring_call(ops: AttentionOps, **change: object) -> None:
    b = make_batch(SPECS["mixed"], window=5, device=DEVICE)
    names = ["q", "k_new", "v_new", "k_ring", "v_ring", "slots", "cu_q", "q_start"]
    args = dict(zip(names, b.ring_args(), strict=True))
    kwargs: dict[str, object] = {"max_q": b.max_q, "scale": b.scale, "window": 5}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    ops.ring_attention(*args.values(), **kwargs)  # type: ignore[arg-type]


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": _t(18, 4)}, r"q must be \[T, Hq, D\]"),
        ({"q": _t(18, 3, 16)}, r"query heads \(3\) must be a multiple of kv heads \(2\)"),
        ({"q": _t(18, 4, 8)}, "q head dim 8 != kv head dim 16"),
        ({"q": _t(18, 4, 16, dtype=torch.float16)}, "k_cache dtype torch.float32 != q dtype torch.float16"),
        ({"cu_q": _t(5, dtype=torch.int64)}, "cu_q must have dtype"),
        ({"cu_q": _t(4, dtype=torch.int32)}, "cu_q must have B\\+1 = 5 entries"),
        ({"block_table": _t(3, 12, dtype=torch.int32)}, "block_table has 3 rows, expected B = 4"),
        ({"v_cache": _t(3, 4, 2, 16)}, "differ in shape"),
        ({"max_q": 0}, "max_q must be a positive Python int"),
        ({"max_q": torch.tensor(9)}, "max_q must be a positive Python int"),
        ({"window": 0}, "window must be a positive Python int or None"),
    ],
)
def test_paged_bad_arguments(ops: AttentionOps, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _paged_call(ops, **change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window": 4}, "ring width 5 != window 4"),
        ({"window": None}, "window is required"),
        ({"k_new": _t(17, 2, 16)}, r"k_new must be \[T, Hkv, D\] = \[18, 2, 16\]"),
        ({"slots": _t(4, dtype=torch.int64)}, "slots must have dtype"),
        ({"slots": _t(3, dtype=torch.int32)}, "slots has 3 entries, expected B = 4"),
        ({"k_ring": _t(6, 5, 2)}, r"k_ring must be \[num_slots, W, Hkv, D\]"),
        ({"q_start": _t(4, 1, dtype=torch.int32)}, r"q_start must be \[B\]"),
    ],
)
def test_ring_bad_arguments(ops: AttentionOps, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _ring_call(ops, **change)


def test_triton_refuses_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU tensors only")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        ops_for("cpu", backend="triton")
