"""vLLM's own view during a step: its /metrics read every ``interval`` with the agent's reader and derivations, a
model's engines summed into one :class:`~vllm_capacity.levers.limits.Reading` each time."""

from __future__ import annotations

import asyncio
import time

from vllm_capacity import derive
from vllm_capacity.levers.limits import Reading
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_metrics.records import VllmMetrics


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def reading(metrics: VllmMetrics, model: str, max_model_len: int | None, at: float) -> Reading:
    """One read of ``metrics`` for ``model``: its engines summed (the KV usage: the fullest engine's)."""
    facts = derive.ServerFacts(max_model_len={model: max_model_len} if max_model_len else {})
    pairs = [
        (m, e) for m, e in zip(metrics.engines, derive.derive_all(metrics, facts), strict=True) if m.model_name == model
    ]
    steps = [m.latency.get("steps") for m, _ in pairs]
    return Reading(
        at=at,
        running=_total([m.running for m, _ in pairs]),
        waiting=_total([m.waiting for m, _ in pairs]),
        waiting_for_capacity=_total([m.waiting_for_capacity for m, _ in pairs]),
        kv_usage=max((m.kv_cache_usage for m, _ in pairs if m.kv_cache_usage is not None), default=None),
        kv_used_tokens=_total([e.used_tokens for _, e in pairs]),
        kv_capacity_tokens=_total([e.capacity_tokens for _, e in pairs]),
        preemptions_total=_total([m.preemptions_total for m, _ in pairs]),
        shed_total=_total([v for (name, _), v in metrics.admission_rejections.items() if name == model]),
        step_tokens_sum=_total([m.step_tokens_sum for m, _ in pairs]),
        steps_total=_total([s[-1][1] if s else None for s in steps]),
    )


class Sampler:
    """Reads vLLM's /metrics every ``interval`` while a step runs; :attr:`readings` is the step's, :attr:`failure`
    the last read's error (None: the last read worked)."""

    def __init__(self, client: VllmClient, model: str, max_model_len: int | None, interval: float) -> None:
        self.client, self.model, self.max_model_len, self.interval = client, model, max_model_len, interval
        self.readings: list[Reading] = []
        self.failure: str | None = None

    async def read(self) -> Reading | None:
        try:
            metrics = await self.client.fetch_metrics(latency=True)
        except SourceError as err:
            self.failure = f"{err.reason}: {err}"
            return None
        self.failure = None
        found = reading(metrics, self.model, self.max_model_len, time.monotonic())
        self.readings.append(found)
        return found

    async def run(self, stop: asyncio.Event) -> None:
        """Read until ``stop`` is set, then once more (the step's end)."""
        while not stop.is_set():
            await self.read()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                continue
        await self.read()
