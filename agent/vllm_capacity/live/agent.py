"""The agent: reads its sources on an interval and keeps the latest derived snapshot for exposition.

Isolation: every source is read under its own deadline and its own ``try``; a failed source sets its
``source_up`` to 0, counts the failure by reason, logs the cause once (and once more when it recovers), and never
stops the loop or the other sources. When vLLM's /metrics cannot be read, the snapshot loses every derived series
at once (``vllm_capacity_up`` 0): nothing stale is served as current.

Over 300 lines for a reason: one cycle's bookkeeping (source status, backoff, restart detection, counters carried
across restarts, what is logged when) reads as one story, and each piece is a short method of the one class.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog

from vllm_capacity import derive
from vllm_capacity.derive import EngineCapacity, ServedModel, ServerFlags
from vllm_capacity.derive.latency_curve import DEFAULT_HALF_LIFE, Objective
from vllm_capacity.live.counters import SOURCE_MODELS, Counters, ModelsReader
from vllm_capacity.live.derived import Derived
from vllm_capacity.live.gpus import GpuReader
from vllm_capacity.live.latency import LatencyLearner
from vllm_capacity.live.startup import StartupLogReader
from vllm_capacity.live.status import SourceBook, first_time, internal
from vllm_capacity.live.sustained import SustainedLearner
from vllm_capacity.snapshot import Snapshot
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.nvml_scope import vllm_pids_in_namespace
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_log import LogFollower, StartupFigures
from vllm_capacity.sources.vllm_metrics.records import VllmMetrics

if TYPE_CHECKING:  # given by cli.py with --nvml auto or on; never imported with --nvml off (NVML's binding)
    from vllm_capacity.sources.nvml import NvmlSource

SOURCE_VLLM = "vllm"
SOURCE_AGENT = "agent"  # the agent itself: the source label of a crashed cycle's internal error
T = TypeVar("T")


async def _beside(main: Awaitable[T], side: list[Coroutine[Any, Any, None]]) -> T:
    """``main``'s result, with the ``side`` reads running beside it; ``main`` alone when there are none (a sidecar
    that reads only vLLM: a task per source costs each 100 ms read a few more turns of the event loop)."""
    if not side:
        return await main
    *_, result = await asyncio.gather(*side, main)
    return cast(T, result)


def _first(items: list[Any], n: int = 8) -> list[Any]:
    """A list for a log line: its first ``n`` items, and how many more there are (a line stays short: log pipelines
    cut lines at 16 KB, and 5,000 engines once made one of 250 KB)."""
    return items if len(items) <= n else [*items[:n], f"... {len(items) - n} more"]


@dataclass(frozen=True)
class AgentSettings:
    """What the operator set for the agent (``serve``'s and ``report``'s flags), as one record."""

    interval: float  # --interval: seconds between reads of vLLM
    models_refresh: float = 300.0  # --models-refresh: seconds between reads of /v1/models and /version
    model: ServedModel = field(default_factory=ServedModel)  # --model-config / --model-dir, --tp, --pp
    flags: ServerFlags = field(default_factory=ServerFlags)  # --max-model-len, --max-num-seqs, ...; else the log's
    nvml_required: bool = False  # --nvml on: NVML's absence is a failure, not "no GPU here"
    objectives: tuple[Objective, ...] = ()  # --slo-itl, --slo-ttft
    latency_half_life: float = DEFAULT_HALF_LIFE  # --latency-half-life


class Agent:
    def __init__(
        self,
        client: VllmClient,
        settings: AgentSettings,
        *,
        vllm_log: LogFollower | None = None,
        nvml: NvmlSource | None = None,
        vllm_pids: Callable[[], set[int]] = vllm_pids_in_namespace,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``vllm_log``, ``nvml``: the optional sources (--vllm-log, --nvml); ``vllm_pids``, ``clock``,
        ``monotonic``: where the agent reads vLLM's processes and the time (a test gives its own)."""
        interval = settings.interval
        self.settings = settings
        self.client = client
        self.interval = interval
        self.clock, self.monotonic = clock, monotonic
        self.logger = structlog.get_logger("vllm_capacity")
        # the agent itself is a source too: source_up{source="agent"} is 0 while its last cycle crashed
        self.sources = SourceBook((SOURCE_VLLM, SOURCE_MODELS, SOURCE_AGENT), monotonic)
        # vLLM's start-up log, when given (--vllm-log): its memory figures; else none of them
        self.startup_log = (
            StartupLogReader(vllm_log, self.sources, monotonic, deadline=client.timeout)
            if vllm_log is not None
            else None
        )
        self.figures = self.startup_log.figures if self.startup_log is not None else StartupFigures()
        self.derived = Derived(self.logger)  # the engines, derived whole every read; warnings logged once
        # the GPUs through NVML, when asked (--nvml auto or on)
        self.gpus = (
            GpuReader(nvml, self.sources, interval=interval, required=settings.nvml_required, vllm_pids=vllm_pids,
                      monotonic=monotonic)
            if nvml is not None
            else None
        )  # fmt: skip
        self.errors = self.sources.errors
        #: what the sidecar's own listener refused or failed, by kind (fed by the server: listener.py, log.py)
        self.http_errors: Counter[str] = Counter()
        # latched once the first cycle has finished, whatever it found: the sidecar then serves a true view (vLLM
        # down is vllm_capacity_up 0). Readiness never follows vLLM: a native sidecar's readiness is the pod's.
        self.ready = False
        self.models = ModelsReader(client, self.sources, settings.models_refresh, monotonic)  # /v1/models and /version
        self.counters = Counters(monotonic)  # restarts, and the counters carried over them
        self._announced: tuple[object, ...] | None = None
        self._shapes_announced: set[tuple[object, ...]] = set()
        self._crashes_logged: set[str] = set()
        self.latency = LatencyLearner(settings.objectives, settings.latency_half_life, monotonic)  # latency curve
        self.sustained = SustainedLearner(settings.latency_half_life, monotonic)  # the concurrency vLLM holds
        self.snapshot = self._snapshot()  # before the first cycle: nothing read, the sources down

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _snapshot(self, **fields: Any) -> Snapshot:
        """A snapshot of ``fields`` with the sources' states and the failures counted as they stand now."""
        return Snapshot(**fields, sources=self.sources.states(), errors=dict(self.errors))

    # -- one cycle ---------------------------------------------------------------------------------------------
    async def _read_log(self) -> None:
        if self.startup_log is not None:
            await self.startup_log.read()

    async def _read_gpus(self) -> None:
        if self.gpus is not None:
            await self.gpus.read()
            if self.gpus.nvml is None:  # --nvml auto without NVIDIA's library or driver: never asked again
                self.gpus = None

    def _gpu_fields(self, engines: tuple[EngineCapacity, ...], metrics: VllmMetrics | None) -> dict[str, Any]:
        """The snapshot's GPU fields: the readings, their budgets (with vLLM's figures while it is up), the lost."""
        if self.gpus is None:
            return {}
        return {
            "gpus": self.gpus.readings,
            "gpu_budgets": self.gpus.budgets(engines, metrics, self.figures.ranks),
            "gpus_unreadable": self.gpus.unreadable,
        }

    async def _fetch_metrics(self, latency: bool) -> tuple[VllmMetrics | SourceError, float]:
        t0 = self.monotonic()
        try:
            return await self.client.fetch_metrics(latency=latency), self.monotonic() - t0
        except SourceError as err:
            return err, self.monotonic() - t0
        except Exception as err:  # a parse no rule covers: named and counted, never a crashed cycle
            return internal(err, "reading vLLM's /metrics"), self.monotonic() - t0

    async def cycle(self) -> Snapshot:
        self.sources.ok(SOURCE_AGENT, 0.0)  # until this cycle crashes (_crashed)
        # the sources are read side by side: a slow or hung one never delays the others
        read_latency = self.latency.due()
        side = [self._read_log()] if self.startup_log is not None else []
        side += [self._read_gpus()] if self.gpus is not None else []
        metrics, took = await _beside(self._fetch_metrics(read_latency), side)
        if isinstance(metrics, SourceError):
            return self._vllm_failed(metrics, took, read_latency)
        self.sources.ok(SOURCE_VLLM, took)
        self.sources.implausible(SOURCE_VLLM, metrics.implausible)
        self.sources.over_limit(SOURCE_VLLM, metrics.over_limit)

        glitches = self.counters.glitches
        verdict = self.counters.judge(metrics)
        restarted, held = verdict == "restart", verdict == "unconfirmed"
        if restarted:
            self.logger.info("vllm_restarted", reason="new process start time, or a counter went down")
        # /v1/models is read again on the first sign of a restart: a new process may serve another max_model_len
        await self.models.read(restarted or held, first=self.counters.last is None)
        refused: tuple[str, ...] = ()  # what this read could not have, left out of what is carried and learned
        if held:  # a restart or a glitch: the next read tells; till then nothing is carried or learned from it
            carried, rejections = self.counters.held()
            if read_latency:
                self.latency.missed()
        else:
            carried = self.counters.carry(metrics, restarted)
            rejections = self.counters.carry_rejections(metrics, restarted)
            refused = (*self.counters.refused, *self.latency.learn(metrics, read_latency))
            if restarted:
                self.sustained.forget()
            refused = (*refused, *self.sustained.learn(metrics, self.counters.preempted))
        if self.counters.glitches > glitches:
            refused = ("process start or counters: a restart the next read did not confirm", *refused)
        self.sources.implausible(SOURCE_VLLM, refused)
        history = derive.EngineHistory(
            carried,
            self.latency.views,
            self.counters.preempted,
            self.sustained.views,
            shed_reported=frozenset(model for model, _ in rejections),
            shedding=self.counters.shedding,
        )
        engines = self.derived.engines(metrics, self._facts(), history)
        if not held and not self.counters.refused:  # the base restarts are told by: reads whose counters can be right
            self.counters.last = metrics
        self.snapshot = self._snapshot(
            up=True,
            timestamp=self.clock(),
            schema=metrics.schema,
            version=self.models.version,
            itl_metric=metrics.itl_metric,
            engines=engines,
            rejections=rejections,
            **self._gpu_fields(engines, metrics),
        )
        self.ready = True
        self._announce(metrics, engines)
        return self.snapshot

    def _vllm_failed(self, err: SourceError, took: float, read_latency: bool) -> Snapshot:
        """vLLM is gone (or not vLLM): no derived series, /v1/models re-read when it is back; NVML's GPUs stay."""
        self.sources.fail(SOURCE_VLLM, err, took)
        if read_latency:
            self.latency.missed()
        self.snapshot = self._snapshot(up=False, timestamp=self.snapshot.timestamp, **self._gpu_fields((), None))
        self.models.forget()
        self.ready = True
        return self.snapshot

    def _facts(self) -> derive.ServerFacts:
        """What the derivations know of the server beside its /metrics: /v1/models, the flags, its start-up log, as
        they are at this read."""
        return derive.ServerFacts(
            max_model_len=self.models.max_model_len,
            startup=self.startup_log.engines if self.startup_log is not None else {},
            model=self.settings.model,
            version=self.models.version,
            flags=self.settings.flags.over(
                ServerFlags(
                    max_num_seqs=self.figures.max_num_seqs, max_num_batched_tokens=self.figures.max_num_batched_tokens
                )
            ),
            speculation=self.figures.speculation,
        )

    def _announce(self, metrics: VllmMetrics, engines: tuple[EngineCapacity, ...]) -> None:
        """Log what was found when it is new: schema, engines, capacity, and what cannot be derived. A server whose
        answers flip between two shapes (a schema that comes and goes) is announced once in each, not every read."""
        summary = (metrics.schema, tuple((e.model_name, e.engine, e.capacity_tokens, e.max_model_len) for e in engines))
        if summary == self._announced:
            return
        self._announced = summary
        if not first_time(self._shapes_announced, summary):
            return
        self.logger.info(
            "vllm_discovered",
            schema=metrics.schema,
            version=self.models.version,
            engine_count=len(engines),
            engines=_first([f"{e.model_name}/{e.engine}" for e in engines]),
            capacity_tokens=_first([e.capacity_tokens for e in engines]),
            max_model_len=_first([e.max_model_len for e in engines]),
        )
        if not engines:
            self.logger.warning("capacity_unknown", why="no per-engine vllm: gauge (num_requests_running, ...) found")
        for event, missing, why in (
            (
                "capacity_unknown",
                [f"{e.model_name}/{e.engine}" for e in engines if e.capacity_tokens is None],
                "vllm:cache_config_info has neither kv_cache_size_tokens nor num_gpu_blocks and block_size "
                "(vLLM 0.8.x reports num_gpu_blocks=None)",
            ),
            (
                "max_model_len_unknown",
                [f"{e.model_name}/{e.engine}" for e in engines if e.max_model_len is None],
                "/v1/models gave none; set --max-model-len",
            ),
        ):
            if missing:
                self.logger.warning(event, engine_count=len(missing), engines=_first(missing), why=why)

    def _crashed(self, err: Exception) -> None:
        """A cycle raised: counted as source_errors_total{source="agent",reason="internal"}, logged with its
        traceback once per distinct cause, and the snapshot keeps what was read (vLLM's state, the GPUs) without
        the derived series it could not compute."""
        self.sources.fail(SOURCE_AGENT, internal(err, "a cycle crashed"), 0.0)  # source_up{source="agent"} 0
        cause = f"{type(err).__name__}: {err}"
        if first_time(self._crashes_logged, cause):
            self.logger.error("cycle_crashed", cause=cause, exc_info=err)  # its traceback, once per cause
        self.snapshot = self._snapshot(
            up=self.sources[SOURCE_VLLM].up,
            timestamp=self.snapshot.timestamp,
            gpus=self.gpus.readings if self.gpus else (),
        )
        self.ready = True

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle every ``interval`` until ``stop`` is set. A cycle that overruns starts the next one at once; a cycle
        in flight when ``stop`` is set is cancelled, so that the sidecar stops at once whatever ``--timeout`` is."""
        reading, stopping = asyncio.ensure_future(self._read_until(stop)), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done():
                reading.result()  # what ended the reads, stop aside: not an Exception (those are counted)
        finally:
            stopping.cancel()
            if not reading.done():  # stopping: abandon the reads in flight
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading

    async def _read_until(self, stop: asyncio.Event) -> None:
        """The reads, in one task: a read pays for no task, wait or waiter of its own, only its timer."""
        while not stop.is_set():
            started = self.monotonic()
            try:
                await self.cycle()
            except Exception as err:  # a bug must not kill the sidecar: count it, log it once, keep serving
                self._crashed(err)
            await asyncio.sleep(max(0.0, self.interval - (self.monotonic() - started)))
