"""The series one sidecar can export at most, counted from the real exposition: an engine with every figure known
(the startup log, config.json, latency objectives with all 16 concurrency bins learned for both latencies, every
max_concurrency basis), each GPU with its memory budget and processes, and the agent's own process metrics. The
multi-cluster docs (docs/alerts.md, "Many clusters") quote these counts; this test fails when they drift."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from support.fake_nvml import FakeGpu, FakeNvml, seed_gpu
from support.files import FIXTURES, VLLM_FIXTURES
from support.payloads import data_parallel
from vllm_capacity.derive import EngineInputs, LatencyView, LoraSlots, ServerFacts, derive_engine
from vllm_capacity.derive.budget import gpu_budget
from vllm_capacity.derive.facts import ServedModel, ServerFlags
from vllm_capacity.derive.latency_curve import MAX_BINS, QUANTILES, bin_bounds
from vllm_capacity.exposition.render import build_registry
from vllm_capacity.snapshot import Snapshot, SourceState
from vllm_capacity.sources.model_config import load_config
from vllm_capacity.sources.nvml import NvmlSource
from vllm_capacity.sources.vllm_log import StartupFigures
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

DOC = Path(__file__).resolve().parents[1] / "docs" / "alerts.md"


def worst_case_series(engines: int) -> int:
    """Series of a sidecar beside a vLLM with ``engines`` data-parallel engines on as many GPUs, all figures known."""
    bins = bin_bounds(10_000.0)
    assert len(bins) == MAX_BINS
    view = LatencyView(
        quantiles={(k, b, q): 0.01 for k in ("itl", "ttft") for b in bins for q in QUANTILES},
        observations={(k, b): 1.0 for k in ("itl", "ttft") for b in bins},
        slo_max_concurrency=8,
        slo_knee_observed=True,
        context_p90_tokens=600.0,
    )
    log = StartupFigures()
    for line in (VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log").read_text().splitlines():
        log.feed(line)
    startup = log.engines["0"]
    startup = dataclasses.replace(startup, cuda_graph_bytes=2**30, weights_bytes=2**30, activation_peak_bytes=2**29)
    geometry = load_config(FIXTURES / "models" / "tiny-llama" / "config.json")
    inputs = EngineInputs(
        schema="v1-capacity",
        dp_engines=engines,
        max_model_len=1024,
        startup=startup,
        latency=view,
        preemptions_total=3.0,
        lora=LoraSlots(2, ("a", "b"), blocked=True) if engines == 1 else None,  # vLLM's LoRA series: one engine
    )
    facts = ServerFacts(model=ServedModel(geometry), flags=ServerFlags(max_num_seqs=16))
    derived = tuple(derive_engine(m, inputs, facts) for m in parse_metrics(data_parallel(engines)).engines)
    assert len(derived) == engines
    gpus: list[FakeGpu] = [
        dataclasses.replace(
            seed_gpu(),
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            used=2**30 + 2**28,  # what the processes hold: every component known (none partly hidden)
            processes=[(4242, 2**30), (5151, 2**28)],
        )
        for i in range(engines)
    ]
    readings = NvmlSource(loader=lambda: FakeNvml(gpus))._read_sync()
    budgets = {
        r.index: gpu_budget(r, vllm_pids={4242}, weights_bytes=2**30, kv_cache_bytes=2**30, gpu_memory_utilization=0.9)
        for r in readings
    }
    sources = {s: SourceState(up=True, duration_seconds=0.01) for s in ("vllm", "models", "nvml", "vllm_log")}
    snap = Snapshot(up=True, timestamp=0.0, schema="v1-capacity", engines=derived, gpus=readings, gpu_budgets=budgets,
                    sources=sources)  # fmt: skip
    served = SimpleNamespace(snapshot=snap, http_errors={})
    text = generate_latest(build_registry(served, process_metrics=True)).decode()  # type: ignore[arg-type]
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert len(set(series)) == len(series), "a series twice"
    return len(series)


@pytest.mark.parametrize("engines", [1, 8])
def test_the_documented_series_budget_is_what_the_agent_exports(engines: int) -> None:
    counted = worst_case_series(engines)
    rows = dict(re.findall(r"^\| (\d+) engines? \(and GPUs?\) \| (\d+) \|", DOC.read_text(), re.MULTILINE))
    assert rows.get(str(engines)) == str(counted), (
        f"docs/alerts.md should say | {engines} engine(s) (and GPU(s)) | {counted} |: {rows}"
    )
