"""The repository stands on its own: a copy of it with nothing beside it collects the whole suite, and nothing in it
reads or cites a folder outside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked_and_new_files() -> list[str]:
    """What a clone of this checkout holds once its changes are committed: tracked files and new ones not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def _collected(cwd: Path, pythonpath: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"collection failed in {cwd}:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_a_clone_alone_collects_the_whole_suite(tmp_path: Path) -> None:
    """The checkout's files in an empty directory (no sibling folders): every test is collected there too."""
    alone = tmp_path / "empty" / "vllm-capacity"
    for name in _tracked_and_new_files():
        target = alone / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    assert sorted(p.name for p in alone.parent.iterdir()) == ["vllm-capacity"]
    here = _collected(ROOT, ROOT / "agent")
    there = _collected(alone, alone / "agent")  # the copy's own package, ahead of the editable install
    assert len(here) > 200  # the whole suite, not a stray file
    assert there == here


def test_nothing_reads_or_cites_a_folder_beside_the_repository() -> None:
    sibling = ".." + "/shared"  # spelled apart so that this test does not find itself
    grep = ["git", "grep", "--untracked", "-n", "-F", sibling]
    found = subprocess.run(grep, cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 1, f"references outside the repository:\n{found.stdout}"


def test_the_layout_table_lists_every_module() -> None:
    """docs/development.md's layout table has a row for each module of the package, and none for one that is gone."""
    import re

    package = ROOT / "agent" / "vllm_capacity"
    modules = {f"agent/vllm_capacity/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    text = (ROOT / "docs" / "development.md").read_text()
    rows = dict(re.findall(r"^\| `(agent/vllm_capacity/[\w/]+\.py)` \| (.+) \|$", text, re.MULTILINE))
    assert not modules - set(rows), f"docs/development.md's layout table lacks {sorted(modules - set(rows))}"
    assert not set(rows) - modules, f"the layout table lists modules that are gone: {sorted(set(rows) - modules)}"
    assert all(len(what.split()) >= 3 for what in rows.values()), "each row says what its module owns"


def test_tests_import_what_they_share_from_support_not_from_conftest() -> None:
    """conftest.py is pytest's (hooks, fixtures); what a test imports lives in tests/support/, so that a helper has
    one home and a test module reads the same under any runner."""
    found = subprocess.run(
        ["git", "grep", "--untracked", "-n", "-E", r"^\s*(from|import) conftest\b", "--", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 1, f"imports of conftest:\n{found.stdout}"


def test_every_runtime_dependency_is_imported_by_the_agent() -> None:
    """What the image installs is what the agent uses: a runtime dependency no module of agent/ imports (httpx was
    one: only the scripts and the tests use it) belongs in an extra."""
    import ast
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[=<>!~\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    modules = {"prometheus-client": "prometheus_client", "nvidia-ml-py": "pynvml", "pyyaml": "yaml"}
    imported = set()
    for path in (ROOT / "agent" / "vllm_capacity").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    unused = {n for n in names if modules.get(n, n.replace("-", "_")) not in imported}
    assert not unused, f"runtime dependencies the agent never imports: {sorted(unused)}"
