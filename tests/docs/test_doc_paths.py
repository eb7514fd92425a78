"""Every file the user docs name by its repository path exists: a doc that points at a moved or deleted
file sends its reader nowhere."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = sorted(
    {
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("*.md"),
        *ROOT.glob("*/README.md"),
        *ROOT.glob("shared/**/README.md"),
    }
)
TOP = ("shared", "decode_service", "prefill_service", "invariants", "tests", "bench", "docs", "k8s", "protos")
# A repository path: a top-level folder, then path characters. Not inside another path or a git revision
# (`git show REV:docs/x.md` names a file of that revision).
PATH = re.compile(rf"(?<![\w:/.\-])((?:{'|'.join(TOP)})/[\w./*\-]*)")
# Sections that name files on purpose which the tree no longer has (where git history keeps them).
HISTORY = re.compile(r"^## Removed experiments$.*?(?=^## |\Z)", re.M | re.S)


def _named_paths(path: Path) -> list[str]:
    text = HISTORY.sub("", path.read_text())
    return sorted({m.rstrip(".,;:)*") for m in PATH.findall(text)})  # no trailing ** of bold text


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = [p for p in _named_paths(doc) if not glob.glob(str(ROOT / p))]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_scan_finds_paths() -> None:
    assert "shared/serving/api/validation.py" in _named_paths(ROOT / "docs" / "architecture.md")
