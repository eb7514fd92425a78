"""The `pdserve` command: `up` (run both services locally), `generate` (stream a completion), `bench`
(an open-loop load test), `health` (a grpc.health.v1 check, TLS-capable: a Kubernetes exec probe) and
`demo` (start the services on the embedded default model, stream one answer, stop them). The process
supervision of `up` and `demo` lives in shared/client/up.py."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.client.credentials import (
    Credentials,
    CredentialsError,
    add_credential_flags,
    credentials_from_args,
)
from shared.client.up import Services, place, placed, visible_gpus

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_TARGET = "127.0.0.1:50051"
# The services' --dtype spellings (shared/serving/config.py DTYPES; a test keeps the two in step): the
# client may not import the serving layer, and `pdserve up` refuses a bad value before starting anything.
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")
_UP_EPILOG = """\
Every other flag goes to the services (see `python -m prefill_service --help` and `python -m
decode_service --help`): decode's own flags (--prefill-timeout, --kv-transfer,
--local-prefill-max-tokens, ...) to decode alone, the rest to both, after the ones `up` sets, so
yours win. Flags after `--` are passed on without being read here.

  pdserve up --model /models/Qwen3-0.6B --device cuda --max-running 64 --prefill-timeout 60
  pdserve up --model /models/Qwen3-8B --device cuda --tp 2 --decode-tp 4
  pdserve up --port 6000 --prefill-port 0 -- --no-metrics

On GPUs each service gets its own: prefill's ranks from --device's GPU on, decode's on the GPUs after
them, on a host that shows enough GPUs; else both run on the same ones.

Each line the services print is shown prefixed by its role ([prefill] ..., [decode] ...). Ctrl-C or
SIGTERM drains decode, then prefill (a second one kills both); the exit code is the worst service's.
"""


def version() -> str:
    """The installed package's version; from pyproject.toml in a source tree that is not installed."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _bounded(
    kind: type, low: float, high: float | None = None, *, above: bool = False
) -> Callable[[str], Any]:
    """An argparse type: `kind` at least `low` (above it, with `above`) and below `high`."""

    def convert(text: str) -> Any:
        value = kind(text)
        if not (value > low if above else value >= low) or (high is not None and not value < high):
            rule = f"> {low:g}" if above else f">= {low:g}" if high is None else f"in [{low:g}, {high:g})"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")  # NaN too
        return value

    convert.__name__ = "integer" if kind is int else "number"  # argparse's "invalid <name> value"
    return convert


_positive_int, _non_negative_int, _port = _bounded(int, 1), _bounded(int, 0), _bounded(int, 0, 65536)
_non_negative_float, _positive_float = _bounded(float, 0), _bounded(float, 0, above=True)
_tp = _bounded(int, 1, 9)  # the services' own bound (shared/serving/config.py)


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _dtype(text: str) -> str:
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}, got {text!r}")
    return text.lower()


def stream(
    target: str, prompt: str, max_tokens: int, temperature: float, *, chat: bool = False,
    credentials: Credentials | None = None,
) -> str:  # fmt: skip
    """Print the completion as it streams, then how it ended; returns the finish reason."""
    from shared.client.client import Client

    with Client(target, credentials=credentials) as client:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            result = client.generate(messages=messages, max_tokens=max_tokens, temperature=temperature)
        else:
            result = client.generate(prompt, max_tokens=max_tokens, temperature=temperature)
        for chunk in result:
            print(chunk.text, end="", flush=True)
        print(f"\n[finish_reason={result.finish_reason}, usage={result.usage}]")
        return result.finish_reason or ""


def run_up(args: argparse.Namespace, passthrough: Sequence[str]) -> int:
    prefill_tp, decode_tp = args.tp, args.decode_tp or args.tp
    gpus = visible_gpus() if args.device != "cpu" else None
    where = place(args.device, prefill_tp, decode_tp, gpus)
    decode_device = args.decode_device or where.decode
    roles = (
        ["--device", where.prefill, "--tp", str(prefill_tp)],
        ["--device", decode_device, "--tp", str(decode_tp)],
    )
    service_args = ["--model", args.model, "--dtype", args.dtype, *passthrough]
    services = Services(
        service_args, host=args.host, port=args.port, prefill_port=args.prefill_port, roles=roles
    )  # fmt: skip
    if where.note and not args.decode_device:
        services.say(where.note)
    model = args.model or "the embedded default model"
    on = f"prefill on {placed(where.prefill, prefill_tp)}, decode on {placed(decode_device, decode_tp)}"
    return services.run(f"prefill and decode on {model} ({on}, dtype {args.dtype})")


def run_demo(args: argparse.Namespace) -> int:
    args_ = ["--device", "cpu", "--num-pages", "128", "--max-running", "4", "--no-metrics"]
    services = Services(args_, port=0, prefill_port=0, echo=False)
    with services.signals_forwarded():
        try:
            if not services.wait_ready(timeout=300):
                if not services.stopping.is_set():
                    services.show_tails()
                    print("pdserve demo: the services did not become ready (their last lines above)")
                return max(services.stop(timeout=30), 1)
            print(
                f"pdserve demo: decode service ready on {services.decode.target} "
                f"(prefill on {services.prefill.target})\n> {args.question}",
                flush=True,
            )
            stream(services.decode.target, args.question, args.max_tokens, 0.0, chat=True)
        finally:
            code = services.stop(timeout=30)
    print(f"pdserve demo: services stopped (exit {code})")
    return code


def run_bench(args: argparse.Namespace, credentials: Credentials | None = None) -> int:
    import asyncio
    import json

    from shared.client.loadgen import AgenticTrace, print_report, run_load

    trace = AgenticTrace(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
    print(
        f"pdserve bench: {trace.requests} requests at {args.rate:g} req/s (Poisson) to {args.target}: "
        f"{args.sessions} sessions x {args.turns} turns, {args.prefix_tokens}-token shared prefix, "
        f"+{args.turn_tokens} tokens a turn, {args.output_tokens} output tokens each",
        flush=True,
    )
    show = lambda line: print(f"pdserve bench: {line}", file=sys.stderr, flush=True)
    result = asyncio.run(
        run_load(args.target, trace, args.rate, timeout=args.timeout, progress=show, credentials=credentials)
    )
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 1 if result.errors else 0


def run_health(args: argparse.Namespace, credentials: Credentials | None) -> int:
    """0 when the health service answers SERVING (a line on stdout), 1 otherwise (why, on stderr)."""
    if "grpc" not in sys.modules:  # grpc reads it on import: its INFO lines (a failed TLS handshake) off
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from shared.client.health import check

    result = check(args.target, service=args.service, credentials=credentials, timeout=args.timeout)
    print(f"pdserve health: {result.message}", file=sys.stdout if result.serving else sys.stderr)
    return 0 if result.serving else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{up,generate,bench,health,demo,openai}")
    target = os.environ.get("PDSERVE_TARGET", DEFAULT_TARGET)
    where = "from $PDSERVE_TARGET" if "PDSERVE_TARGET" in os.environ else "$PDSERVE_TARGET sets another"
    target_help = f"decode service to call, HOST:PORT (default: {target}; {where})"

    up = sub.add_parser(
        "up",
        help="run the prefill and decode services locally until Ctrl-C",
        description="Run the prefill and the decode service (paired) as child processes until Ctrl-C.",
        epilog=_UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    up.add_argument(
        "--model",
        default="",
        metavar="PATH",
        help="Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    up.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="auto, cpu, cuda or cuda:N; auto = cuda when a GPU is visible (default: auto)",
    )
    up.add_argument(
        "--decode-device",
        type=_device,
        default=None,
        metavar="DEVICE",
        help="decode's device, where it is not the GPUs after prefill's (default: those, on a host that "
        "shows enough GPUs for both services' ranks; else --device)",
    )
    up.add_argument(
        "--tp",
        type=_tp,
        default=1,
        metavar="N",
        help="tensor-parallel ranks (one process and one GPU each) of both services (default: 1)",
    )
    up.add_argument(
        "--decode-tp",
        type=_tp,
        default=0,
        metavar="N",
        help="decode's tensor-parallel ranks, where they differ from --tp; the KV cache's heads are "
        "regrouped on the way (default: --tp)",
    )
    up.add_argument(
        "--dtype",
        type=_dtype,
        default="auto",
        metavar="DTYPE",
        help=f"{', '.join(DTYPES)}; auto = the checkpoint's dtype on CUDA, float32 on most CPUs "
        "(default: auto)",
    )
    up.add_argument("--host", default="127.0.0.1", help="address both services bind (default: 127.0.0.1)")
    up.add_argument(
        "--port",
        type=_port,
        default=50051,
        help="decode service (the public API) port; 0 = a free one (default: 50051)",
    )
    up.add_argument(
        "--prefill-port",
        type=_port,
        default=50052,
        help="prefill service port; 0 = a free one (default: 50052)",
    )

    gen = sub.add_parser("generate", help="stream a completion from a running decode service")
    gen.add_argument("prompt", help="the prompt (raw text; with --chat, the user's message)")
    gen.add_argument("--target", default=target, help=target_help)
    gen.add_argument(
        "--max-tokens", type=_positive_int, default=64, help="tokens to generate at most (default: 64)"
    )
    gen.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        help="sampling temperature; 0 = greedy (default: 0.0)",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message, rendered with the served model's own chat template "
        "(default: off: the prompt is sent as raw text)",
    )
    add_credential_flags(gen)

    bench = sub.add_parser(
        "bench",
        help="open-loop load test (Poisson arrivals, agentic shared-prefix trace)",
        description="Open-loop load: requests arrive at --rate whatever the server's speed. The defaults "
        "are a load a 2-core CPU serves the embedded model at without errors; raise them on a GPU.",
    )
    bench.add_argument("--target", default=target, help=target_help)
    bench.add_argument("--rate", type=_positive_float, default=2.0, help="requests per second (default: 2.0)")
    bench.add_argument("--sessions", type=_positive_int, default=8, help="conversations (default: 8)")
    bench.add_argument(
        "--turns", type=_positive_int, default=2, help="requests per conversation (default: 2)"
    )
    bench.add_argument(
        "--prefix-tokens",
        type=_non_negative_int,
        default=128,
        help="system prefix the sessions share, tokens (default: 128)",
    )
    bench.add_argument(
        "--turn-tokens",
        type=_non_negative_int,
        default=32,
        help="tokens each turn appends to its session (default: 32)",
    )
    bench.add_argument(
        "--output-tokens", type=_positive_int, default=16, help="tokens each request generates (default: 16)"
    )
    bench.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        help="seconds one request may take before it counts as an error (default: 120)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the results to FILE (default: none)")
    add_credential_flags(bench)

    health = sub.add_parser(
        "health",
        help="grpc.health.v1 Check of a service, over TLS if asked: exit 0 if SERVING, else 1",
        description="One grpc.health.v1 Check: exit 0 if SERVING, 1 otherwise (NOT_SERVING, unknown "
        "service, unreachable, TLS refused, timeout) with one line on stderr saying why. A Kubernetes "
        "exec probe for ports that serve TLS (the kubelet's own gRPC probe has no TLS).",
    )
    health.add_argument(
        "--target", default=target, help=f"service to check, HOST:PORT: decode or prefill (default: {target})"
    )
    health.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="the service to ask about, e.g. pdserve.v1.Generation for readiness (default: '': the "
        "server as a whole, i.e. liveness)",
    )
    health.add_argument(
        "--timeout",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="give up (exit 1) after this long; keep it below the probe's timeoutSeconds (default: 5)",
    )
    add_credential_flags(health, token=False)  # health checks need no token (the services exempt them)

    # Parsed by the front itself (shared/client/openai/server.py): `main` hands it the rest of argv.
    sub.add_parser(
        "openai",
        add_help=False,
        help="an OpenAI-compatible HTTP API in front of a decode service (pdserve openai --help)",
    )
    demo = sub.add_parser("demo", help="start the services on the embedded default model, stream, stop")
    demo.add_argument("--question", default=DEMO_PROMPT, help=f"what to ask (default: {DEMO_PROMPT!r})")
    demo.add_argument(
        "--max-tokens", type=_positive_int, default=48, help="tokens to generate at most (default: 48)"
    )
    return ap


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """`pdserve up ... -- X Y`: (argv before `--`, [X, Y]); other commands keep `--` (a prompt may follow)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "up" and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["openai"]:
        from shared.client.openai.server import main as openai_main  # FastAPI loads only for it

        return openai_main(argv[1:])
    argv, after_dashes = _split_passthrough(argv)
    args, unknown = ap.parse_known_args(argv)
    if unknown and args.cmd != "up":
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    credentials = None
    if args.cmd in ("generate", "bench", "health"):
        try:
            credentials = credentials_from_args(args)
        except CredentialsError as err:  # a usage error, as argparse's: exit 2
            print(f"pdserve {args.cmd}: {err.for_flag()}", file=sys.stderr)
            return 2
    if args.cmd == "health":
        return run_health(args, credentials)
    from shared.client.client import GenerationError

    try:
        if args.cmd == "up":
            return run_up(args, [*unknown, *after_dashes])
        if args.cmd == "bench":
            return run_bench(args, credentials)
        if args.cmd == "generate":
            stream(
                args.target, args.prompt, args.max_tokens, args.temperature, chat=args.chat,
                credentials=credentials,
            )  # fmt: skip
            return 0
        return run_demo(args)
    except GenerationError as err:
        print(f"pdserve: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
