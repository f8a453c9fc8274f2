"""scripts/vllm_metric_names.py, the reader that keeps tests/fixtures/vllm/metric-names.tsv: each form in which vLLM's
files register a family, over synthetic sources shaped as those files write them, and the committed table as the
script writes it."""

from __future__ import annotations

from pathlib import Path

import vllm_metric_names as names

LOGGERS = """
import prometheus_client
KV_OFFLOAD_CONFIG_INFO = "vllm:kv_offload_config_info"

class PrometheusStatLogger:
    _gauge_cls = prometheus_client.Gauge
    _counter_cls = prometheus_client.Counter

    def __init__(self):
        self.gauge_running = self._gauge_cls(name="vllm:num_requests_running", documentation="...")
        self.counter_rejected = self._counter_cls(name="vllm:admission_rejections", documentation="...")
        self.histogram_ttft = prometheus_client.Histogram("vllm:time_to_first_token_seconds", "...")
        self.info = self._gauge_cls(name=KV_OFFLOAD_CONFIG_INFO, documentation="...")
        self.not_a_family = self._gauge_cls(name="not_vllm", documentation="...")
"""

SPEC_DECODE = """
class SpecDecodingProm:
    def __init__(self):
        for name, doc in [
            ("vllm:spec_decode_num_drafts", "drafts"),
            ("vllm:spec_decode_num_accepted_tokens", "accepted"),
        ]:
            self._counter_cls(name=name, documentation=doc)
"""

OFFLOAD = """
CPU_HITS = "vllm:cpu_offload_hits"
METRICS = {
    CPU_HITS: OffloadingCounterMetadata(documentation="hits"),
    "vllm:cpu_offload_bytes": OffloadingHistogramMetadata(documentation="bytes"),
}
"""


def test_each_form_a_family_is_registered_in() -> None:
    assert names.families(LOGGERS) == {
        ("vllm:num_requests_running", "gauge"),
        ("vllm:admission_rejections_total", "counter"),  # exposed with _total
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:kv_offload_config_info", "gauge"),  # a constant of the file
    }
    assert names.families(SPEC_DECODE) == {
        ("vllm:spec_decode_num_drafts_total", "counter"),
        ("vllm:spec_decode_num_accepted_tokens_total", "counter"),
    }
    assert names.families(OFFLOAD) == {
        ("vllm:cpu_offload_hits_total", "counter"),
        ("vllm:cpu_offload_bytes", "histogram"),
    }


def test_a_release_is_read_file_by_file_and_clients_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "vllm"
    (root / "v1" / "metrics").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "benchmarks").mkdir()
    (root / "v1" / "metrics" / "loggers.py").write_text(LOGGERS)
    (root / "engine" / "metrics.py").write_text('Gauge(name="vllm:gpu_cache_usage_perc", documentation="")')
    (root / "benchmarks" / "serve.py").write_text('Gauge(name="vllm:from_a_client", documentation="")')
    found = names.release_families(root)
    assert found[("vllm:gpu_cache_usage_perc", "v0")] == "gauge"
    assert found[("vllm:num_requests_running", "v1")] == "gauge"
    assert not any(name == "vllm:from_a_client" for name, _ in found)


def test_merge_widens_first_and_last_and_adds_new_families() -> None:
    rows = {("vllm:a", "v1"): ["vllm:a", "gauge", "v1", "0.8.0", "0.31.0"]}
    names.merge(rows, "0.34.0", {("vllm:a", "v1"): "gauge", ("vllm:b_total", "v1"): "counter"})
    names.merge(rows, "0.10.0", {("vllm:a", "v1"): "gauge"})
    names.merge(rows, "0.7.3", {("vllm:b_total", "v1"): "counter"})
    assert rows[("vllm:a", "v1")] == ["vllm:a", "gauge", "v1", "0.8.0", "0.34.0"]  # 0.10 < 0.8 is not taken as text
    assert rows[("vllm:b_total", "v1")] == ["vllm:b_total", "counter", "v1", "0.7.3", "0.34.0"]


def test_the_committed_table_is_as_the_script_writes_it(tmp_path: Path) -> None:
    header, rows = names.read_tsv(names.TSV)
    assert len(rows) > 100
    # V0 registered cache_config_info as prometheus-client's Info
    assert all(row[1] in (*names.KINDS, "info") and row[2] in ("v0", "v1") for row in rows.values())
    copy = tmp_path / "metric-names.tsv"
    names.write_tsv(copy, header, rows)
    assert copy.read_text() == names.TSV.read_text()
