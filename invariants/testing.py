"""Test helpers: prove a block of code never makes the CPU wait for the GPU.

`no_host_sync()` combines two detectors:

* PyTorch's sync debug mode set to "error": `.item()`, `bool(t)`, `torch.equal`, `x[mask]`,
  `nonzero`, `.cpu()` raise at the call with a traceback.
* A probe for what that misses (a copy into pageable memory, `event.synchronize()`, raw
  `cudaDeviceSynchronize`, syncs in extensions): before the block, a kernel holds the current stream
  until a watchdog releases it after `timeout_s`. A block that waits for the GPU cannot finish before
  the release, so a block that runs that long has synced. Warm up (compile, allocate) before the
  block: a slow first call would read as a sync.

On a machine without CUDA there is no device to wait for and the guard does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["HostSyncError", "no_host_sync"]


class HostSyncError(AssertionError):
    """The guarded block made the host wait for the device."""


@contextlib.contextmanager
def no_host_sync(
    *, timeout_s: float = 2.0, sync_debug: bool = True, probe: bool = True, device: torch.device | None = None
) -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    from invariants.kernels import spin

    dev = device or torch.device("cuda", torch.cuda.current_device())
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))  # the release must land after the zeroing
    released = threading.Event()
    fired = threading.Event()

    def release(by_watchdog: bool) -> None:
        if released.is_set():
            return
        released.set()
        if by_watchdog:
            fired.set()
        with torch.cuda.stream(side):
            flag.fill_(1)

    watchdog = threading.Timer(timeout_s, release, args=(True,))
    previous = torch.cuda.get_sync_debug_mode()
    if probe:
        spin.hold(flag)
        watchdog.start()
    start = time.perf_counter()
    try:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        except RuntimeError as err:
            if "synchronizing CUDA operation" in str(err):
                raise HostSyncError(f"host sync inside no_host_sync(): {err}") from err
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        elapsed = time.perf_counter() - start
    finally:
        watchdog.cancel()
        if probe:
            release(False)
            torch.cuda.synchronize(dev)
    if probe and fired.is_set():
        raise HostSyncError(
            f"the block waited for the GPU: it ran {elapsed:.2f}s while the stream was held for {timeout_s}s "
            "(a host sync the sync debug mode does not see, e.g. a copy into pageable memory; or a cold "
            "first call: warm up before the block)"
        )
