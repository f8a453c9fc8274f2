"""The NVML checks of scripts/gpu-check: real GPU, real driver, real nvidia-ml-py (see that script)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from vllm_capacity.budget import gpu_budget
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.nvml import NvmlSource

MiB = 2**20
GIB = float(os.environ.get("GPU_CHECK_GIB", "2"))
ALLOCATOR = f"""
import os, sys, time, torch
x = torch.empty({int(GIB * 2**30)}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def smi() -> dict[str, dict[str, int]]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = {}
    for line in out.strip().splitlines():
        index, uuid, total, used, free = (v.strip() for v in line.split(","))
        rows[uuid] = {"index": int(index), "total": int(total), "used": int(used), "free": int(free)}
    return rows


def main() -> int:
    failures = []
    source = NvmlSource(deadline=10)
    try:
        readings = asyncio.run(source.read())
    except SourceError as err:
        print(f"gpu-check: no usable NVIDIA GPU here ({err.reason}): {err}")
        return 2
    print(f"NVML sees {len(readings)} GPU(s)")
    table = smi()
    for g in readings:
        row = table.get(g.uuid)
        if row is None:
            print(f"  GPU {g.index} {g.uuid}: not in nvidia-smi (MIG instance?)")
            continue
        ok = abs(g.memory_total_bytes / MiB - row["total"]) <= 1
        print(
            f"  GPU {g.index} {g.name} {g.uuid}: total {g.memory_total_bytes / MiB:.0f} MiB (nvidia-smi "
            f"{row['total']}) used {g.memory_used_bytes / MiB:.0f} MiB (nvidia-smi {row['used']}) "
            f"reserved {(g.memory_reserved_bytes or 0) / MiB:.0f} MiB, util {g.utilization_ratio}, "
            f"power {g.power_watts} W / {g.power_limit_watts} W, {g.temperature_celsius} C, "
            f"SM {g.sm_clock_hertz} Hz -> {'OK' if ok else 'MISMATCH'}"
        )
        if not ok:
            failures.append(f"GPU {g.index} total differs from nvidia-smi")

    python = os.environ.get("GPU_CHECK_PYTHON", "python3")
    proc = subprocess.Popen([python, "-c", ALLOCATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())  # type: ignore[union-attr]
        time.sleep(1)
        readings = asyncio.run(source.read())
        mine = [(g, p) for g in readings for p in (g.processes or ()) if p.pid == pid]
        if not mine:
            failures.append(f"NVML lists no process {pid} (another PID namespace? run on the host)")
        for g, p in mine:
            used = (p.used_bytes or 0) / 2**30
            ok = GIB <= used <= GIB + 1.5  # the allocation plus the CUDA context
            print(
                f"  process {pid} on GPU {g.index}: NVML says {used:.2f} GiB for a {GIB:g} GiB allocation "
                f"-> {'OK' if ok else 'MISMATCH'}"
            )
            if not ok:
                failures.append(f"process {pid}: {used:.2f} GiB for {GIB:g} GiB")
            b = gpu_budget(g, vllm_pids={pid}, weights_bytes=GIB * 2**30, kv_cache_bytes=0.0)
            print(
                f"  budget of GPU {g.index} taking the process as vLLM with {GIB:g} GiB of 'weights': "
                + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in b.components.items())
                + f"; sum {sum(b.components.values()) / 2**30:.2f} of {g.memory_total_bytes / 2**30:.2f} GiB"
            )
            if abs(sum(b.components.values()) - g.memory_total_bytes) > MiB:
                failures.append(f"GPU {g.index}: components do not add up to the total")
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(30)
    print("gpu-check:", "OK" if not failures else "FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
