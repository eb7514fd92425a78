"""A STRICT trip must stop the whole process: run a script that trips one in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def assert_trip_stops_the_process(script: str, name: str = "swa.history_present") -> None:
    """`script` runs with PDSERVE_INVARIANT_CHECK=strict, prints "survived" if it gets past the trip."""
    env = {**os.environ, "PDSERVE_INVARIANT_CHECK": "strict"}
    cmd = [sys.executable, "-c", script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "survived" not in proc.stdout, proc.stdout[-2000:]
    assert f"invariant-check FAILED [{name}]" in proc.stderr, proc.stderr[-2000:]
