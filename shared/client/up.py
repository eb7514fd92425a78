"""`pdserve up` (and `pdserve demo`): the prefill and the decode service as supervised child processes.

- Both start at once. The parent fixes prefill's port before either starts (a free one for
  `--prefill-port 0`), so decode gets `--prefill-target` up front, loads its model alongside prefill
  and waits in its start-up handshake until prefill is ready (decode_service/prefill_client.py).
- Their output is shown live, line by line, each line prefixed by its role (`[prefill] ...`,
  `[decode] ...`): a child's stdout to ours, its stderr to ours. `echo=False` (the demo) keeps the
  last lines instead and shows them only when a service fails.
- SIGTERM or SIGINT to `pdserve up` drains both: decode first (its requests may still be prefilling),
  then prefill; a second signal kills both at once. The children run in their own process group, so a
  terminal's Ctrl-C reaches the parent alone, which forwards it in that order; on Linux a child also
  gets SIGTERM should the parent die without forwarding anything (SIGKILL).
- A service that exits on its own stops the other; the exit code is the worst child's.
- Each child gets half the host's cores for its torch threads (OMP_NUM_THREADS, unless set): two
  processes that each spin a thread per core fight over every core, and on a 2-core CPU the
  README's bench took 20-30 s to a first token that way instead of about 1 s.
- On GPUs each role gets its own (`place`): prefill's ranks on the first GPUs from `--device`'s,
  decode's on the ones after them, where the host shows enough of them; else both share.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, NamedTuple

__all__ = [
    "DECODE_FLAGS", "Placement", "Service", "Services", "child_env", "free_port", "place", "placed",
    "split_service_args", "visible_gpus",
]  # fmt: skip

# decode_service's own flags (decode_service/config.py), each with whether it takes a value: they go to
# decode alone, every other flag to both services. tests/services/test_cli_up.py keeps this in step.
DECODE_FLAGS = {
    "--prefill-target": True,
    "--local-prefill-max-tokens": True,
    "--remote-prefill-max-queued-tokens": True,
    "--prefill-timeout": True,
    "--window-history": False,
    "--no-window-history": False,
    "--kv-transfer": True,
    "--mixed-steps": False,
    "--no-mixed-steps": False,
    "--auth-tokens-file": True,
    "--prefill-tls-ca": True,
    "--prefill-tls-cert": True,
    "--prefill-tls-key": True,
}
_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1


def split_service_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(flags for both services, flags for decode alone): each flag with the values that follow it."""
    both: list[str] = []
    decode: list[str] = []
    dest = both
    for arg in args:
        if arg.startswith("--"):
            dest = decode if arg.split("=", 1)[0] in DECODE_FLAGS else both
        dest.append(arg)
    return both, decode


class Placement(NamedTuple):
    """Each service's --device, and a note for the user when they share GPUs."""

    prefill: str
    decode: str
    note: str = ""


def place(device: str, prefill_tp: int, decode_tp: int, gpus: int | None) -> Placement:
    """Where the two services run, from `pdserve up`'s --device (auto, cpu, cuda or cuda:N), each
    service's tensor-parallel degree and the GPUs the host shows (None: unknown).

    A service's rank r runs on its --device's GPU + r. Decode's ranks go on the GPUs after prefill's,
    when the host shows every GPU both need from --device's on: one GPU a rank, as disaggregation
    means. A host with fewer (one GPU, say) runs both on the same GPUs, as a single-GPU box must.
    CPU, or GPUs unknown (no `nvidia-smi`, `auto` on a host without one), leave both on --device."""
    if device == "cpu" or gpus is None or (device == "auto" and gpus == 0):
        return Placement(device, device)
    first = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
    if first + prefill_tp + decode_tp <= gpus:
        return Placement(f"cuda:{first}", f"cuda:{first + prefill_tp}")
    shown = f"{gpus} GPU{'s' if gpus != 1 else ''}"
    note = (
        f"prefill and decode share {_gpus(first, max(prefill_tp, decode_tp))}: the host shows {shown}, and "
        f"a GPU each for prefill's {prefill_tp} and decode's {decode_tp} rank(s) from cuda:{first} needs "
        f"{first + prefill_tp + decode_tp}"
    )
    return Placement(f"cuda:{first}", f"cuda:{first}", note)


def _gpus(first: int, count: int) -> str:
    return f"cuda:{first}" if count == 1 else f"cuda:{first}-{first + count - 1}"


def placed(device: str, tp: int) -> str:
    """A service's GPUs (or device) as the user reads them: cuda:2, cuda:0-1, cpu."""
    if not device.startswith("cuda"):
        return device
    return _gpus(int(device.partition(":")[2] or 0), tp)


def visible_gpus() -> int | None:
    """How many GPUs the services will see: CUDA_VISIBLE_DEVICES's entries where it is set (CUDA
    ignores the entries after an invalid one; so does this count), else the lines of `nvidia-smi -L`;
    None where neither says (no NVIDIA driver tools)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def child_env() -> dict[str, str]:
    """Our environment, unbuffered, with OMP_NUM_THREADS = half the cores this process may use."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        env["OMP_NUM_THREADS"] = str(max(1, cores // 2))
    return env


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick), for a child told its port up front."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, whatever kills it."""
    with contextlib.suppress(Exception):
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before the line above: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)


def _prctl() -> object | None:
    # Resolved in the parent: the child between fork and exec calls the C function and nothing else.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def exit_code(returncode: int | None) -> int:
    """A child's return code as a shell shows it: killed by signal N -> 128 + N."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


class Service:
    """One service in a child process; `target` once it listens, `ready` once its model is served."""

    def __init__(
        self, role: str, host: str, port: int, args: Sequence[str], *, echo: bool = False,
        lock: threading.Lock | None = None, env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        """`env` adds to (or overrides) the child's environment."""
        self.role = role
        self.target = ""
        self.ready = threading.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._echo, self._lock = echo, lock or threading.Lock()
        cmd = [sys.executable, "-m", f"{role}_service", "--host", host, "--port", str(port), *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", bufsize=1, env={**child_env(), **(env or {})}, process_group=0,
            preexec_fn=_die_with_parent if _PRCTL is not None else None,
        )  # fmt: skip
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _pump(self, src: IO[str] | None, dst: IO[str]) -> None:
        assert src is not None
        for raw in src:
            line = raw.rstrip("\n")
            if line.startswith(f"pdserve {self.role} listening on "):
                self.target = line.rsplit(" ", 1)[1]
            elif line == f"pdserve {self.role} ready":
                self.ready.set()
            self.tail.append(line)
            if self._echo:
                with self._lock:
                    dst.write(f"[{self.role}] {line}\n")
                    dst.flush()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.running:
                self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (128 + N when signal N killed it), once its output is all shown."""
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(5)
        return exit_code(code)

    def wait_ready(self, timeout: float) -> bool:
        """True once it serves its model; False as soon as it exits, or after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if not self.running or time.monotonic() > deadline:
                return False
        return True

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drain), then SIGKILL after `timeout`; its exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.wait()


class Services:
    """Prefill and decode on `host`, started together; decode paired with this prefill.

    `roles` (prefill's flags, decode's: the device and tensor-parallel degree `pdserve up` placed each
    on) come first; then `args`, to both services except decode's own flags (`DECODE_FLAGS`), which go
    to decode alone. Later flags win (argparse keeps the last), so `args` override `roles`."""

    def __init__(
        self, args: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 50051,
        prefill_port: int = 50052, local_prefill_max_tokens: int = 16, echo: bool = True,
        roles: tuple[Sequence[str], Sequence[str]] = ((), ()),
    ) -> None:  # fmt: skip
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self._signals = 0
        both, decode_only = split_service_args(args)
        prefill_port = prefill_port or free_port(host)
        reach = "127.0.0.1" if host.strip("[]") in ("", "::", "0.0.0.0") else host
        remote = ["--prefill-target", f"{reach}:{prefill_port}"]
        remote += ["--local-prefill-max-tokens", str(local_prefill_max_tokens)]
        prefill_args = [*roles[0], *both]
        self.prefill = Service("prefill", host, prefill_port, prefill_args, echo=echo, lock=self._lock)
        try:
            decode_args = [*remote, *roles[1], *both, *decode_only]
            self.decode = Service("decode", host, port, decode_args, echo=echo, lock=self._lock)
        except BaseException:
            self.prefill.signal(signal.SIGKILL)
            raise

    @property
    def services(self) -> tuple[Service, Service]:
        return self.decode, self.prefill

    def say(self, text: str, stream: IO[str] | None = None) -> None:
        with self._lock:
            print(f"pdserve: {text}", file=stream or sys.stdout, flush=True)

    def run(self, what: str) -> int:
        """`pdserve up`: say when both are ready, run until a signal or until either exits, stop both;
        the worst exit code."""
        with self.signals_forwarded():
            self.say(f"starting {what}")
            if self.wait_ready():
                self.say(
                    f"ready: decode (the public API) on {self.decode.target}, prefill on "
                    f"{self.prefill.target}; Ctrl-C stops both"
                )
            self.wait()
            failed = self.failed()
            if failed is not None:
                self.say(
                    f"the {failed.role} service exited ({failed.wait()}): stopping the other", sys.stderr
                )
            code = self.stop()
        self.say(f"stopped (exit {code})")
        return code

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once both are ready; False as soon as either exits, a signal came, or at `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(s.ready.is_set() for s in self.services):
            if self.stopping.is_set() or not all(s.running for s in self.services):
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def wait(self) -> None:
        """Until either service exits or a signal asks to stop."""
        while all(s.running for s in self.services) and not self.stopping.is_set():
            time.sleep(0.2)

    def stop(self, timeout: float | None = None) -> int:
        """Decode first (it drains against prefill), then prefill; the worst exit code. `timeout`: per
        service, then it is killed (None: as long as its own --drain-timeout takes). A service that
        our SIGTERM ended before it could handle it (still starting up) counts as stopped cleanly."""
        self.stopping.set()
        codes = []
        for svc in self.services:
            asked = svc.running
            svc.signal(signal.SIGTERM)  # graceful: readiness off, drain, exit 0
            try:
                code = svc.wait(timeout)
            except subprocess.TimeoutExpired:
                svc.signal(signal.SIGKILL)
                code = svc.wait()
            codes.append(0 if asked and code == exit_code(-signal.SIGTERM) else code)
        return max(codes)

    def kill(self) -> None:
        for svc in self.services:
            svc.signal(signal.SIGKILL)

    def failed(self) -> Service | None:
        """The first service that exited on its own (before any stop was asked), if one did."""
        if self.stopping.is_set():
            return None
        return next((s for s in self.services if not s.running), None)

    def show_tails(self) -> None:
        """The last lines of both services' output (what `echo=False` kept), to stderr."""
        with self._lock:
            for svc in self.services:
                for line in svc.tail:
                    print(f"[{svc.role}] {line}", file=sys.stderr)
            sys.stderr.flush()

    @contextlib.contextmanager
    def signals_forwarded(self) -> Iterator[None]:
        """While inside: the first SIGTERM/SIGINT sets `stopping` (the caller then calls `stop`), a
        second kills both services."""

        def handle(signum: int, _frame: object) -> None:
            self._signals += 1
            if self._signals == 1:
                self.stopping.set()
                name = signal.Signals(signum).name
                self.say(f"{name}: stopping (decode drains, then prefill; again to kill)", sys.stderr)
            else:
                self.say("killing both services", sys.stderr)
                self.kill()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
