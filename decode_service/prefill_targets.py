"""--prefill-target: the prefill replicas decode calls, how it finds them and its start-up handshakes.

The flag is a comma-separated list of entries. `HOST:PORT` is one replica, dialled as written.
`dns:///NAME:PORT` is every address NAME resolves to (a Kubernetes headless Service names every ready
prefill pod). Decode resolves such names itself, not through a gRPC round_robin channel: the router
(decode_service/routing.py) must tell the replicas apart, to send each prompt to the one that holds its
prefix (decode_service/replicas.py). It resolves them at start and again every `RESOLVE_EVERY_S`
(the Deployment scales, pods restart under new addresses), off the event loop (getaddrinfo runs on
the loop's executor). A resolved address is dialled by IP, and with TLS its certificate is checked
against NAME (`Address.server_name`), the name the certificate was issued for.

Start-up (`handshake_all`) handshakes with every replica at once: a refusal by any (a layout mismatch)
fails start-up; it returns once every replica has answered, or `STARTUP_GRACE_S` after the first did:
the others start down (the router re-handshakes them in the background, as after a failure), so one
dead replica does not keep a decode from serving with the rest.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "RESOLVE_EVERY_S",
    "STARTUP_WAIT_S",
    "Address",
    "Entry",
    "handshake_all",
    "parse_targets",
    "resolve",
    "resolve_async",
]

RESOLVE_EVERY_S = 10.0
STARTUP_WAIT_S = 120.0  # how long start-up waits for prefill replicas to resolve and load
STARTUP_GRACE_S = 5.0
_RETRY_S = 0.5  # start-up: how often a name that resolves to nothing yet is looked up again


@dataclass(frozen=True)
class Entry:
    """One entry of --prefill-target: a replica as written, or a DNS name to resolve (`dns`)."""

    text: str
    host: str = ""  # dns: the name to resolve
    port: int = 0
    dns: bool = False


@dataclass(frozen=True)
class Address:
    """One prefill replica: what its channel dials, and the name its TLS certificate must carry
    ("" = the host in `target`)."""

    target: str
    server_name: str = ""


def parse_targets(value: str) -> tuple[Entry, ...]:
    """The entries of a --prefill-target value; ValueError for a malformed dns entry."""
    entries = []
    for text in (part.strip() for part in value.split(",")):
        if not text:
            raise ValueError(f"prefill_target {value!r}: an empty entry")
        if not text.startswith("dns:"):
            entries.append(Entry(text))
            continue
        rest = text.removeprefix("dns:")
        if rest.startswith("//") and not rest.startswith("///"):
            raise ValueError(f"prefill_target {text!r}: name no DNS server (dns:///NAME:PORT)")
        host, _, port = rest.lstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"prefill_target {text!r}: a dns entry is dns:///NAME:PORT")
        entries.append(Entry(text, host.strip("[]"), int(port), dns=True))
    return tuple(entries)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _addresses(entries: Iterable[Entry], found: dict[Entry, list[str]]) -> list[Address]:
    out: dict[str, Address] = {}
    for e in entries:
        if not e.dns:
            out.setdefault(e.text, Address(e.text))
        for ip in found.get(e, []):
            target = _join(ip, e.port)
            out.setdefault(target, Address(target, e.host))
    return list(out.values())


def _ips(infos: Iterable[tuple]) -> list[str]:  # type: ignore[type-arg]
    return sorted({str(info[4][0]) for info in infos})


def resolve(entries: Sequence[Entry], wait_s: float = 0.0) -> list[Address]:
    """Every replica `entries` name, now (blocking). A name that resolves to nothing is looked up
    again until `wait_s` has passed (prefill pods that are not ready yet), then OSError."""
    deadline = time.monotonic() + wait_s
    found: dict[Entry, list[str]] = {}
    for e in (e for e in entries if e.dns):
        while True:
            try:
                found[e] = _ips(socket.getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM))
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise OSError(f"prefill target {e.text}: {e.host} does not resolve: {err}") from err
            time.sleep(_RETRY_S)
    return _addresses(entries, found)


async def resolve_async(entries: Sequence[Entry]) -> list[Address] | None:
    """`resolve`, on the running loop's executor; None when a name does not resolve now (a DNS
    outage, or no prefill pod ready): the caller keeps the replicas it has, whose circuits say which
    answer."""
    loop = asyncio.get_running_loop()
    found: dict[Entry, list[str]] = {}
    for e in (e for e in entries if e.dns):
        try:
            found[e] = _ips(await loop.getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM))
        except OSError:
            return None
    return _addresses(entries, found)


def handshake_all(
    addresses: Sequence[Address], shake: Callable[[Address], None], grace_s: float = STARTUP_GRACE_S
) -> set[str]:
    """Run `shake` (a blocking Handshake: retries while the replica is unreachable or loading, raises
    at once on a refusal and once its own wait is over) on every address at once, each on a daemon
    thread. Returns the targets that answered: every one, or those that had when `grace_s` passed
    after the first answer. Raises the first failure that comes before then."""
    results: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()

    def run(a: Address) -> None:
        try:
            shake(a)
        except BaseException as e:  # handed to the waiting thread, which raises it
            results.put((a.target, e))
        else:
            results.put((a.target, None))

    for a in addresses:
        threading.Thread(target=run, args=(a,), name=f"handshake-{a.target}", daemon=True).start()
    answered: set[str] = set()
    until: float | None = None  # once one has answered: when start-up stops waiting for the rest
    while len(answered) < len(addresses):
        timeout = None if until is None else until - time.monotonic()
        if timeout is not None and timeout <= 0:
            break
        try:
            target, err = results.get(timeout=timeout)
        except queue.Empty:
            break
        if err is not None:
            raise err
        answered.add(target)
        until = until if until is not None else time.monotonic() + grace_s
    return answered
