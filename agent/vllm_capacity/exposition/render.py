"""Render the agent's latest snapshot as Prometheus metrics with a prometheus-client custom collector.

The only module that builds metric families. It uses its own registry (never the global one), so the agent's
/metrics shows exactly the catalogue in :mod:`vllm_capacity.exposition.catalogue` plus the agent's own process metrics
(``vllm_capacity_process_*``).
"""

from __future__ import annotations

import asyncio
import functools
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from vllm_capacity import __version__
from vllm_capacity.derive.budget import COMPONENTS
from vllm_capacity.exposition.catalogue import BY_NAME, NAMESPACE, NOT_THROTTLING, SPECS, MetricSpec
from vllm_capacity.snapshot import Snapshot

ENGINE_SPECS = tuple(s for s in SPECS if s.engine_values or s.engine_rows)
GPU_SPECS = tuple(s for s in SPECS if s.gpu_value)
N = f"{NAMESPACE}_"
OPENMETRICS_EOF = b"# EOF\n"  # the end of an OpenMetrics document

Family = CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily


class Served(Protocol):
    """What exposition reads (the agent is one): the latest snapshot, and what the listener refused, by kind."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def http_errors(self) -> Mapping[str, int]: ...


class _Families(Collector):
    """Families keyed by catalogue name, created on first use, yielded in catalogue order, empty ones left out; a
    collector of them, for an encoder."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def add(self, name: str, labels: Iterable[str], value: float | dict[str, str] | None) -> None:
        if value is None:
            return  # unknown is absent, never 0
        spec: MetricSpec = BY_NAME[name]
        family = self._families.get(name)
        if family is None:
            family = _new_family(spec)
            self._families[name] = family
        labels = list(labels)
        if len(labels) != len(spec.labels):
            raise ValueError(f"{name}: {len(labels)} label values for labels {spec.labels}")
        if isinstance(family, InfoMetricFamily):
            if not isinstance(value, dict) or tuple(value) != spec.info_labels:
                raise ValueError(f"{name}: info labels {value!r} are not {spec.info_labels}")
            family.add_metric(labels, value)
        else:
            if isinstance(value, dict):
                raise ValueError(f"{name}: a {spec.kind} takes a number, not labels {value!r}")
            family.add_metric(labels, value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(sorted(self._families.values(), key=lambda f: _ORDER[_spec_name(f)]))

    def collect(self) -> Iterator[Metric]:
        return iter(self)


_ORDER = {name: i for i, name in enumerate(BY_NAME)}


def _spec_name(family: Metric) -> str:
    if family.type == "counter":
        return family.name + "_total"
    if family.type == "info":
        return family.name + "_info"
    return family.name


def _new_family(spec: MetricSpec) -> Family:
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.kind == "info":
        return InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


class _SnapshotCollector(Collector):
    """A collector over the latest snapshot (and the listener's refusals); collecting does no I/O. Each of the three
    yields its part of the catalogue, in catalogue order, so that together they give it whole."""

    def __init__(self, served: Served) -> None:
        self.served = served

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        self.add(f, self.served.snapshot)
        yield from f

    def add(self, f: _Families, snap: Snapshot) -> None:
        raise NotImplementedError


class EngineCollector(_SnapshotCollector):
    """Whether vLLM is read, and every per-engine series, as the catalogue says to read it from the engine's record."""

    def add(self, f: _Families, snap: Snapshot) -> None:
        f.add(N + "up", [], 1.0 if snap.up else 0.0)
        for e in snap.engines:
            key = [e.model_name, e.engine]
            for spec in ENGINE_SPECS:
                for label, read in spec.engine_values:
                    f.add(spec.name, key if label is None else [*key, label], read(e))
                if spec.engine_rows is not None:
                    for values, v in spec.engine_rows(e):
                        f.add(spec.name, [*key, *values], v)
            f.add(N + "vllm_info", key, _vllm_info(snap, e.cache_info))
        for (model_name, reason), total in sorted(snap.rejections.items()):
            f.add(N + "requests_rejected_total", [model_name, reason], total)


def _vllm_info(snap: Snapshot, cc: Mapping[str, str]) -> dict[str, str]:
    """vllm_info's labels: the one per-engine metric with facts of the whole server too."""
    return {
        "schema": snap.schema or "",
        "version": snap.version or "",
        "itl_metric": snap.itl_metric or "",
        "block_size": cc.get("block_size", ""),
        "cache_dtype": cc.get("cache_dtype", ""),
        "gpu_memory_utilization": cc.get("gpu_memory_utilization", ""),
        "enable_prefix_caching": cc.get("enable_prefix_caching", ""),
    }


#: what ``--gpu-device-series off`` keeps of the per-GPU readings: what dcgm-exporter has not (the memory budget,
#: vLLM's processes) and what the budget's alerts and panels read beside it
KEPT_DEVICE_SERIES = frozenset({N + "gpu_memory_total_bytes"})


class GpuCollector(_SnapshotCollector):
    """Each GPU NVML reads (the catalogue's per-GPU values), its clock reasons, processes and memory budget. Without
    ``device_series`` (beside dcgm-exporter) the device's own readings are left out but the memory total; its
    processes, the budget, gpu_up and gpu_info stay."""

    def __init__(self, served: Served, *, device_series: bool = True) -> None:
        super().__init__(served)
        self.device_series = device_series

    def add(self, f: _Families, snap: Snapshot) -> None:
        for index, uuid in snap.gpus_unreadable:
            f.add(N + "gpu_up", [index, uuid], 0.0)
        for g in snap.gpus:
            key = [g.index, g.uuid]
            f.add(N + "gpu_up", key, 1.0)
            for spec in GPU_SPECS:
                if self.device_series or spec.name in KEPT_DEVICE_SERIES:
                    f.add(spec.name, key, spec.gpu_value(g) if spec.gpu_value else None)
            for reason, active in (g.throttle_reasons or {}).items() if self.device_series else ():
                name = "gpu_clock_event" if reason in NOT_THROTTLING else "gpu_throttled"
                f.add(N + name, [*key, reason], 1.0 if active else 0.0)
            budget = snap.gpu_budgets.get(g.index)
            ours = set(budget.vllm_pids) if budget else set()
            for p in g.processes or ():
                owner = "vllm" if p.pid in ours else "other"
                f.add(N + "gpu_process_memory_bytes", [*key, str(p.pid), owner], p.used_bytes)
            if budget:
                for component in COMPONENTS:
                    f.add(N + "gpu_memory_bytes", [*key, component], budget.components.get(component))
                f.add(N + "gpu_memory_budget_bytes", key, budget.budget_bytes)
            f.add(N + "gpu_info", key, {"name": g.name, "mig_parent": g.mig_parent or ""})


class HealthCollector(_SnapshotCollector):
    """The agent's own health: its build, each source's state and failures, what the listener refused, when the
    snapshot was taken."""

    def add(self, f: _Families, snap: Snapshot) -> None:
        f.add(N + "build_info", [], {"version": __version__, "python_version": platform.python_version()})
        for source, status in sorted(snap.sources.items()):
            f.add(N + "source_up", [source], 1.0 if status.up else 0.0)
            f.add(N + "source_duration_seconds", [source], status.duration_seconds)
        for (source, reason), count in sorted(snap.errors.items()):
            f.add(N + "source_errors_total", [source, reason], float(count))
        for kind, count in sorted(self.served.http_errors.items()):
            f.add(N + "http_errors_total", [kind], float(count))
        f.add(N + "last_update_timestamp_seconds", [], snap.timestamp)


def build_registry(
    served: Served, *, process_metrics: bool = True, gpu_device_series: bool = True
) -> CollectorRegistry:
    """The agent's exposition in one registry: the snapshot's collectors in catalogue order, then its process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(served))
    registry.register(GpuCollector(served, device_series=gpu_device_series))
    registry.register(HealthCollector(served))
    if process_metrics:
        ProcessCollector(namespace=NAMESPACE, registry=registry)
    return registry


def process_registry() -> CollectorRegistry:
    """The agent's own process metrics alone (``vllm_capacity_process_*``): what :class:`RenderCache` encodes after
    a snapshot's series."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(namespace=NAMESPACE, registry=registry)
    return registry


def choose_format(accept: str | None) -> tuple[Callable[[Collector], bytes], str]:
    """The encoder for the client's Accept header: OpenMetrics when asked for, else the classic text format (also
    for an Accept header prometheus-client cannot read, such as an OpenMetrics version that is not a number)."""
    try:
        return choose_encoder(accept or "")
    except (TypeError, ValueError):
        return choose_encoder("")


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    encoder, content_type = choose_format(accept)
    return encoder(registry), content_type


#: A snapshot of up to this many engines is rendered on the event loop (one engine's render is ~0.2 ms, less than the
#: hand-off to the worker thread and back costs a sidecar woken from idle); a larger one in the worker thread.
INLINE_RENDER_ENGINES = 4
#: Formats a render cache keeps at once: the content type names the format's version and escaping, which a scraper
#: chooses (``version=1.0.1``, ``1.0.2``, ...), so what is kept per format is forgotten past a handful
MAX_FORMATS = 8


@dataclass(frozen=True)
class _Moment:
    """What a render shows (a :class:`Served` that stands still): one snapshot, and what the listener had refused when
    the render began, copied on the event loop (the listener counts on it while a large render runs in the worker
    thread)."""

    snapshot: Snapshot
    http_errors: Mapping[str, int]


class _Rest(Collector):
    """A render's series after the engines' part: the GPUs and the agent's health of the same moment, then the
    collectors of ``after`` (the agent's process)."""

    def __init__(self, moment: _Moment, after: CollectorRegistry | None, device_series: bool = True) -> None:
        self._moment, self._after, self._device_series = moment, after, device_series

    def collect(self) -> Iterator[Metric]:
        gpus = GpuCollector(self._moment, device_series=self._device_series)
        for collector in (gpus, HealthCollector(self._moment)):  # in catalogue order
            yield from collector.collect()
        if self._after is not None:
            yield from self._after.collect()


class RenderCache:
    """Each snapshot rendered once per exposition format, in a worker thread when it is large: N scrapers of one
    snapshot cost one render, and the event loop (``/healthz``, the vLLM reads) never waits on a long encoding. What is
    served is as fresh as the latest snapshot; the process metrics beside it too (one interval at most). A render
    shows one snapshot whole, whichever thread encodes it and whatever the loop swaps in meanwhile.

    The render is whole: every series of the snapshot encoded again, nothing kept of an earlier one."""

    def __init__(self, served: Served, after: CollectorRegistry | None, *, gpu_device_series: bool = True) -> None:
        """``gpu_device_series``: False leaves out the GPU readings dcgm-exporter exports (:class:`GpuCollector`)."""
        self._served, self._after, self._device_series = served, after, gpu_device_series
        self._engines = EngineCollector(served)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-capacity-render")
        self._cached: dict[str, tuple[Snapshot, asyncio.Future[bytes]]] = {}

    async def body(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_format(accept)
        snapshot = self._served.snapshot
        entry = self._cached.get(content_type)
        if entry is None or entry[0] is not snapshot:
            loop = asyncio.get_running_loop()
            moment = _Moment(snapshot, dict(self._served.http_errors))
            render = functools.partial(self._render, encoder, content_type, moment)
            if len(snapshot.engines) <= INLINE_RENDER_ENGINES:
                rendered: asyncio.Future[bytes] = loop.create_future()
                try:
                    rendered.set_result(render())
                except Exception as err:
                    rendered.set_exception(err)
            else:
                rendered = loop.run_in_executor(self._executor, render)
            _make_room(self._cached, content_type)
            entry = self._cached[content_type] = (snapshot, rendered)
        try:
            # shielded: a scraper that hangs up does not cancel the render the others wait for
            return await asyncio.shield(entry[1]), content_type
        except Exception:
            if self._cached.get(content_type) is entry:
                del self._cached[content_type]  # a failed render is not kept: the next scrape tries again
            raise

    def _render(self, encoder: Callable[[Collector], bytes], content_type: str, moment: _Moment) -> bytes:
        """The moment's snapshot, the engines' families then the rest. The parts' concatenation is the whole: the
        encoders write family after family, and OpenMetrics' one end marker is the rest's."""
        families = _Families()
        self._engines.add(families, moment.snapshot)
        rest = _Rest(moment, self._after, self._device_series)
        return encoder(families).removesuffix(OPENMETRICS_EOF) + encoder(rest)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _make_room(kept: dict[str, Any], key: str) -> None:
    """Forget every format kept when ``key`` would be one more than :data:`MAX_FORMATS`."""
    if key not in kept and len(kept) >= MAX_FORMATS:
        kept.clear()
