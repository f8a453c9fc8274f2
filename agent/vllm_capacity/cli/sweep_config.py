"""What ``vllm-capacity sweep`` is asked: a field per option (the options themselves: :mod:`.options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.geometry import Geometry


@dataclass(frozen=True)
class SweepConfig:
    vllm_url: str
    model: str | None
    api_key_file: str | None
    concurrency: tuple[int, ...]
    requests_per_step: int | None
    duration_per_step: float | None
    warmup_requests: int
    prompt_tokens: int
    max_tokens: int
    slo_ttft: Objective | None
    slo_itl: Objective | None
    model_config: Geometry | None
    vllm_log: str | None  # vLLM's log: the memory budget it printed at start, in the report
    flags: ServerFlags  # --max-num-seqs, --max-num-batched-tokens
    sample_interval: float
    timeout: float
    format: Literal["text", "json", "csv", "html"]
    output: str | None
