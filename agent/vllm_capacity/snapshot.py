"""What the agent serves: an immutable snapshot of its latest derived view, swapped in whole after each cycle."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_capacity.derive import EngineCapacity
from vllm_capacity.derive.budget import GpuBudget
from vllm_capacity.sources.gpu import GpuReading


@dataclass(frozen=True)
class SourceState:
    """A source's state as the snapshot shows it: up, and how long its last read took."""

    up: bool
    duration_seconds: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """What /metrics shows. Immutable: the loop swaps in a new one; a scrape renders one consistent view."""

    up: bool = False
    timestamp: float | None = None
    schema: str | None = None
    version: str | None = None
    itl_metric: str | None = None
    engines: tuple[EngineCapacity, ...] = ()
    gpus: tuple[GpuReading, ...] = ()  # from NVML, independent of vLLM being up
    gpu_budgets: Mapping[str, GpuBudget] = field(default_factory=dict)
    #: (index, uuid) of GPUs read before that NVML cannot read now while it reads the others (lost, reset, ...)
    gpus_unreadable: tuple[tuple[str, str], ...] = ()
    #: each source's state and the failures counted by (source, reason), as they stood when the snapshot was taken
    sources: Mapping[str, SourceState] = field(default_factory=dict)
    errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: vLLM's admission rejections by (model_name, reason), carried across its restarts
    rejections: Mapping[tuple[str, str], float] = field(default_factory=dict)
