"""Parsing real exposition text of every metric generation (captures of the real 0.32.0 server, and the
older generations transcribed from vLLM's metric definitions of those releases: vllm/engine/metrics.py,
vllm/v1/metrics/loggers.py)."""

import pytest

from support.files import fixture_text
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.sources.vllm_metrics.records import (
    META,
    SCHEMA_V0,
    SCHEMA_V1,
    SCHEMA_V1_CAPACITY,
    SCHEMA_V1_LEGACY,
    WANTED,
    LoraRequests,
)
from vllm_capacity.sources.vllm_metrics.select import select_lines
from vllm_capacity.sources.vllm_metrics.stream import MetricsStream


def test_current_v1_capture() -> None:
    m = parse_metrics(fixture_text("v1-0.32.0-cpu-saturated.prom"))
    assert m.schema == SCHEMA_V1_CAPACITY
    assert m.dp_engines == 1
    (e,) = m.engines
    assert (e.model_name, e.engine) == ("tiny-llama", "0")
    assert e.running == 16.0
    assert e.waiting == 8.0
    assert e.waiting_by_reason == {"capacity": 8.0, "deferred": 0.0}
    assert e.kv_cache_usage == pytest.approx(16 / 31)
    assert e.preemptions_total == 82.0
    cc = e.cache_config
    assert cc is not None
    assert (cc.block_size, cc.num_gpu_blocks, cc.kv_cache_size_tokens) == (128, 32, 4096)
    assert cc.kv_cache_max_concurrency == 4.0
    assert cc.num_gpu_blocks_override == 32
    assert cc.labels["enable_prefix_caching"] == "True"
    assert cc.cache_dtype == "auto"
    assert "num_cpu_blocks" not in cc.labels  # "None" means unset: dropped
    assert m.process_start_time_seconds is not None


def test_legacy_v0_multiprocess() -> None:
    m = parse_metrics(fixture_text("v0-0.6.6-multiprocess.prom"))
    assert m.schema == SCHEMA_V0
    (e,) = m.engines
    assert e.engine == "0"  # V0 has no engine label
    assert e.kv_cache_usage == 0.75  # from gpu_cache_usage_perc
    assert e.swapped == 1.0
    assert e.cache_config is not None and e.cache_config.num_gpu_blocks == 5691
    assert e.waiting_for_capacity is None  # V0 gives no reason
    assert m.process_start_time_seconds is None


def test_v1_0_8_cache_config_none() -> None:
    m = parse_metrics(fixture_text("v1-0.8.5-legacy.prom"))
    assert m.schema == SCHEMA_V1_LEGACY
    (e,) = m.engines
    assert e.kv_cache_usage == 0.125
    assert e.cache_config is not None  # applies to the engine although it has no engine label
    assert e.cache_config.num_gpu_blocks is None
    assert e.cache_config.block_size == 16


def test_v1_data_parallel_engines() -> None:
    m = parse_metrics(fixture_text("v1-0.10.2-dp2.prom"))
    assert m.schema == SCHEMA_V1
    assert m.dp_engines == 2
    assert [(e.engine, e.running) for e in m.engines] == [("0", 4.0), ("1", 0.0)]
    assert all(e.cache_config and e.cache_config.num_gpu_blocks == 5332 for e in m.engines)


def test_prefers_kv_cache_usage_over_deprecated_name() -> None:
    text = fixture_text("v1-0.10.2-dp2.prom").replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="qwen3-14b"} 0.5',
        'vllm:kv_cache_usage_perc{engine="0",model_name="qwen3-14b"} 0.25',
    )
    assert parse_metrics(text).engines[0].kv_cache_usage == 0.25


def test_label_order_does_not_matter() -> None:
    text = fixture_text("v1-0.24-seed.prom").replace(
        '{engine="0",model_name="gemma-12b"} 20.0', '{model_name="gemma-12b",engine="0"} 20.0'
    )
    assert parse_metrics(text).engines[0].running == 20.0


def _selected(text: str) -> str:
    return "\n".join(select_lines(text, WANTED, META))


def test_only_the_latency_request_size_and_step_size_histograms_buckets_are_parsed() -> None:
    """The buckets of the histograms the agent learns from, and of them one sum: the steps' tokens."""
    kept = _selected(fixture_text("v1-0.32.0-cpu-idle.prom"))
    buckets = {line.split("{")[0] for line in kept.splitlines() if "_bucket{" in line}
    assert buckets == {
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:iteration_tokens_total_bucket",
    }
    sums = {line.split("{")[0] for line in kept.splitlines() if "_sum{" in line}
    assert sums == {"vllm:iteration_tokens_total_sum"}  # the steps' tokens: their mean size against the budget
    assert "_count{" not in kept
    assert "vllm:kv_cache_usage_perc{" in kept
    assert "# TYPE vllm:num_preemptions_total counter" in kept
    assert len(kept) < len(fixture_text("v1-0.32.0-cpu-idle.prom")) / 4  # a fifth of the body, the step sizes aside


def test_multiple_models_and_engines_are_kept_apart() -> None:
    base = fixture_text("v1-0.24-seed.prom")
    extra = "\n".join(
        line.replace('model_name="gemma-12b"', 'model_name="other"')
        for line in base.splitlines()
        if line.startswith("vllm:num_requests_running")
    )
    m = parse_metrics(base + extra + "\n")
    assert [(e.model_name, e.running) for e in m.engines] == [("gemma-12b", 20.0), ("other", 20.0)]


def test_an_integer_beyond_a_float_leaves_its_series_out() -> None:
    """prometheus-client's parser keeps '1000...0' (400 digits) as a Python int, which no float holds: that series
    is absent, the others stand (it once raised OverflowError on every cycle)."""
    body = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1' + "0" * 400 + "\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    (e,) = parse_metrics(body).engines
    assert e.running is None and e.kv_cache_usage == 0.5


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("", "empty_body"),
        ("<!DOCTYPE html><html><body>502 Bad Gateway</body></html>\n", "not_metrics"),
        ('{"detail":"Not Found"}\n', "not_metrics"),
        ("# HELP up x\n# TYPE up gauge\nup 1\n", "not_vllm"),
        ('vllm:num_requests_running{engine="0",model_name="m"} 1.0\nvllm:kv_cache_usage_perc{engi', "truncated"),
        ('vllm:num_requests_running{engine="0",model_name="m"} one\n', "parse_error"),
        ('vllm:num_requests_running{engine="0",model_name="m} 1\n', "parse_error"),
        # another vllm-capacity: vLLM's names only in its HELP texts, no family the agent reads
        (
            "# HELP vllm_capacity_kv_cache_usage_ratio From vllm:kv_cache_usage_perc.\n"
            "# TYPE vllm_capacity_kv_cache_usage_ratio gauge\n"
            'vllm_capacity_kv_cache_usage_ratio{engine="0",model_name="m"} 0.5\n',
            "not_vllm",
        ),
        # a duplicated series: Prometheus refuses the scrape, and silently taking the last one hides the fault
        (
            'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 9\n',
            "parse_error",
        ),
    ],
)
def test_bad_bodies_raise_with_reason(body: str, reason: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_metrics(body)
    assert err.value.reason == reason
    assert str(err.value)


def test_nan_values_are_unknown_not_zero() -> None:
    text = fixture_text("v1-0.24-seed.prom").replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="gemma-12b"} 0.4',
        'vllm:kv_cache_usage_perc{engine="0",model_name="gemma-12b"} NaN',
    )
    assert parse_metrics(text).engines[0].kv_cache_usage is None


@pytest.mark.parametrize(
    ("fixture", "itl"),
    [
        ("v1-0.32.0-cpu-idle.prom", "vllm:inter_token_latency_seconds"),
        ("v0-0.6.6-multiprocess.prom", None),  # its fixture carries only the TTFT histogram
        ("v1-0.8.5-legacy.prom", None),
    ],
)
def test_latency_histogram_name_is_recognised(fixture: str, itl: str | None) -> None:
    assert parse_metrics(fixture_text(fixture)).itl_metric == itl


def test_older_latency_name_is_recognised_from_help_and_type_alone() -> None:
    text = fixture_text("v1-0.8.5-legacy.prom") + (
        "# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.\n"
        "# TYPE vllm:time_per_output_token_seconds histogram\n"
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0\n'
        'vllm:time_per_output_token_seconds_count{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0\n'
        'vllm:time_per_output_token_seconds_sum{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.3\n'
    )
    assert [ln for ln in _selected(text).splitlines() if "_bucket" in ln] == [
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0'
    ]
    assert parse_metrics(text).itl_metric == "vllm:time_per_output_token_seconds"


def test_speculative_decoding_counters_v1_and_v0() -> None:
    """V1 counts drafts, draft and accepted tokens per engine (the real 0.32 server's lines, captured with an EAGLE
    drafter); V0 (0.6.6) has the token counters under the same names, without drafts or engine."""
    v1 = fixture_text("v1-0.32.0-cpu-idle.prom") + (
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.\n"
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny-llama"} 39.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny-llama"} 1.796125880993223e+09\n'
        "# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.\n"
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny-llama"} 78.0\n'
        "# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny-llama"} 13.0\n'
    )
    (e,) = parse_metrics(v1).engines
    assert (e.spec_drafts_total, e.spec_draft_tokens_total, e.spec_accepted_tokens_total) == (39.0, 78.0, 13.0)
    (plain,) = parse_metrics(fixture_text("v1-0.32.0-cpu-idle.prom")).engines
    assert plain.spec_draft_tokens_total is None  # no speculative decoding: nothing, not zero
    v0 = fixture_text("v0-0.6.6-multiprocess.prom") + (
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
        'vllm:spec_decode_num_draft_tokens_total{model_name="meta-llama/Meta-Llama-3-8B"} 400.0\n'
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{model_name="meta-llama/Meta-Llama-3-8B"} 300.0\n'
    )
    (e0,) = parse_metrics(v0).engines
    assert (e0.engine, e0.spec_drafts_total, e0.spec_accepted_tokens_total) == ("0", None, 300.0)


LORA_FAMILY = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    "# TYPE vllm:lora_requests_info gauge\n"
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7961258e+09\n'
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="code"} '
    "1.7961259e+09\n"
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7961257e+09\n'
)


def test_lora_requests_the_newest_series_is_read() -> None:
    """vLLM keeps a series for every pair of adapter lists it ever recorded, each valued with when it last did: the
    newest (largest) is the current one."""
    lora = parse_metrics(fixture_text("v1-0.32.0-cpu-idle.prom") + LORA_FAMILY).lora
    assert lora == LoraRequests(max_loras=2, running=("sql", "chat"), waiting=("code",))
    assert parse_metrics(fixture_text("v1-0.32.0-cpu-idle.prom")).lora is None  # no --enable-lora: no family
    odd = LORA_FAMILY.replace('max_lora="2"', 'max_lora="two"')
    assert parse_metrics(fixture_text("v1-0.32.0-cpu-idle.prom") + odd).lora.max_loras is None  # not a count


def _counted_reads(monkeypatch) -> list[int]:
    """A list that grows by one at each real read of selected lines (``read_selected``) by a stream."""
    from vllm_capacity.sources.vllm_metrics import stream as vllm_stream

    reads: list[int] = []
    real = vllm_stream.read_selected
    monkeypatch.setattr(
        vllm_stream, "read_selected", lambda selected, reader: reads.append(len(selected)) or real(selected, reader)
    )
    return reads


def _streamed(text: str | bytes, reader: ReaderMemory | None = None) -> object:
    """``text`` streamed and read as the client reads it (with ``reader``, the client's memory)."""
    stream = MetricsStream(latency=False, reader=reader)
    stream.feed(text.encode() if isinstance(text, str) else text)
    return stream.finish()


def test_every_body_is_read_whole_and_nothing_of_the_last_is_kept(monkeypatch) -> None:
    """The same body twice is selected and read twice (no memory across reads to fall out of date), and a moved
    line reads as a parse of the whole text does."""
    reads = _counted_reads(monkeypatch)
    body = fixture_text("v1-0.32.0-cpu-saturated.prom")
    running = 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 16.0'
    busier = body.replace(running, running[:-4] + "17.0")
    assert busier != body
    reader = ReaderMemory()  # the client's, warm after the first read: the moved line is a line it never read
    first, again, moved = _streamed(body, reader), _streamed(body, reader), _streamed(busier, reader)
    assert len(reads) == 3 and first == again and first is not again
    assert moved.engines[0].running == 17.0 and moved == parse_metrics(busier, latency=False)


def test_bytes_outside_ascii_anywhere_read_as_the_whole_text_and_bytes_not_utf8_are_refused() -> None:
    """UTF-8 outside ASCII (a model's name, a HELP text) before vLLM's families, in them or after them reads as a
    parse of the whole text does; bytes that are not UTF-8 are refused."""
    body = fixture_text("v1-0.32.0-cpu-saturated.prom")
    for old, new, char in [
        ("# HELP process_cpu_seconds_total Total", "# HELP process_cpu_seconds_total Tötal", "ö"),
        ('model_name="tiny-llama"', 'model_name="tiny-llamä"', "ä"),
        ('handler="/v1/models"', 'handler="/v1/mödels"', "ö"),
    ]:
        changed = body.replace(old, new)
        assert changed != body
        assert _streamed(changed) == parse_metrics(changed, latency=False), new
        with pytest.raises(SourceError) as err:
            _streamed(changed.encode().replace(char.encode(), b"\xff"))
        assert err.value.reason == Reason.PARSE_ERROR and "not UTF-8" in str(err.value), new
