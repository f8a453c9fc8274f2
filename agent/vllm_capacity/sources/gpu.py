"""What a reading of a GPU is, as plain data: the records the NVML reader (:mod:`.nvml`) gives and the snapshot, the
memory budget and the exposition read. Apart from the reader so that nothing but the reader loads NVML's binding
(a sidecar with ``--nvml off`` never imports it: ~2.4 MiB resident)."""

from __future__ import annotations

from dataclasses import dataclass

# clock event (throttle) reason bits, as nvmlClocksEventReason* in pynvml
THROTTLE_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU, or one MIG instance (``mig_parent`` set). ``None`` = not supported or not available."""

    index: str
    uuid: str
    name: str
    memory_total_bytes: int | None  # None: a unified-memory GPU (GB10, Jetson Thor) does not report device memory
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    memory_reserved_bytes: int | None = None
    utilization_ratio: float | None = None
    memory_bandwidth_utilization_ratio: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    throttle_reasons: dict[str, bool] | None = None
    processes: tuple[GpuProcess, ...] | None = None
    mig_parent: str | None = None
    # whether the driver lists processes by host PID (before 535.113.01), so that a listed process no PID names is
    # someone's on the node; False: only those the reader's PID namespace sees; None: not known
    host_pids: bool | None = None
