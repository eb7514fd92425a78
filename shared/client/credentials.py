"""How a client reaches a pdserve service that asks who it is: TLS (the server's certificate checked
against a CA bundle; a client certificate for mutual TLS) and a bearer token.

    creds = Credentials.from_files(tls_ca="ca.pem", tls_cert="me.pem", tls_key="me.key", token_file="tok")
    with Client("decode.example:50051", credentials=creds) as c:
        ...

The token goes as gRPC metadata `authorization: Bearer <token>` on every call: over TLS as grpc's own
access-token call credentials (which grpc refuses to send over a plaintext channel), over a plaintext
channel (loopback development only: anyone on the path reads it) as metadata the client adds itself.
`from_files` reads the token from `token_file`, else from $PDSERVE_TOKEN: never from a command line,
where `ps` shows it to every user of the host.

Files are read and checked when the credentials are made, so a missing file or a PEM that is not what
it should be fails at once, naming the option and the file, not later as an opaque handshake failure.
grpc itself is imported only where a channel or call credentials are made: the CLI parses these flags
before `pdserve health` quiets grpc's logging (GRPC_VERBOSITY, read when grpc loads).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

__all__ = [
    "TOKEN_ENV",
    "CallAuth",
    "Credentials",
    "CredentialsError",
    "TLSFiles",
    "add_credential_flags",
    "aio_channel",
    "channel",
    "credentials_from_args",
    "valid_token",
]

TOKEN_ENV = "PDSERVE_TOKEN"
_TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


class CredentialsError(ValueError):
    """A credential file that is missing, unreadable or not what it should be. `option` is the keyword
    of `Credentials.from_files` (tls_ca, tls_cert, tls_key, token_file; the CLI's flag with dashes)."""

    def __init__(self, option: str, path: str | os.PathLike[str] | None, why: str) -> None:
        self.option = option
        self.path = None if path is None else str(path)
        self.why = why
        where = f" {self.path}" if self.path is not None else ""
        super().__init__(f"{option}{where}: {why}")

    def for_flag(self) -> str:
        """The message naming command-line flags (`--tls-ca FILE: ...`) instead of keywords."""
        where = f" {self.path}" if self.path is not None else ""
        return f"{_flag(self.option)}{where}: {re.sub(_OPTION_WORD, lambda m: _flag(m[0]), self.why)}"


_OPTIONS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")
_OPTION_WORD = re.compile(r"\b(" + "|".join(_OPTIONS) + r")\b")


def _flag(option: str) -> str:
    return f"--{option.replace('_', '-')}" if option in _OPTIONS else option


@dataclass(frozen=True)
class TLSFiles:
    """TLS to the server: PEM bytes, as grpc.ssl_channel_credentials takes them."""

    root_certificates: bytes | None = None  # CA bundle the server's certificate must chain to; None: system's
    certificate_chain: bytes | None = None  # the client's certificate (mutual TLS), with its intermediates
    private_key: bytes | None = field(default=None, repr=False)  # and its key
    server_name: str | None = None  # the name to expect in the server's certificate; None: the target's host

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and a key its certificate")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [(_TARGET_NAME_OVERRIDE, self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class Credentials:
    """TLS (None: a plaintext channel) and a bearer token (None: none sent). The token stays out of
    repr, so logging the credentials does not log it."""

    tls: TLSFiles | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None and not valid_token(self.token):
            raise ValueError("a token is one word of visible ASCII characters (no spaces, not empty)")

    @classmethod
    def from_files(
        cls,
        *,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        token_env: str | None = TOKEN_ENV,
    ) -> Credentials:
        """Read and check the files. TLS is on when any tls_* is given (without tls_ca the server is
        checked against the system's CAs); tls_cert and tls_key go together (mutual TLS). The token is
        `token_file`'s content (surrounding whitespace stripped), else $`token_env` when set and not
        empty (token_env=None: the environment is not read). Raises CredentialsError."""
        if tls_cert is not None and tls_key is None:
            raise CredentialsError("tls_cert", tls_cert, "a certificate needs its key: give tls_key too")
        if tls_key is not None and tls_cert is None:
            raise CredentialsError("tls_key", tls_key, "a key needs its certificate: give tls_cert too")
        if tls_server_name is not None and not tls_server_name.strip():
            raise CredentialsError("tls_server_name", None, "empty")
        tls = None
        if any(x is not None for x in (tls_ca, tls_cert, tls_key, tls_server_name)):
            ca = _read("tls_ca", tls_ca) if tls_ca is not None else None
            if ca is not None:
                _check_certificates("tls_ca", tls_ca, ca)
            chain = key = None
            if tls_cert is not None and tls_key is not None:
                chain, key = _read("tls_cert", tls_cert), _read("tls_key", tls_key)
                _check_certificates("tls_cert", tls_cert, chain)
                _check_key(tls_cert, tls_key)
            tls = TLSFiles(ca, chain, key, tls_server_name.strip() if tls_server_name else None)
        token = _read_token(token_file, token_env)
        return cls(tls, token)

    def without_token(self) -> Credentials:
        return replace(self, token=None)


def valid_token(token: str) -> bool:
    """What gRPC metadata can carry after `Bearer `: visible ASCII, no spaces, at least one character."""
    return bool(token) and all("!" <= ch <= "~" for ch in token)


class CallAuth:
    """The token's way onto each call: grpc's access-token call credentials on a TLS channel (grpc
    sends those over TLS only), `authorization: Bearer <token>` metadata added here on a plaintext one
    (grpc refuses call credentials there)."""

    def __init__(self, credentials: Credentials | None) -> None:
        self.secure = credentials is not None and credentials.tls is not None
        self.token = credentials.token if credentials is not None else None
        self._credentials = self._call_credentials(self.token)

    def _call_credentials(self, token: str | None) -> grpc.CallCredentials | None:
        if token is None or not self.secure:
            return None
        import grpc

        return grpc.access_token_call_credentials(token)

    def call_kwargs(
        self, metadata: Sequence[tuple[str, str]] | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """A call's `metadata` (`metadata`, plus the token on a plaintext channel) and `credentials`,
        for `token`, or the credentials' own token when None."""
        if token is None:
            token, creds = self.token, self._credentials
        elif not valid_token(token):
            raise ValueError("a token is one word of visible ASCII characters (no spaces, not empty)")
        else:
            creds = self._call_credentials(token)
        md = tuple(metadata or ())
        if token is not None and not self.secure:
            md = (*md, ("authorization", f"Bearer {token}"))
        return {"metadata": md or None, "credentials": creds}


def channel(
    target: str, credentials: Credentials | None = None, *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A sync channel to `target`: TLS per `credentials.tls`, else plaintext. The token is not in the
    channel: the client adds it to each call (see the module's docstring)."""
    import grpc

    tls = credentials.tls if credentials is not None else None
    if tls is None:
        return grpc.insecure_channel(target, options=list(options) or None)
    opts = [*options, *tls.channel_options()]
    return grpc.secure_channel(target, tls.channel_credentials(), options=opts or None)


def aio_channel(
    target: str, credentials: Credentials | None = None, *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """`channel`'s grpc.aio twin (make it inside the event loop that will use it)."""
    import grpc.aio

    tls = credentials.tls if credentials is not None else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options) or None)
    opts = [*options, *tls.channel_options()]
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts or None)


def _read(option: str, path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CredentialsError(option, path, "no such file") from None
    except IsADirectoryError:
        raise CredentialsError(option, path, "is a directory, not a file") from None
    except OSError as e:
        raise CredentialsError(option, path, f"cannot read it: {e.strerror or e}") from None


def _check_certificates(option: str, path: str | os.PathLike[str] | None, pem: bytes) -> None:
    """Every PEM certificate in `pem` parses (through the ssl module: OpenSSL reads X.509 as grpc's
    BoringSSL does), and there is at least one."""
    import ssl  # only when TLS is asked for: `pdserve health` without TLS stays light

    try:
        text = pem.decode("ascii")
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    except (UnicodeDecodeError, ValueError, ssl.SSLError) as e:
        why = "not PEM text" if isinstance(e, UnicodeDecodeError) else getattr(e, "reason", None) or str(e)
        raise CredentialsError(
            option, path, f"not a PEM certificate file (-----BEGIN CERTIFICATE----- ...): {why}"
        ) from None


def _check_key(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> None:
    """The key is a PEM private key, not encrypted (grpc takes no passphrase), of the certificate."""
    import ssl

    def no_passphrase() -> bytes:
        raise CredentialsError("tls_key", key, "the key is encrypted: grpc needs it unencrypted")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise CredentialsError("tls_key", key, "not the key of the tls_cert certificate") from None
        raise CredentialsError(
            "tls_key", key, f"not a PEM private key (-----BEGIN PRIVATE KEY----- ...): {e.reason or e}"
        ) from None


def _read_token(token_file: str | os.PathLike[str] | None, token_env: str | None) -> str | None:
    if token_file is not None:
        raw = _read("token_file", token_file)
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise CredentialsError("token_file", token_file, "not ASCII text") from None
        if not token:
            raise CredentialsError("token_file", token_file, "empty")
        if not valid_token(token):
            why = "a token is one word of visible ASCII characters (no spaces or line breaks inside)"
            raise CredentialsError("token_file", token_file, why)
        return token
    token = os.environ.get(token_env, "").strip() if token_env else ""
    if token and not valid_token(token):
        raise CredentialsError(f"${token_env}", None, "a token is one word of visible ASCII characters")
    return token or None


def add_credential_flags(
    parser: argparse.ArgumentParser, *, token: bool = True, token_help: str | None = None
) -> None:
    """--tls-ca, --tls-cert, --tls-key, --tls-server-name and, with `token`, --token-file (`token_help`:
    its help)."""
    g = parser.add_argument_group("TLS and authentication")
    g.add_argument(
        "--tls-ca", metavar="FILE",
        help="connect over TLS, checking the server's certificate against this PEM CA bundle "
        "(default: none: plaintext unless another --tls-* flag is given, then the system's CAs)",
    )  # fmt: skip
    g.add_argument(
        "--tls-cert", metavar="FILE",
        help="PEM client certificate for mutual TLS; needs --tls-key (default: none)",
    )  # fmt: skip
    g.add_argument("--tls-key", metavar="FILE", help="its PEM private key, unencrypted (default: none)")
    g.add_argument(
        "--tls-server-name", metavar="NAME",
        help="the name the server's certificate must carry, when the target's host is not it, e.g. an IP "
        "address (default: the target's host)",
    )  # fmt: skip
    if not token:
        return
    g.add_argument(
        "--token-file", metavar="FILE",
        help=token_help or "send the bearer token in FILE as `authorization: Bearer ...`; never give a "
        f"token itself on a command line, `ps` shows it (default: ${TOKEN_ENV} if set, else no token)",
    )  # fmt: skip


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    """The flags `add_credential_flags` added, read and checked (CredentialsError). Without
    --token-file among them, no token (not even $PDSERVE_TOKEN's)."""
    with_token = hasattr(args, "token_file")
    return Credentials.from_files(
        tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_server_name=args.tls_server_name, token_file=getattr(args, "token_file", None),
        token_env=TOKEN_ENV if with_token else None,
    )  # fmt: skip
