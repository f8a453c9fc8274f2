"""Each read's engines, derived whole from that read (its metrics, the facts and what the learners hold), and
checked against the plan and the model's config.json: a disagreement is logged once per engine."""

from __future__ import annotations

from typing import Any

from vllm_capacity import derive
from vllm_capacity.derive import EngineCapacity, ServerFacts
from vllm_capacity.live.status import first_time
from vllm_capacity.sources.vllm_metrics.records import EngineKey, VllmMetrics

DISAGREEMENT = 0.02  # model_config vs startup_log bytes per token: log when they differ by more


class Derived:
    """The derivation of every read, with the warnings it has logged (once per engine): the only memory it keeps."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._disagreements_logged: set[EngineKey] = set()
        self._plans_logged: set[EngineKey] = set()
        self._cpu_logged: set[EngineKey] = set()

    def engines(
        self, metrics: VllmMetrics, facts: ServerFacts, history: derive.EngineHistory
    ) -> tuple[EngineCapacity, ...]:
        """``derive_all(metrics, facts, history)``, each engine checked."""
        engines = tuple(derive.derive_all(metrics, facts, history))
        for engine in engines:
            self._check(engine)
        return engines

    def _check(self, e: EngineCapacity) -> None:
        key = (e.model_name, e.engine)
        if e.layout is not None and e.layout.mismatch and first_time(self._plans_logged, key):
            self.logger.warning(
                "plan_disagrees",
                engine=f"{e.model_name}/{e.engine}",
                vllm_tokens=e.capacity_tokens,
                planned_tokens=e.layout.planned_tokens,
                assumed=e.layout.assumed,
                hint="--model-config, --tp/--pp or the assumed settings may not match the server (--vllm-log "
                "gives the scheduler's max_num_batched_tokens), or a speculative drafter shares the pool",
            )
        if e.cpu_capacity_reported and e.cpu_capacity_tokens_planned is not None and e.cpu_capacity_tokens:
            planned, reported = e.cpu_capacity_tokens_planned, e.cpu_capacity_tokens
            if abs(planned - reported) > DISAGREEMENT * reported and first_time(self._cpu_logged, key):
                self.logger.warning(
                    "cpu_tier_disagrees",
                    engine=f"{e.model_name}/{e.engine}",
                    vllm_tokens=reported,
                    planned_tokens=planned,
                    hint="the exported CPU tier is vLLM's figure; --model-config or --tp/--pp may not match the server",
                )
        model, logged = e.kv_bytes_per_token_model_config, e.kv_bytes_per_token_startup_log
        if model is None or logged is None or abs(model - logged) <= DISAGREEMENT * model:
            return
        if key not in self._disagreements_logged:
            self._disagreements_logged.add(key)
            self.logger.warning(
                "bytes_per_token_disagree",
                engine=f"{e.model_name}/{e.engine}",
                model_config=round(model, 1),
                startup_log=round(logged, 1),
                hint="--tp/--pp or the model config may not match the server, or a drafter the agent did not plan "
                "(a separate draft model, or no --vllm-log to name it) shares the pool",
            )
