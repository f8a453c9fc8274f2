"""Parse vLLM's ``/metrics`` text into plain data, for every metric-name generation (legacy V0 to current V1).

Pure: text in, :class:`VllmMetrics` out. The grammar is prometheus-client's own text parser, applied to the lines of
the families the agent reads (:mod:`vllm_capacity.sources.vllm_metrics.select` finds them,
:mod:`vllm_capacity.sources.vllm_metrics.scan` reads the canonical ones itself, with the parser's exact result).

What each name and label means, per vLLM release: :mod:`vllm_capacity.sources.vllm_metrics.records`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric

from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory
from vllm_capacity.sources.vllm_metrics.records import (
    ADMISSION_REJECTIONS,
    CACHE_CONFIG,
    CPU_TIER,
    GENERATION_TOKENS,
    GPU_CACHE_USAGE,
    ITERATION_TOKENS_SUM,
    ITL,
    KV_OFFLOAD_CONFIG,
    KV_USAGE,
    LATENCY_BUCKETS,
    LORA_REQUESTS,
    META,
    PREEMPTIONS,
    PRESENCE_ONLY,
    PROCESS_START,
    RUNNING,
    SCHEMA_V0,
    SCHEMA_V1,
    SCHEMA_V1_CAPACITY,
    SCHEMA_V1_LEGACY,
    SIMPLE_OFFLOAD_USED,
    SLEEP,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    SWAPPED,
    WAITING,
    WAITING_BY_REASON,
    WANTED,
    WANTED_WITHOUT_LATENCY,
    CacheConfig,
    EngineKey,
    EngineMetrics,
    LoraRequests,
    VllmMetrics,
    label_float,
)
from vllm_capacity.sources.vllm_metrics.scan import parse_selected
from vllm_capacity.sources.vllm_metrics.select import Selection, select_lines

_WANTED_SET = frozenset(WANTED)
#: The per-engine values: every wanted family but the cache config, the process start and the sleep state (read
#: apart) and the latency buckets.
_PER_ENGINE = frozenset(WANTED_WITHOUT_LATENCY) - {
    CACHE_CONFIG,
    PROCESS_START,
    SLEEP,
    LORA_REQUESTS,
    ADMISSION_REJECTIONS,
    *CPU_TIER,
}
_ONE_VALUE = _PER_ENGINE - {WAITING_BY_REASON}  # a value per engine (waiting_by_reason has one per reason)
# What a value can be and still be right: a usage fraction in [0, 1] (a float's excess aside), counts and sizes not
# negative and exact in a float (2^53). A value outside is vLLM's error or a corrupted body: it is left out, and the
# family named in VllmMetrics.implausible.
EXACT = 2.0**53
USAGE_EXCESS = 1e-9
_FRACTIONS = {KV_USAGE, GPU_CACHE_USAGE}
# cache_config_info labels read as numbers, with the least value each may take
_CONFIG_NUMBERS = {
    "block_size": 1.0,
    "num_gpu_blocks": 0.0,
    "num_gpu_blocks_override": 0.0,
    "kv_cache_size_tokens": 0.0,
    "kv_cache_max_concurrency": 0.0,
    "kv_cache_memory_bytes": 0.0,
    "gpu_memory_utilization": 0.0,
}
# cache_config_info labels read as booleans (pydantic's bool, formatted by str(): "True" or "False"; "None" unset):
# vLLM 0.34's enable_extensible_kv_cache decides the budget an unset gpu_memory_utilization resolves to
_CONFIG_BOOLS = ("enable_extensible_kv_cache",)
# vllm:admission_rejections_total's reasons (ADMISSION_REASONS, vllm/v1/metrics/loggers.py:47 of the 0.34.0 wheel:
# max_num_queued_reqs, max_num_queued_tokens); a later release may add one, so any name of that shape is carried
_REJECTION_REASON = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _plausible(name: str, value: float) -> bool:
    if name in _FRACTIONS:
        return 0.0 <= value <= 1.0 + USAGE_EXCESS
    return 0.0 <= value <= EXACT


def _plausible_config(labels: Mapping[str, str]) -> list[str]:
    """The numeric cache_config_info labels whose value cannot be right (not the text "None", which means unset)."""
    bad = []
    for key, least in _CONFIG_NUMBERS.items():
        value = label_float(labels, key)
        if labels.get(key) is None or (value is None and labels[key] in ("None", "")):
            continue
        if value is None or not least <= value <= EXACT or (key == "gpu_memory_utilization" and value > 1.0):
            bad.append(f"{CACHE_CONFIG}{{{key}}}")
    bad.extend(
        f"{CACHE_CONFIG}{{{key}}}"
        for key in _CONFIG_BOOLS
        if labels.get(key, "None") not in ("True", "False", "None", "")
    )
    return bad


_V1_RUNNING_HELP = "Number of requests in model execution batches"


def parse_metrics(text: str, *, latency: bool = True, reader: ReaderMemory | None = None) -> VllmMetrics:
    """Parse a vLLM /metrics body. Raises :class:`SourceError` when it is not a (whole) vLLM exposition.
    ``latency``: read the latency histograms' buckets too (the agent does every few seconds, not every cycle);
    ``reader``: the reader's memory of lines read before (a fresh one when none is given: the same result)."""
    _check_body(text)
    names, meta = (WANTED, META) if latency else (WANTED_WITHOUT_LATENCY, PRESENCE_ONLY)
    reader = ReaderMemory() if reader is None else reader
    return read_selected(select_lines(text, names, meta, reader=reader), reader)


def read_selected(selected: Selection, reader: ReaderMemory | None = None) -> VllmMetrics:
    """The families of the selected lines, parsed and reduced to what the derivations need."""
    try:
        families = parse_selected(selected, reader)
    except (ValueError, TypeError, IndexError, OverflowError) as err:  # OverflowError: an integer beyond a float
        raise SourceError(Reason.PARSE_ERROR, f"vLLM /metrics is not valid Prometheus text: {err}") from err
    scan = _Scan(ReaderMemory() if reader is None else reader)
    for family in families:
        scan.add(family)
    if not any(name.startswith("vllm:") for name in scan.seen):
        # "vllm:" in the text, but no family the agent reads: another exporter quoting vLLM's names (another
        # vllm-capacity, say), not vLLM
        raise SourceError(Reason.NOT_VLLM, "the /metrics body has no vllm: family the agent reads: is it vLLM's?")
    return VllmMetrics(
        schema=scan.schema(),
        engines=scan.engines(),
        dp_engines=max(1, len(scan.cache_configs)),
        process_start_time_seconds=scan.process_start,
        itl_metric=next((n for n in PRESENCE_ONLY if n in scan.latency_families), None),
        implausible=tuple(sorted(scan.implausible)),
        lora=LoraRequests.from_labels(scan.lora[1]) if scan.lora else None,
        over_limit=tuple(sorted(selected.over_limit.items())),
        admission_rejections=scan.rejections,
    )


def check_head(head_text: str) -> None:
    if head_text.lower().startswith(("<!doctype", "<html", "<?xml", "{")):
        raise SourceError(
            Reason.NOT_METRICS, f"vLLM /metrics returned a document, not metrics text: {head_text[:60]!r}"
        )


#: The longest line a body may hold (bytes as sent; characters of a decoded text): no vLLM writes one of a megabyte,
#: and a line is held whole until its end, so a longer one refuses the read before it is held.
LONG_LINE = 1 << 20


def has_long_line(text: str | bytes, limit: int = LONG_LINE) -> bool:
    """Whether ``text`` holds a line (or an unfinished last line) of more than ``limit`` characters, in time linear in
    the text and a few calls a megabyte: such a line covers a whole block of ``limit // 2`` aligned at a multiple of
    it, so only a block without a newline is looked at closer."""
    newline: Any = b"\n" if isinstance(text, bytes) else "\n"
    half = max(1, limit // 2)
    for at in range(0, len(text), half):
        if text.find(newline, at, at + half) == -1:
            start = text.rfind(newline, 0, at) + 1
            end = text.find(newline, at + half)
            if (len(text) if end == -1 else end) - start > limit:
                return True
    return False


def long_line(size: int) -> SourceError:
    return SourceError(
        Reason.LINE_TOO_LONG, f"vLLM /metrics has a line of over {size} bytes (the limit is {LONG_LINE}): not read"
    )


def _check_body(text: str) -> None:
    """Refuse what is not a whole vLLM exposition before parsing it, each with its reason (as MetricsStream does)."""
    if has_long_line(text):
        raise long_line(LONG_LINE)
    start = LEADING_SPACE.match(text).end()  # type: ignore[union-attr]  # \s* always matches
    if start == len(text):
        raise SourceError(Reason.EMPTY_BODY, "vLLM /metrics returned an empty body")
    check_head(text[start : start + 200])
    if not text.endswith("\n"):
        raise SourceError(Reason.TRUNCATED, "vLLM /metrics body does not end with a newline: truncated")
    if "vllm:" not in text:
        raise SourceError(Reason.NOT_VLLM, "the /metrics body has no vllm: metric at all: is --vllm-url a vLLM server?")


LEADING_SPACE_BYTES = re.compile(rb"[ \t\n\r\x0b\x0c\x1c-\x1f]*")  # what str.strip strips, in ASCII
LEADING_SPACE = re.compile(r"\s*")
#: the reader's memory of what cache_config_info's labels say (ReaderMemory): its labels but the engine's -> (the
#: implausible ones, the config without them). The same labels come back every scrape, on every engine; a generation
#: holds CACHE_CONFIGS_HELD label sets (each about 45 labels), so labels that change on every read cost a few of them
CACHE_CONFIGS, CACHE_CONFIGS_HELD = "cache_configs", 64


def _cache_config(
    series: frozenset[tuple[str, str]], labels: Mapping[str, str], reader: ReaderMemory
) -> tuple[list[str], CacheConfig]:
    """The implausible labels of a cache_config_info series (``series``: its labels as a set, ``labels`` as read),
    and the config without them (or "None")."""
    key = series.difference({("engine", labels.get("engine", ""))})  # one entry for every engine alike
    memory = reader.of(CACHE_CONFIGS, lambda: CACHE_CONFIGS_HELD)
    known = memory.current.get(key) or memory.recall(key)
    if known is None:
        bad = _plausible_config(labels)
        dropped = {b[len(CACHE_CONFIG) + 1 : -1] for b in bad}
        config = CacheConfig(
            {k: v for k, v in labels.items() if k != "engine" and k not in dropped and v not in ("None", "")}
        )
        known = (bad, config)
        memory.remember(key, known)
    return known


def _cpu_tier(tier: dict[str, float], name: str, labels: Mapping[str, str], value: float) -> None:
    """One series of the CPU-tier families into the engine's figures: an info series' numeric labels (a label
    "None" or empty, vLLM's unknown, adds nothing; several series, one per tier, add up), the pool's used blocks."""
    if name == SIMPLE_OFFLOAD_USED:
        tier["simple_offload_used_blocks"] = value
        return
    if value != 1.0:
        return  # an info family's series is 1
    fields = (
        (("cpu_kv_cache_size_tokens", "offload_tokens"),)
        if name == KV_OFFLOAD_CONFIG
        else (("capacity_blocks", "simple_offload_blocks"),)
    )
    for label, key in fields:
        number = label_float(labels, label)
        if number is not None and 0 <= number <= EXACT:
            tier[key] = tier.get(key, 0.0) + number


def _finite(value: float) -> float | None:
    """A sample's value as a finite float; None for NaN, infinities and integers beyond a float (the parser keeps
    those as Python ints, which no float can hold): such a series is left out, never exported wrong (NaN is
    unknown; the others are also named implausible)."""
    try:
        as_float = float(value)
    except OverflowError:
        return None
    return as_float if math.isfinite(as_float) else None


@dataclass
class _Scan:
    """What the wanted families say, gathered sample by sample."""

    reader: ReaderMemory  # the reader's memory (what cache_config_info's labels say)
    values: dict[EngineKey, dict[str, float]] = field(default_factory=dict)
    waiting_by_reason: dict[EngineKey, dict[str, float]] = field(default_factory=dict)
    buckets: dict[EngineKey, dict[str, dict[float, float]]] = field(default_factory=dict)
    sleep: dict[EngineKey, str] = field(default_factory=dict)
    step_sums: dict[EngineKey, float] = field(default_factory=dict)
    cache_configs: dict[str, CacheConfig] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    latency_families: set[str] = field(default_factory=set)
    implausible: set[str] = field(default_factory=set)
    series: set[tuple[str, frozenset[tuple[str, str]]]] = field(default_factory=set)
    running_help: str = ""
    has_engine_label: bool = False
    process_start: float | None = None
    lora: tuple[float, Mapping[str, str]] | None = None  # the newest lora_requests_info series: (value, labels)
    rejections: dict[tuple[str, str], float] = field(default_factory=dict)  # (model_name, reason) -> total
    cpu_tier: dict[EngineKey, dict[str, float]] = field(default_factory=dict)  # the CPU tier vLLM reports

    def add(self, family: Metric) -> None:
        if family.name in PRESENCE_ONLY:
            self.latency_families.add(family.name)
        if family.name == RUNNING:
            self.running_help = family.documentation
        seen, all_series = self.seen, self.series
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name not in _WANTED_SET:
                continue
            seen.add(name)  # the generation of names is what is there, whatever its value (NaN included)
            series = (name, frozenset(labels.items()))
            if series in all_series:  # Prometheus refuses a scrape with a duplicated series; so does the agent
                raise SourceError(Reason.PARSE_ERROR, f"vLLM /metrics has the series {name}{labels} twice")
            all_series.add(series)
            key = (labels.get("model_name", ""), labels.get("engine", "0"))
            if name in _PER_ENGINE:  # the engine exists, whatever its values say
                self.has_engine_label |= "engine" in labels
                self.values.setdefault(key, {})
            value = _finite(sample.value)
            if value is None:
                if sample.value == sample.value:  # an infinity or an integer beyond a float: wrong, not unknown
                    self.implausible.add(name)
                continue
            if name == CACHE_CONFIG:
                bad, config = _cache_config(series[1], labels, self.reader)
                self.implausible.update(bad)
                self.cache_configs[labels.get("engine", "0")] = config
            elif not _plausible(name, value):
                self.implausible.add(name)
            elif name in _ONE_VALUE:
                self.values[key][name] = value
            else:
                self._store_apart(name, key, labels, value)

    def _store_apart(self, name: str, key: EngineKey, labels: Mapping[str, str], value: float) -> None:
        """A plausible value of a family read apart from the per-engine values."""
        if name == PROCESS_START:
            self.process_start = value
        elif name == LORA_REQUESTS:
            if self.lora is None or value > self.lora[0]:
                self.lora = (value, labels)
        elif name == ADMISSION_REJECTIONS:
            reason = labels.get("reason", "")
            if _REJECTION_REASON.fullmatch(reason):
                self.rejections[(labels.get("model_name", ""), reason)] = value
            else:  # not a reason vLLM names: left out, named implausible, never a label of ours
                self.implausible.add(f"{name}{{reason}}")
        elif name in CPU_TIER:
            _cpu_tier(self.cpu_tier.setdefault(key, {}), name, labels, value)
        elif name == WAITING_BY_REASON:
            self.waiting_by_reason.setdefault(key, {})[labels.get("reason", "")] = value
        elif name == SLEEP:
            if value == 1.0:
                self.sleep[key] = labels.get("sleep_state", "")
        elif name == ITERATION_TOKENS_SUM:
            self.step_sums[key] = value
        elif name in LATENCY_BUCKETS:
            le = label_float(labels, "le") if labels.get("le") not in ("+Inf", "Inf") else math.inf
            if le is not None:
                self.buckets.setdefault(key, {}).setdefault(name, {})[le] = value

    def engines(self) -> tuple[EngineMetrics, ...]:
        # cache_config_info without an engine label (V0, V1 0.8.x) applies to every engine
        shared_config = self.cache_configs.get("0") if len(self.cache_configs) == 1 else None
        return tuple(
            EngineMetrics(
                model_name=model_name,
                engine=engine,
                kv_cache_usage=slot.get(KV_USAGE, slot.get(GPU_CACHE_USAGE)),
                running=slot.get(RUNNING),
                waiting=slot.get(WAITING),
                waiting_by_reason=self.waiting_by_reason.get((model_name, engine), {}),
                swapped=slot.get(SWAPPED),
                preemptions_total=slot.get(PREEMPTIONS),
                generation_tokens_total=slot.get(GENERATION_TOKENS),
                cache_config=self.cache_configs.get(engine, shared_config),
                latency=self._latency((model_name, engine)),
                sleep_state=self.sleep.get((model_name, engine)),
                spec_drafts_total=slot.get(SPEC_DRAFTS),
                spec_draft_tokens_total=slot.get(SPEC_DRAFT_TOKENS),
                spec_accepted_tokens_total=slot.get(SPEC_ACCEPTED_TOKENS),
                step_tokens_sum=self.step_sums.get((model_name, engine)),
                **self.cpu_tier.get((model_name, engine), {}),
            )
            for (model_name, engine), slot in sorted(self.values.items())
        )

    def _latency(self, key: EngineKey) -> dict[str, tuple[tuple[float, float], ...]]:
        """Each kind's buckets, whole (ending with +Inf) and cumulative (never decreasing along le), else left out."""
        out: dict[str, tuple[tuple[float, float], ...]] = {}
        for name, by_le in self.buckets.get(key, {}).items():
            kind = LATENCY_BUCKETS[name]
            if kind in out and not name.startswith(ITL):
                continue  # the newer inter-token name wins
            buckets = tuple(sorted(by_le.items()))
            if buckets and math.isinf(buckets[-1][0]) and all(a[1] <= b[1] for a, b in itertools.pairwise(buckets)):
                out[kind] = buckets
        return out

    def schema(self) -> str:
        is_v1 = self.has_engine_label or self.running_help.startswith(_V1_RUNNING_HELP) or KV_USAGE in self.seen
        if not is_v1:
            return SCHEMA_V0
        if KV_USAGE not in self.seen:
            return SCHEMA_V1_LEGACY
        if any(c.kv_cache_size_tokens is not None for c in self.cache_configs.values()):
            return SCHEMA_V1_CAPACITY
        return SCHEMA_V1
