"""The per-GPU memory budget: what the GPU's memory holds, from NVML's readings and vLLM's own figures.

Pure. Components (bytes, per GPU), which add up to the GPU's total when all are known:

``weights`` and ``kv_cache``
    vLLM's per-rank figures (startup log; the KV pool also from a fixed ``kv_cache_memory_bytes``).
``vllm_runtime``
    vLLM's processes' memory on this GPU - weights - KV cache: CUDA graphs, activations, the CUDA context.
``other_processes``
    Other processes' memory on this GPU: inside vLLM's budget they are an OOM risk.
``system``
    total - free - every process: the driver's reservation and memory no process accounts for.
``free``
    NVML's free memory.

A component that cannot be known is absent (never 0, never folded into another). vLLM's processes are those
whose PID the agent can see running vLLM (shared process namespace); when it sees none of the GPU's processes'
PIDs (another PID namespace) the largest process is taken as vLLM's, the others as other processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_capacity.sources.gpu import GpuProcess, GpuReading

COMPONENTS = ("weights", "kv_cache", "vllm_runtime", "other_processes", "system", "free")


@dataclass(frozen=True)
class GpuBudget:
    components: dict[str, float]
    budget_bytes: float | None  # total x gpu_memory_utilization
    vllm_pids: tuple[int, ...]
    # "pid", "elimination", "none", "hidden" (NVML lists none of the processes using it), or "unattributed" (it lists
    # some, in the reader's PID namespace, none of them vLLM's that the sidecar knows)
    identified_by: str
    # the processes NVML lists hold more than the GPU's used memory by this much (bytes): the readings disagree (a
    # process list read with the wrong structure, or memory info v1's "used" on a driver that reserves memory), so
    # "system" is absent; None when they agree
    overcommitted_bytes: float | None = None
    # memory in use beyond the driver's reservation and every listed process, by this much (bytes): a process NVML
    # does not list to this reader (another pod's, on a GPU shared by time-slicing or MPS), so "other_processes" and
    # "system" are absent rather than a confident 0 and everything else; None when the listed processes explain it
    partly_hidden_bytes: float | None = None


# NVML lists no process while more than this is in use beyond the driver's reservation: the processes are hidden from
# this reader (drivers from 535.113.01 list only the PIDs the reader's PID namespace can see), not absent
HIDDEN_MIN_BYTES = 2**30


def split_processes(
    processes: tuple[GpuProcess, ...], vllm_pids: set[int], *, host_pids: bool | None = None
) -> tuple[list[GpuProcess], list[GpuProcess], str]:
    """(vLLM's, others', how): by PID when any is known, else the largest process is vLLM's by elimination, but only
    where the driver lists every process by host PID (or is not known to filter). A driver that lists only the
    reader's namespace (535.113.01 and later) with no PID of vLLM's among them says nothing of whose they are:
    "unattributed", and the budget then gives neither vLLM's share nor other processes'."""
    if not processes:
        return [], [], "none"
    if vllm_pids and any(p.pid in vllm_pids for p in processes):
        return [p for p in processes if p.pid in vllm_pids], [p for p in processes if p.pid not in vllm_pids], "pid"
    if host_pids is False:
        return [], [], "unattributed"
    largest = max(processes, key=lambda p: p.used_bytes or 0)
    return [largest], [p for p in processes if p is not largest], "elimination"


def _total(processes: list[GpuProcess]) -> float | None:
    if any(p.used_bytes is None for p in processes):
        return None  # NVML could not say (e.g. Windows WDDM, or no permission to see other containers)
    return float(sum(p.used_bytes or 0 for p in processes))


def gpu_budget(
    gpu: GpuReading,
    *,
    vllm_up: bool = True,
    vllm_pids: set[int] | None = None,
    weights_bytes: float | None = None,
    kv_cache_bytes: float | None = None,
    gpu_memory_utilization: float | None = None,
) -> GpuBudget:
    """The budget of one GPU (one that reports its memory). With ``vllm_up`` False every process on it counts as
    another process."""
    total, free = gpu.memory_total_bytes, gpu.memory_free_bytes
    if total is None or free is None:
        raise ValueError(f"GPU {gpu.index} reports no memory: it has no budget")
    comps: dict[str, float] = {"free": float(free)}
    budget = total * gpu_memory_utilization if gpu_memory_utilization else None
    if gpu.processes is None:
        return GpuBudget(comps, budget, (), "none")
    if not gpu.processes and total - free - (gpu.memory_reserved_bytes or 0) > HIDDEN_MIN_BYTES:
        # whose the memory is cannot be told: vLLM's, other processes' and the system's shares are unknown (absent),
        # never a confident 0 for other processes with everything under "system"
        return GpuBudget(comps, budget, (), "hidden")
    if vllm_up:
        ours, others, how = split_processes(gpu.processes, vllm_pids or set(), host_pids=gpu.host_pids)
    else:
        ours, others, how = [], list(gpu.processes), "none"
    if how == "unattributed":  # processes listed, none known to be vLLM's, and no elimination to say which is
        return GpuBudget(comps, budget, (), how)
    vllm_mem, other_mem = _total(ours), _total(others)
    shares = _vllm_shares(vllm_mem, weights_bytes, kv_cache_bytes) if ours and vllm_mem is not None else {}
    hidden = _unlisted(gpu, vllm_mem, other_mem)
    if hidden is not None:  # someone's memory no listed process holds: whose cannot be told
        return GpuBudget(comps | shares, budget, tuple(p.pid for p in ours), how, partly_hidden_bytes=hidden)
    rest, overcommitted = _beside_vllm(total - free, vllm_mem, other_mem)
    return GpuBudget(comps | rest | shares, budget, tuple(p.pid for p in ours), how, overcommitted)


def _beside_vllm(used: float, vllm_mem: float | None, other_mem: float | None) -> tuple[dict[str, float], float | None]:
    """What other processes hold, and the system's share (in use, less vLLM's and theirs); when the processes hold
    more than is in use (NVML's figures from two moments), no system share but how much over."""
    rest = {} if other_mem is None else {"other_processes": other_mem}
    if vllm_mem is None or other_mem is None:
        return rest, None
    system = used - vllm_mem - other_mem
    if system < 0:
        return rest, float(-system)
    return {**rest, "system": float(system)}, None


def _unlisted(gpu: GpuReading, vllm_mem: float | None, other_mem: float | None) -> float | None:
    """Memory in use that neither the driver's reservation (memory info v2) nor a listed process explains, when it
    is over HIDDEN_MIN_BYTES; None otherwise, and without v2's reservation or every process's figure."""
    if gpu.memory_reserved_bytes is None or vllm_mem is None or other_mem is None or gpu.memory_free_bytes is None:
        return None
    total = gpu.memory_total_bytes or 0
    unlisted = total - gpu.memory_free_bytes - gpu.memory_reserved_bytes - vllm_mem - other_mem
    return float(unlisted) if unlisted > HIDDEN_MIN_BYTES else None


def _vllm_shares(vllm_mem: float, weights_bytes: float | None, kv_cache_bytes: float | None) -> dict[str, float]:
    """vLLM's memory on the GPU by what holds it: the weights and the KV cache from its own figures, the rest its
    runtime (CUDA graphs, context, activations). Figures that leave a negative runtime describe another rank or
    start: none of the three then, rather than a wrong one."""
    shares = {k: v for k, v in (("weights", weights_bytes), ("kv_cache", kv_cache_bytes)) if v is not None}
    if weights_bytes is not None and kv_cache_bytes is not None:
        runtime = vllm_mem - weights_bytes - kv_cache_bytes
        if runtime < 0:
            return {}
        shares["vllm_runtime"] = runtime
    return shares
