"""What the derivations are given beside one scrape of vLLM's /metrics, in two frozen records: what the agent knows
of the server (its flags, /v1/models, /version, start-up log, model config) and what it learned of each engine over
its reads. They replace the long keyword lists of ``derive_all`` and ``derive_engine``, as
:class:`~vllm_capacity.sizing.PlanInputs` does for the planner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_capacity.derive.features import LatencyView, Sustained
from vllm_capacity.geometry import Geometry
from vllm_capacity.sources.vllm_log import EngineFigures
from vllm_capacity.sources.vllm_metrics.records import EngineKey


@dataclass(frozen=True)
class ServedModel:
    """The model as the operator describes it to the agent (--model-config or --model-dir, --tp, --pp): one record,
    passed from the command line to the agent and on to the derivations as it is."""

    geometry: Geometry | None = None
    tp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class ServerFlags:
    """vLLM's scheduler flags that its metrics do not say, where known: the operator's (--max-model-len,
    --max-num-seqs, --max-num-batched-tokens), else its start-up log's. One record, passed from the command line to
    the agent, the derivations and the levers as it is."""

    max_model_len: int | None = None  # for when /v1/models gives none
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # the log's "Chunked prefill is enabled with max_num_batched_tokens"

    def over(self, other: ServerFlags) -> ServerFlags:
        """These flags where given, else ``other``'s (the operator's over the log's)."""
        return ServerFlags(
            self.max_model_len or other.max_model_len,
            self.max_num_seqs or other.max_num_seqs,
            self.max_num_batched_tokens or other.max_num_batched_tokens,
        )


@dataclass(frozen=True)
class ServerFacts:
    """The server as the agent knows it beside its metrics."""

    max_model_len: Mapping[str, int] = field(default_factory=dict)  # model_name -> /v1/models' max_model_len
    startup: Mapping[str, EngineFigures] = field(default_factory=dict)  # engine -> its start-up log figures
    model: ServedModel = field(default_factory=ServedModel)  # --model-config, --tp, --pp
    version: str | None = None  # vLLM's /version: whose sizing rules apply (None: the metric generation's)
    flags: ServerFlags = field(default_factory=ServerFlags)  # the operator's flags, else the log's
    speculation: tuple[str, int] | None = None  # the (method, num_speculative_tokens) the engine logged


@dataclass(frozen=True)
class EngineHistory:
    """What the agent learned of each engine over its reads, by (model_name, engine)."""

    preemptions: Mapping[EngineKey, float] = field(default_factory=dict)  # vLLM's counter, carried over restarts
    latency: Mapping[EngineKey, LatencyView] = field(default_factory=dict)
    preempted: frozenset[EngineKey] = frozenset()  # engines that preempted since the last read
    sustained: Mapping[EngineKey, Sustained] = field(default_factory=dict)  # the concurrency each holds under pressure
    #: models whose queue caps vLLM reports (vllm:admission_rejections_total), and those that shed requests since
    #: the last read
    shed_reported: frozenset[str] = frozenset()
    shedding: frozenset[str] = frozenset()


NO_FACTS = ServerFacts()  # the server known from its metrics alone
NO_HISTORY = EngineHistory()  # a first read: nothing learned yet
