"""A sweep: at each concurrency in turn, the load and vLLM's /metrics read beside it; each step summed up as it
ends (client-side latency and throughput, vLLM's side, the limit that bound it); then the knee and its levers.

A step vLLM did not survive (no request served, its /metrics unreadable) is marked failed with the reason and ends
the sweep; an interrupted step is dropped and ends it. Either way every finished step is kept.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.levers.knee import Knee, StepFigures, find_knee
from vllm_capacity.levers.limits import Binding, Reading, binding_limit
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sweep.load import LoadSpec, RequestResult, StepLoad, one_request, run_step
from vllm_capacity.sweep.sample import Sampler

QUANTILES = (0.5, 0.9, 0.99)
KINDS = ("ttft", "tpot", "itl", "e2e")


class Refused(Exception):
    """The sweep cannot run: vLLM did not serve the warm-up request as asked (the reason is the message)."""


@dataclass(frozen=True)
class SweepSpec:
    load: LoadSpec
    concurrencies: tuple[int, ...]
    requests_per_step: int | None = None  # None with no duration: 4 x the concurrency, at least 8
    duration_per_step: float | None = None
    warmup: int = 1  # requests before the first step, left out of every figure
    sample_interval: float = 0.5
    objectives: tuple[Objective, ...] = ()
    flags: ServerFlags = field(default_factory=ServerFlags)  # the scheduler limits, where the operator said
    max_model_len: int | None = None


@dataclass(frozen=True)
class Step:
    """One concurrency's figures: client side, vLLM's side, the limit that bound it (or why it failed)."""

    concurrency: int
    requests: int
    errors: dict[str, int]
    seconds: float
    latency: dict[str, dict[float, float | None]]  # kind -> quantile -> seconds
    output_tokens_per_second: float
    total_tokens_per_second: float
    requests_per_second: float
    kv_cache_capacity_tokens: float | None = None
    kv_cache_used_tokens_max: float | None = None
    kv_cache_used_tokens_mean: float | None = None
    kv_cache_usage_max: float | None = None
    requests_running_max: float | None = None
    requests_waiting_max: float | None = None
    waiting_for_capacity_max: float | None = None
    reads: int = 0
    binding: Binding | None = None
    failed: str | None = None

    @property
    def preemptions(self) -> float:
        return self.binding.preemptions if self.binding else 0.0

    @property
    def shed(self) -> float:
        return self.binding.shed if self.binding else 0.0

    def figures(self) -> StepFigures:
        return StepFigures(self.concurrency, self.output_tokens_per_second, self.latency, self.binding, self.failed)


@dataclass(frozen=True)
class Sweep:
    steps: tuple[Step, ...]
    knee: Knee
    interrupted: bool = False


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile, linear between the closest ranks (numpy's default); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _max(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _latency(ok: Sequence[RequestResult]) -> dict[str, dict[float, float | None]]:
    """TTFT, TPOT, ITL and end-to-end latency quantiles of the requests that succeeded."""
    per_kind = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2e": [r.e2e for r in ok],
    }
    return {kind: {q: quantile(values, q) for q in QUANTILES} for kind, values in per_kind.items()}


def _client_side(results: Sequence[RequestResult], prompt_tokens: int) -> dict[str, Any]:
    """What the client measured: requests, errors by kind, the step's time, latency quantiles, throughput."""
    ok = [r for r in results if r.error is None]
    seconds = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    output = sum(r.output_tokens for r in ok)
    total = output + sum(r.prompt_tokens or prompt_tokens for r in ok)
    rate = 1 / seconds if seconds else 0.0
    return {
        "requests": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "seconds": seconds,
        "latency": _latency(ok),
        "output_tokens_per_second": output * rate,
        "total_tokens_per_second": total * rate,
        "requests_per_second": len(ok) * rate,
    }


def _server_side(readings: Sequence[Reading], flags: ServerFlags) -> dict[str, Any]:
    """What vLLM's /metrics said during the step: its KV cache and queue at most, and the limit that bound it."""
    used = [r.kv_used_tokens for r in readings if r.kv_used_tokens is not None]
    return {
        "kv_cache_capacity_tokens": _max([r.kv_capacity_tokens for r in readings]),
        "kv_cache_used_tokens_max": max(used) if used else None,
        "kv_cache_used_tokens_mean": sum(used) / len(used) if used else None,
        "kv_cache_usage_max": _max([r.kv_usage for r in readings]),
        "requests_running_max": _max([r.running for r in readings]),
        "requests_waiting_max": _max([r.waiting for r in readings]),
        "waiting_for_capacity_max": _max([r.waiting_for_capacity for r in readings]),
        "reads": len(readings),
        "binding": binding_limit(readings, flags) if readings else None,
    }


def summarize(concurrency: int, results: Sequence[RequestResult], readings: Sequence[Reading], spec: SweepSpec) -> Step:
    """One step's figures from its requests and the reads of vLLM beside them."""
    return Step(concurrency, **_client_side(results, spec.load.prompt_tokens), **_server_side(readings, spec.flags))


def step_size(spec: SweepSpec, concurrency: int) -> tuple[int | None, float | None]:
    if spec.duration_per_step is not None:
        return None, spec.duration_per_step
    return spec.requests_per_step or max(8, 4 * concurrency), None


async def sweep(
    client: VllmClient,
    spec: SweepSpec,
    *,
    on_step: Callable[[Step], None] = lambda _: None,
    on_request: Callable[[], None] = lambda: None,
    interrupt: asyncio.Event | None = None,
) -> Sweep:
    """Every step in turn; ``interrupt`` set: the running step's load stops at once, the finished steps are kept."""
    interrupt = interrupt or asyncio.Event()
    steps: list[Step] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for number in range(spec.warmup):
            warm = await one_request(session, spec.load, -1 - number)
            if warm.error is not None:
                raise Refused(f"vLLM did not serve the warm-up request ({warm.error}: {warm.detail or 'no detail'})")
        first = 0
        for concurrency in spec.concurrencies:
            count, duration = step_size(spec, concurrency)
            step = await _one_step(
                client, session, spec, StepLoad(concurrency, count, duration), first, on_request, interrupt
            )
            if step is None:
                return Sweep(tuple(steps), find_knee([s.figures() for s in steps], spec.objectives), interrupted=True)
            first += len(step.errors) + step.requests
            steps.append(step)
            on_step(step)
            if step.failed is not None:
                break
    return Sweep(tuple(steps), find_knee([s.figures() for s in steps], spec.objectives))


async def _one_step(
    client: VllmClient,
    session: aiohttp.ClientSession,
    spec: SweepSpec,
    load: StepLoad,
    first: int,
    on_request: Callable[[], None],
    interrupt: asyncio.Event,
) -> Step | None:
    """One step summed up; None when it was interrupted."""
    sampler = Sampler(client, spec.load.model, spec.max_model_len, spec.sample_interval)
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    loading = asyncio.create_task(run_step(session, spec.load, load, first, on_request))
    waiting = asyncio.create_task(interrupt.wait())
    await asyncio.wait({loading, waiting}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    if not loading.done():
        loading.cancel()
        sampling.cancel()
        await asyncio.gather(loading, sampling, return_exceptions=True)
        return None
    waiting.cancel()
    await sampling
    step = summarize(load.concurrency, load.results, sampler.readings, spec)
    if step.requests == 0 and sampler.failure is not None:
        errors = ", ".join(f"{n} {kind}" for kind, n in sorted(step.errors.items()))
        return Step(load.concurrency, 0, step.errors, step.seconds, step.latency, 0.0, 0.0, 0.0,
                    failed=f"vLLM stopped answering: {sampler.failure} (requests: {errors or 'none'})")  # fmt: skip
    return step
