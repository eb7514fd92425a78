"""The `pdserve` command: `up` (run the services locally), `generate` (stream a completion) and
`demo` (start, stream one answer from the embedded default model, shut down)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from shared.client.client import Client, GenerationError

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def chatml(question: str) -> str:
    """The embedded default (SmolLM2-Instruct) speaks ChatML; the public API takes raw text."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


class _Child:
    """One service in a child process on a loopback port; `target` once it listens."""

    def __init__(self, module: str, port: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.module = module
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", port, *extra]
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.target = ""
        self._ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self.target = line.strip().rsplit(" ", 1)[1]
            if line.strip().endswith("ready"):
                self._ready.set()
        self._ready.set()  # stdout closed: the service exited, and waiting for "ready" would be in vain

    def wait_ready(self, timeout: float) -> bool:
        """True once the service is ready; False at once when it exited, or after `timeout`."""
        if not self._ready.wait(timeout):
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.2)  # stdout may close just before the exit code is there
        return self.proc.poll() is None

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: drain, free, exit 0
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class LocalServices:
    """The prefill service, then the decode service pointed at it, in child processes on loopback.

    Prompts longer than `local_prefill_max_tokens` are prefilled by the prefill service (the demo's
    ChatML prompt is), shorter ones locally by decode.
    """

    def __init__(
        self, *extra: str, decode_port: str = "0", prefill_port: str = "0", local_prefill_max_tokens: int = 16
    ) -> None:
        self._extra = extra
        self._decode_port = decode_port
        self._local = local_prefill_max_tokens
        self.prefill = _Child("prefill_service", prefill_port, *extra)
        self.decode: _Child | None = None
        self.target = ""

    def wait_ready(self, timeout: float) -> None:
        if not self.prefill.wait_ready(timeout):
            self.stop()
            raise SystemExit(f"pdserve: the prefill service did not become ready within {timeout:.0f}s")
        remote = ("--prefill-target", self.prefill.target, "--local-prefill-max-tokens", str(self._local))
        self.decode = _Child("decode_service", self._decode_port, *self._extra, *remote)
        if not self.decode.wait_ready(timeout):
            self.stop()
            raise SystemExit(f"pdserve: the decode service did not become ready within {timeout:.0f}s")
        self.target = self.decode.target

    def wait(self) -> int:
        """Until either service exits (or Ctrl-C)."""
        procs = [c.proc for c in (self.decode, self.prefill) if c is not None]
        while all(p.poll() is None for p in procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0].wait(0.5)
        return max(p.returncode or 0 for p in procs if p.poll() is not None)

    def stop(self, timeout: float = 30) -> int:
        """Decode first (it drains against prefill), then prefill; the worst exit code."""
        codes = [c.stop(timeout) for c in (self.decode, self.prefill) if c is not None]
        return max(codes, key=abs)


def stream(target: str, prompt: str, max_tokens: int, temperature: float) -> str:
    with Client(target) as client:
        result = client.generate(prompt, max_tokens=max_tokens, temperature=temperature)
        for chunk in result:
            print(chunk.text, end="", flush=True)
        print(f"\n[finish_reason={result.finish_reason}, usage={result.usage}]")
        return result.finish_reason or ""


def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from shared.client.loadgen import AgenticTrace, run_load

    trace = AgenticTrace(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.output_tokens)
    result = asyncio.run(run_load(args.target, trace, args.rate))
    for key, value in result.as_dict().items():
        print(f"{key:>14s}: {value:.4f}" if isinstance(value, float) else f"{key:>14s}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 0 if not result.errors else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="start the services on the embedded default model, stream, stop")
    demo.add_argument("--question", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=48)
    gen = sub.add_parser("generate", help="stream a completion from a running decode service")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=os.environ.get("PDSERVE_TARGET", "127.0.0.1:50051"))
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML template")
    bench = sub.add_parser("bench", help="open-loop load (Poisson arrivals, agentic shared-prefix trace)")
    bench.add_argument("--target", default=os.environ.get("PDSERVE_TARGET", "127.0.0.1:50051"))
    bench.add_argument("--rate", type=float, default=2.0, help="requests per second")
    bench.add_argument("--sessions", type=int, default=8)
    bench.add_argument("--turns", type=int, default=4)
    bench.add_argument("--prefix-tokens", type=int, default=1024)
    bench.add_argument("--turn-tokens", type=int, default=256)
    bench.add_argument("--output-tokens", type=int, default=32)
    bench.add_argument("--json", help="also write the result here")
    up = sub.add_parser("up", help="run the services locally until Ctrl-C (embedded default model, CPU)")
    up.add_argument("--port", default="50051", help="decode service (the public API) port")
    up.add_argument("--prefill-port", default="50052")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "bench":
            return run_bench(args)
        if args.cmd == "generate":
            prompt = chatml(args.prompt) if args.chat else args.prompt
            stream(args.target, prompt, args.max_tokens, args.temperature)
            return 0
        if args.cmd == "up":
            services = LocalServices("--device", "cpu", decode_port=args.port, prefill_port=args.prefill_port)
            try:
                services.wait_ready(timeout=300)
                print(f"pdserve up: decode on {services.target}, prefill on {services.prefill.target}")
                return services.wait()
            except KeyboardInterrupt:
                return 0
            finally:
                services.stop()
        services = LocalServices("--device", "cpu", "--num-pages", "128", "--max-running", "4")
        try:
            services.wait_ready(timeout=300)
            print(
                f"pdserve demo: decode service ready on {services.target} "
                f"(prefill on {services.prefill.target})\n> {args.question}"
            )
            stream(services.target, chatml(args.question), args.max_tokens, 0.0)
        finally:
            code = services.stop()
        print(f"pdserve demo: services stopped (exit {code})")
        return code
    except GenerationError as err:
        print(f"pdserve: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
