"""Each read's engines, derived again only where what an engine's derivation reads has changed, and checked against
the plan and the model's config.json when they are new.

An idle server's reads are alike: the same lines (``LastRead`` gives the same record), the same facts and history,
and :func:`~vllm_capacity.derive.derive_engine` is a function of its engine's metrics, inputs and the facts: the same
ones give the same engine, which is kept instead of derived again (at one engine a twentieth of a read's CPU).
"""

from __future__ import annotations

import operator
from typing import Any

from vllm_capacity import derive
from vllm_capacity.derive import EngineCapacity, EngineInputs, ServerFacts
from vllm_capacity.derive.facts import EngineKey
from vllm_capacity.live.status import first_time
from vllm_capacity.sources.vllm_records import EngineMetrics, VllmMetrics

DISAGREEMENT = 0.02  # model_config vs startup_log bytes per token: log when they differ by more


class Derived:
    """The last read's engines, each with what it was derived from; warnings logged once per engine."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._last: dict[EngineKey, tuple[EngineMetrics, EngineInputs, EngineCapacity]] = {}
        self._engines: tuple[EngineCapacity, ...] = ()  # the last read's, as returned
        self._facts: ServerFacts | None = None  # what the last read's engines were derived with
        # the last read's record and a copy of its history (the learners' mappings change in place)
        self._read: tuple[VllmMetrics, derive.EngineHistory] | None = None
        self._disagreements_logged: set[EngineKey] = set()
        self._plans_logged: set[EngineKey] = set()
        self._cpu_logged: set[EngineKey] = set()

    def engines(
        self, metrics: VllmMetrics, facts: ServerFacts, history: derive.EngineHistory
    ) -> tuple[EngineCapacity, ...]:
        """``derive_all(metrics, facts, history)``, an engine derived again only when its metrics (the same record),
        inputs or the facts differ from the last read's; the last read's tuple itself when every engine is the last
        read's (exposition keeps what it encoded of them while they are the same tuple: exposition.RenderCache).
        The same record, the same facts and an equal history (an idle server's read) are not looked at engine by
        engine."""
        read = self._read
        if read is not None and read[0] is metrics and facts is self._facts and read[1] == history:
            return self._engines
        self._read = (metrics, _copy(history))
        out, kept = [], {}
        last = self._last if facts is self._facts or facts == self._facts else {}  # once a read, not once an engine
        for m, inputs in derive.engine_inputs(metrics, facts, history):
            key = (m.model_name, m.engine)
            known = last.get(key)
            if known is not None and known[0] is m and known[1] == inputs:
                engine = known[2]
            else:
                engine = derive.derive_engine(m, inputs, facts)
                if known is not None and _switched(known[0], m) and engine == known[2]:
                    engine = known[2]  # derived alike: the record exposition kept
                else:
                    self._check(engine)
            kept[key] = (m, inputs, engine)
            out.append(engine)
        self._last, self._facts = kept, facts
        if len(out) != len(self._engines) or not all(map(operator.is_, out, self._engines)):
            self._engines = tuple(out)
        return self._engines

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


def _switched(before: EngineMetrics, now: EngineMetrics) -> bool:
    """Whether one of the two reads has the latency histograms and the other not: another record of an idle server's
    same values (every few seconds, and the read after), which is worth comparing by value. A busy server's next
    read moves its values: comparing its engines would cost an eighth of deriving them, for nothing."""
    return bool(before.latency) is not bool(now.latency)


def _copy(history: derive.EngineHistory) -> derive.EngineHistory:
    """``history`` as it is now: its mappings copied (their records never change; the mappings do)."""
    return derive.EngineHistory(dict(history.preemptions), dict(history.latency), history.preempted,
                                dict(history.sustained), history.shed_reported, history.shedding)  # fmt: skip
