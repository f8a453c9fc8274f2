"""The concurrency vLLM sustains, learned over the agent's reads: at each read where requests wait for capacity or
vLLM has just preempted, the running requests are a level vLLM holds under pressure, whatever limits it (KV cache,
--max-num-seqs, the step's token budget, the CPU). The mean of those levels, its weights halving every half-life as
the latency curve's do, is exported as ``max_concurrency{basis="sustained"}``; before the first such read, the most
requests seen running (a lower bound, ``sustained_queue_observed`` 0)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from vllm_capacity import derive
from vllm_capacity.derive.latency_curve import DEFAULT_HALF_LIFE
from vllm_capacity.sources.vllm_metrics.records import CacheConfig, EngineKey, VllmMetrics


class SustainedLearner:
    """Each engine's :class:`~vllm_capacity.derive.Sustained`, one more read at a time."""

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.half_life, self.monotonic = half_life, monotonic
        self._learned: dict[EngineKey, derive.Sustained] = {}  # with the weight and the time of the last pressed read

    @property
    def views(self) -> Mapping[EngineKey, derive.Sustained]:
        """What the derivations read of each engine's: the level and whether a queue was observed."""
        return {key: derive.Sustained(level=s.level, observed=s.observed) for key, s in self._learned.items()}

    def learn(self, metrics: VllmMetrics, preempted: frozenset[EngineKey]) -> tuple[str, ...]:
        """One read: every engine's running requests, pressed (a queue for capacity, or a preemption since the last
        read) or calm. An engine asleep teaches nothing; one that went away takes what it taught with it. Returns the
        families this read could not have (running past the cache's tokens), which taught nothing."""
        now = self.monotonic()
        present, refused = set(), False
        for m in metrics.engines:
            key = (m.model_name, m.engine)
            present.add(key)
            if m.sleep_state not in (None, "awake"):
                continue
            if not _plausible_running(m.running, m.cache_config):
                refused = True  # one read of running 1e12 set the sustained level to 2.1e10 for hours
                continue
            queue = m.waiting_for_capacity if m.waiting_for_capacity is not None else m.waiting
            pressed = (queue is not None and queue > 0) or key in preempted
            known = self._learned.get(key, derive.NO_SUSTAINED)
            self._learned[key] = derive.learn_sustained(known, m.running, pressed, now, self.half_life)
        for gone in set(self._learned) - present:
            del self._learned[gone]
        return ("vllm:num_requests_running",) if refused else ()

    def forget(self) -> None:
        """vLLM restarted: its settings (and so what it sustains) may have changed."""
        self._learned.clear()


def _plausible_running(running: float | None, cc: CacheConfig | None) -> bool:
    """Running requests an engine can hold: finite, and no more than its KV cache's tokens (each holds one at least)."""
    if running is None:
        return True
    if not math.isfinite(running) or running < 0:
        return False
    tokens = cc.kv_cache_size_tokens if cc is not None else None
    if tokens is None and cc is not None and cc.num_gpu_blocks and cc.block_size:
        tokens = cc.num_gpu_blocks * cc.block_size
    return tokens is None or running <= tokens
