"""Binding a service's gRPC port, and saying so plainly when it is taken.

gRPC on Linux binds with SO_REUSEPORT unless told not to, so a second server on a port another gRPC
server holds would not fail: the two would silently split the connections. The services' servers turn
it off (`grpc.so_reuseport` 0, shared/serving/runtime.py), and a plain socket, bound first, finds the
port taken by anything (a gRPC server of another program included) and says so: gRPC's own bind
failure is a RuntimeError that names no cause. Both become one OSError that says which address and
what to do.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from typing import Any

__all__ = ["bind", "port_taken"]


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on HOST:PORT already (False for port 0, or an address this host cannot
    probe: gRPC's own bind then decides)."""
    if port == 0:
        return False
    addr = host.strip("[]") or "::"
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # e.g. no IPv6 on this host
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is free
            if family == socket.AF_INET6:  # [::] covers IPv4 too, as gRPC's dual-stack socket does
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def bind(server: Any, host: str, port: int, credentials: Any = None) -> int:
    """`server.add_insecure_port(HOST:PORT)` (`add_secure_port` with `credentials`), returning the bound
    port; OSError when it is taken."""
    address = f"{host}:{port}"
    hint = "another process listens there (another pdserve?): stop it or choose another --port"
    if port_taken(host, port):
        raise OSError(errno.EADDRINUSE, f"cannot listen on {address}: address already in use; {hint}")
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as e:  # gRPC's "Failed to bind to address ..."
        raise OSError(errno.EADDRINUSE, f"cannot listen on {address}: {e}; {hint}") from e
