"""Argument checks of the Triton wrappers: shapes, dtypes, strides and devices, never values (a check
that read a value would make the host wait for the device)."""

from __future__ import annotations

import torch

from shared.kernels._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    fail,
)
from shared.kernels._launch import check_triton_device

__all__ = [
    "FLOAT_DTYPES",
    "check_activation",
    "check_dims",
    "check_dtype",
    "check_eps",
    "check_norm_input",
    "check_rms_norm",
    "check_same_device",
    "check_triton_device",
    "check_weight",
    "fail",
]


def check_activation(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    """A float activation whose rows the kernel addresses by stride and whose last dim it reads as one run."""
    check_dims(op, name, t, ndim, layout)
    check_dtype(op, name, t, FLOAT_DTYPES)
    check_last_dim_contiguous(op, **{name: t})


def check_weight(op: str, name: str, w: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    check_dims(op, name, w, 1, f"[{size}]")
    if w.shape[0] != size:
        fail(op, f"{name} must have {size} entries, got {w.shape[0]}")
    if w.dtype != dtype:
        fail(op, f"{name} dtype {w.dtype} != activation dtype {dtype}")
    if not w.is_contiguous():
        fail(op, f"{name} must be contiguous")


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, float | int) or isinstance(eps, bool) or eps < 0:
        fail(op, f"eps must be a non-negative Python float, got {eps!r}")


def check_norm_input(op: str, x: torch.Tensor, name: str, scaled: torch.Tensor, eps: float) -> None:
    """x [T, H]: the rows whose RMSNorm scale the kernel applies to `scaled`'s rows (a norm folded into
    the GEMM before it, `Transformer.fold_norms`), each row summed by one program."""
    check_activation(op, "x", x, 2, "[T, H]")
    rows = scaled.shape[0]
    if x.shape[0] != rows or x.dtype != scaled.dtype:
        fail(op, f"x {tuple(x.shape)} {x.dtype} must have {name}'s {rows} rows and dtype {scaled.dtype}")
    check_eps(op, eps)
    check_same_device(op, **{name: scaled, "x": x})
    if x.shape[1] > 65536:
        fail(op, f"rows of x of {x.shape[1]} values do not fit one program (at most 65536)")


def check_rms_norm(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[int, int]:
    """An RMSNorm kernel's arguments: x [T, H] (rows may be strided) and weight [H] on one Triton
    device, a valid eps. Returns (T, H)."""
    check_activation(op, "x", x, 2, "[T, H]")
    rows, size = x.shape
    check_weight(op, "weight", weight, size, x.dtype)
    check_eps(op, eps)
    check_same_device(op, x=x, weight=weight)
    check_triton_device(op, x.device)
    return rows, size
