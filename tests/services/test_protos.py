"""The committed generated code in shared/pb is what protos/generate.py makes from protos/ now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generate_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("protos_generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the code")
    gen = _generate_module()
    written = {p.relative_to(tmp_path) for p in gen.generate(tmp_path)}
    committed = {
        p.relative_to(gen.DEFAULT_OUT)
        for p in gen.DEFAULT_OUT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert written == committed, "run: python protos/generate.py"
    stale = [
        str(r) for r in sorted(written) if (tmp_path / r).read_bytes() != (gen.DEFAULT_OUT / r).read_bytes()
    ]
    assert not stale, f"stale generated code {stale}; run: python protos/generate.py"


def test_generated_code_imports_as_a_package() -> None:
    from shared.pb.pdserve.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert generation_pb2_grpc.GenerationStub is not None
    fields = generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    # Unset must differ from 0 for these: proto3 `optional`.
    assert all(fields[f].has_presence for f in ("max_tokens", "temperature", "top_p", "seed"))
