"""What carries across vLLM's restarts: telling that it restarted, its counters carried so that they never go down,
and /v1/models and /version, read again on every restart and now and then."""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_capacity import derive
from vllm_capacity.live.status import SourceBook, internal
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.vllm import ModelsInfo, VllmClient
from vllm_capacity.sources.vllm_metrics.records import EngineKey, VllmMetrics

SOURCE_MODELS = "vllm_models"


class Counters:
    """The last good read of vLLM's metrics, to tell a restart by, and its preemption counter carried over them."""

    def __init__(self) -> None:
        self.last: VllmMetrics | None = None  # the last good read (None: vLLM was never read)
        self.preempted: frozenset[EngineKey] = frozenset()  # engines that preempted requests since the last read
        self._raw: dict[EngineKey, float] = {}
        self._total: dict[EngineKey, float] = {}
        self.shedding: frozenset[str] = frozenset()  # models whose queue caps rejected requests since the last read
        self._rejected_raw: dict[tuple[str, str], float] = {}
        self._rejected: dict[tuple[str, str], float] = {}

    def restarted(self, metrics: VllmMetrics) -> bool:
        """vLLM restarted since the last good read: a new process start time, or a counter went down. Not a missing
        or re-formatted info family: cache_config_info coming and going (or '0.92' becoming '0.920') is no restart,
        and counting it as one added vLLM's whole counter again each time."""
        prev = self.last
        if prev is None:
            return False
        if (
            metrics.process_start_time_seconds is not None
            and prev.process_start_time_seconds is not None
            and metrics.process_start_time_seconds != prev.process_start_time_seconds
        ):
            return True
        before = {(e.model_name, e.engine): e for e in prev.engines}
        for e in metrics.engines:
            old = before.get((e.model_name, e.engine))
            if old is None:
                continue
            for now, then in (
                (e.generation_tokens_total, old.generation_tokens_total),
                (e.preemptions_total, old.preemptions_total),
            ):
                if now is not None and then is not None and now < then:
                    return True
        return False

    def carry(self, metrics: VllmMetrics, restarted: bool) -> dict[EngineKey, float]:
        """Carry vLLM's preemption counters across its restarts; returns the totals to export this cycle: those of
        the engines that reported a (plausible) value. An engine that reported none this time keeps its total for
        the next; an engine that went away takes its series with it."""
        present, exported = {(e.model_name, e.engine) for e in metrics.engines}, {}
        preempted: set[EngineKey] = set()
        for e in metrics.engines:
            key = (e.model_name, e.engine)
            if e.preemptions_total is None:
                continue
            before = self._total.get(key)
            self._total[key] = derive.accumulate_counter(before, self._raw.get(key), e.preemptions_total, restarted)
            if before is not None and self._total[key] > before:
                preempted.add(key)
            self._raw[key] = e.preemptions_total
            exported[key] = self._total[key]
        for key in set(self._total) - present:
            del self._total[key]
            self._raw.pop(key, None)
        self.preempted = frozenset(preempted)
        return exported

    def carry_rejections(self, metrics: VllmMetrics, restarted: bool) -> dict[tuple[str, str], float]:
        """vLLM's admission rejections by (model_name, reason), carried across its restarts as the preemptions are;
        ``shedding`` names the models whose total rose since the last read. A model or reason no longer reported
        takes its series with it."""
        shedding: set[str] = set()
        totals: dict[tuple[str, str], float] = {}
        for key, raw in metrics.admission_rejections.items():
            before = self._rejected.get(key)
            totals[key] = derive.accumulate_counter(before, self._rejected_raw.get(key), raw, restarted)
            if before is not None and totals[key] > before:
                shedding.add(key[0])
        self._rejected, self._rejected_raw = totals, dict(metrics.admission_rejections)
        self.shedding = frozenset(shedding)
        return dict(totals)


class ModelsReader:
    """/v1/models (max_model_len) and /version (whose sizing rules apply): read on vLLM's first answer and every
    restart, then every ``refresh`` seconds; a failure is retried within 30 s."""

    def __init__(
        self,
        client: VllmClient,
        sources: SourceBook,
        refresh: float = 300.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.sources, self.refresh, self.monotonic = client, sources, refresh, monotonic
        self.models: ModelsInfo | None = None
        self.version: str | None = None
        self._fetched_at = -float("inf")

    def forget(self) -> None:
        """vLLM is gone: read both again as soon as it is back."""
        self._fetched_at = -float("inf")

    async def read(self, restarted: bool, first: bool) -> None:
        """Read both when vLLM just restarted or answered for the first time, or when they are due."""
        if restarted:
            self.models = None
        if not (restarted or first or self.monotonic() - self._fetched_at >= self.refresh):
            return
        t0 = self.monotonic()
        try:
            models = await self.client.fetch_models()
            version = await self.client.fetch_version()
        except Exception as err:  # what no rule covers is this source's failure too, never a crashed cycle
            failure = err if isinstance(err, SourceError) else internal(err, "reading vLLM's /v1/models")
            self.sources.fail(SOURCE_MODELS, failure, self.monotonic() - t0)
            self._fetched_at = self.monotonic() - self.refresh + min(30.0, self.refresh)
            return
        self.version = version
        self.sources.ok(SOURCE_MODELS, self.monotonic() - t0)
        self.models, self._fetched_at = models, self.monotonic()

    @property
    def max_model_len(self) -> dict[str, int]:
        return dict(self.models.max_model_len) if self.models else {}
