"""Whose GPUs and whose processes: the parts of the NVML reader (:mod:`.nvml`) that decide what is the pod's rather
than read a device.

* The GPUs the container runtime made visible (``NVIDIA_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``), and whether
  a device is one of them (:func:`visible_selection`, :func:`selects`).
* Drivers 535.43.02-535.86.x write the *_v3 process lists with a wider structure than pynvml reads
  (:func:`wide_process_infos` reads them as they are).
* Under MPS the compute list holds the MPS server and vLLM is a client (:func:`merged_processes`).
* vLLM's own PIDs, as far as a sidecar sharing the pod's PID namespace sees them (:func:`vllm_pids_in_namespace`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Drivers 535.43.02 to 535.86.x fill nvmlDeviceGetComputeRunningProcesses_v3 (and its MPS twin) with a 32-byte
# structure (an added usedGpuCcProtectedMemory), while pynvml reads 24-byte ones: the first process comes out right
# and every further one is garbage (nvitop PR 79, go-nvml issue 75). 535.98 went back to 24 bytes. On those drivers
# the agent calls the functions itself with the wide structure.
WIDE_PROCESS_INFO_DRIVERS = ((535, 43), (535, 98))  # [from, to)
# From 535.113.01 the driver lists a reader only the processes its PID namespace sees, by the PIDs it sees them as
# (the open GPU kernel modules' _gpuConvertPid); before, every process on the GPU by its host PID.
PIDS_IN_READERS_NAMESPACE = (535, 113)


class ProcessInfoWide(ctypes.Structure):
    """nvmlProcessInfo_v2_t as drivers 535.43.02-535.86.x write it: with usedGpuCcProtectedMemory."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
        ("usedGpuCcProtectedMemory", ctypes.c_ulonglong),
    ]


def driver_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a driver version such as 535.54.03; None when it is not one."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else None


@dataclass(frozen=True)
class GpuProcessInfo:
    """A process as pynvml's friendly objects give it (pid, usedGpuMemory)."""

    pid: int
    usedGpuMemory: int | None


def wide_process_infos(nvml: Any, handle: Any, function: str) -> list[Any]:
    """``function`` (a *_v3 process list) called with the 32-byte structure: what pynvml's own call would read
    wrong on drivers 535.43.02-535.86.x. The same two calls pynvml makes: the count, then the list."""
    fn = nvml._nvmlGetFunctionPointer(function)
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.pointer(count), None)
    if ret == nvml.NVML_SUCCESS:
        return []
    if ret != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise nvml.NVMLError(ret)
    count.value = count.value * 2 + 5  # room for processes started in between, as pynvml leaves
    infos = (ProcessInfoWide * count.value)()
    ret = fn(handle, ctypes.pointer(count), infos)
    if ret != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(ret)
    unavailable = nvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    return [
        GpuProcessInfo(int(i.pid), None if i.usedGpuMemory == unavailable else int(i.usedGpuMemory))
        for i in infos[: count.value]
    ]


def merged_processes(procs: Any, clients: Any) -> Any:
    """The compute processes and the MPS clients, once each by PID (None when the compute list is unknown)."""
    if procs is None or not clients:
        return procs
    listed = {int(p.pid) for p in procs}
    return [*procs, *(c for c in clients if int(c.pid) not in listed)]


def vllm_pids_in_namespace(proc: Path = Path("/proc")) -> set[int]:
    """PIDs of vLLM's processes, as far as this process can see (a shared PID namespace): those whose command line
    mentions vllm (``vllm serve``, ``VLLM::EngineCore``, ``VLLM::Worker_TP1``), and their descendants (workers
    started by multiprocessing's spawn, whose command line names only python)."""
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return set()
    parents: dict[int, int] = {}
    roots: set[int] = set()
    for entry in entries:
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").lower()
        except OSError:
            continue
        if b"vllm-capacity" in cmdline or b"vllm_capacity" in cmdline:
            continue  # the sidecar and what it starts are not vLLM's
        if b"vllm" in cmdline:
            roots.add(pid)
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
            parents[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    pids = set(roots)
    for pid in parents:
        seen, p = set(), pid
        while p in parents and p not in seen and p not in roots:
            seen.add(p)
            p = parents[p]
        if p in roots:
            pids.add(pid)
    return pids


def visible_selection(environ: dict[str, str]) -> list[str] | None:
    """GPUs named by NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES: indices, UUIDs (GPU-..., MIG-..., or a unique
    prefix of one), or the device plugin's volume-mount form (a directory whose entries name the devices). None =
    every visible GPU ("all"); [] = none ("none": the container has no GPU). "void" is what every CDI spec of
    NVIDIA's container toolkit and NVIDIA's DRA driver set in a container they do give GPUs (the runtime decided,
    through CDI): the GPUs NVML shows the container, narrowed by CUDA_VISIBLE_DEVICES when that is set."""
    for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(var, "").strip()
        if not value or value.lower() == "void":
            continue
        if value.lower() == "all":
            return None
        if value.lower() in ("none", "nodevfiles"):
            return []
        if value.startswith("/"):  # NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices (volume-mounts)
            try:
                return sorted(os.listdir(value))
            except OSError:
                return None  # the mount is not here: the runtime gave what it gave
        return [v.strip() for v in value.split(",") if v.strip()]
    return None


def may_select(selection: list[str] | None, index: int) -> bool:
    """Whether ``selection`` may name GPU ``index`` (or one of its MIG instances) before anything of it is read: by
    its index, or by a UUID, which only reading it tells. A GPU it cannot name is never touched, so that another
    pod's lost GPU is never this pod's error."""
    if selection is None:
        return True
    return any(s == str(index) or s.startswith((f"{index}/", "GPU-", "MIG-")) for s in selection)


def names_only_these(selection: list[str] | None, found: list[tuple[str, str, str | None]]) -> bool:
    """Whether every entry of ``selection`` names one of ``found`` (index, UUID, MIG parent's UUID): then a GPU that
    failed before its UUID was known is one the selection does not name."""
    if selection is None:
        return False
    return all(
        any(
            selects([s], index, uuid) or (parent is not None and selects([s], index.split("/")[0], parent))
            for index, uuid, parent in found
        )
        for s in selection
    )


def selects(selection: list[str] | None, index: str, uuid: str) -> bool:
    """Whether ``selection`` names this device: by index, by UUID, or by a unique prefix of its UUID (as nvidia-smi
    and the container runtime accept: GPU-5eed...)."""
    if selection is None:
        return True
    return any(s in (index, uuid) or (s.startswith(("GPU-", "MIG-")) and uuid.startswith(s)) for s in selection)
