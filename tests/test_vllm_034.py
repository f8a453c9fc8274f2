"""vLLM 0.34 read live at the first start after an upgrade: its extensible KV cache (sized after warm-up, an unset
gpu_memory_utilization resolved to 1.0), its start-up lines, and demand shed at its queue caps. The server and log
are built from 0.34.0's own format strings and labels (tests/support/vllm034.py); every release before reads as it
did (the golden outputs, tests/test_golden.py)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from support.doubles import FakeVllm
from support.exposition import samples, value
from support.fake_nvml import FakeGpu, FakeNvml
from support.vllm034 import CAPACITY, EXTENDED, GiB, Start034, metrics_034
from vllm_capacity.derive.facts import ServedModel
from vllm_capacity.exposition.render import build_registry
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sizing import SizingRules
from vllm_capacity.sources.nvml import NvmlSource
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_log import LogFollower, StartupFigures
from vllm_capacity.sources.vllm_metrics.records import CacheConfig

MODELS = '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":32768}]}'
TOTAL = int(79.19 * GiB)
GPU = {"gpu": "0", "uuid": "GPU-00340000"}


def _figures(lines: list[str]) -> StartupFigures:
    figures = StartupFigures()
    for line in lines:
        figures.feed(line)
    return figures


def test_the_pool_and_bytes_per_token_are_the_post_warm_up_figures() -> None:
    start = Start034()
    (engine,) = _figures(start.lines()).engines.values()
    assert engine.extensible
    assert engine.extended_blocks == engine.num_gpu_blocks == start.blocks
    # the pool is what the GPU holds after warm-up, never the estimate "Available KV cache memory" said before it
    # (its GiB written with two decimals)
    held = start.blocks * start.bytes_per_block + start.physical_extra_bytes
    assert engine.kv_pool_bytes == pytest.approx(held, abs=0.005 * GiB)
    assert abs(engine.kv_pool_bytes - start.estimate_bytes) > GiB
    # 128 KiB a token (Llama-3.1-8B bf16): blocks x a block's bytes over the post-warm-up tokens, within the null
    # block vLLM holds back; the estimate over those tokens would say 132 KiB
    assert engine.kv_bytes_per_token == pytest.approx(128 * 1024, rel=2e-4)
    assert start.estimate_bytes / start.tokens > 1.03 * 128 * 1024
    assert engine.kv_cache_tokens == start.tokens and engine.max_concurrency == pytest.approx(14.72)
    assert engine.requested_bytes == pytest.approx(79.19 * GiB)
    assert engine.weights_bytes == pytest.approx(14.99 * GiB) and engine.cuda_graph_bytes == pytest.approx(0.62 * GiB)
    assert engine.device == "GPU" and not engine.host_tier


def test_before_the_post_warm_up_lines_the_estimate_is_no_pool() -> None:
    lines = Start034().lines()
    upto = next(i for i, line in enumerate(lines) if "Memory after warmup" in line)
    (engine,) = _figures(lines[: upto + 1]).engines.values()
    assert engine.kv_pool_bytes is None and engine.kv_bytes_per_token is None
    assert engine.weights_bytes == pytest.approx(14.99 * GiB)  # the figures that stand are kept


def test_a_remap_and_a_host_tier_are_understood() -> None:
    start = Start034(remapped_from=7700, host_tier=True)
    (engine,) = _figures(start.lines()).engines.values()
    assert engine.remapped_from_blocks == 7700
    assert engine.num_gpu_blocks == start.blocks  # the final count, not warm-up's
    assert engine.device == "GPU" and engine.host_tier


def test_malformed_new_lines_carry_no_figure() -> None:
    prefix = "(Worker pid=1) INFO 12-07 10:00:00 [extensible_kv_cache.py:537] "
    lines = [
        *Start034().lines()[:2],
        prefix + "Extended KV cache to many blocks (58.91 GiB).",
        prefix + EXTENDED.replace("%d", "7540").replace("%.2f", "x"),
        prefix + "Memory after warmup: lots free",
    ]
    figures = _figures(lines)
    assert all(not e.extensible and e.kv_pool_bytes is None for e in figures.engines.values())


def test_an_unknown_extensible_flag_or_rejection_reason_is_named_and_adds_nothing() -> None:
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    good = parse_metrics(metrics_034(rejections=(3, 4)))
    assert good.implausible == () and good.engines[0].cache_config.resolved_gpu_memory_utilization == (
        1.0,
        "extensible_default",
    )
    flag = parse_metrics(metrics_034(cache_config={"enable_extensible_kv_cache": "maybe"}))
    assert flag.implausible == ("vllm:cache_config_info{enable_extensible_kv_cache}",)
    assert flag.engines[0].cache_config.resolved_gpu_memory_utilization is None  # unknown, never guessed as 1.0
    known = 'vllm:admission_rejections_total{model_name="tiny-llama",reason="max_num_queued_tokens"} 4'
    odd = 'vllm:admission_rejections_total{model_name="tiny-llama",reason="Queue full, \\"x\\""} 9.0'
    body = metrics_034(rejections=(3, 4))
    assert known in body
    reason = parse_metrics(body.replace(known, f"{known}\n{odd}"))
    assert reason.implausible == ("vllm:admission_rejections_total{reason}",)
    assert reason.admission_rejections == good.admission_rejections  # the two known reasons still counted
    assert sorted(good.admission_rejections.values()) == [3, 4]


def test_the_capacity_line_of_every_release_reads_alike() -> None:
    old = "(EngineCore_DP0 pid=2) INFO [kv_cache_utils.py:1147] GPU KV cache size: 208,625 tokens"
    new = "(EngineCore_DP0 pid=2) INFO [kv_cache_utils.py:1169] " + CAPACITY % ("GPU", "208,625", "32,768", 6.37)
    for line in (old, new):
        (engine,) = _figures([line]).engines.values()
        assert engine.kv_cache_tokens == 208_625 and engine.device == "GPU"


@pytest.mark.parametrize(
    ("labels", "resolved"),
    [
        ({"gpu_memory_utilization": "None", "enable_extensible_kv_cache": "True"}, (1.0, "extensible_default")),
        ({"gpu_memory_utilization": "None", "enable_extensible_kv_cache": "False"}, (0.92, "default")),
        ({"gpu_memory_utilization": "0.85", "enable_extensible_kv_cache": "True"}, (0.85, "set")),
        ({"gpu_memory_utilization": "0.92"}, (0.92, "set")),  # 0.32 and 0.33 always say it
        ({"gpu_memory_utilization": "None"}, None),  # neither the value nor the mode: unknown, not guessed
        ({"gpu_memory_utilization": "None", "enable_extensible_kv_cache": "maybe"}, None),
    ],
)
def test_gpu_memory_utilization_is_resolved_as_vllm_resolves_it(labels: dict, resolved: tuple | None) -> None:
    config = CacheConfig({k: v for k, v in labels.items() if v != "None"})  # the parser drops "None"
    assert config.resolved_gpu_memory_utilization == resolved


def _render(agent: Agent) -> str:
    return generate_latest(build_registry(agent, process_metrics=False)).decode()


async def _agent(
    fake_vllm: FakeVllm, tmp_path, start: Start034, lines: list[str] | None = None, **cache_config: str
) -> Agent:
    fake_vllm.metrics, fake_vllm.models = metrics_034(cache_config=cache_config), MODELS
    fake_vllm.version = '{"version":"0.34.0"}'
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(start.lines() if lines is None else lines) + "\n")
    held = int(start.weights_bytes + start.blocks * start.bytes_per_block + 2 * GiB)
    gpu = FakeGpu(uuid=GPU["uuid"], name="NVIDIA H100 80GB HBM3", total=TOTAL, used=held, processes=[(210, held)])
    return Agent(
        VllmClient(fake_vllm.url, timeout=10),
        AgentSettings(interval=0.05),
        nvml=NvmlSource(loader=lambda: FakeNvml([gpu])),
        vllm_pids=lambda: {210},
        vllm_log=LogFollower(log),
    )


@pytest.mark.parametrize(
    ("cache_config", "utilization"),
    [
        ({}, 1.0),  # unset, extensible: 1.0 (CacheConfig.resolved_gpu_memory_utilization)
        ({"enable_extensible_kv_cache": "False"}, 0.92),
        ({"gpu_memory_utilization": "0.9"}, 0.9),  # set: as set
    ],
)
async def test_a_034_server_reads_right_at_its_first_start(
    fake_vllm: FakeVllm, tmp_path, cache_config: dict, utilization: float
) -> None:
    start = Start034()
    agent = await _agent(fake_vllm, tmp_path, start, **cache_config)
    await agent.cycle()
    text = _render(agent)
    assert value(text, "vllm_capacity_up") == 1
    # the budget is the one vLLM resolved, not absent (main read the label "None" as no budget)
    assert value(text, "vllm_capacity_gpu_memory_budget_bytes", **GPU) == pytest.approx(TOTAL * utilization)
    engine = {"model_name": "tiny-llama", "engine": "0"}
    per_token = value(text, "vllm_capacity_kv_cache_bytes_per_token", method="startup_log", **engine)
    assert per_token == pytest.approx(128 * 1024, rel=2e-4)
    assert value(text, "vllm_capacity_gpu_memory_bytes", component="kv_cache", **GPU) == pytest.approx(
        start.blocks * start.bytes_per_block + start.physical_extra_bytes, abs=0.005 * GiB
    )
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens", **engine) == 482_496
    await agent.client.aclose()


async def test_an_estimate_without_its_post_warm_up_lines_is_not_served_as_the_pool(
    fake_vllm: FakeVllm, tmp_path
) -> None:
    """The log read stopped before warm-up's lines (a log cut, or lines vLLM changed again) while vLLM's labels
    say the cache is extensible: "Available KV cache memory" is the estimate, so no pool and no bytes per token
    from the log, rather than the estimate served as the pool."""
    start = Start034()
    lines = [line for line in start.lines() if "Memory after warmup" not in line and "Extended KV" not in line]
    agent = await _agent(fake_vllm, tmp_path, start, lines)
    await agent.cycle()
    text = _render(agent)
    engine = {"model_name": "tiny-llama", "engine": "0"}
    assert value(text, "vllm_capacity_kv_cache_bytes_per_token", method="startup_log", **engine) is None
    assert value(text, "vllm_capacity_gpu_memory_bytes", component="kv_cache", **GPU) is None
    assert value(text, "vllm_capacity_gpu_memory_budget_bytes", **GPU) == pytest.approx(TOTAL)
    await agent.client.aclose()


async def test_requests_shed_at_a_queue_cap_are_counted_named_and_carried(fake_vllm: FakeVllm) -> None:
    """vLLM's frontend answers 503 at --max-num-queued-reqs: those requests never wait. While its rejections rise
    the limit is queue_cap and headroom at most 0; the counter is carried across a vLLM restart."""
    fake_vllm.models = MODELS
    agent = Agent(VllmClient(fake_vllm.url, timeout=10), AgentSettings(interval=0.05))
    engine = {"model_name": "tiny-llama", "engine": "0"}
    # the last two: a restart, its counters from 0 again: held the first read, carried once the second confirms it
    reads = [((0, 0), 0), ((5, 0), 5), ((5, 0), 5), ((2, 1), 5), ((2, 1), 8)]
    states = []
    for i, (rejections, carried) in enumerate(reads):
        body = metrics_034(rejections=rejections)
        if i >= len(reads) - 2:
            body = body.replace("process_start_time_seconds 1.79", "process_start_time_seconds 1.80")
        fake_vllm.metrics = body
        await agent.cycle()
        text = _render(agent)
        total = sum(
            value(text, "vllm_capacity_requests_rejected_total", model_name="tiny-llama", reason=r) or 0
            for r in ("max_num_queued_reqs", "max_num_queued_tokens")
        )
        assert total == carried, (i, total)
        room = [v for (n, _), v in samples(text).items() if n == "vllm_capacity_headroom_requests"]
        states.append((value(text, "vllm_capacity_concurrency_limit", limit="queue_cap", **engine), room))
    assert states[0][0] != 1  # nothing shed yet
    assert states[1][0] == 1 and states[1][1] and max(states[1][1]) <= 0  # shedding now: no room
    assert states[2][0] != 1  # nothing more shed since the last read
    assert states[4][0] == 1 and max(states[4][1]) <= 0  # shed again after the restart
    await agent.client.aclose()


def test_the_fixture_is_the_real_capture_with_034_labels() -> None:
    body = metrics_034()
    assert 'enable_extensible_kv_cache="True"' in body and 'gpu_memory_utilization="None"' in body
    assert body.count("vllm:cache_config_info{") == 1
    assert dataclasses.asdict(Start034())["blocks"] == 7540


def test_shedding_names_the_queue_cap_and_leaves_no_room_on_a_calm_engine() -> None:
    from vllm_capacity.derive.capacity import Bounds, concurrency_limit, headroom

    calm = {"observed_context": 40.0, "slo": None}
    assert headroom(3.0, calm) == (37.0, "observed_context")
    assert headroom(3.0, calm, shedding=True) == (0.0, "queue_cap")  # the model says 37: vLLM says no
    assert headroom(3.0, calm, queue=4.0, shedding=True) == (-4.0, "queue")  # a queue is the stronger evidence
    args = {"running": 3.0, "waiting": 0.0, "waiting_for_capacity": 0.0, "preempted": True, "usage": 0.2}
    assert concurrency_limit(**args) == "kv_cache"
    assert concurrency_limit(**args, bounds=Bounds(shedding=True)) == "queue_cap"


LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json, the fields the plan reads
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}  # fmt: skip
H100 = ["--gpu-memory", "79.19GiB", "--weights-memory", "14.99GiB", "--activation-memory", "1.19GiB"]
H100 += ["--cuda-graph-memory", "0.62GiB", "--max-model-len", "32768", "--format", "json"]


def _plan(tmp_path, *args: str) -> tuple[int, dict | str]:
    import contextlib
    import io
    import json

    from vllm_capacity import cli

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["plan", "--model-config", str(config), *args], environ={})
    return code, json.loads(out.getvalue()) if code == 0 and "json" in args else err.getvalue()


def test_the_plan_follows_the_release_block_size_budget_and_sizing(tmp_path) -> None:
    code, new = _plan(tmp_path, *H100)
    assert code == 0
    budget = new["memory_budget"]
    assert new["block_size"] == 64 and budget["gpu_memory_utilization"] == 1.0 and budget["extensible_kv_cache"]
    # measure_kv_cache_bytes: min(requested - held, free - margin) - transient peak, the margin max(1 GiB, 0.75 x
    # 1.19 GiB); the GPU all free at start: 79.19 - 14.99 - 0.62 - 1 (margin) - 1.19 = 61.39 GiB
    assert budget["kv_cache_bytes"] == pytest.approx(61.39 * GiB, abs=2 << 20)
    assert budget["extensible_margin_bytes"] == GiB
    assert new["num_gpu_blocks"] == int(61.39 * GiB) // (8 << 20)
    code, old = _plan(tmp_path, *H100, "--vllm-version", "0.33.0")
    assert code == 0 and old["block_size"] == 16 and not old["memory_budget"]["extensible_kv_cache"]
    # 0.33: the estimate from 0.92 (its field default) of the GPU
    assert old["memory_budget"]["gpu_memory_utilization"] == 0.92
    estimate = 79.19 * GiB * 0.92 - 14.99 * GiB - 1.19 * GiB - 0.62 * GiB
    assert old["memory_budget"]["kv_cache_bytes"] == pytest.approx(estimate, abs=4)
    code, off = _plan(tmp_path, *H100, "--extensible-kv-cache", "off")
    assert code == 0 and off["memory_budget"]["gpu_memory_utilization"] == 0.92 and off["block_size"] == 64
    code, rocm = _plan(tmp_path, *H100, "--platform", "rocm")
    assert rocm["memory_budget"]["extensible_margin_bytes"] == 3 * GiB  # KV_CACHE_MARGIN_FLOOR_BYTES on ROCm
    assert budget["kv_cache_bytes"] - rocm["memory_budget"]["kv_cache_bytes"] == pytest.approx(2 * GiB, abs=4)
    code, xpu = _plan(tmp_path, *H100, "--platform", "xpu")
    assert code == 0 and not xpu["memory_budget"]["extensible_kv_cache"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--extensible-kv-cache", "on", "--vllm-version", "0.33.0"], "has no extensible KV cache"),
        (["--extensible-kv-cache", "on", "--platform", "cpu"], "only on CUDA and ROCm"),
        (["--extensible-kv-cache", "sometimes"], "--extensible-kv-cache"),
        (["--platform", "metal"], "--platform"),
    ],
)
def test_an_extensible_cache_vllm_would_refuse_is_refused(tmp_path, args: list[str], message: str) -> None:
    code, err = _plan(tmp_path, *H100[:-2], *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_plan_says_how_034_sizes_it_and_which_lines_to_read(tmp_path) -> None:
    _, plan = _plan(tmp_path, *H100[:-2], "--gpu-memory-utilization", "0.9", "--format", "json")
    notes = " ".join(plan["notes"])
    assert "Extensible KV cache" in notes and "vLLM warns" in notes and "leave it unset" in notes
    _, logged = _plan(tmp_path, "--kv-cache-memory", "58.91GiB", "--max-model-len", "32768", "--format", "json")
    assert any("'Extended KV cache to N blocks (X GiB)'" in n for n in logged["notes"])
    # 7,540 blocks of 8 MiB: the figure 'Extended KV cache to 7540 blocks (58.91 GiB)' gives
    assert logged["num_gpu_blocks"] == 7540


async def test_the_report_says_the_cache_was_sized_after_warm_up(fake_vllm: FakeVllm, tmp_path) -> None:
    from vllm_capacity.cli.report import render_text

    agent = await _agent(fake_vllm, tmp_path, Start034(remapped_from=7700))
    await agent.cycle()
    out = render_text(agent.snapshot, fake_vllm.url)
    assert "sized after warm-up (vLLM 0.34's extensible KV cache, within the requested 79.19 GiB" in out
    assert "remapped from the 7,700 blocks warm-up had committed" in out
    await agent.client.aclose()


OFFLOAD_INFO = """\
# HELP vllm:kv_offload_config_info Static configuration of the KV offload managers of this engine instance.
# TYPE vllm:kv_offload_config_info gauge
vllm:kv_offload_config_info{cpu_blocks_per_chunk="1",cpu_kv_cache_size_bytes="%d",cpu_kv_cache_size_tokens="%s",cpu_num_chunks="8192",engine="0",model_name="tiny-llama"} 1.0
"""  # noqa: E501
SIMPLE_OFFLOAD = """\
# HELP vllm:simple_kv_offload_used_blocks Offload-pool blocks currently pinned by in-flight transfers or cache hits.
# TYPE vllm:simple_kv_offload_used_blocks gauge
vllm:simple_kv_offload_used_blocks{engine="0",model_name="tiny-llama"} 12.0
# HELP vllm:simple_kv_offload_info SimpleCPUOffloadConnector deployment facts.
# TYPE vllm:simple_kv_offload_info gauge
vllm:simple_kv_offload_info{backend="cpu",capacity_blocks="4096",engine="0",lazy_offload="false",model_name="tiny-llama",page_cache="false"} 1.0
"""  # noqa: E501


def _engine(body: str):
    from support.files import FIXTURES
    from vllm_capacity.derive import EngineInputs, ServerFacts, derive_engine
    from vllm_capacity.sources.model_config import load_config
    from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

    (m,) = parse_metrics(body).engines
    facts = ServerFacts(
        model=ServedModel(load_config(FIXTURES / "models" / "tiny-llama" / "config.json")), version="0.34.0"
    )
    inputs = EngineInputs(schema="v1-capacity", max_model_len=1024, rules=SizingRules("v1", (0, 34, 0)))
    return derive_engine(m, inputs, facts)


def test_the_cpu_tier_vllm_reports_wins_over_the_plan() -> None:
    tiered = {"kv_offloading_size": "1.0", "kv_cache_memory_bytes": str(GiB), "block_size": "16"}
    planned = _engine(metrics_034(cache_config=tiered))
    assert planned.cpu_capacity_tokens is not None and not planned.cpu_capacity_reported  # the plan's, from 1 GiB
    reported = _engine(metrics_034(cache_config=tiered, extra=OFFLOAD_INFO % (GiB, "524288")))
    assert reported.cpu_capacity_tokens == 524_288 and reported.cpu_capacity_reported
    assert reported.cpu_capacity_tokens_planned == planned.cpu_capacity_tokens != 524_288  # they differ: vLLM's wins
    unknown = _engine(metrics_034(cache_config=tiered, extra=OFFLOAD_INFO % (GiB, "None")))  # max_model_len unknown
    assert unknown.cpu_capacity_tokens == planned.cpu_capacity_tokens and not unknown.cpu_capacity_reported
    simple = _engine(metrics_034(extra=SIMPLE_OFFLOAD))
    assert simple.cpu_capacity_tokens == 4096 * 64 and simple.cpu_used_tokens == 12 * 64  # in the engine's blocks


def test_a_cpu_tier_series_with_bad_labels_adds_nothing() -> None:
    for tokens in ("-5", "1e300", "many", ""):
        e = _engine(metrics_034(extra=OFFLOAD_INFO % (GiB, tokens)))
        assert e.cpu_capacity_tokens is None, tokens
