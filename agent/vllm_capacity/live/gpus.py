"""The NVML reader: the GPUs read each cycle, the backoff after a failure, the grace of NVML's slow first read,
which GPUs are the pod's, and each GPU's memory budget from vLLM's own figures (the budget's arithmetic:
:mod:`vllm_capacity.derive.budget`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import structlog

from vllm_capacity.derive import EngineCapacity
from vllm_capacity.derive.budget import GpuBudget, gpu_budget
from vllm_capacity.live.status import SourceBook, first_time, internal
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.gpu import GpuReading
from vllm_capacity.sources.nvml_scope import vllm_pids_in_namespace
from vllm_capacity.sources.vllm_log import RankFigures
from vllm_capacity.sources.vllm_metrics.records import VllmMetrics

_T = TypeVar("_T")

if TYPE_CHECKING:  # the reader is given one (cli.py); importing it here would load NVML's binding with --nvml off
    from vllm_capacity.sources.nvml import NvmlSource

SOURCE_NVML = "nvml"
NVML_MAX_BACKOFF = 300.0
# the first read of NVML (nvmlInit, and each GPU's first query) can take seconds a GPU where persistence mode is
# off: for this long after the first attempt, a first read that outlasts --timeout is "starting", not a failure
NVML_FIRST_READ_GRACE = 60.0


def alike(values: Iterable[float | None], within: float = 0.02) -> bool:
    """Whether the known values agree within ``within`` of the largest (true when fewer than two are known)."""
    known = [v for v in values if v is not None]
    return len(known) < 2 or max(known) - min(known) <= within * max(known)


def only(values: Iterable[_T | None]) -> _T | None:
    """The one value every item agrees on, else None."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


class GpuReader:
    """NVML through :class:`~vllm_capacity.sources.nvml.NvmlSource`, its state kept here: the last readings (none
    while NVML is unread: nothing stale), the GPUs of this pod once seen, and when to ask again after a failure."""

    def __init__(
        self,
        nvml: NvmlSource,
        sources: SourceBook,
        *,
        interval: float,
        required: bool = False,
        vllm_pids: Callable[[], set[int]] = vllm_pids_in_namespace,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml: NvmlSource | None = nvml
        self.sources, self.interval, self.required = sources, interval, required
        self.vllm_pids, self.monotonic = vllm_pids, monotonic
        self.logger = structlog.get_logger("vllm_capacity")
        sources.add(SOURCE_NVML)
        self.readings: tuple[GpuReading, ...] = ()
        self.unreadable: tuple[tuple[str, str], ...] = ()  # GPUs read before that NVML cannot read now
        self._vllm_pids: set[int] = set()
        self._vllm_gpus: set[str] = set()  # UUIDs of the GPUs vLLM's processes were seen on (see _pods_gpus)
        self._known_gpus: dict[str, str] = {}  # index -> UUID of every GPU read so far
        self._next_attempt = 0.0
        self._backoff = interval
        self._first_attempt: float | None = None  # when NVML was first asked
        self._answered = False  # whether NVML ever answered a read
        self._logged: set[object] = set()

    async def read(self) -> None:
        """Read the GPUs; after a failure wait (interval, doubling up to 5 min) before trying again."""
        if self.nvml is None or self.monotonic() < self._next_attempt:
            return
        t0 = self.monotonic()
        try:
            try:
                self.readings = tuple(await self.nvml.read())
            except SourceError:
                raise
            except Exception as unexpected:  # e.g. a binding that raises a plain Exception: named, not a crash
                raise internal(unexpected, "reading NVML") from None
        except SourceError as err:
            self.readings, self.unreadable = (), ()  # nothing stale: the GPU series go away while NVML is unread
            if self._starting(err, t0):
                return
            if err.reason in (Reason.LIBRARY_NOT_FOUND, Reason.DRIVER_NOT_LOADED) and not self.required:
                # --nvml auto on a machine without NVIDIA's library or driver: nothing failed, there is no GPU to
                # read. One line, no error series, and NVML is not asked again.
                self.logger.info("nvml_absent", reason=err.reason, error=str(err), hint="--nvml off silences this")
                self.nvml = None
                self.sources.remove(SOURCE_NVML)
                return
            self.sources.fail(SOURCE_NVML, err, self.monotonic() - t0)
            self._next_attempt = self.monotonic() + self._backoff
            self._backoff = min(NVML_MAX_BACKOFF, self._backoff * 2)
            return
        for skipped in self.nvml.skipped:  # a GPU that failed alone: counted and logged, the others served
            self.sources.errors[(SOURCE_NVML, skipped.reason)] += 1
            if first_time(self._logged, str(skipped)):
                self.logger.warning("gpu_skipped", source=SOURCE_NVML, reason=skipped.reason, error=str(skipped))
        # which processes are vLLM's: a walk of /proc, so off the event loop, and only when there are GPUs to use it
        self._vllm_pids = await asyncio.to_thread(self.vllm_pids) if self.readings else set()
        if self.nvml.narrow_to_vllm:
            self.readings = self._pods_gpus(self.readings)
        # a GPU of ours read before that NVML cannot read now (its MIG instances too): its own gpu_up 0
        self._known_gpus.update((g.index, g.uuid) for g in self.readings)
        self.unreadable = tuple(
            (index, uuid)
            for index, uuid in sorted(self._known_gpus.items())
            for i in self.nvml.skipped_indices
            if index == i or index.startswith(f"{i}/")
        )
        self._backoff = self.interval
        self._answered = True
        self.sources.ok(SOURCE_NVML, self.monotonic() - t0)

    def _starting(self, err: SourceError, t0: float) -> bool:
        """Whether ``err`` is NVML's first read still running (it outlasted --timeout, or a later cycle found it
        busy) within NVML_FIRST_READ_GRACE of the first attempt: then no failure is counted, the backoff does not
        grow, and the next cycle asks again (the driver's first answer can take seconds a GPU)."""
        if self._first_attempt is None:
            self._first_attempt = t0
        if self._answered or err.reason not in (Reason.TIMEOUT, Reason.HUNG):
            return False
        if self.monotonic() - self._first_attempt >= NVML_FIRST_READ_GRACE:
            return False
        if first_time(self._logged, "nvml_starting"):
            self.logger.info(
                "nvml_starting",
                source=SOURCE_NVML,
                hint=f"NVML's first read takes longer than --timeout; waiting up to {NVML_FIRST_READ_GRACE:g}s "
                "(persistence mode off? nvidia-smi -pm 1 makes it fast)",
            )
        return True

    def _pods_gpus(self, gpus: tuple[GpuReading, ...]) -> tuple[GpuReading, ...]:
        """With nothing naming the pod's GPUs (NVIDIA_VISIBLE_DEVICES=all in the sidecar, or unset) NVML shows every
        GPU of the node: keep those running vLLM's processes. A pod's GPUs do not change while it lives, so once
        seen they are kept while vLLM is away (restarting, asleep); with no evidence yet, every GPU is shown and one
        warning says why."""
        running = {g.uuid for g in gpus if any(p.pid in self._vllm_pids for p in g.processes or ())}
        if running and running != self._vllm_gpus:
            self._vllm_gpus = running
            self.logger.info("gpus_of_vllm", gpus=sorted(running), of=len(gpus), how="vLLM's processes on them")
        if self._vllm_gpus:
            # and the physical GPU of a MIG instance kept (its reading holds the board's power and clocks)
            parents = {g.mig_parent for g in gpus if g.uuid in self._vllm_gpus}
            return tuple(g for g in gpus if g.uuid in self._vllm_gpus or g.uuid in parents)
        if len(gpus) > 1 and first_time(self._logged, "gpus_unattributed"):
            self.logger.warning(
                "gpus_unattributed",
                gpus=len(gpus),
                hint="every GPU this container sees is reported: none runs a vLLM process this sidecar can see; "
                "set --gpus (vLLM's GPU UUIDs), or share the pod's process namespace (shareProcessNamespace: true)",
            )
        return gpus

    def budgets(
        self, engines: tuple[EngineCapacity, ...], metrics: VllmMetrics | None, ranks: Mapping[int, RankFigures]
    ) -> dict[str, GpuBudget]:
        """Per-GPU budgets (of GPUs that report their memory). vLLM's per-rank figures (``ranks``: its log's, by
        worker PID) apply when every engine reports the same ones."""
        gpus = [g for g in self.readings if g.memory_total_bytes is not None and g.memory_free_bytes is not None]
        if not gpus:
            return {}
        if metrics is None:  # vLLM is down: no memory on the GPUs is vLLM's now
            down = {g.index: gpu_budget(g, vllm_up=False) for g in gpus}
            self._count_doubts(gpus, down)
            return down
        weights, pool, utilization = _engine_figures(engines, metrics, ranks)
        budgets = {}
        for g in gpus:
            mine = next((ranks[p.pid] for p in g.processes or () if p.pid in ranks), None)
            budgets[g.index] = gpu_budget(
                g,
                vllm_pids=self._vllm_pids,
                weights_bytes=mine.weights_bytes if mine is not None and mine.weights_bytes is not None else weights,
                kv_cache_bytes=pool,
                gpu_memory_utilization=utilization,
            )
        self._count_doubts(gpus, budgets)
        return budgets

    def _count_doubts(self, gpus: list[GpuReading], budgets: dict[str, GpuBudget]) -> None:
        """A GPU whose memory is in use while NVML lists no process, or whose processes hold more than its used
        memory: counted, and said once per GPU."""
        for g in gpus:
            over = budgets[g.index].overcommitted_bytes
            if over is not None:
                self._gpu_doubt(
                    g,
                    Reason.MEMORY_INCONSISTENT,
                    "gpu_memory_inconsistent",
                    "NVML's process list holds more memory than the GPU uses: the system share is left out",
                    processes_over_used_bytes=over,
                )
            if budgets[g.index].partly_hidden_bytes is not None:
                self._gpu_doubt(
                    g,
                    Reason.PROCESSES_PARTLY_HIDDEN,
                    "gpu_processes_partly_hidden",
                    "more memory is in use than the processes NVML lists and the driver's reservation: another "
                    "process (another pod's, on a GPU shared by time-slicing or MPS) is not listed to this sidecar, "
                    "so other_processes and system are left out",
                    unlisted_bytes=budgets[g.index].partly_hidden_bytes or 0.0,
                )
            if budgets[g.index].identified_by == "hidden":
                self._gpu_doubt(
                    g,
                    Reason.PROCESSES_HIDDEN,
                    "gpu_processes_hidden",
                    "memory is in use but NVML lists no process: they are in a PID namespace this sidecar cannot "
                    "see; share the pod's (shareProcessNamespace: true) for vLLM's and other processes' shares",
                )

    def _gpu_doubt(self, g: GpuReading, reason: Reason, event: str, hint: str, **extra: float) -> None:
        """A reading the budget cannot take at its word: counted under ``reason``, one warning per GPU."""
        self.sources.errors[(SOURCE_NVML, reason)] += 1
        if first_time(self._logged, (reason, g.uuid)):
            self.logger.warning(event, source=SOURCE_NVML, gpu=g.index, uuid=g.uuid, hint=hint, **extra)


def _engine_figures(
    engines: tuple[EngineCapacity, ...], metrics: VllmMetrics, ranks: Mapping[int, RankFigures]
) -> tuple[float | None, float | None, float | None]:
    """The weights, the KV pool and the resolved gpu_memory_utilization every engine agrees on (None where they
    differ). Under pipeline parallelism the stages hold different layers: their weights and KV differ, and one
    rank's figure would be wrong on the others' GPUs; a GPU then takes its own rank's weights (the worker PID of its
    log lines running on it), the engine's figures only where every rank loaded the same weights (tensor
    parallelism: vLLM then sizes every rank's KV cache to the smallest, the engine's figure)."""
    weights = only(e.weights_bytes for e in engines)
    pool = only(e.kv_pool_bytes for e in engines)
    resolved = only(e.cache_config.resolved_gpu_memory_utilization for e in metrics.engines if e.cache_config)
    if not alike(r.weights_bytes for r in ranks.values()):
        weights = pool = None
    return weights, pool, resolved[0] if resolved else None
