"""The checks of scripts/gpu-check, on a machine with an NVIDIA GPU and no network: the real driver and nvidia-ml-py
against what the agent assumes. Needs only Python >= 3.11 and nvidia-ml-py (pynvml.py, pure Python: found in
.venv when it is not installed); the agent's NVML code is imported from agent/ (it needs nothing else). CUDA memory
is allocated through libcuda with ctypes (no PyTorch). Prints a table a reviewer can paste; exit 0 when every check
passes, 1 when one fails, 2 when there is no usable GPU, 4 when it cannot run (no nvidia-ml-py: one line).

Checks: the driver's NVML function table (which versioned calls exist); each GPU's reading against nvidia-smi
(``[N/A]`` tolerated) and total = reserved + used + free; two allocator processes of different sizes as NVML lists
them (both right: the 32-byte process structure of drivers 535.43-535.86 garbles the second through pynvml); the
gap between used memory and the processes' sum; the process list read from a separate PID namespace (``unshare``:
drivers from 535.113.01 hide processes the reader cannot see) and as UID 65532 (the sidecar's user); power,
clocks, temperature and utilization for plausibility; the first read's time against the agent's deadline;
MIG instances only where MIG is already enabled.
"""

from __future__ import annotations

import asyncio
import ctypes
import glob
import importlib.metadata
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "agent"))
CANNOT_RUN = 4  # exit status: the check itself cannot run here (not "a check failed", not "no GPU")
try:
    import pynvml
except ImportError:  # not installed: the checkout's virtualenv has the pure-Python module
    sys.path[1:1] = glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages"))
    try:
        import pynvml
    except ImportError:
        print("gpu-check: cannot run: nvidia-ml-py is not installed (pip install nvidia-ml-py==13.615.71, or "
              "scripts/setup --agent-only for this checkout's .venv)")  # fmt: skip
        sys.exit(CANNOT_RUN)

from vllm_capacity.derive.budget import gpu_budget  # noqa: E402 - after the path to agent/
from vllm_capacity.sources import SourceError  # noqa: E402
from vllm_capacity.sources.gpu import GpuReading  # noqa: E402
from vllm_capacity.sources.nvml import NvmlSource  # noqa: E402

MiB, GiB = 2**20, 2**30
DEADLINE = 4.0  # the agent's default --timeout
SIDECAR_UID = 65532
FUNCTIONS = (  # the NVML symbols the agent calls, or falls back between
    "nvmlInit_v2",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerUsage",
    # not called: their presence dates the driver for the process-structure rule (conf. compute: R535+; the
    # process detail list: R550+)
    "nvmlDeviceGetConfComputeMemSizeInfo",
    "nvmlDeviceGetRunningProcessDetailList",
)
ALLOCATOR = """
import ctypes, os, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(ret, what):
    if ret != 0:
        print(f"error {what} {ret}", flush=True)
        sys.exit(3)
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), int(sys.argv[1])), "cuDeviceGet")
context = ctypes.c_void_p()  # the primary context, as PyTorch (and so vLLM) takes it
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
pointer = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(int(sys.argv[2]))), "cuMemAlloc")
print(os.getpid(), flush=True)
sys.stdin.read()
"""
# a reader in another process (another PID namespace, another user): what NVML lists on one GPU, as the agent reads it
READER = """
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
from vllm_capacity.sources.nvml import NvmlSource
reading = [g for g in NvmlSource()._read_sync() if g.index == sys.argv[2]][0]
print(json.dumps([[p.pid, p.used_bytes] for p in reading.processes] if reading.processes is not None else None))
"""
# the deployment the shipped components rely on: vLLM and the sidecar in one PID namespace (shareProcessNamespace), the
# sidecar not root: an allocator and a reader started in one new namespace as UID 65532, the budget then vLLM's share
SHARED = """
import json, subprocess, sys, time
sys.path[:0] = json.loads(sys.argv[1])
from vllm_capacity.derive.budget import gpu_budget
from vllm_capacity.sources.nvml import NvmlSource
alloc = subprocess.Popen([sys.executable, "-c", sys.argv[4], sys.argv[2], sys.argv[3]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
line = alloc.stdout.readline().strip()
if not line.isdigit():
    print(json.dumps({"error": "the allocator said " + (line or "nothing")}))
    sys.exit(0)
time.sleep(1)
g = [g for g in NvmlSource()._read_sync() if g.index == sys.argv[2]][0]
b = gpu_budget(g, vllm_pids={int(line)}, weights_bytes=int(sys.argv[3]), kv_cache_bytes=0)
print(json.dumps({"pid": int(line), "listed": [p.pid for p in g.processes or ()], "components": sorted(b.components)}))
alloc.stdin.close()
alloc.wait(30)
"""


@dataclass
class Report:
    """The table, each row printed as its check completes (a check that hangs shows where it hung)."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)
    width: int = 34
    out: Any = None  # a text stream; stdout when None

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        row = (check, {True: "ok", False: "FAIL", None: "info"}[ok], detail)
        self.rows.append(row)
        print(f"{row[0]:<{self.width}}  {row[1]:<4}  {row[2]}", file=self.out or sys.stdout, flush=True)

    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _ in self.rows)


def smi_number(text: str) -> float | None:
    """One nvidia-smi CSV value: a number, or None for [N/A], [Not Supported], N/A and the like."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None


def smi_rows(run: Any = subprocess.run) -> dict[str, dict[str, float | None]]:
    """nvidia-smi's view of each GPU by UUID (MiB, W, C); {} without nvidia-smi."""
    fields = ("uuid", "memory.total", "memory.reserved", "memory.used", "memory.free", "power.draw", "temperature.gpu")
    try:
        out = run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = {}
    for line in out.stdout.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) == len(fields):
            rows[values[0]] = {f: smi_number(v) for f, v in zip(fields[1:], values[1:], strict=True)}
    return rows


def plausible(g: GpuReading) -> list[str]:
    """What is implausible in a reading (empty: nothing)."""
    wrong = []
    if g.power_watts is not None and not 0 < g.power_watts <= 1.1 * (g.power_limit_watts or 2000):
        wrong.append(f"power {g.power_watts} W (limit {g.power_limit_watts} W)")
    if g.temperature_celsius is not None and not 5 <= g.temperature_celsius <= 110:
        wrong.append(f"temperature {g.temperature_celsius} C")
    if g.sm_clock_hertz is not None and g.sm_clock_max_hertz and g.sm_clock_hertz > 1.05 * g.sm_clock_max_hertz:
        wrong.append(f"SM clock {g.sm_clock_hertz / 1e6:.0f} MHz over its maximum {g.sm_clock_max_hertz / 1e6:.0f}")
    if g.utilization_ratio is not None and not 0 <= g.utilization_ratio <= 1:
        wrong.append(f"utilization {g.utilization_ratio}")
    return wrong


def identity(g: GpuReading) -> tuple[bool, str]:
    """total = reserved + used + free (memory info v2), or total = used + free (v1)."""
    parts = [g.memory_reserved_bytes or 0, g.memory_used_bytes or 0, g.memory_free_bytes or 0]
    gap = (g.memory_total_bytes or 0) - sum(parts)
    version = "v2" if g.memory_reserved_bytes is not None else "v1"
    return abs(gap) <= MiB, f"{version}: total - reserved - used - free = {gap / MiB:+.1f} MiB"


def versions() -> str:
    """nvidia-ml-py's version and the CUDA driver API's (cuDriverGetVersion: 12040 is 12.4)."""
    try:
        binding = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        binding = "unknown (pynvml.py borrowed from .venv)"
    try:
        number = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(number))
        cuda = f"{number.value // 1000}.{number.value % 1000 // 10}"
    except OSError as err:
        cuda = f"no libcuda.so.1 ({err})"
    return f"nvidia-ml-py {binding}, CUDA driver API {cuda}"


def function_table(nvml: Any) -> str:
    present, absent = [], []
    for name in FUNCTIONS:
        try:
            nvml._nvmlGetFunctionPointer(name)
            present.append(name)
        except nvml.NVMLError:
            absent.append(name)
    return f"absent: {', '.join(absent) or 'none'} (of {len(FUNCTIONS)})"


def run_python(prefix: list[str], script: str, args: list[str], timeout: float) -> tuple[Any, str]:
    """``script`` run by this Python under ``prefix`` (unshare, setpriv), its arguments the agent's import paths (as
    JSON) then ``args``: the JSON of its last line, or None and why not."""
    paths = json.dumps([str(ROOT / "agent"), *sys.path[1:]])
    try:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", script, paths, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"could not run: {err}"
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def run_reader(gpu: str, prefix: list[str]) -> tuple[Any, str]:
    """The process list of GPU ``gpu`` read by a new process started under ``prefix`` (unshare, setpriv)."""
    return run_python(prefix, READER, [gpu], 30)


ALLOCATOR_DEADLINE = 30.0  # seconds for cuInit and an allocation (a hanging cuInit must not eat the 120 s)


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The process's first line of output, "" after ``deadline`` seconds (it is then killed) or at its end."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], deadline)
    if not ready:
        proc.kill()
        return f"nothing within {deadline:g} s"
    return proc.stdout.readline().strip()


def budget_sum(reading: GpuReading, vllm_pid: int, vllm_size: int) -> tuple[bool, str]:
    """The components of the budget taking one allocator as vLLM, its allocation as the weights and no KV cache
    (its context is then vLLM's runtime): they add up to the total when every byte is in one. Without weights and
    KV cache vLLM's own memory would be in none, and the sum always short by it."""
    budget = gpu_budget(reading, vllm_pids={vllm_pid}, weights_bytes=vllm_size, kv_cache_bytes=0)
    gap = (reading.memory_total_bytes or 0) - sum(budget.components.values())
    return abs(gap) <= MiB, f"total - the components ({', '.join(budget.components)}) = {gap / MiB:+.1f} MiB"


def allocate(gpu: int, size: int) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's ordinals in NVML's order
    proc = subprocess.Popen(
        [sys.executable, "-c", ALLOCATOR, str(gpu), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = read_line(proc, ALLOCATOR_DEADLINE)
    if not line.isdigit():
        proc.kill()
        raise RuntimeError(f"the allocator could not allocate {size / GiB:.1f} GiB on GPU {gpu}: {line or 'no output'}")
    return proc, int(line)


Allocator = Callable[[int, int], tuple[subprocess.Popen[str], int]]
Reader = Callable[[str, list[str]], tuple[Any, str]]
Shared = Callable[[str, int], tuple[dict[str, Any] | None, str]]


def run_shared(gpu: str, size: int) -> tuple[dict[str, Any] | None, str]:
    """SHARED in a new PID namespace as UID 65532 (needs root, unshare and setpriv): what it printed, or why not."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if os.geteuid() != 0 or not unshare or not setpriv:
        return None, "not measured: needs root, unshare and setpriv"
    prefix = [unshare, "--pid", "--fork", "--mount-proc", setpriv, f"--reuid={SIDECAR_UID}", f"--regid={SIDECAR_UID}",
              "--clear-groups"]  # fmt: skip
    return run_python(prefix, SHARED, [gpu, str(size), ALLOCATOR], 60)


def shared_row(result: dict[str, Any] | None, error: str) -> tuple[bool | None, str]:
    """The shared-namespace row: vLLM's process listed by the PID the reader sees, and its share in the budget."""
    if result is None:
        return None, error
    if "error" in result:
        return False, result["error"]
    listed = result["pid"] in result["listed"]
    share = "vllm_runtime" in result["components"] and "weights" in result["components"]
    return listed and share, (
        f"the allocator {'listed' if listed else 'NOT listed'} as PID {result['pid']} (of {result['listed']}); "
        f"budget components {', '.join(result['components'])}"
    )


def check_processes(  # allocator, reader and shared: what a run over the test double replaces
    report: Report,
    source: NvmlSource,
    gpu: GpuReading,
    allocator: Allocator = allocate,
    reader: Reader = run_reader,
    shared: Shared = run_shared,
) -> None:
    """Two allocators of different sizes, as the agent reads them; then the same list from another PID namespace
    and as the sidecar's user."""
    free = gpu.memory_free_bytes or 0
    sizes = [int(s) for s in (min(1 * GiB, free // 8), min(3 * GiB, free // 4))]
    procs: list[tuple[subprocess.Popen[str], int, int]] = []
    try:
        for size in sizes:
            proc, pid = allocator(int(gpu.index), size)
            procs.append((proc, pid, size))
        time.sleep(1)
        reading = next(g for g in source._read_sync() if g.index == gpu.index)
        listed = {p.pid: p.used_bytes for p in reading.processes or ()}
        for _, pid, size in procs:
            used = listed.get(pid)
            ok = used is not None and size <= used <= size + GiB
            shown = "not listed" if pid not in listed else f"{(used or 0) / GiB:.2f} GiB"
            report.add(f"process {pid} ({size / GiB:.1f} GiB)", ok, f"NVML lists {shown} (allocation + context)")
        known = [u for u in listed.values() if u is not None]
        gap = (reading.memory_used_bytes or 0) - sum(known)
        report.add("used - processes", None, f"{gap / MiB:+.0f} MiB over {len(listed)} processes")
        report.add("budget adds up", *budget_sum(reading, procs[0][1], procs[0][2]))
        ours = {pid for _, pid, _ in procs}
        unshare = shutil.which("unshare")
        if unshare:
            prefix = [unshare, "--pid", "--fork", "--mount-proc"]
            if os.geteuid() != 0:
                prefix[1:1] = ["--user", "--map-root-user"]
            seen, error = reader(gpu.index, prefix)
            if seen is None:
                report.add("another PID namespace", None, f"not measured: {error}")
            else:
                visible = {pid for pid, _ in seen} & ours
                report.add(
                    "another PID namespace",
                    None,
                    f"lists {len(seen)} processes, {len(visible)} of the 2 allocators by their PIDs "
                    + ("(hidden: the driver translates PIDs, 535.113.01+)" if not visible else "(host PIDs)"),
                )
        else:
            report.add("another PID namespace", None, "not measured: no unshare")
        setpriv = shutil.which("setpriv")
        if os.geteuid() == 0 and setpriv:
            prefix = [setpriv, f"--reuid={SIDECAR_UID}", f"--regid={SIDECAR_UID}", "--clear-groups"]
            seen, error = reader(gpu.index, prefix)
            detail = (
                error or f"{len(seen or [])} processes, memory known for {sum(u is not None for _, u in seen or [])}"
            )
            report.add(f"as UID {SIDECAR_UID}", seen is not None, detail)
        else:
            report.add(f"as UID {SIDECAR_UID}", None, "not measured: needs root and setpriv")
        report.add(f"one PID namespace, UID {SIDECAR_UID}", *shared_row(*shared(gpu.index, sizes[0])))
    finally:
        for proc, _, _ in procs:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(30)


def main(
    nvml: Any = None, allocator: Allocator = allocate, reader: Reader = run_reader, shared: Shared = run_shared
) -> int:
    """The checks, printed as they complete; ``nvml`` (pynvml by default), ``allocator`` and ``reader`` are what a
    run over the test double replaces."""
    t0 = time.monotonic()
    nvml = nvml if nvml is not None else pynvml
    source = NvmlSource(deadline=120, loader=lambda: nvml)
    try:
        readings = asyncio.run(source.read())
    except SourceError as err:
        print(f"gpu-check: no usable NVIDIA GPU here ({err.reason}): {err}")
        return 2
    first = time.monotonic() - t0
    report = Report()
    driver = nvml.nvmlSystemGetDriverVersion()
    report.add("driver", None, f"{driver}, NVML {nvml.nvmlSystemGetNVMLVersion()}, {len(readings)} device(s)")
    report.add("versions", None, versions())
    report.add("function table", None, function_table(nvml))
    report.add("first read", first <= DEADLINE, f"{first:.2f} s (the agent's --timeout: {DEADLINE:g} s; grace 60 s)")
    smi = smi_rows()
    for g in readings:
        label = f"GPU {g.index}"
        ok, detail = identity(g)
        report.add(f"{label} memory identity", ok, detail)
        row = smi.get(g.uuid)
        if row is None or row["memory.total"] is None or g.memory_total_bytes is None:
            report.add(f"{label} vs nvidia-smi", None, "no nvidia-smi row (a MIG instance, or no nvidia-smi)")
        else:
            total_ok = abs(g.memory_total_bytes / MiB - row["memory.total"]) <= 1
            report.add(
                f"{label} vs nvidia-smi",
                total_ok,
                f"total {g.memory_total_bytes / MiB:.0f}/{row['memory.total']:.0f} MiB, used "
                f"{(g.memory_used_bytes or 0) / MiB:.0f}/{row['memory.used']} MiB (NVML/nvidia-smi)",
            )
        wrong = plausible(g)
        report.add(f"{label} plausible", not wrong, "; ".join(wrong) or "power, temperature, clocks, utilization")
        if g.mig_parent:
            report.add(f"{label} MIG", g.power_watts is not None, f"instance of {g.mig_parent}: power from the parent")
    whole = [g for g in readings if not g.mig_parent and g.memory_free_bytes]
    if whole:
        try:
            check_processes(report, source, whole[0], allocator, reader, shared)
        except RuntimeError as err:
            report.add("allocators", False, str(err))
    report.add("time", None, f"{time.monotonic() - t0:.1f} s in all")
    print("gpu-check:", "FAILED" if report.failed() else "OK")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
