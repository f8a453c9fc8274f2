"""Two ``vllm-capacity serve`` processes side by side, the code at a git revision and the working tree's, each reading
the same payload every 100 ms and scraped once a second: the CPU each spends per read over the same windows.

usage: .venv/bin/python bench/ab.py REV [--engines 1] [--windows 8] [--seconds 10]

Why side by side: the machine is shared, and one process measured after another wanders by +-10 % from one 10 s
window to the next (bench/cycle.py's rounds), more than most changes are worth. Side by side both see the same
neighbours, and the ratio of the two holds within a few per cent. The process started second measured ~5 % cheaper
when both ran the same code, so the windows are run twice, each process started first once, and the ratio printed is
the geometric mean of the two halves' medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cycle

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """The repository at ``rev``, checked out beside it for as long as the measurement runs."""
    where = Path(tempfile.mkdtemp(prefix="vllm-capacity-ab-"))
    subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(where), rev], cwd=ROOT, check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)


def _loads_from(tree: Path) -> str:
    """Where ``python -m vllm_capacity`` imports the package from with ``tree``'s agent/ on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(tree / "agent")}
    code = "import vllm_capacity; print(vllm_capacity.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


async def _half(url: str, trees: dict[str, Path], windows: int, seconds: float) -> dict[str, list[float]]:
    """``windows`` windows of ``seconds``, the processes started in the order of ``trees``: ms of CPU per read."""
    procs = {}
    for name, tree in trees.items():
        os.environ["PYTHONPATH"] = str(tree / "agent")
        procs[name] = await cycle._start_agent(url)
    per_read: dict[str, list[float]] = {name: [] for name in trees}
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(3.0)  # warm: the first reads, the first render
            for _ in range(windows):
                before = {name: cycle._cpu_seconds(proc.pid) for name, (proc, _) in procs.items()}
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    for _, agent in procs.values():
                        async with session.get(agent + "/metrics") as resp:
                            await resp.read()
                    await asyncio.sleep(1.0)
                reads = (time.monotonic() - t0) / cycle.INTERVAL
                for name, (proc, _) in procs.items():
                    per_read[name].append((cycle._cpu_seconds(proc.pid) - before[name]) / reads * 1e3)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            await proc.wait()
    return per_read


async def run(rev: str, engines: int, windows: int, seconds: float) -> list[str]:
    with worktree(rev) as base, cycle.payload_server() as url:
        trees = {"base": base, "new": ROOT}
        for name, tree in trees.items():
            loads = _loads_from(tree)
            if not loads.startswith(str(tree)):
                raise SystemExit(f"the {name} process would load vllm_capacity from {loads.strip()}, not {tree}")
        out, ratios = [], []
        for order in (("base", "new"), ("new", "base")):
            per_read = await _half(f"{url}/e{engines}", {name: trees[name] for name in order}, windows, seconds)
            ratio = statistics.median(n / b for n, b in zip(per_read["new"], per_read["base"], strict=True))
            ratios.append(ratio)
            out.append(
                f"{order[0]} started first: base {statistics.median(per_read['base']):.3f} ms, new "
                f"{statistics.median(per_read['new']):.3f} ms CPU per read (medians of {windows} windows of "
                f"{seconds:g} s); new / base {ratio:.3f}"
            )
        out.append(
            f"{engines} engine{'s' if engines > 1 else ''}: new / base {math.sqrt(ratios[0] * ratios[1]):.3f} "
            f"(the geometric mean of the two orders; {rev} against the working tree)"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare the working tree with (HEAD: the uncommitted change)")
    ap.add_argument("--engines", type=int, default=1, choices=cycle.ENGINES, help="data-parallel engines served")
    ap.add_argument("--windows", type=int, default=8, help="windows measured in each order")
    ap.add_argument("--seconds", type=float, default=10.0, help="the length of a window")
    args = ap.parse_args()
    print("\n".join(asyncio.run(run(args.rev, args.engines, args.windows, args.seconds))))


if __name__ == "__main__":
    main()
