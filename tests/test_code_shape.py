"""The package keeps the shape docs/development.md promises: small classes, functions and modules, plain control
flow, and imports that run one way (sources, then sizing, derivations, the snapshot, the live loop, exposition, the
front ends), with no cycle. A new function over a limit fails here, with its place and its figure.

Limits (docs/development.md, "Shape"): a class at most 250 lines; a function at most 60 lines (its docstring
included) and 8 parameters (``self`` and ``cls`` not counted); cyclomatic complexity at most 20 (radon's measure,
as ``radon cc`` prints it); a module at most 350 lines unless it is mostly a table (then at most 300 of its lines in
functions and classes).
"""

from __future__ import annotations

import ast
import asyncio
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from radon.complexity import cc_visit

PACKAGE = Path(__file__).resolve().parents[1] / "agent" / "vllm_capacity"
MAX_CLASS, MAX_FUNCTION, MAX_PARAMETERS, MAX_COMPLEXITY = 250, 60, 8, 20
MAX_MODULE, MAX_MODULE_CODE = 350, 300

# The layers, lowest first: a module imports from its own layer or below, never above. By module name under
# vllm_capacity ("" is the package's __init__), a package name covering its modules.
LAYERS: tuple[tuple[str, ...], ...] = (
    # no vLLM, no I/O of sources; the listener's guard, its TLS and its configuration
    ("", "units", "geometry", "redaction", "log", "web.tls", "web.listener", "web.config"),
    ("sources",),  # vLLM's API and log, model configs, NVML: I/O, plain data out
    ("sizing",),  # vLLM's KV-cache sizing rules, pure
    ("derive", "levers"),  # what the agent derives from one read; limits and levers from many: pure
    ("snapshot", "exposition.catalogue"),  # the one consistent view, and the catalogue of what is exported
    ("live", "sweep", "advise"),  # the loop and its readers; the sweep's load and its reads; advise's queries
    ("exposition", "cli.report", "cli.report_json"),  # renders of a snapshot
    ("web", "cli", "__main__"),  # the front ends: the web app, the commands
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == n or (n and module.startswith(n + ".")) for n in names):
            return rank
    raise AssertionError(f"vllm_capacity.{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


def _imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at run time (what a ``TYPE_CHECKING`` block names is left out:
    annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("vllm_capacity"):
            base = node.module.removeprefix("vllm_capacity").lstrip(".")  # type: ignore[union-attr]
            for alias in node.names:
                full = f"{base}.{alias.name}".lstrip(".")
                out.add(full if full in MODULES else base)
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("vllm_capacity").lstrip(".") for a in node.names if a.name.startswith("vllm_")}
    return out


GRAPH = {module: _imports(path) - {module} for module, path in MODULES.items()}


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def _lines(node: ast.stmt) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1


@pytest.mark.parametrize("module", sorted(MODULES))
def test_classes_functions_and_modules_stay_within_their_limits(module: str) -> None:
    path = MODULES[module]
    text = path.read_text()
    tree = ast.parse(text)
    over = [
        f"class {n.name} (line {n.lineno}): {_lines(n)} lines > {MAX_CLASS}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and _lines(n) > MAX_CLASS
    ]
    for fn in _functions(tree):
        if _lines(fn) > MAX_FUNCTION:
            over.append(f"{fn.name} (line {fn.lineno}): {_lines(fn)} lines > {MAX_FUNCTION}")
        if _parameters(fn) > MAX_PARAMETERS:
            over.append(f"{fn.name} (line {fn.lineno}): {_parameters(fn)} parameters > {MAX_PARAMETERS}")
    for block in cc_visit(text):
        for b in (block, *getattr(block, "methods", ())):
            if b.complexity > MAX_COMPLEXITY:
                over.append(f"{b.name} (line {b.lineno}): complexity {b.complexity} > {MAX_COMPLEXITY}")
    length = len(text.splitlines())
    code = sum(
        (n.end_lineno or n.lineno) - min([n.lineno] + [d.lineno for d in n.decorator_list]) + 1
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    )
    if length > MAX_MODULE and code > MAX_MODULE_CODE:
        over.append(f"the module: {length} lines > {MAX_MODULE}, {code} of them in functions and classes")
    assert not over, f"{path.relative_to(PACKAGE.parents[1])}:\n  " + "\n  ".join(over)


def test_imports_run_one_way_from_sources_to_the_front_ends() -> None:
    upward = [
        f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})"
        for m, imported in sorted(GRAPH.items())
        for i in sorted(imported)
        if _layer(i) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_the_exposition_reads_only_the_snapshot_never_the_loop_or_a_source() -> None:
    imported = {i for m, names in GRAPH.items() if m.split(".")[0] == "exposition" for i in names}
    forbidden = {i for i in imported if i.split(".")[0] in ("live", "sources")}
    assert not forbidden, forbidden


def test_no_import_cycle() -> None:
    # Tarjan's strongly connected components: any with more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in GRAPH.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_the_checks_see_what_they_check() -> None:
    """The graph and the limits are read from the package itself: a module, an import and a layer each exist."""
    assert len(MODULES) > 40 and "sources.vllm_metrics.parse" in MODULES
    assert "sources.vllm_metrics.records" in GRAPH["sources.vllm_metrics.parse"]
    assert _layer("exposition") > _layer("snapshot") > _layer("derive.capacity") > _layer("sources.nvml")
    assert _parameters(ast.parse("def f(self, a, *b, c, **d): pass").body[0]) == 4  # type: ignore[arg-type]


_ASYNCIO = {m.name for m in pkgutil.iter_modules(asyncio.__path__)}  # its implementation modules (sslproto, ...)


def _private_module(name: str) -> bool:
    """``name`` (a module, or a name in one) is private: underscored, or one of asyncio's implementation modules."""
    parts = name.split(".")
    return any(p.startswith("_") for p in parts) or (parts[0] == "asyncio" and len(parts) > 1 and parts[1] in _ASYNCIO)


def _private_uses(tree: ast.AST) -> Iterator[str]:
    """Imports of a private module or name of Python or a library (a leading underscore, or one of asyncio's
    implementation modules such as ``asyncio.sslproto``), and ``getattr``/``hasattr``/``setattr`` of an
    underscored attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in (None, "__future__"):
            module = node.module or ""
            if module.startswith("vllm_capacity"):
                continue
            if _private_module(module):
                yield f"line {node.lineno}: from {module} import"
            private = [a.name for a in node.names if _private_module(f"{module}.{a.name}")]
            yield from (f"line {node.lineno}: {module}.{name}" for name in private)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    yield f"line {node.lineno}: import {alias.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            yield f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})"


def test_no_private_api_of_python_or_a_library() -> None:
    """The listener subclassed asyncio.sslproto.SSLProtocol and read aiohttp's _request_in_progress: either can
    change in any release. Public API only."""
    found = [f"{m}: {use}" for m, path in sorted(MODULES.items()) for use in _private_uses(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)
    caught = list(_private_uses(ast.parse("from asyncio import sslproto\nimport asyncio.sslproto\ngetattr(h, '_x')")))
    assert len(caught) == 3, caught


def test_the_top_level_is_a_handful_of_wings() -> None:
    """A newcomer reads the package from its tree: a few shared modules at the top, the rest in wings (the command
    line, the web listener, the live loop, sources, sizing, derivations, exposition), each saying what it holds."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    wings = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= 7, top
    assert {"cli", "web", "live", "sources", "sizing", "derive", "exposition"} <= set(wings), wings
    for wing in wings:
        assert ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text())), f"{wing}/ says nothing"


def test_no_module_keeps_state_between_reads() -> None:
    """The /metrics reader kept its line and series memories in module globals (and a ``global`` counter): state
    belongs to the object that reads (ReaderMemory, the client's). No ``global`` statement, no memory made at a
    module's top level."""
    found = []
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text())
        found += [f"{module}: line {n.lineno}: global" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("Remembered", "ReaderMemory"):
                found.append(f"{module}: line {node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)


def test_one_name_is_defined_once() -> None:
    """The (model_name, engine) key was defined three times: each type alias the package names is defined once."""
    defined: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if name[:1].isupper() and not name.isupper() and isinstance(node.value, ast.Subscript):
                    defined.setdefault(name, []).append(module)
    assert "EngineKey" in defined
    twice = {name: modules for name, modules in defined.items() if len(modules) > 1}
    assert not twice, twice
