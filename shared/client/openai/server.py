"""`python -m shared.client.openai --target HOST:PORT [--host 127.0.0.1] [--port 8000] [--api-key KEY]
[--served-model-name NAME] [--tls-ca FILE [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]]
[--token-file FILE]`: the OpenAI-compatible front under uvicorn. `main(argv) -> int`."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence

import uvicorn

from shared.client.credentials import CredentialsError, add_credential_flags, credentials_from_args
from shared.client.openai.app import DEFAULT_MAX_BODY_BYTES, Settings, create_app

__all__ = ["main"]

log = logging.getLogger("pdserve.openai")

# SIGTERM: stop accepting, let running requests finish for this long, then close them (their gRPC calls
# are cancelled, so decode frees their KV). The decode service's default --drain-timeout.
_GRACEFUL_S = 30.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve openai",
        description="An OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) "
        "in front of a pdserve decode service.",
    )
    p.add_argument(
        "--target", default=os.environ.get("PDSERVE_TARGET", "127.0.0.1:50051"),
        help="the decode service, HOST:PORT (env PDSERVE_TARGET; default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)")
    p.add_argument(
        "--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1 (env PDSERVE_API_KEY; default: none)",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send and see (default: the decode service's model name)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (default: %(default)s)",
    )  # fmt: skip
    add_credential_flags(
        p, token_help="the front's own bearer token to decode, in FILE, for its /health; callers' requests "
        "carry their own API key on as the token (default: $PDSERVE_TOKEN if set, else none)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536 or args.max_body_bytes < 1:
        p.error("--port must be in [0, 65535] and --max-body-bytes >= 1")
    return args


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; binding it here (not in uvicorn) lets port 0 be reported before serving."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(args.host) and args.api_key is None:
        log.warning("binding %s without an API key: anyone who reaches it can generate", args.host)
    try:
        credentials = credentials_from_args(args)
    except CredentialsError as e:
        print(f"pdserve openai: {e.for_flag()}", file=sys.stderr)
        return 2
    settings = Settings(args.target, args.api_key, args.served_model_name, args.max_body_bytes, credentials)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"pdserve openai: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    over = " over TLS" if credentials.tls is not None else ""
    print(f"pdserve openai: decode at {args.target}{over}; listening on {shown}:{port}", flush=True)
    config = uvicorn.Config(
        create_app(settings), log_level="info", timeout_graceful_shutdown=_GRACEFUL_S, lifespan="on"
    )
    with _signals_end_quietly():
        uvicorn.Server(config).run(sockets=[sock])
    return 0


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the handler
    that was there before it: make that one a no-op, so a stop is `main` returning 0 (not a
    KeyboardInterrupt, nor death by SIGTERM)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
