"""NVML (nvidia-ml-py's ``pynvml`` module): per-GPU memory, utilization, power, clocks, throttling, processes.

I/O only, plain data out. The module is injected (the real ``pynvml``, or a test double with the same functions,
structures and ``NVMLError_*`` classes). Calls run in a worker thread under a deadline, because a wedged driver
can block an NVML call for minutes: while one call hangs no other is started, and the source reports ``hung``.
A field a GPU does not support (``NVMLError_NotSupported``) is absent, never 0; errors that concern the whole
library or a device (no library, no driver, no permission, GPU lost) fail the read with a stable reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import pynvml  # nvidia-ml-py, a dependency: importing it loads no driver library (nvmlInit does)

from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.gpu import THROTTLE_REASONS, GpuProcess, GpuReading
from vllm_capacity.sources.nvml_scope import (
    PIDS_IN_READERS_NAMESPACE,
    WIDE_PROCESS_INFO_DRIVERS,
    driver_version,
    may_select,
    merged_processes,
    names_only_these,
    selects,
    wide_process_infos,
)

# NVML error code (pynvml's NVML_ERROR_*, nvml.h's nvmlReturn_t) -> reason of source_errors_total{source="nvml"}
_REASONS = {
    pynvml.NVML_ERROR_UNINITIALIZED: Reason.UNINITIALIZED,
    pynvml.NVML_ERROR_NOT_SUPPORTED: Reason.NOT_SUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION: Reason.NO_PERMISSION,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: Reason.DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_TIMEOUT: Reason.TIMEOUT,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: Reason.LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: Reason.FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_GPU_IS_LOST: Reason.GPU_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED: Reason.RESET_REQUIRED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: Reason.DRIVER_VERSION_MISMATCH,
    pynvml.NVML_ERROR_GPU_NOT_FOUND: Reason.GPU_NOT_FOUND,
}
# a field a device cannot answer is absent, not an error: MIG instances answer few, an older driver lacks a function
# (FunctionNotFound), a container may not be allowed one field (NoPermission): the GPU's other fields still stand
# each process list's calls, newest structure first: pynvml's unversioned name is the _v3 symbol
_PROCESS_CALLS = {
    "compute": ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "mps": ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2"),
}
_FIELD_ABSENT = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_INVALID_ARGUMENT,
    pynvml.NVML_ERROR_NOT_FOUND,
    pynvml.NVML_ERROR_NO_DATA,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
)
# memory info v2 not answered: fall back to v1
_NO_MEMORY_INFO_V2 = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
)
# errors that concern the whole library, not one GPU: the read fails
_LIBRARY_WIDE = (
    Reason.UNINITIALIZED,
    Reason.DRIVER_NOT_LOADED,
    Reason.LIBRARY_NOT_FOUND,
    Reason.DRIVER_VERSION_MISMATCH,
)
# errors after which NVML is started afresh on the next attempt
_RESTART = (Reason.GPU_LOST, Reason.RESET_REQUIRED, Reason.UNINITIALIZED, Reason.DRIVER_NOT_LOADED)


def reason_of(err: BaseException) -> Reason:
    return _REASONS.get(getattr(err, "value", None), Reason.NVML_ERROR)


def load_pynvml() -> ModuleType:
    """The real NVML binding (nvidia-ml-py); a test injects a double with the same functions and errors."""
    module: ModuleType = pynvml  # nvidia-ml-py ships no type information
    return module


@dataclass
class NvmlSource:
    """Reads the selected GPUs through ``nvml`` (a pynvml-like module) in a worker thread, under a deadline."""

    loader: Callable[[], Any] = load_pynvml
    selection: list[str] | None = None  # indices or UUIDs; None = all
    deadline: float = 5.0
    #: nothing names the pod's GPUs (no --gpus; NVIDIA_VISIBLE_DEVICES all or unset): the agent keeps the GPUs that
    #: run vLLM's processes (Agent._pods_gpus)
    narrow_to_vllm: bool = False
    _nvml: Any = None
    _initialized: bool = False
    _held: bool = False  # this source holds one of nvmlInit's references
    _driver: tuple[int, int] | None = None  # the driver's (major, minor), read once NVML started
    #: the process calls this driver answers, by kind ("compute", "mps"): resolved once per start of NVML
    _calls: dict[str, str] = field(default_factory=dict)
    _busy: threading.Event = field(default_factory=threading.Event)
    #: the GPUs the last read left out, each with why (one failing GPU does not hide the others)
    skipped: list[SourceError] = field(default_factory=list)
    #: their NVML indices, in the same order
    skipped_indices: list[str] = field(default_factory=list)

    def _ensure_init(self) -> Any:
        if self._nvml is None:
            self._nvml = self.loader()
        if not self._initialized:
            if self._held:
                # nvmlInit is reference-counted (the library starts only when the count goes from 0 to 1): to start
                # NVML afresh after a lost or reset GPU, give back our reference first, or nvmlInit re-reads nothing
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlShutdown()
                self._held = False
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as err:
                raise SourceError(reason_of(err), f"NVML could not start: {err}") from err
            self._held = self._initialized = True
            self._calls.clear()  # another driver may answer after a restart of NVML
            version = self._optional(self._nvml.nvmlSystemGetDriverVersion)
            self._driver = driver_version(_text(version)) if version is not None else None
        return self._nvml

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A field, ``fn(*args)``: NotSupported (and the like, for MIG instances) means absent."""
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError as err:
            if err.value in _FIELD_ABSENT:
                return None
            raise

    def _clock_reasons(self, nvml: Any, handle: Any) -> Any:
        """nvmlDeviceGetCurrentClocksEventReasons exists from driver 535.43.02; before, the same bits come from
        nvmlDeviceGetCurrentClocksThrottleReasons."""
        try:
            return nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        except nvml.NVMLError as err:
            if err.value in _FIELD_ABSENT and err.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                return None
            if err.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
        return self._optional(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def _processes(self, nvml: Any, handle: Any) -> Any:
        """The compute processes, and under MPS its clients (the compute list then holds the MPS server; vLLM is a
        client)."""
        low, high = WIDE_PROCESS_INFO_DRIVERS
        if self._driver is not None and low <= self._driver < high:  # the 32-byte structure: read it as it is
            procs = self._optional(lambda: wide_process_infos(nvml, handle, "nvmlDeviceGetComputeRunningProcesses_v3"))
            clients = self._optional(
                lambda: wide_process_infos(nvml, handle, "nvmlDeviceGetMPSComputeRunningProcesses_v3")
            )
            return merged_processes(procs, clients)
        procs = self._versioned(nvml, handle, "compute", _PROCESS_CALLS["compute"])
        clients = self._versioned(nvml, handle, "mps", _PROCESS_CALLS["mps"])
        return merged_processes(procs, clients)

    def _versioned(self, nvml: Any, handle: Any, kind: str, names: tuple[str, ...]) -> Any:
        """A process list through the first of ``names`` the driver has, found once per start of NVML (as go-nvml's
        updateVersionedSymbols and nvitop do). pynvml's unversioned calls use the _v3 symbol and raise the plain
        NVMLLibraryMismatchError where the driver lacks it (before 510.39.01, and 535.98), the _v2 ones
        FunctionNotFound: either moves on to the next. None: no call answers (or the field is absent)."""
        known = self._calls.get(kind)
        for name in (known,) if known else names:
            try:
                result = self._optional(getattr(nvml, name), handle)
            except nvml.NVMLLibraryMismatchError:
                continue
            except nvml.NVMLError as err:
                if err.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                raise
            self._calls[kind] = name
            return result
        return None

    def _device(self, nvml: Any, handle: Any, index: str, mig_parent: str | None = None) -> GpuReading:
        """One device's reading. A MIG instance's has no power, temperature or clocks: they are the whole GPU's,
        which its parent's reading carries once (copied onto each instance, a sum over a node counted them once per
        instance)."""
        device = replace(
            self._memory(nvml, handle, index),
            processes=self._process_tuple(nvml, handle),
            host_pids=self._driver < PIDS_IN_READERS_NAMESPACE if self._driver is not None else None,
        )
        if mig_parent is not None:
            return replace(device, mig_parent=mig_parent)
        return replace(device, **self._board(nvml, handle))

    def _board(self, nvml: Any, handle: Any) -> dict[str, Any]:
        """The whole GPU's power, temperature, clocks and clock event reasons, as GpuReading's fields."""
        power = self._optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit = self._optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        temp = self._optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        sm = self._optional(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        sm_max = self._optional(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        reasons = self._clock_reasons(nvml, handle)
        return {
            "power_watts": power / 1000 if power is not None else None,
            "power_limit_watts": limit / 1000 if limit is not None else None,
            "temperature_celsius": float(temp) if temp is not None else None,
            "sm_clock_hertz": sm * 1e6 if sm is not None else None,
            "sm_clock_max_hertz": sm_max * 1e6 if sm_max is not None else None,
            "throttle_reasons": {k: bool(reasons & bit) for k, bit in THROTTLE_REASONS.items()}
            if reasons is not None
            else None,
        }

    def _process_tuple(self, nvml: Any, handle: Any) -> tuple[GpuProcess, ...] | None:
        procs = self._processes(nvml, handle)
        if procs is None:
            return None
        return tuple(GpuProcess(int(p.pid), _int_or_none(p.usedGpuMemory)) for p in procs)

    def _memory(self, nvml: Any, handle: Any, index: str) -> GpuReading:
        """A device's identity, memory and utilization."""
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        name = _text(nvml.nvmlDeviceGetName(handle))
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            reserved = int(mem.reserved)
        except nvml.NVMLError as err:
            if err.value not in _NO_MEMORY_INFO_V2:
                raise
            # v1; a unified-memory GPU (GB10 / DGX Spark, Jetson Thor) answers neither: its memory is absent
            mem, reserved = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle)), None
        util = self._optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        return GpuReading(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_free_bytes=int(mem.free) if mem is not None else None,
            memory_reserved_bytes=reserved,
            utilization_ratio=util.gpu / 100 if util is not None else None,
            memory_bandwidth_utilization_ratio=util.memory / 100 if util is not None else None,
        )

    def _read_sync(self) -> list[GpuReading]:
        """Every selected GPU's reading. A GPU that fails alone (lost, no permission, needs a reset) is left out and
        named in ``skipped``, and the others are read; what concerns the whole library fails the read."""
        nvml = self._ensure_init()
        readings: list[GpuReading] = []
        self.skipped, self.skipped_indices = [], []
        try:
            count = nvml.nvmlDeviceGetCount()
            for i in range(count):
                if not may_select(self.selection, i):
                    continue  # another pod's GPU
                try:
                    readings += self._gpu(nvml, i)
                except nvml.NVMLError as err:
                    if reason_of(err) in _LIBRARY_WIDE:
                        raise
                    self.skipped.append(SourceError(reason_of(err), f"NVML: GPU {i}: {err}"))
                    self.skipped_indices.append(str(i))
        except nvml.NVMLError as err:
            if reason_of(err) in _RESTART:
                self._initialized = False
            raise SourceError(reason_of(err), f"NVML: {err}") from err
        if self.skipped and names_only_these(self.selection, [(r.index, r.uuid, r.mig_parent) for r in readings]):
            self.skipped, self.skipped_indices = [], []  # what failed is a GPU the selection does not name
        if any(e.reason in _RESTART for e in self.skipped):
            self._initialized = False  # one of ours was lost or reset: start NVML afresh on the next attempt
        if self.skipped and not readings:  # every GPU failed: the read did
            raise self.skipped[0]
        if self.selection and not readings and not self.skipped:
            raise SourceError(
                Reason.GPU_NOT_FOUND,
                f"NVML: the selection {','.join(self.selection)} (--gpus, or NVIDIA_VISIBLE_DEVICES / "
                f"CUDA_VISIBLE_DEVICES) names none of the {count} GPUs NVML sees",
            )
        return readings

    def _gpu(self, nvml: Any, i: int) -> list[GpuReading]:
        """GPU ``i``'s reading (its MIG instances' when MIG is on: those selected, or all when the GPU is); none when
        it is not selected."""
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        whole = selects(self.selection, str(i), uuid)
        mig = self._optional(nvml.nvmlDeviceGetMigMode, handle)
        if mig is None or mig[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return [self._device(nvml, handle, str(i))] if whole else []
        readings = []
        for m in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            mig_handle = self._optional(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, m)
            if mig_handle is None:
                continue
            if whole or selects(self.selection, f"{i}/{m}", _text(nvml.nvmlDeviceGetUUID(mig_handle))):
                readings.append(self._device(nvml, mig_handle, f"{i}/{m}", mig_parent=uuid))
        if not readings:
            return []
        # the physical GPU once, for what is the whole board's (power, temperature, clocks): no memory of its own,
        # which its instances hold
        name = _text(nvml.nvmlDeviceGetName(handle))
        parent = GpuReading(str(i), uuid, name, None, None, None, **self._board(nvml, handle))
        return [parent, *readings]

    def _run(self, done: asyncio.Future[list[GpuReading]], loop: asyncio.AbstractEventLoop) -> None:
        try:
            result: Any = self._read_sync()
        except BaseException as err:  # delivered to the awaiting coroutine
            result = err
        finally:
            self._busy.clear()

        def deliver() -> None:
            if done.cancelled():
                return
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

        if not loop.is_closed():  # a read abandoned at its deadline may end after the loop did: nobody awaits it
            with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
                loop.call_soon_threadsafe(deliver)

    async def read(self) -> list[GpuReading]:
        if self._busy.is_set():
            raise SourceError(Reason.HUNG, "an earlier NVML call has not returned: not starting another")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[GpuReading]] = loop.create_future()
        self._busy.set()
        threading.Thread(target=self._run, args=(done, loop), name="nvml", daemon=True).start()
        try:
            return await asyncio.wait_for(done, timeout=self.deadline)
        except TimeoutError as err:
            raise SourceError(Reason.TIMEOUT, f"NVML did not answer within {self.deadline:g}s") from err


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None
