"""The memory budget a sweep's report gives once (``--vllm-log``): what vLLM's start-up log says one GPU rank holds
(weights, the KV cache, CUDA graphs, the activation peak), read with the sidecar's own log reader, so that the knee's
KV capacity is seen beside what took the rest of the GPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_capacity.sources.vllm_log import LogFollower, StartupFigures, might_carry_figures
from vllm_capacity.units import MiB

#: The most of the log read for it (the start-up lines come first; a log of days is not read to its end).
MOST_READ = 64 * MiB


@dataclass(frozen=True)
class MemoryBudget:
    """Per GPU rank, in bytes; None where the log does not say (vLLM's CPU build logs only its KV cache)."""

    path: str
    weights_bytes: float | None = None
    kv_cache_bytes: float | None = None
    cuda_graph_bytes: float | None = None
    activation_peak_bytes: float | None = None
    budget_bytes: float | None = None  # total x gpu_memory_utilization, where vLLM logs it (0.34's extensible cache)
    error: str | None = None  # why the log could not be read, or why it holds no figure

    def parts(self) -> dict[str, float | None]:
        return {
            "weights": self.weights_bytes,
            "kv_cache": self.kv_cache_bytes,
            "cuda_graphs": self.cuda_graph_bytes,
            "activation_peak": self.activation_peak_bytes,
        }


def read_budget(path: str) -> MemoryBudget:
    """The latest start's figures of the log at ``path`` (of its first engine); never raises: a log that cannot be
    read, or holds none of the figures, is a budget with ``error`` saying so."""
    follower, figures = LogFollower(Path(path), keep=might_carry_figures), StartupFigures()
    try:
        size = min(Path(path).stat().st_size, MOST_READ)
        for _ in range(-(-size // follower.max_read)):  # a read takes at most max_read bytes, kept lines or not
            for line in follower.read_lines():
                figures.feed(line)
    except OSError as err:
        return MemoryBudget(path, error=f"{path}: {err.strerror or err}")
    if not figures.engines:
        return MemoryBudget(path, error=f"{path} holds none of vLLM's start-up memory lines (is it vLLM's log?)")
    fig = figures.engines[min(figures.engines)]
    return MemoryBudget(
        path,
        weights_bytes=fig.weights_bytes,
        kv_cache_bytes=fig.kv_pool_bytes,
        cuda_graph_bytes=fig.cuda_graph_bytes,
        activation_peak_bytes=fig.activation_peak_bytes or fig.transient_peak_bytes,
        budget_bytes=fig.requested_bytes,
    )
