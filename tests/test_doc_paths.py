"""Docs say what is true now: every file or module of this repository a doc names exists. A path is taken as the
repository's when it starts with one of its folders (``agent/``, ``tests/``, ``docs/``...) or a folder of the package
(``sources/``, ``derive/``, ``live/``, ``sizing/``, ``vllm_capacity/``), or is a test file's name (``test_*.py``);
vLLM's own files (``vllm/v1/...``, ``gpu_worker.py``) are cited as upstream sources, not checked here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agent" / "vllm_capacity"
TOP = ("agent/", "tests/", "docs/", "scripts/", "bench/", "deploy/", "alerts/", "dashboards/", ".ci/")
INSIDE = tuple(f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_"))
TOKEN = re.compile(r"`([^`\s]+)`|\]\(([^)\s#]+)")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("alerts/*.md")),
            *sorted(ROOT.glob("deploy/**/*.md")), *sorted(ROOT.glob("dashboards/*.md"))]  # fmt: skip


def _named(doc: Path) -> list[tuple[str, list[Path]]]:
    """The repository paths ``doc`` names, each with where it may be."""
    out = []
    for m in TOKEN.finditer(doc.read_text()):
        token = (m.group(1) or m.group(2)).split("::")[0].rstrip(".,:;)")
        if m.group(2) is not None and not token.startswith(("http", "mailto:")):  # a relative link: from the doc
            out.append((token, [doc.parent / token]))
        elif token.startswith(TOP):
            out.append((token, [ROOT / token]))
        elif token.startswith("vllm_capacity/"):
            out.append((token, [ROOT / "agent" / token]))
        elif token.startswith(INSIDE) and re.fullmatch(r"[\w/]+(\.py)?/?", token):
            out.append((token, [PACKAGE / token]))
        elif re.fullmatch(r"test_\w+\.py", token):
            out.append((token, [ROOT / "tests" / token]))
    return out


def _exists(path: Path) -> bool:
    """The path, or for a pattern (``tests/fixtures/vllm/v0-*``) a file it matches."""
    if "*" in path.name:
        return any(path.parent.glob(path.name))
    return path.exists()


def test_every_repository_path_a_doc_names_exists() -> None:
    missing = [f"{doc.relative_to(ROOT)}: {token}" for doc in _docs() for token, where in _named(doc)
               if not any(_exists(p) for p in where)]  # fmt: skip
    assert missing == []


def test_the_check_reads_the_forms_the_docs_use() -> None:
    """It would see a missing module: the forms above are found in the docs, many of them."""
    named = [token for doc in _docs() for token, _ in _named(doc)]
    assert len(named) > 100
    assert any(t.startswith("agent/") for t in named) and any(t.startswith("sources/") for t in named)
    assert any(re.fullmatch(r"test_\w+\.py", t) for t in named)
