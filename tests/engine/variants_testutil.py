"""Which compiled variants of our Triton kernels a block of work would need, seen through the
interpreter (CPU tests): a launch's specialization key as Triton builds it on a GPU.

Triton compiles one kernel per key: the constexpr values and launch options, and for every other
argument its kind: a tensor's dtype and whether its address is 16-byte aligned (unless the kernel
says `do_not_specialize_on_alignment`), an int's width and whether it is 1 or a multiple of 16
(unless `do_not_specialize`). A key first seen mid-traffic is a compile (~1 s on an H200) that every
request in flight waits for.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from triton.runtime.interpreter import InterpretedFunction


def _key(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    names = list(inspect.signature(kernel.fn).parameters)
    plain = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    kinds = []
    for name, a in zip(names, args, strict=False):
        if isinstance(a, torch.Tensor):
            kinds.append((name, str(a.dtype), name in unaligned or a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            kinds.append((name, a))
        elif isinstance(a, int) and name not in plain:
            div16 = name in unaligned or a % 16 == 0
            kinds.append((name, -(2**31) <= a < 2**31, a == 1, div16))
    return kernel.fn.__name__, tuple(kinds), tuple(sorted(kwargs.items()))


@contextlib.contextmanager
def launched_variants() -> Iterator[set[tuple]]:
    """The set of specialization keys launched inside the block (interpreter only)."""
    seen: set[tuple] = set()
    run = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        seen.add(_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
