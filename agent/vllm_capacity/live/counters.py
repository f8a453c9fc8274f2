"""What carries across vLLM's restarts: telling that it restarted, its counters carried so that they never go down,
and /v1/models and /version, read again on every restart and now and then."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from vllm_capacity import derive
from vllm_capacity.live.status import SourceBook, internal
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.vllm import ModelsInfo, VllmClient
from vllm_capacity.sources.vllm_metrics.records import EngineKey, VllmMetrics

SOURCE_MODELS = "vllm_models"
Verdict = Literal["same", "restart", "unconfirmed"]


class Counters:
    """The last good read of vLLM's metrics, to tell a restart by, and its preemption counter carried over them.

    A restart is carried exactly, a glitch not at all: a read that looks like a restart (a new process start time, a
    counter gone down) is held, unconfirmed, until the next read says the same (the new start time stays, the
    counters go on from where it left them); a read that goes back to the old process was a glitch, left out whole
    (one bad process_start_time_seconds added 20 preemptions, a dip in generation tokens 10). A counter that rises
    further in a read than any engine could (:func:`~vllm_capacity.derive.plausible_rise`) is refused for it."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = monotonic
        self.last: VllmMetrics | None = None  # the last good read (None: vLLM was never read)
        self.preempted: frozenset[EngineKey] = frozenset()  # engines that preempted requests since the last read
        self._raw: dict[EngineKey, float] = {}
        self._total: dict[EngineKey, float] = {}
        self.shedding: frozenset[str] = frozenset()  # models whose queue caps rejected requests since the last read
        self._rejected_raw: dict[tuple[str, str], float] = {}
        self._rejected: dict[tuple[str, str], float] = {}
        self._pending: VllmMetrics | None = None  # a read that looked like a restart, not yet confirmed
        self._carried_at: float | None = None  # when the counters were last carried
        self._elapsed = 0.0  # the seconds the last carry covered
        self.refused: tuple[str, ...] = ()  # the counters refused this read (risen further than can be right)
        self.glitches = 0  # reads that looked like a restart and were not one

    def judge(self, metrics: VllmMetrics) -> Verdict:
        """Whether this read continues the last accepted one (``same``), confirms a restart the read before it
        showed (``restart``), or looks like a restart not yet confirmed (``unconfirmed``: hold it)."""
        prev = self.last
        if prev is None or not self._restarted(metrics, prev):
            if self._pending is not None:
                self.glitches += 1  # the read before looked like a restart; this one goes on from before it
            self._pending = None
            return "same"
        pending, self._pending = self._pending, metrics
        if pending is not None and not self._restarted(metrics, pending):
            self._pending = None
            return "restart"
        return "unconfirmed"

    def held(self) -> tuple[dict[EngineKey, float], dict[tuple[str, str], float]]:
        """What an unconfirmed read exports: the totals as they stood, nothing newly preempted or shed."""
        self.preempted, self.shedding, self.refused = frozenset(), frozenset(), ()
        return dict(self._total), dict(self._rejected)

    @staticmethod
    def _restarted(metrics: VllmMetrics, prev: VllmMetrics) -> bool:
        """vLLM restarted between ``prev`` and ``metrics``: a new process start time, or a counter went down. Not a
        missing or re-formatted info family: cache_config_info coming and going (or '0.92' becoming '0.920') is no
        restart, and counting it as one added vLLM's whole counter again each time."""
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

    def _seconds(self) -> float:
        """Since the counters were last carried (0 the first time): what a counter may have risen in."""
        now = self.monotonic()
        seconds = now - self._carried_at if self._carried_at is not None else 0.0
        self._carried_at = now
        return seconds

    def carry(self, metrics: VllmMetrics, restarted: bool) -> dict[EngineKey, float]:
        """Carry vLLM's preemption counters across its restarts; returns the totals to export this cycle: those of
        the engines that reported a (plausible) value. An engine that reported none this time keeps its total for
        the next; an engine that went away takes its series with it."""
        present, exported = {(e.model_name, e.engine) for e in metrics.engines}, {}
        preempted: set[EngineKey] = set()
        seconds, refused = self._seconds(), set()
        self._elapsed = seconds
        for e in metrics.engines:
            key = (e.model_name, e.engine)
            if e.preemptions_total is None:
                continue
            raw = self._raw.get(key)
            rise = e.preemptions_total - (0.0 if restarted or raw is None else raw)
            if raw is not None and not derive.plausible_rise(rise, seconds):
                refused.add("vllm:num_preemptions")  # this read's value left out: the total and its base stand
                exported[key] = self._total[key]
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
        self.preempted, self.refused = frozenset(preempted), tuple(sorted(refused))
        return exported

    def carry_rejections(self, metrics: VllmMetrics, restarted: bool) -> dict[tuple[str, str], float]:
        """vLLM's admission rejections by (model_name, reason), carried across its restarts as the preemptions are
        (after :meth:`carry`, over the same seconds), a rise past what can be right refused as theirs is;
        ``shedding`` names the models whose total rose since the last read. A model or reason no longer reported
        takes its series with it."""
        shedding: set[str] = set()
        totals: dict[tuple[str, str], float] = {}
        raws: dict[tuple[str, str], float] = {}
        for key, raw in metrics.admission_rejections.items():
            last_raw, before = self._rejected_raw.get(key), self._rejected.get(key)
            rise = raw - (0.0 if restarted or last_raw is None else last_raw)
            if last_raw is not None and before is not None and not derive.plausible_rise(rise, self._elapsed):
                totals[key], raws[key] = before, last_raw  # this read's value left out: the total and its base stand
                self.refused = (*self.refused, "vllm:admission_rejections")
                continue
            totals[key], raws[key] = derive.accumulate_counter(before, last_raw, raw, restarted), raw
            if before is not None and totals[key] > before:
                shedding.add(key[0])
        self._rejected, self._rejected_raw = totals, raws
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
