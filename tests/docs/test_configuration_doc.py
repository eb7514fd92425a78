"""docs/configuration.md is generated from the services' config dataclasses and must not go stale; every
setting the code reads is on it, and the settings the other docs name are ones the services accept."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

from decode_service.config import parse_args as decode_args
from prefill_service.config import parse_args as prefill_args
from shared.serving.config import CommonConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
# The user docs: every Markdown file a user reads (docs/, the READMEs).
USER_DOCS = sorted(
    {
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("*.md"),
        *ROOT.glob("*/README.md"),
        *ROOT.glob("shared/**/README.md"),
    }
)
# Where the code reads PDSERVE_* variables by name (the flags' variables are built from field names).
SOURCES = ("shared", "invariants", "prefill_service", "decode_service")


def _generator() -> ModuleType:
    path = ROOT / "docs" / "tools" / "configuration_doc.py"
    spec = importlib.util.spec_from_file_location("configuration_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


GEN = _generator()
CONFIGS = {
    "common": CommonConfig,
    "decode": type(decode_args([], env={})),
    "prefill": type(prefill_args([], env={})),
}


def _field_vars() -> set[str]:
    return {f"PDSERVE_{f.name.upper()}" for cls in CONFIGS.values() for f in dataclasses.fields(cls)}


def _other_vars() -> set[str]:
    return {name for name, *_ in GEN.OTHER_VARIABLES}


def test_configuration_doc_is_current() -> None:
    assert DOC.read_text() == GEN.render(), (
        "docs/configuration.md is stale: run `python docs/tools/configuration_doc.py`"
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_of_each_config_is_documented(name: str) -> None:
    text = DOC.read_text()
    for f in dataclasses.fields(CONFIGS[name]):
        flag = f"--{f.name.replace('_', '-')}"
        assert f"`{flag}`" in text, f"{name}: {f.name}: flag {flag} missing from docs/configuration.md"
        assert f"`PDSERVE_{f.name.upper()}`" in text, f"{name}: {f.name}: its variable is missing"


def test_each_field_is_in_its_services_section() -> None:
    """Common fields under "Both services", decode's own under "Decode service only"."""
    sections = re.split(r"^## ", DOC.read_text(), flags=re.M)
    both = next(s for s in sections if s.startswith("Both services"))
    decode = next(s for s in sections if s.startswith("Decode service only"))
    prefill = next(s for s in sections if s.startswith("Prefill service only"))
    common = {f.name for f in dataclasses.fields(CommonConfig)}
    for f in dataclasses.fields(CONFIGS["decode"]):
        assert f"`PDSERVE_{f.name.upper()}`" in (both if f.name in common else decode), f.name
    for f in dataclasses.fields(CONFIGS["prefill"]):
        assert f"`PDSERVE_{f.name.upper()}`" in (both if f.name in common else prefill), f.name


def test_service_defaults_are_the_dataclasses() -> None:
    """The table's defaults are what each service's parser gives with no flag and no variable."""
    text = DOC.read_text()
    decode, prefill = decode_args([], env={}), prefill_args([], env={})
    assert f"decode `{decode.port}`, prefill `{prefill.port}`" in text
    assert f"decode `{decode.metrics_port}`, prefill `{prefill.metrics_port}`" in text


def test_check_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "configuration.md"
    monkeypatch.setattr(GEN, "ROOT", tmp_path)
    monkeypatch.setattr(GEN, "OUTPUT", out)
    assert GEN.main(["--check"]) == 1  # missing
    out.write_text(GEN.render().replace("PDSERVE_PAGE_SIZE", "PDSERVE_PAGESIZE"))
    assert GEN.main(["--check"]) == 1  # edited by hand
    assert GEN.main([]) == 0
    assert out.read_text() == GEN.render()
    assert GEN.main(["--check"]) == 0


def test_every_variable_the_code_reads_is_documented() -> None:
    """A PDSERVE_* name written in the code (not built from a field name) is in the hand-kept table."""
    named = set()
    for pkg in SOURCES:
        for path in (ROOT / pkg).rglob("*.py"):
            named |= set(re.findall(r"""["'](PDSERVE_[A-Z][A-Z0-9_]*)["']""", path.read_text()))
    assert named, "the scan found no variable: the pattern is wrong"
    missing = named - _field_vars() - _other_vars()
    assert not missing, (
        f"read by the code but not in OTHER_VARIABLES (docs/tools/configuration_doc.py): {missing}"
    )
    text = DOC.read_text()
    for name in _other_vars():
        assert f"`{name}`" in text


def test_the_docs_name_only_variables_that_exist() -> None:
    known = _field_vars() | _other_vars()
    for path in USER_DOCS:
        for name in re.findall(r"PDSERVE_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()):
            assert name in known, f"{path.relative_to(ROOT)} names {name}, which nothing reads"


def test_device_values_in_the_docs_are_accepted() -> None:
    """What an operator copies from the docs must start a service (the form is checked at parse)."""
    for path in USER_DOCS:
        text = path.read_text()
        found = re.findall(r"PDSERVE_DEVICE=([^\s`'\",;)\]]+)", text) + re.findall(r"--device[= ](\S+)", text)
        for value in found:
            value = value.rstrip(".,`")
            if value.isupper() or value in ("DEV", "X"):  # a placeholder, not a value
                continue
            try:
                CommonConfig(device=value)
            except ValueError as e:
                pytest.fail(f"{path.relative_to(ROOT)}: device {value!r}: {e}")


def _service_command_lines() -> list[tuple[str, str, list[str]]]:
    """(file, service, args) of every `python -m <service> ...` command line in the docs."""
    out = []
    for path in USER_DOCS:
        text = path.read_text().replace("\\\n", " ")  # a shell line continued with a backslash
        for line in text.splitlines():
            m = re.search(r"python -m (decode_service|prefill_service)\b(.*)", line)
            if m is None or "..." in m.group(2) or "`" in m.group(2):
                continue  # prose (a name in backticks) or an elided command
            args = shlex.split(m.group(2), comments=True)
            if "--help" not in args:
                out.append((str(path.relative_to(ROOT)), m.group(1), args))
    return out


def test_service_command_lines_in_the_docs_parse() -> None:
    lines = _service_command_lines()
    assert lines, "no service command line found in the docs"
    for where, service, args in lines:
        parse = decode_args if service == "decode_service" else prefill_args
        try:
            parse(args, env={})
        except (SystemExit, ValueError) as e:
            pytest.fail(f"{where}: python -m {service} {shlex.join(args)}: {e!r}")
