"""The `pdserve` command: `up` (run the services locally), `generate` (stream a completion) and
`demo` (start, stream one answer from the embedded default model, shut down)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from shared.client import Client, GenerationError

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def chatml(question: str) -> str:
    """The embedded default (SmolLM2-Instruct) speaks ChatML; the public API takes raw text."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


class LocalServices:
    """The decode service in a child process on a free loopback port (it prefills locally)."""

    def __init__(self, *extra: str) -> None:
        cmd = [sys.executable, "-m", "decode_service", "--host", "127.0.0.1", "--port", "0", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise SystemExit(f"pdserve: the decode service did not become ready within {timeout:.0f}s")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: drain, free, exit 0
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def stream(target: str, prompt: str, max_tokens: int, temperature: float) -> str:
    with Client(target) as client:
        result = client.generate(prompt, max_tokens=max_tokens, temperature=temperature)
        for chunk in result:
            print(chunk.text, end="", flush=True)
        print(f"\n[finish_reason={result.finish_reason}, usage={result.usage}]")
        return result.finish_reason or ""


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
    up = sub.add_parser("up", help="run the services locally until Ctrl-C (embedded default model, CPU)")
    up.add_argument("--port", default="50051")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "generate":
            prompt = chatml(args.prompt) if args.chat else args.prompt
            stream(args.target, prompt, args.max_tokens, args.temperature)
            return 0
        if args.cmd == "up":
            cmd = [sys.executable, "-m", "decode_service", "--port", args.port, "--device", "cpu"]
            return subprocess.call(cmd)
        services = LocalServices("--device", "cpu", "--num-pages", "128", "--max-running", "4")
        try:
            services.wait_ready(timeout=300)
            print(f"pdserve demo: decode service ready on {services.target}\n> {args.question}")
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
