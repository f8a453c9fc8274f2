"""A stand-in for nvidia-ml-py's ``pynvml`` where no GPU exists: the edge that cannot run here.

Same function names and signatures as pynvml, and the real library's own types: the ctypes structures
(``c_nvmlMemory_v2_t``, ``c_nvmlUtilization_t``), the friendly process objects (``nvmlStructToFriendlyObject``
over ``c_nvmlProcessInfo_v2_t``, ``usedGpuMemory`` None when not available), and the real ``NVMLError``
classes (``pynvml.NVMLError(code)`` maps to ``NVMLError_GpuIsLost`` and friends). Scenarios set the devices.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import pynvml
import pytest

from vllm_capacity.sources.nvml_scope import ProcessInfoWide

GiB = 2**30


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA A10G"
    total: int = int(22.03 * GiB)
    used: int = 0
    free: int | None = None  # default: total - used - reserved
    reserved: int = 300 * 2**20
    util_gpu: int = 87
    util_mem: int = 41
    power_mw: int | None = 182_000
    limit_mw: int = 300_000
    temp: int = 64
    sm_mhz: int = 1710
    sm_max_mhz: int = 1710
    reasons: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig: list[FakeGpu] | None = None
    supports_v2: bool = True
    lost: bool = False
    error: int | None = None  # every call on it fails with this NVML error (NVML_ERROR_TIMEOUT, say)
    hang: threading.Event | None = None  # a call blocks until this is set
    # an older driver: no nvmlDeviceGetComputeRunningProcesses_v3 (before 510.39, and 535.98), no
    # nvmlDeviceGetCurrentClocksEventReasons (before 535.43.02)
    no_v3_processes: bool = False
    no_event_reasons: bool = False
    denied: frozenset[str] = frozenset()  # NVML functions this container may not call (NoPermission)
    unified: bool = False  # a unified-memory GPU: memory info is NotSupported
    # reset under us: every call on it fails as lost until NVML itself starts again (its reference count back to 0,
    # then nvmlInit), as the driver's handles are those of the GPU before the reset
    stale: bool = False
    # under MPS the compute list holds the MPS server; its clients (vLLM among them) are listed by
    # nvmlDeviceGetMPSComputeRunningProcesses
    mps_processes: list[tuple[int, int | None]] = field(default_factory=list)
    no_mps_call: bool = False  # a driver without nvmlDeviceGetMPSComputeRunningProcesses_v3


class FakeNvml:
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_ERROR_INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    NVML_VALUE_NOT_AVAILABLE_ulonglong = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong
    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE

    def __init__(
        self,
        gpus: list[FakeGpu],
        init_error: int | None = None,
        driver: str = "550.54.15",
        reader_pids: set[int] | None = None,
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        # the PIDs the reader's PID namespace can see (None: all, the host's namespace or a shared one): drivers from
        # 535.113.01 list only those (the kernel module translates each PID into the reader's namespace and drops
        # the ones it cannot, _gpuConvertPid in gpu_rmapi.c); older drivers list every process by its host PID
        self.reader_pids = reader_pids
        self.init_calls = 0
        self.refcount = 0  # nvmlInit is reference-counted, as the real library's
        self.starts = 0  # times the library really started (its count went from 0 to 1)

    def _check(self, gpu: FakeGpu) -> FakeGpu:
        if self.refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if gpu.hang is not None:
            gpu.hang.wait()
        if gpu.lost or gpu.stale:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if gpu.error is not None:
            raise pynvml.NVMLError(gpu.error)
        return gpu

    def _board(self, gpu: FakeGpu) -> FakeGpu:
        """A whole-GPU property (power, temperature, clocks): a MIG instance's handle does not answer it."""
        g = self._check(gpu)
        if g.uuid.startswith("MIG-"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.refcount += 1
        if self.refcount == 1:  # the library starts: the GPUs are enumerated afresh
            self.starts += 1
            for g in self.gpus:
                g.stale = False

    def nvmlShutdown(self) -> None:
        if self.refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        if self.refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if index >= len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return self._check(handle).uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return self._check(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None):
        g = self._check(handle)
        if g.unified:  # GB10 / DGX Spark, Jetson Thor: no device memory of its own
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        free = g.free if g.free is not None else g.total - g.used - g.reserved
        if version == pynvml.nvmlMemory_v2:
            if not g.supports_v2:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            return pynvml.c_nvmlMemory_v2_t(version, g.total, g.reserved, free, g.used)
        return pynvml.c_nvmlMemory_t(g.total, free, g.used + g.reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu):
        g = self._check(handle)
        if g.mig is None and g.uuid.startswith("MIG-"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(g.util_gpu, g.util_mem)

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        g = self._board(handle)
        if "nvmlDeviceGetPowerUsage" in g.denied:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if g.power_mw is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGpu) -> int:
        return self._board(handle).limit_mw

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._board(handle).temp

    def nvmlDeviceGetClockInfo(self, handle: FakeGpu, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._board(handle).sm_mhz

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGpu, clock: int) -> int:
        return self._board(handle).sm_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGpu) -> int:
        g = self._board(handle)
        if g.no_event_reasons:  # pynvml: _nvmlGetFunctionPointer fails
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return g.reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeGpu) -> int:
        return self._board(handle).reasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list:
        """pynvml's unversioned call: the _v3 symbol, read with pynvml's 24-byte structure."""
        if handle.no_v3_processes:  # as pynvml's throwOnVersionMismatch turns FunctionNotFound into
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")
        g = self._check(handle)
        if self._wide():  # the _v3 symbol writes 32-byte structures there: garbage after the first
            return self._misread(self._listed(g.processes))
        return self._process_infos(self._listed(g.processes))

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeGpu) -> list:
        """The _v2 symbol: 24-byte structures on every driver (nvml.h 535.43.02 declares it so; only _v3 took the
        wide one), so it reads right on 535.43-535.86 too."""
        return self._process_infos(self._listed(self._check(handle).processes))

    def _listed(self, processes: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        """What the driver lists to this reader: from 535.113.01 only the processes its PID namespace sees."""
        major, minor = (int(x) for x in self.driver.split(".")[:2])
        if self.reader_pids is None or (major, minor) < (535, 113):
            return processes
        return [(pid, used) for pid, used in processes if pid in self.reader_pids]

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self.driver

    def nvmlSystemGetDriverVersion(self) -> str:
        if self.refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return self.driver

    def _wide(self) -> bool:
        """Drivers 535.43.02-535.86.x write 32-byte process structures (usedGpuCcProtectedMemory added)."""
        major, minor = (int(x) for x in self.driver.split(".")[:2])
        return (535, 43) <= (major, minor) < (535, 98)

    def _driver_array(self, processes: list[tuple[int, int | None]], length: int) -> ctypes.Array:
        """The process array as this driver writes it into memory."""
        unavailable = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        layout = ProcessInfoWide if self._wide() else pynvml.c_nvmlProcessInfo_v2_t
        array = (layout * length)()
        for i, (pid, used) in enumerate(processes):
            array[i].pid, array[i].usedGpuMemory = pid, used if used is not None else unavailable
        return array

    def _misread(self, processes: list[tuple[int, int | None]]) -> list:
        """What pynvml returns on those drivers: the driver's bytes read as 24-byte structures."""
        length = len(processes) * 2 + 5
        written = self._driver_array(processes, length)
        read = (pynvml.c_nvmlProcessInfo_v2_t * length).from_buffer_copy(
            bytes(written)[: ctypes.sizeof(pynvml.c_nvmlProcessInfo_v2_t) * length]
        )
        return [pynvml.nvmlStructToFriendlyObject(read[i]) for i in range(len(processes))]

    def _nvmlGetFunctionPointer(self, name: str):
        """The C functions the agent calls itself (the *_v3 process lists with the driver's own structure): the same
        two-call protocol as the driver's (a count, then the array)."""
        if self.refcount == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        lists = {
            "nvmlDeviceGetComputeRunningProcesses_v3": lambda g: self._listed(g.processes),
            "nvmlDeviceGetMPSComputeRunningProcesses_v3": lambda g: self._listed(g.mps_processes),
        }
        if name not in lists:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        def call(handle: FakeGpu, count, array) -> int:
            try:
                processes = lists[name](self._check(handle))
            except pynvml.NVMLError as err:
                return err.value
            if not processes:
                count.contents.value = 0
                return pynvml.NVML_SUCCESS
            if array is None or count.contents.value < len(processes):
                count.contents.value = len(processes)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            ctypes.memmove(
                array, self._driver_array(processes, len(processes)), ctypes.sizeof(array[0]) * len(processes)
            )
            count.contents.value = len(processes)
            return pynvml.NVML_SUCCESS

        return call

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeGpu) -> list:
        g = self._check(handle)
        if g.no_mps_call:  # pynvml wraps it in throwOnVersionMismatch like the compute call: a driver without the
            # _v3 symbol (before 510.39.01, and 535.98) raises the plain NVMLLibraryMismatchError, not an NVMLError
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")
        listed = self._listed(g.mps_processes)
        return self._misread(listed) if self._wide() else self._process_infos(listed)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: FakeGpu) -> list:
        return self._process_infos(self._listed(self._check(handle).mps_processes))  # 24 bytes on every driver

    @staticmethod
    def _process_infos(processes: list[tuple[int, int | None]]) -> list:
        out = []
        for pid, used in processes:
            raw = pynvml.c_nvmlProcessInfo_v2_t(
                pid, used if used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            )
            obj = pynvml.nvmlStructToFriendlyObject(raw)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # as pynvml does (WDDM, or another container's process)
            out.append(obj)
        return out

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        g = self._check(handle)
        if g.uuid.startswith("MIG-"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if g.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        g = self._check(handle)
        if not g.mig or index >= len(g.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return g.mig[index]


def seed_gpu(vllm_pid: int = 4242) -> FakeGpu:
    """The worked example's GPU (an A10G, ~22 GiB): vLLM holding 15.18 GiB weights + 4.31 GiB KV + 0.78 GiB
    graphs + 0.5 GiB context."""
    vllm = int((15.18 + 4.31 + 0.78 + 0.5) * GiB)
    return FakeGpu(uuid="GPU-5eed0000-0000-0000-0000-000000000000", used=vllm, processes=[(vllm_pid, vllm)])


# What vLLM logged starting on the seed GPU (the worked example: v1-0.24-seed.prom's server)
SEED_LOG = """\
(APIServer pid=1) INFO 11-29 10:00:00 [api_utils.py:286] non-default args: {'max_model_len': 32768}
(EngineCore_DP0 pid=2) INFO 11-29 10:00:10 [gpu_model_runner.py:3000] Model loading took 15.18 GiB memory and 9.1 seconds
(EngineCore_DP0 pid=2) INFO 11-29 10:00:20 [gpu_model_runner.py:4000] Graph capturing finished in 7 secs, took 0.78 GiB
(EngineCore_DP0 pid=2) INFO 11-29 10:00:20 [gpu_worker.py:400] Available KV cache memory: 4.31 GiB
(EngineCore_DP0 pid=2) INFO 11-29 10:00:20 [kv_cache_utils.py:1147] GPU KV cache size: 208,625 tokens, Maximum concurrency for 32,768 tokens per request: 6.37x
"""  # noqa: E501


def real_library_loads() -> bool:
    """Whether NVIDIA's own libnvidia-ml loads on this machine (a GPU box). The tests of the machine without one
    (``library_not_found``) are skipped there, saying so: scripts/gpu-check and the device run cover that machine."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


#: for a test that reads the real pynvml on a machine without NVIDIA's library
WITHOUT_NVIDIA_LIBRARY = pytest.mark.skipif(
    real_library_loads(),
    reason="NVIDIA's libnvidia-ml loads here: this test is of a machine without it (scripts/gpu-check covers this one)",
)
