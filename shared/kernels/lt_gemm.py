"""Half-precision GEMMs through cuBLASLt, the algorithm picked by the clock, not by a heuristic alone.

torch runs cuBLAS's first heuristic for a shape. At a decode step's few rows that pick is not always
the fastest of the algorithms cuBLASLt itself offers for the shape (a decode step's gate/up
projection and LM head each have a faster one), so `shared/model/gemm_tuning.py` times them on the
model's own weights; this module holds the cuBLASLt side: the candidates and the call.

The bindings are nvmath-python's (the `gpu` extra): cuBLASLt's C API, a function per C function.
Row-major y[M, N] = x[M, K] @ w[N, K]^T is column-major y^T = op_T(w) . x: A = w, B = x, D = y.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator

import numpy as np
import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t
_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # the half types cuBLASLt takes here (CUDA_R_16BF, _16F)
HALF_TYPES = tuple(_TYPES)
_OP_N, _OP_T = 0, 1
_MAX_WORKSPACE = 32 << 20  # bytes an algorithm may ask for (split-K partial sums)


def _lt():  # type: ignore[no-untyped-def]
    from nvmath.bindings import cublasLt

    return cublasLt


@functools.cache
def available() -> bool:
    """Whether cuBLASLt can be called here: nvmath-python importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        _lt().get_version()
    except Exception:  # not installed, or no libcublasLt it can load
        return False
    return True


@functools.cache
def _handle(device: int) -> int:
    """One cuBLASLt context per device, created on it (its heuristics read that device)."""
    with torch.cuda.device(device):
        return int(_lt().create())


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def _set(setter, obj: int, attr: int, value: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    setter(obj, attr, value.ctypes.data, value.nbytes)


class _Descs:
    """The matmul and layout descriptors of one (M, N, K) problem in a half type, x, w, y contiguous."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        lt = _lt()
        kind = _TYPES[dtype]
        self.op = lt.matmul_desc_create(_COMPUTE_32F, _R_32F)
        attr = lt.MatmulDescAttribute
        _set(lt.matmul_desc_set_attribute, self.op, attr.TRANSA, np.array(_OP_T, np.int32))
        _set(lt.matmul_desc_set_attribute, self.op, attr.TRANSB, np.array(_OP_N, np.int32))
        self.a = lt.matrix_layout_create(kind, k, n, k)
        self.b = lt.matrix_layout_create(kind, k, m, k)
        self.d = lt.matrix_layout_create(kind, n, m, n)
        # Bound now: at interpreter exit a __del__ could no longer import the bindings.
        weakref.finalize(self, _destroy, lt, self.op, (self.a, self.b, self.d))


def _destroy(lt, op: int, layouts: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    lt.matmul_desc_destroy(op)
    for layout in layouts:
        lt.matrix_layout_destroy(layout)


def _config(algo: np.ndarray, attr: int) -> int:
    lt = _lt()
    buf = np.zeros(1, lt.get_matmul_algo_config_attribute_dtype(attr))
    written = np.zeros(1, np.uint64)
    lt.matmul_algo_config_get_attribute(
        algo.ctypes.data, attr, buf.ctypes.data, buf.nbytes, written.ctypes.data
    )  # fmt: skip
    return int(buf[0])


_LABEL = ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "CTA_SWIZZLING", "CLUSTER_SHAPE_ID")


def algo_label(algo: np.ndarray) -> str:
    """The algorithm's configuration, as cuBLASLt names its parts."""
    attr = _lt().MatmulAlgoConfigAttribute
    return " ".join(f"{p.lower()}={_config(algo, getattr(attr, p))}" for p in _LABEL)


def _heuristic(descs: _Descs, device: int, count: int) -> list[tuple[np.ndarray, int]]:
    """cuBLASLt's ranking for the problem: (algorithm, the workspace bytes it needs)."""
    lt = _lt()
    pref = lt.matmul_preference_create()
    try:
        pattr = lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES
        _set(lt.matmul_preference_set_attribute, pref, pattr, np.array(_MAX_WORKSPACE, np.uint64))
        results = np.zeros(count, lt.matmul_heuristic_result_dtype)
        returned = np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(
            _handle(device), descs.op, descs.a, descs.b, descs.d, descs.d, pref, count,
            results.ctypes.data, returned.ctypes.data,
        )  # fmt: skip
    finally:
        lt.matmul_preference_destroy(pref)
    ok = [i for i in range(int(returned[0])) if results[i]["state"] == 0]
    return [(results["algo"][i : i + 1].copy(), int(results[i]["workspace_size"])) for i in ok]


def _checked(descs: _Descs, device: int, algo: np.ndarray) -> int | None:
    """The workspace bytes `algo` needs for the problem, None when cuBLASLt rejects it."""
    lt = _lt()
    result = np.zeros(1, lt.matmul_heuristic_result_dtype)
    try:
        lt.matmul_algo_check(
            _handle(device), descs.op, descs.a, descs.b, descs.d, descs.d, algo.ctypes.data,
            result.ctypes.data,
        )  # fmt: skip
    except lt.cuBLASLtError:
        return None
    size = int(result[0]["workspace_size"])
    return size if size <= _MAX_WORKSPACE else None


def candidates(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | int | None = None,
    *, count: int = 16, vary: int = 0,
) -> Iterator[LtGemm]:  # fmt: skip
    """cuBLASLt's heuristic's algorithms for the shape (up to `count`), then, with `vary`, the first
    `vary` of them again with each split-K factor and reduction scheme the heuristic did not list;
    each configuration once. Without `vary` only algorithms that do not split K: their sums are
    reduced in one order, so a step's result does not depend on timing (split-K won nothing at the
    decode shapes measured)."""
    lt = _lt()
    index = _index(device)
    descs = _Descs(m, n, k, dtype)
    attr = lt.MatmulAlgoConfigAttribute
    seen: set[str] = set()
    ranked = _heuristic(descs, index, count)
    for algo, workspace in ranked:
        label = algo_label(algo)
        if label not in seen and (vary or _config(algo, attr.SPLITK_NUM) == 1):
            seen.add(label)
            yield LtGemm(m, n, k, algo, workspace, dtype, index)
    for base, _ in ranked[:vary]:
        for split in (1, 2, 3, 4, 6, 8, 12, 16):
            for scheme in (0, 1, 2, 4) if split > 1 else (0,):
                algo = base.copy()
                split_arr, scheme_arr = np.array(split, np.uint32), np.array(scheme, np.uint32)
                _set(lt.matmul_algo_config_set_attribute, algo.ctypes.data, attr.SPLITK_NUM, split_arr)
                _set(lt.matmul_algo_config_set_attribute, algo.ctypes.data, attr.REDUCTION_SCHEME, scheme_arr)
                label = algo_label(algo)
                workspace = None if label in seen else _checked(descs, index, algo)
                if workspace is not None:
                    seen.add(label)
                    yield LtGemm(m, n, k, algo, workspace, dtype, index)


class LtGemm:
    """y = x @ w^T (+ residual) for one (M, N, K) shape in one half type on one device, with one
    cuBLASLt algorithm, on the current stream: no allocation, no sync (graph-capturable)."""

    def __init__(
        self, m: int, n: int, k: int, algo: np.ndarray, workspace: int = 0,
        dtype: torch.dtype = torch.bfloat16, device: torch.device | int | None = None,
    ) -> None:  # fmt: skip
        self.shape = (m, n, k)
        self.dtype = dtype
        self.device = torch.device("cuda", _index(device))
        self.descs = _Descs(m, n, k, dtype)
        self.algo = algo.copy()
        self.label = algo_label(self.algo)
        self.workspace_bytes = workspace
        # Its own, allocated now (not inside a capture): graphs replay it while other GEMMs run eagerly.
        self._workspace = torch.empty(workspace, dtype=torch.uint8, device=self.device) if workspace else None
        self._one = np.array(1.0, np.float32)  # host scalars: cuBLASLt reads them at the call (capture)
        self._zero = np.array(0.0, np.float32)

    def takes(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether this GEMM computes x @ w^T: its shape, dtype and device, both contiguous."""
        m, n, k = self.shape
        return (
            x.dim() == 2 and x.shape == (m, k) and w.shape == (n, k) and x.dtype == w.dtype == self.dtype
            and x.device == w.device == self.device and x.is_contiguous() and w.is_contiguous()
        )  # fmt: skip

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x @ w^T into `out` (a new tensor when None), or residual + x @ w^T (out may be residual
        itself: the in-place add). Callers check `takes(x, w)`; out and residual are [M, N] contiguous."""
        m, n, _ = self.shape
        if out is None:
            out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        c = out if residual is None else residual
        beta = self._zero if residual is None else self._one
        ws = self._workspace.data_ptr() if self._workspace is not None else 0
        _lt().matmul(
            _handle(self.device.index), self.descs.op, self._one.ctypes.data, w.data_ptr(), self.descs.a,
            x.data_ptr(), self.descs.b, beta.ctypes.data, c.data_ptr(), self.descs.d, out.data_ptr(),
            self.descs.d, self.algo.ctypes.data, ws, self.workspace_bytes,
            torch.cuda.current_stream(self.device).cuda_stream,
        )  # fmt: skip
        return out
