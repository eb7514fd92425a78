"""The OpenAI-compatible front in a subprocess (`python -m shared.client.openai`) on a free loopback port,
in front of a real decode service."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class FrontProcess:
    """`python -m shared.client.openai --target TARGET --port 0 ...`; `url` once it listens and (unless
    wait_healthy=False) answers /health, which it does once the decode service does."""

    def __init__(
        self, target: str, *args: str, env: dict[str, str] | None = None, wait_healthy: bool = True
    ) -> None:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="openai-front-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "shared.client.openai", "--target", target, "--port", "0", *args]
        inherited = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}  # a key only if given
        env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        out = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=self._log, text=True)
        self._address = ""
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(30):
            self.kill()
            raise RuntimeError(f"the front did not start:\n{self.log()}")
        self.url = f"http://{self._address}"
        if wait_healthy:
            self._wait_health(30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self._address = line.strip().rsplit(" ", 1)[1]
                self._listening.set()

    def _wait_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"the front never answered /health:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return Path(self._log.name).read_text()

    def stop(self) -> tuple[int, str]:
        """SIGTERM (uvicorn shuts down gracefully): the exit code and the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(30)
            return code, self.log()
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        Path(self._log.name).unlink(missing_ok=True)
