"""Update tests/fixtures/vllm/metric-names.tsv from vLLM releases' own sources: every ``vllm:`` family a release
registers, with its type, merged into each family's first and last release.

    .venv/bin/python scripts/vllm_metric_names.py 0.31.0 0.32.0 0.33.0 0.34.0     # download, read, merge
    .venv/bin/python scripts/vllm_metric_names.py --sources DIR 0.32.0            # a release unpacked in DIR/vllm

Each release's wheel is downloaded without its dependencies (``pip download --no-deps vllm==X``, through pip's own
configuration) and only its Python files are read, none run. A family is registered where a call whose callee names a
counter, gauge or histogram (prometheus-client's classes, vLLM's ``_counter_cls`` and the like, the connectors'
``OffloadingCounterMetadata``) is given its name, as a literal or a constant of the same file (``name="vllm:..."``,
``name=KV_OFFLOAD_CONFIG_INFO``, a metadata dict keyed by the name): the core loggers (vllm/v1/metrics/loggers.py, V0's
vllm/engine/metrics.py), speculative decoding's, and every connector's and offloading tier's. A counter's exposed name
ends in ``_total``. The releases before 0.31 were read from the core loggers only (the file's header says so).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TSV = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm" / "metric-names.tsv"
KINDS = ("counter", "gauge", "histogram")
NAME = re.compile(r"^vllm:[a-z0-9_:]+$")
SKIPPED = ("benchmarks/", "tests/", "v1/metrics/reader.py")  # a client's and a reader's names, not registrations


def _kind(func: ast.expr) -> str | None:
    text = ast.unparse(func).lower()
    found = [k for k in KINDS if k in text]
    return found[0] if len(found) == 1 else None


def _constants(tree: ast.AST) -> dict[str, str]:
    """Names (and class attributes) bound to a ``vllm:`` literal anywhere in the file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name) and NAME.match(node.value.value):
                    out[target.id] = node.value.value
    return out


def _resolve(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if NAME.match(node.value) else None
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.Attribute):
        return constants.get(node.attr)
    return None


def families(source: str) -> set[tuple[str, str]]:
    """The (exposed name, type) of every family one file registers."""
    tree = ast.parse(source)
    constants = _constants(tree)
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (kind := _kind(node.func)) is not None:
            named = next((k.value for k in node.keywords if k.arg == "name"), node.args[0] if node.args else None)
            if (name := _resolve(named, constants)) is not None:
                found.add((name, kind))
        elif isinstance(node, ast.Dict):  # {NAME: OffloadingCounterMetadata(...), ...}
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(value, ast.Call)
                    and (kind := _kind(value.func)) is not None
                    and (name := _resolve(key, constants)) is not None
                ):
                    found.add((name, kind))
    found |= _looped(tree, constants)
    return {(f"{n}_total" if k == "counter" and not n.endswith("_total") else n, k) for n, k in found}


def _looped(tree: ast.AST, constants: dict[str, str]) -> set[tuple[str, str]]:
    """Names given through a loop variable (``for name, doc in [("vllm:...", "..."), ...]: _counter_cls(name=name)``,
    as spec decoding's counters are): the literals first in the tuples of the function that makes the call."""
    found = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        kinds = {
            kind
            for node in ast.walk(func)
            if isinstance(node, ast.Call) and (kind := _kind(node.func)) is not None
            for k in node.keywords
            if k.arg == "name" and isinstance(k.value, ast.Name) and k.value.id not in constants
        }
        if len(kinds) != 1:
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Tuple) and node.elts and (name := _resolve(node.elts[0], {})) is not None:
                found.add((name, next(iter(kinds))))
    return found


def release_families(root: Path) -> dict[tuple[str, str], str]:
    """(name, engine) -> type over a release's ``vllm`` package: V0's engine/metrics.py is ``v0``, the rest ``v1``."""
    out: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel.startswith(s) or f"/{s}" in f"/{rel}" for s in SKIPPED):
            continue
        text = path.read_text(errors="replace")
        if "vllm:" not in text:
            continue
        engine = "v0" if rel == "engine/metrics.py" else "v1"
        for name, kind in families(text):
            out[(name, engine)] = kind
    return out


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def merge(rows: dict[tuple[str, str], list[str]], version: str, found: dict[tuple[str, str], str]) -> None:
    """Each family ``version`` registers widens its row's first and last to include it (a new family gets a row)."""
    for (name, engine), kind in found.items():
        row = rows.setdefault((name, engine), [name, kind, engine, version, version])
        if _version(version) < _version(row[3]):
            row[3] = version
        if _version(version) > _version(row[4]):
            row[4] = version


def read_tsv(path: Path) -> tuple[list[str], dict[tuple[str, str], list[str]]]:
    header, rows = [], {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or line.startswith("name\t"):
            header.append(line)
        elif line:
            cells = line.split("\t")
            rows[(cells[0], cells[2])] = cells
    return header, rows


def write_tsv(path: Path, header: list[str], rows: dict[tuple[str, str], list[str]]) -> None:
    ordered = sorted(rows.values(), key=lambda r: (r[2] != "v1", r[0]))
    path.write_text("\n".join([*header, *("\t".join(r) for r in ordered)]) + "\n")


def download(version: str, into: Path) -> Path:
    """vLLM ``version``'s wheel, its Python files unpacked under ``into``; returns the ``vllm`` package."""
    wheels = into / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(wheels),
         f"vllm=={version}"],
        check=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into / "src", [m for m in z.namelist() if m.startswith("vllm/") and m.endswith(".py")])
    wheel.unlink()
    return into / "src" / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--sources", type=Path, help="a release unpacked here (DIR/vllm), for one version")
    parser.add_argument("--tsv", type=Path, default=TSV)
    args = parser.parse_args(argv)
    if args.sources is not None and len(args.versions) != 1:
        parser.error("--sources reads one release: give one version")
    header, rows = read_tsv(args.tsv)
    for version in sorted(args.versions, key=_version):
        if args.sources is not None:
            found = release_families(args.sources / "vllm")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                found = release_families(download(version, Path(tmp)))
        merge(rows, version, found)
        print(f"{version}: {len(found)} families", file=sys.stderr)
    write_tsv(args.tsv, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
