"""The layout is the architecture: shared/ holds one package per layer, and the import contracts in
pyproject.toml (layers, the client on wire types only, no server libraries below serving, the
invariants API alone, no cycles) hold. A broken contract fails the suite, not only `make lint`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"client", "serving", "transfer", "engine", "model", "kernels", "pb"}


def test_shared_holds_one_package_per_layer() -> None:
    entries = {p.name for p in (ROOT / "shared").iterdir() if p.name != "__pycache__"}
    assert entries == LAYERS | {"__init__.py"}, sorted(entries)
    for layer in LAYERS:
        assert (ROOT / "shared" / layer / "__init__.py").is_file(), f"shared/{layer} is a package"


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    exe = str(lint) if lint.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter (the dev extra) checks the contracts")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
