"""The GPU side: NVML through a stand-in with nvidia-ml-py's own types and errors (no GPU here), the real
pynvml where it can run (no library on this machine), and the per-GPU memory budget."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pynvml
import pytest
import structlog
from prometheus_client import generate_latest

from lab import stop_process
from support.doubles import FakeClock, FakeVllm
from support.exposition import samples, value
from support.fake_nvml import SEED_LOG, WITHOUT_NVIDIA_LIBRARY, FakeGpu, FakeNvml, GiB, seed_gpu
from support.files import fixture_text
from vllm_capacity.derive.budget import COMPONENTS, gpu_budget
from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.exposition.render import build_registry
from vllm_capacity.live.agent import Agent, AgentSettings
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.nvml import NvmlSource
from vllm_capacity.sources.nvml_scope import visible_selection, vllm_pids_in_namespace
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_log import LogFollower


def render(agent: Agent) -> str:
    from prometheus_client import generate_latest

    return generate_latest(build_registry(agent, process_metrics=False)).decode()


async def _agent(fake_vllm: FakeVllm, tmp_path, nvml: NvmlSource, pids: set[int], **kw) -> Agent:
    fake_vllm.metrics = fixture_text("v1-0.24-seed.prom")
    fake_vllm.models = '{"data":[{"id":"gemma-12b","max_model_len":32768}]}'
    log = tmp_path / "vllm.log"
    log.write_text(SEED_LOG)
    settings = {k: kw.pop(k) for k in list(kw) if k in AgentSettings.__dataclass_fields__}
    return Agent(
        VllmClient(fake_vllm.url, timeout=10),
        AgentSettings(interval=0.05, **settings),
        nvml=nvml,
        vllm_pids=lambda: pids,
        vllm_log=LogFollower(log),
        **kw,
    )


def _components(text: str, gpu: str = "0") -> dict[str, float]:
    return {
        c: v
        for c in COMPONENTS
        if (v := value(text, "vllm_capacity_gpu_memory_bytes", gpu=gpu, component=c)) is not None
    }


async def test_worked_example_gpu_budget(fake_vllm: FakeVllm, tmp_path) -> None:
    """The worked example's GPU: ~22 GiB; weights 15.18, KV 4.31, graphs 0.78 (+ CUDA context) in vLLM's runtime."""
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([seed_gpu()])), {4242})
    await agent.cycle()
    text = render(agent)
    gpu = {"gpu": "0", "uuid": "GPU-5eed0000-0000-0000-0000-000000000000"}
    total = value(text, "vllm_capacity_gpu_memory_total_bytes", **gpu)
    assert total == int(22.03 * GiB)
    comps = _components(text)
    assert comps["weights"] == pytest.approx(15.18 * GiB)
    assert comps["kv_cache"] == pytest.approx(4.31 * GiB)
    assert comps["vllm_runtime"] == pytest.approx((0.78 + 0.5) * GiB, rel=1e-6)
    assert comps["other_processes"] == 0
    assert comps["system"] == 300 * 2**20  # the driver's reservation
    assert sum(comps.values()) == pytest.approx(total)
    assert value(text, "vllm_capacity_gpu_memory_budget_bytes", **gpu) == pytest.approx(total * 0.9)
    assert value(text, "vllm_capacity_gpu_process_memory_bytes", pid="4242", owner="vllm") > 20 * GiB
    assert value(text, "vllm_capacity_gpu_utilization_ratio", **gpu) == 0.87
    assert value(text, "vllm_capacity_gpu_memory_bandwidth_utilization_ratio", **gpu) == 0.41
    assert value(text, "vllm_capacity_gpu_power_watts", **gpu) == 182.0
    assert value(text, "vllm_capacity_gpu_power_limit_watts", **gpu) == 300.0
    assert value(text, "vllm_capacity_gpu_temperature_celsius", **gpu) == 64
    assert value(text, "vllm_capacity_gpu_sm_clock_hertz", **gpu) == 1.71e9
    assert value(text, "vllm_capacity_gpu_throttled", reason="sw_power_cap", **gpu) == 0
    assert value(text, "vllm_capacity_gpu_info", name="NVIDIA A10G", **gpu) == 1
    assert value(text, "vllm_capacity_gpu_memory_reserved_bytes", **gpu) == 300 * 2**20
    await agent.client.aclose()


async def test_eight_gpus_under_tensor_parallelism_by_elimination(fake_vllm: FakeVllm, tmp_path) -> None:
    """TP 8: one vLLM worker per GPU; the sidecar sees none of their PIDs, and the driver (before 535.113.01) lists
    them by host PID, so the largest process is vLLM's. A driver from 535.113.01 lists a process to the sidecar only
    by a PID it sees: none of them known to be vLLM's, whose they are is not guessed (unattributed)."""
    gpus = [
        FakeGpu(
            uuid=f"GPU-{i:08d}",
            total=80 * GiB,
            used=70 * GiB,
            processes=[(1000 + i, 70 * GiB)],
            reasons=pynvml.nvmlClocksEventReasonSwPowerCap if i == 3 else 0,
        )
        for i in range(8)
    ]
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml(gpus, driver="535.104.05")), set())
    await agent.cycle()
    text = render(agent)
    for i in range(8):
        comps = _components(text, str(i))
        assert comps["weights"] == pytest.approx(15.18 * GiB) and comps["kv_cache"] == pytest.approx(4.31 * GiB)
        assert sum(comps.values()) == pytest.approx(80 * GiB)
        assert value(text, "vllm_capacity_gpu_process_memory_bytes", gpu=str(i), owner="vllm") == 70 * GiB
    assert agent.snapshot.gpu_budgets["0"].identified_by == "elimination"
    assert value(text, "vllm_capacity_gpu_throttled", gpu="3", reason="sw_power_cap") == 1
    await agent.client.aclose()
    (newer,) = NvmlSource(loader=lambda: FakeNvml(gpus[:1], driver="550.54.15"))._read_sync()
    assert newer.host_pids is False
    b = gpu_budget(newer, vllm_pids=set(), weights_bytes=15.18 * GiB, kv_cache_bytes=4.31 * GiB)
    assert b.identified_by == "unattributed" and set(b.components) == {"free"}  # whose: unknown, not a guess


async def test_another_process_inside_the_budget(fake_vllm: FakeVllm, tmp_path) -> None:
    gpu = seed_gpu()
    gpu.processes.append((777, GiB // 2))  # e.g. a notebook on the same GPU, inside vLLM's 90 %
    gpu.used += GiB // 2
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    await agent.cycle()
    text = render(agent)
    assert _components(text)["other_processes"] == GiB // 2
    assert value(text, "vllm_capacity_gpu_process_memory_bytes", pid="777", owner="other") == GiB // 2
    assert sum(_components(text).values()) == pytest.approx(gpu.total)
    await agent.client.aclose()


async def test_mig_instances_are_their_own_devices(fake_vllm: FakeVllm, tmp_path) -> None:
    parent = FakeGpu(
        uuid="GPU-aaaa",
        name="NVIDIA H100 80GB HBM3",
        total=80 * GiB,
        mig=[
            FakeGpu(
                uuid="MIG-1111",
                name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                total=40 * GiB,
                used=30 * GiB,
                processes=[(4242, 30 * GiB)],
            ),
            FakeGpu(uuid="MIG-2222", name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", total=40 * GiB),
        ],
        power_mw=410_000,
        temp=51,
    )
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([parent])), {4242})
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="0/0", uuid="MIG-1111") == 40 * GiB
    assert value(text, "vllm_capacity_gpu_info", gpu="0/1", mig_parent="GPU-aaaa") == 1
    assert value(text, "vllm_capacity_gpu_utilization_ratio", gpu="0/0") is None  # not supported on MIG: absent
    # power, temperature and clocks are the whole GPU's: a MIG handle does not answer them, and the physical GPU's
    # own series carry them once (copied onto each of 7 instances, a node's sum counted the board 7 times)
    assert value(text, "vllm_capacity_gpu_power_watts", gpu="0", uuid="GPU-aaaa") == 410.0
    assert value(text, "vllm_capacity_gpu_temperature_celsius", gpu="0") == 51
    assert value(text, "vllm_capacity_gpu_sm_clock_hertz", gpu="0") == 1.71e9
    assert value(text, "vllm_capacity_gpu_info", gpu="0", uuid="GPU-aaaa", mig_parent="") == 1
    for board in ("power_watts", "temperature_celsius", "sm_clock_hertz"):
        assert [line for line in text.splitlines() if line.startswith(f"vllm_capacity_gpu_{board}{{")] == [
            line for line in text.splitlines() if line.startswith(f'vllm_capacity_gpu_{board}{{gpu="0",')
        ], board
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="0") is None  # its memory is its instances'
    await agent.client.aclose()


async def test_gpu_lost_mid_run_backs_off_and_recovers(fake_vllm: FakeVllm, tmp_path) -> None:
    gpu = seed_gpu()
    fake = FakeNvml([gpu])
    clock = FakeClock()
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: fake), {4242}, monotonic=clock)
    await agent.cycle()
    assert agent.snapshot.gpus
    gpu.lost = True
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        await agent.cycle()  # within the backoff: NVML is not asked again
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 0
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="gpu_lost") == 1
    assert [e["reason"] for e in logs if e["event"] == "source_failed"] == ["gpu_lost"]
    assert "vllm_capacity_gpu_memory_total_bytes" not in text  # nothing stale
    assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 208625  # vLLM metrics keep flowing
    gpu.lost = False
    clock.advance(agent.interval * 0.9)
    await agent.cycle()  # still within the first backoff (one interval): NVML is not asked
    assert not agent.sources["nvml"].up and fake.init_calls == 1
    clock.advance(agent.interval * 0.1)
    await agent.cycle()
    assert agent.sources["nvml"].up and agent.snapshot.gpus
    assert fake.init_calls == 2  # NVML started afresh after the GPU was lost
    assert (fake.starts, fake.refcount) == (2, 1)  # really afresh: the old reference was given back first
    await agent.client.aclose()


async def test_a_reset_gpu_comes_back_only_when_nvml_really_starts_again(fake_vllm: FakeVllm, tmp_path) -> None:
    """nvmlInit is reference-counted: calling it again while holding a reference starts nothing, and a GPU reset
    under the agent stays lost. The source gives its reference back first, so the library starts again."""
    gpu = seed_gpu()
    fake = FakeNvml([gpu])
    clock = FakeClock()
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: fake), {4242}, monotonic=clock)
    await agent.cycle()
    gpu.stale = True  # reset under us: lost until NVML starts again
    await agent.cycle()
    assert not agent.sources["nvml"].up
    clock.advance(agent.interval)
    await agent.cycle()
    assert agent.sources["nvml"].up and agent.snapshot.gpus, agent.errors
    assert (fake.starts, fake.refcount) == (2, 1)
    await agent.client.aclose()


async def test_a_hanging_call_times_out_and_is_not_piled_on(fake_vllm: FakeVllm, tmp_path) -> None:
    gpu = seed_gpu()
    clock = FakeClock()
    nvml = NvmlSource(loader=lambda: FakeNvml([gpu]), deadline=0.2)
    agent = await _agent(fake_vllm, tmp_path, nvml, {4242}, monotonic=clock)
    await agent.cycle()  # NVML answered once: from now on a hang is a failure
    gpu.hang = threading.Event()
    clock.advance(agent.interval)
    snap = await agent.cycle()
    assert snap.up and snap.engines[0].capacity_tokens == 208625  # vLLM was read while NVML hung
    assert agent.errors[("nvml", "timeout")] == 1
    clock.advance(agent.interval)  # the first backoff: one interval
    await agent.cycle()
    assert agent.errors[("nvml", "hung")] == 1  # the earlier call still blocks: no second thread
    assert [t.name for t in threading.enumerate()].count("nvml") == 1
    gpu.hang.set()
    (worker,) = [t for t in threading.enumerate() if t.name == "nvml"]
    await asyncio.to_thread(worker.join, 10)  # the wedged call returns
    clock.advance(agent.interval)  # half of the doubled backoff: not yet
    await agent.cycle()
    assert agent.errors[("nvml", "hung")] == 1 and not agent.sources["nvml"].up
    clock.advance(agent.interval * 1.5)  # past it
    await agent.cycle()
    assert agent.sources["nvml"].up
    await agent.client.aclose()


@WITHOUT_NVIDIA_LIBRARY
async def test_the_real_library_without_a_gpu(fake_vllm: FakeVllm, tmp_path) -> None:
    """The real pynvml on this machine: no libnvidia-ml. With --nvml auto nothing failed: one info line, no NVML
    series at all (no source_up 0, no error counter rising), and NVML is not asked again."""
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(), {4242})
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        await agent.cycle()
    assert [(e["event"], e["reason"], e["log_level"]) for e in logs if "nvml" in e["event"]] == [
        ("nvml_absent", "library_not_found", "info")
    ]
    assert not [e for e in logs if e["event"] == "source_failed"]
    text = render(agent)
    assert 'source="nvml"' not in text
    assert agent.snapshot.up and not agent.snapshot.gpus
    await agent.client.aclose()


@WITHOUT_NVIDIA_LIBRARY
async def test_nvml_on_without_a_library_is_a_failure(fake_vllm: FakeVllm, tmp_path) -> None:
    """--nvml on: the operator said there are GPUs, so no library is a counted, logged failure."""
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(), {4242}, nvml_required=True)
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
    assert [(e["reason"], e["log_level"]) for e in logs if e["event"] == "source_failed"] == [
        ("library_not_found", "warning")
    ]
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 0
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="library_not_found") == 1
    await agent.client.aclose()
    await agent.client.aclose()


def test_driver_errors_map_to_reasons() -> None:
    for code, reason in [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
    ]:
        source = NvmlSource(loader=lambda code=code: FakeNvml([], init_error=code))
        with pytest.raises(SourceError) as err:
            source._read_sync()
        assert err.value.reason == reason


def test_selection_by_index_or_uuid_and_from_the_environment() -> None:
    gpus = [FakeGpu(uuid=f"GPU-{i}") for i in range(4)]
    assert [g.uuid for g in NvmlSource(loader=lambda: FakeNvml(gpus), selection=["1", "GPU-3"])._read_sync()] == [
        "GPU-1",
        "GPU-3",
    ]
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2"}) == ["GPU-1", "GPU-2"]
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0"}) is None
    assert visible_selection({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]
    assert visible_selection({}) is None
    # "none": the container has no GPU (it was read as "every GPU")
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": "none"}) == []
    # "void": set by every CDI spec of NVIDIA's container toolkit and by its DRA driver in containers that do have
    # GPUs (the runtime decided): the GPUs NVML shows, narrowed by CUDA_VISIBLE_DEVICES when set (it read as none)
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": "void"}) is None
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": "1"}) == ["1"]
    cdi = NvmlSource(loader=lambda: FakeNvml(gpus), selection=visible_selection({"NVIDIA_VISIBLE_DEVICES": "void"}))
    assert [g.uuid for g in cdi._read_sync()] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]


def test_selection_by_mig_uuid_abbreviated_uuid_and_the_volume_mount_form(tmp_path) -> None:
    parent = FakeGpu(uuid="GPU-aaaa1111-0000", mig=[FakeGpu(uuid="MIG-m0"), FakeGpu(uuid="MIG-m1")])
    other = FakeGpu(uuid="GPU-bbbb2222-0000")

    def read(*selection: str) -> list[str]:
        return [
            g.uuid for g in NvmlSource(loader=lambda: FakeNvml([parent, other]), selection=list(selection))._read_sync()
        ]

    # one MIG instance, by its own UUID (it matched nothing), with its physical GPU's board (power, clocks: once)
    assert read("MIG-m1") == ["GPU-aaaa1111-0000", "MIG-m1"]
    assert read("GPU-aaaa1111-0000") == ["GPU-aaaa1111-0000", "MIG-m0", "MIG-m1"]  # the parent: all its instances
    assert read("GPU-bbbb") == ["GPU-bbbb2222-0000"]  # a unique prefix, as nvidia-smi accepts
    # the device plugin's volume-mount form: the devices are the entries of a directory
    mounts = tmp_path / "nvidia-container-devices"
    mounts.mkdir()
    (mounts / "GPU-bbbb2222-0000").touch()
    assert visible_selection({"NVIDIA_VISIBLE_DEVICES": str(mounts)}) == ["GPU-bbbb2222-0000"]


def test_a_selection_that_matches_nothing_is_a_failure_not_silence() -> None:
    source = NvmlSource(loader=lambda: FakeNvml([FakeGpu(uuid="GPU-1")]), selection=["GPU-9", "7"])
    with pytest.raises(SourceError, match="names none of the 1 GPUs") as err:
        source._read_sync()
    assert err.value.reason == Reason.GPU_NOT_FOUND


def test_budget_without_process_figures_leaves_components_absent() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-x", used=10 * GiB, processes=[(1, None)])])
    (reading,) = NvmlSource(loader=lambda: fake)._read_sync()
    b = gpu_budget(reading, vllm_pids={1}, weights_bytes=5 * GiB, kv_cache_bytes=3 * GiB)
    assert set(b.components) == {"free", "other_processes"}  # vLLM's memory unknown: no weights/runtime guesses
    down = gpu_budget(reading, vllm_up=False)
    assert "weights" not in down.components


@WITHOUT_NVIDIA_LIBRARY
def test_serve_with_nvml_auto_on_this_machine(fake_vllm_thread: str) -> None:
    """No GPU here: serve --nvml auto runs, says once that there is no NVML, and serves vLLM metrics."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_capacity",
            "serve",
            "--vllm-url",
            fake_vllm_thread,
            "--nvml",
            "auto",
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "100ms",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NVIDIA_VISIBLE_DEVICES": ""},
    )
    try:
        text = ""
        for _ in range(100):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            except httpx.TransportError:
                text = ""
            if value(text, "vllm_capacity_up") == 1:
                break
            threading.Event().wait(0.1)
        threading.Event().wait(0.3)  # a few more cycles: NVML must stay unasked and silent
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'source="nvml"' not in text
        assert value(text, "vllm_capacity_kv_cache_capacity_tokens") == 4096
    finally:
        _, stderr = stop_process(proc)
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert [(e["msg"], e["reason"]) for e in events if "nvml" in e["msg"]] == [("nvml_absent", "library_not_found")]
    assert not [e for e in events if e["msg"] == "source_failed"]


def test_report_draws_each_gpus_budget() -> None:
    from vllm_capacity.cli.report import gpu_picture
    from vllm_capacity.snapshot import Snapshot

    (reading,) = NvmlSource(loader=lambda: FakeNvml([seed_gpu()]))._read_sync()
    budget = gpu_budget(
        reading, vllm_pids={4242}, weights_bytes=15.18 * GiB, kv_cache_bytes=4.31 * GiB, gpu_memory_utilization=0.9
    )
    text = "\n".join(gpu_picture(Snapshot(gpus=(reading,), gpu_budgets={"0": budget})))
    assert "GPU 0 NVIDIA A10G" in text and "22.03 GiB" in text
    for label, size in [
        ("Model weights", "15.18 GiB"),
        ("KV cache", "4.31 GiB"),
        ("CUDA graphs, activations, context", "1.28 GiB"),
        ("Driver reserved", "300.00 MiB"),
    ]:
        line = next(ln for ln in text.splitlines() if label in ln)
        assert size in line
    assert len({len(ln) for ln in text.splitlines() if ln.startswith("  |") or ln.startswith("  +")}) == 1
    assert "vLLM's budget (gpu_memory_utilization): 19.83 GiB" in text


async def test_older_drivers_and_a_denied_field(fake_vllm: FakeVllm, tmp_path) -> None:
    """Driver generations the real binding meets: no _v3 process list (pynvml raises NVMLLibraryMismatchError, a
    plain Exception: the _v2 call answers), no ClocksEventReasons before 535.43.02 (ThrottleReasons, same bits),
    and a field the container may not read (absent, the rest of the GPU read)."""
    gpu = seed_gpu()
    gpu.no_v3_processes, gpu.no_event_reasons, gpu.reasons = True, True, 0x4
    gpu.denied = frozenset({"nvmlDeviceGetPowerUsage"})
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    assert value(text, "vllm_capacity_gpu_process_memory_bytes", pid="4242", owner="vllm") > 20 * GiB
    assert value(text, "vllm_capacity_gpu_throttled", reason="sw_power_cap", gpu="0") == 1
    assert "vllm_capacity_gpu_power_watts{" not in text  # denied: absent, never 0
    assert value(text, "vllm_capacity_gpu_power_limit_watts", gpu="0") == 300.0
    await agent.client.aclose()


async def test_one_failing_gpu_does_not_hide_the_others(fake_vllm: FakeVllm, tmp_path) -> None:
    """Of two GPUs one is lost: the other is still read and served, source_up{nvml} stays 1, the lost one is
    counted (gpu_lost) and logged once, its series absent."""
    healthy, lost = seed_gpu(), seed_gpu()
    lost.uuid, lost.lost = "GPU-10570000-0000-0000-0000-000000000000", True
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([healthy, lost])), {4242})
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="0") == int(22.03 * GiB)
    assert 'vllm_capacity_gpu_memory_total_bytes{gpu="1"' not in text
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="gpu_lost") == 2
    assert len([e for e in logs if e["event"] == "gpu_skipped"]) == 1
    await agent.client.aclose()


@pytest.mark.parametrize("selection", [["0"], ["GPU-5eed0000-0000-0000-0000-000000000000"]])
async def test_a_neighbours_failing_gpu_is_not_this_pods_error(fake_vllm: FakeVllm, tmp_path, selection) -> None:
    """The pod's GPU is 0 (by index, or by UUID); GPU 1, another pod's, is lost: it is never this pod's error. By
    index it is not even touched; by UUID its UUID cannot be read, but every entry of the selection was found."""
    ours, theirs = seed_gpu(), seed_gpu()
    ours.uuid = "GPU-5eed0000-0000-0000-0000-000000000000"
    theirs.uuid, theirs.lost = "GPU-10570000-0000-0000-0000-000000000000", True
    fake = FakeNvml([ours, theirs])
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: fake, selection=selection), {4242})
    await agent.cycle()
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="0") == int(22.03 * GiB)
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="gpu_lost") in (None, 0)
    assert fake.init_calls == 1  # nothing of ours was lost: NVML was not started afresh
    await agent.client.aclose()


async def test_a_gpu_that_times_out_is_skipped_not_the_whole_read(fake_vllm: FakeVllm, tmp_path) -> None:
    """NVML_ERROR_TIMEOUT concerns the GPU that answered it: the others are read."""
    healthy, slow = seed_gpu(), seed_gpu()
    slow.uuid, slow.error = "GPU-71e00000-0000-0000-0000-000000000000", pynvml.NVML_ERROR_TIMEOUT
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([healthy, slow])), {4242})
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="0") == int(22.03 * GiB)
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="timeout") == 1
    await agent.client.aclose()


async def test_a_unified_memory_gpu_reports_what_it_can(fake_vllm: FakeVllm, tmp_path) -> None:
    """GB10 / DGX Spark and Jetson Thor answer memory info with NotSupported (the whole read failed): the GPU is
    read, its memory and budget absent, its power and clocks there."""
    gpu = seed_gpu()
    gpu.unified = True
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    assert value(text, "vllm_capacity_gpu_power_watts", gpu="0") == 182.0
    assert "vllm_capacity_gpu_memory_total_bytes{" not in text
    assert "vllm_capacity_gpu_memory_bytes{" not in text  # no budget without the GPU's memory
    await agent.client.aclose()


def test_vllms_processes_are_found_with_their_spawned_workers(tmp_path: Path) -> None:
    """By command line (vllm serve, VLLM::EngineCore) and by descent: a worker started by multiprocessing's spawn
    names only python; the sidecar and unrelated processes are not vLLM's."""
    procs = {
        1: (b"/pause", 0),
        7: (b"vllm\0serve\0/models/m\0--tensor-parallel-size\x002", 1),
        8: (b"VLLM::EngineCore", 7),
        9: (b"/usr/bin/python3\0-c\0from multiprocessing.spawn import spawn_main; spawn_main()", 8),
        10: (b"/usr/bin/python3\0-c\0from multiprocessing.spawn import spawn_main; spawn_main()", 8),
        20: (b"/app/.venv/bin/vllm-capacity\0serve", 1),
        21: (b"/usr/bin/python3\0-c\0from multiprocessing.spawn import spawn_main; spawn_main()", 20),
        30: (b"sleep\x00100", 1),
    }
    for pid, (cmdline, ppid) in procs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} 1 1 0 -1")
    (tmp_path / "self").mkdir()
    assert vllm_pids_in_namespace(tmp_path) == {7, 8, 9, 10}
    assert vllm_pids_in_namespace(tmp_path / "missing") == set()


async def test_with_every_gpu_of_the_node_visible_the_pods_are_those_running_vllm(
    fake_vllm: FakeVllm, tmp_path
) -> None:
    """NVIDIA_VISIBLE_DEVICES=all in a sidecar shows the node's every GPU: the agent reports the ones running vLLM's
    processes, keeps them while vLLM is away, and with no evidence reports all of them with one warning."""
    ours = seed_gpu()
    other = FakeGpu(uuid="GPU-0ther000-0000-0000-0000-000000000000", used=8 * GiB, processes=[(999, 8 * GiB)])
    idle = FakeGpu(uuid="GPU-1d1e0000-0000-0000-0000-000000000000")
    agent = await _agent(
        fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([other, ours, idle]), narrow_to_vllm=True), {4242}
    )
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        assert [g.uuid for g in agent.snapshot.gpus] == [ours.uuid]
        ours.processes = []  # vLLM restarting: its GPU is still the pod's
        await agent.cycle()
        assert [g.uuid for g in agent.snapshot.gpus] == [ours.uuid]
    assert [e["gpus"] for e in logs if e["event"] == "gpus_of_vllm"] == [[ours.uuid]]
    await agent.client.aclose()

    blind = await _agent(
        fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([other, idle]), narrow_to_vllm=True), {4242}
    )
    with structlog.testing.capture_logs() as logs:
        await blind.cycle()
        await blind.cycle()
    assert len(blind.snapshot.gpus) == 2  # no GPU runs a vLLM process it can see: all are shown, and it says so
    assert [e["event"] for e in logs if e["event"] == "gpus_unattributed"] == ["gpus_unattributed"]
    await blind.client.aclose()


@pytest.mark.parametrize(
    ("gpus", "environ", "narrow"),
    [
        (None, {"NVIDIA_VISIBLE_DEVICES": "all"}, True),
        (None, {}, True),
        ("all", {"NVIDIA_VISIBLE_DEVICES": "all"}, False),  # --gpus all: every GPU, as asked
        (None, {"NVIDIA_VISIBLE_DEVICES": "GPU-5eed"}, False),
        (["0"], {"NVIDIA_VISIBLE_DEVICES": "all"}, False),
    ],
)
def test_only_an_unnamed_selection_is_narrowed_to_vllms_gpus(gpus, environ, narrow, monkeypatch) -> None:
    from vllm_capacity.cli.configs import SourceConfig
    from vllm_capacity.cli.serve import build_agent as _agent

    for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for var, v in environ.items():
        monkeypatch.setenv(var, v)
    config = SourceConfig(
        vllm_url="http://127.0.0.1:8000",
        timeout=5.0,
        flags=ServerFlags(),
        api_key_file=None,
        max_body_size=2**20,
        vllm_log=None,
        model_config=None,
        model_dir=None,
        tp=1,
        pp=1,
        nvml="on",
        gpus=gpus,
        slo_itl=None,
        slo_ttft=None,
        latency_half_life=3600.0,
    )
    gpus_read = _agent(config, 1.0).gpus
    assert gpus_read is not None and gpus_read.nvml is not None
    assert gpus_read.nvml.narrow_to_vllm is narrow


def test_memory_in_use_with_no_process_listed_is_hidden_not_other_processes_at_zero() -> None:
    """A sidecar in its own PID namespace on a driver from 535.113.01 gets an empty process list: whose the memory
    is cannot be told, so vLLM's, other processes' and the system's shares are absent (never other_processes 0 and
    everything under system). A GPU nobody uses still has other_processes 0."""
    busy = FakeGpu(uuid="GPU-b", used=20 * GiB, processes=[])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([busy]))._read_sync()
    b = gpu_budget(reading, vllm_pids={4242}, weights_bytes=5 * GiB, kv_cache_bytes=3 * GiB)
    assert b.identified_by == "hidden" and set(b.components) == {"free"}
    idle = FakeGpu(uuid="GPU-i", processes=[])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([idle]))._read_sync()
    b = gpu_budget(reading, vllm_pids={4242})
    assert b.identified_by == "none" and b.components["other_processes"] == 0


def test_memory_no_listed_process_explains_is_partly_hidden_not_other_processes_at_zero() -> None:
    """vLLM is listed (the pod shares its PID namespace) but another pod's process on the same GPU (time-slicing,
    MPS) is not: 6 GiB in use that neither the driver's reservation nor a listed process holds. Other processes and
    the system are absent, not other_processes 0 with the neighbour's 6 GiB under system; vLLM's own shares stand.
    Within 1 GiB (the CUDA context's and the driver's odd bytes) the listed processes explain the GPU."""
    shared = FakeGpu(uuid="GPU-s", used=16 * GiB, processes=[(4242, 10 * GiB)])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([shared]))._read_sync()
    b = gpu_budget(reading, vllm_pids={4242}, weights_bytes=5 * GiB, kv_cache_bytes=3 * GiB)
    assert b.partly_hidden_bytes == pytest.approx(6 * GiB)
    assert set(b.components) == {"free", "weights", "kv_cache", "vllm_runtime"}, b.components
    alone = FakeGpu(uuid="GPU-a", used=10 * GiB + 512 * 2**20, processes=[(4242, 10 * GiB)])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([alone]))._read_sync()
    b = gpu_budget(reading, vllm_pids={4242}, weights_bytes=5 * GiB, kv_cache_bytes=3 * GiB)
    assert b.partly_hidden_bytes is None and b.components["other_processes"] == 0 and "system" in b.components
    no_v2 = FakeGpu(uuid="GPU-o", used=16 * GiB, processes=[(4242, 10 * GiB)], supports_v2=False)
    (reading,) = NvmlSource(loader=lambda: FakeNvml([no_v2]))._read_sync()
    assert gpu_budget(reading, vllm_pids={4242}).partly_hidden_bytes is None  # without v2 the reservation is unknown


async def _two_reads(fake_vllm: FakeVllm, tmp_path, gpu: FakeGpu) -> tuple[str, list[dict]]:
    """The exposition after two cycles of an agent on ``gpu`` (vLLM's PID 4242), and what it logged."""
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
        await agent.cycle()
    await agent.client.aclose()
    return render(agent), logs


async def test_partly_hidden_processes_are_counted_and_said_once(fake_vllm: FakeVllm, tmp_path) -> None:
    gpu = seed_gpu()
    gpu.used, gpu.processes = 16 * GiB, [(4242, 10 * GiB)]
    text, logs = await _two_reads(fake_vllm, tmp_path, gpu)
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="processes_partly_hidden") == 2
    assert value(text, "vllm_capacity_gpu_memory_bytes", gpu="0", component="other_processes") is None
    assert value(text, "vllm_capacity_gpu_memory_bytes", gpu="0", component="system") is None
    assert [e["event"] for e in logs if e["event"] == "gpu_processes_partly_hidden"] == ["gpu_processes_partly_hidden"]


async def test_hidden_processes_are_counted_and_said_once(fake_vllm: FakeVllm, tmp_path) -> None:
    gpu = FakeGpu(uuid="GPU-b", used=20 * GiB, processes=[])
    text, logs = await _two_reads(fake_vllm, tmp_path, gpu)
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="processes_hidden") == 2
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1  # the GPU is read all the same
    assert _components(text) == {"free": pytest.approx(gpu.total - gpu.used - gpu.reserved)}
    assert [e["uuid"] for e in logs if e["event"] == "gpu_processes_hidden"] == ["GPU-b"]


async def test_an_idle_gpu_is_not_throttled(fake_vllm: FakeVllm, tmp_path) -> None:
    """The idle and application-clocks bits lower the clocks without throttling work: they are gpu_clock_event,
    apart from gpu_throttled, which the dashboard's throttling panel reads."""
    gpu = seed_gpu()
    gpu.reasons = 0x1 | 0x2 | 0x40  # idle, application clocks, hardware thermal slowdown
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_gpu_clock_event", reason="gpu_idle") == 1
    assert value(text, "vllm_capacity_gpu_clock_event", reason="applications_clocks_setting") == 1
    assert value(text, "vllm_capacity_gpu_throttled", reason="gpu_idle") is None
    assert value(text, "vllm_capacity_gpu_throttled", reason="hw_thermal_slowdown") == 1
    assert value(text, "vllm_capacity_gpu_throttled", reason="sw_power_cap") == 0
    await agent.client.aclose()


async def test_processes_holding_more_than_the_gpu_uses_are_counted_not_dropped(fake_vllm: FakeVllm, tmp_path) -> None:
    """A negative remainder (the listed processes hold more than the GPU's used memory) leaves system out, and is
    counted and said, never dropped silently."""
    gpu = seed_gpu()
    gpu.processes = [(4242, gpu.used), (999, 4 * GiB)]  # 4 GiB more than is in use
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu])), {4242})
    with structlog.testing.capture_logs() as logs:
        await agent.cycle()
    text = render(agent)
    assert "system" not in _components(text)
    assert value(text, "vllm_capacity_source_errors_total", source="nvml", reason="memory_inconsistent") == 1
    (event,) = [e for e in logs if e["event"] == "gpu_memory_inconsistent"]
    assert event["processes_over_used_bytes"] == pytest.approx(4 * GiB - gpu.reserved, abs=2**20)
    await agent.client.aclose()


def test_used_memory_is_named_by_the_memory_info_version() -> None:
    """v2: total = reserved + used + free, used without the driver's reservation; v1 (drivers before 510): used
    counts the reservation, and reserved is absent: each reading says which it is by reserved being known."""
    gpu = FakeGpu(uuid="GPU-a", used=10 * GiB)
    (v2,) = NvmlSource(loader=lambda: FakeNvml([gpu]))._read_sync()
    assert v2.memory_reserved_bytes == gpu.reserved and v2.memory_used_bytes == 10 * GiB
    assert v2.memory_total_bytes == v2.memory_reserved_bytes + v2.memory_used_bytes + v2.memory_free_bytes
    old = FakeGpu(uuid="GPU-b", used=10 * GiB, supports_v2=False)
    (v1,) = NvmlSource(loader=lambda: FakeNvml([old]))._read_sync()
    assert v1.memory_reserved_bytes is None and v1.memory_used_bytes == 10 * GiB + old.reserved
    assert v1.memory_total_bytes == v1.memory_used_bytes + v1.memory_free_bytes


PP_LOG = """\
(APIServer pid=1) INFO 10-03 16:20:00 [api_server.py:1] vLLM API server version 0.11.0
(Worker_PP0_TP0 pid=101) INFO 10-03 16:21:00 [gpu_model_runner.py:2602] Model loading took 10.50 GiB and 9.1 seconds
(Worker_PP1_TP0 pid=102) INFO 10-03 16:21:00 [gpu_model_runner.py:2602] Model loading took 12.25 GiB and 9.3 seconds
(Worker_PP0_TP0 pid=101) INFO 10-03 16:21:30 [gpu_worker.py:298] Available KV cache memory: 6.00 GiB
(Worker_PP1_TP0 pid=102) INFO 10-03 16:21:30 [gpu_worker.py:298] Available KV cache memory: 4.00 GiB
"""


async def test_under_pipeline_parallelism_each_gpu_takes_its_own_ranks_weights(fake_vllm: FakeVllm, tmp_path) -> None:
    """The stages' weights differ (the first holds the embeddings, the last the LM head): each GPU takes the weights
    its own rank logged (matched by the worker PID running on it); where no rank is matched nothing is assumed, and
    the KV cache, which differs by stage too, is left out rather than one stage's figure applied to every GPU."""
    first = FakeGpu(uuid="GPU-0", used=int(18 * GiB), processes=[(101, int(18 * GiB))])
    last = FakeGpu(uuid="GPU-1", used=int(18 * GiB), processes=[(102, int(18 * GiB))])
    unknown = FakeGpu(uuid="GPU-2", used=int(18 * GiB), processes=[(103, int(18 * GiB))])
    agent = await _agent(
        fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([first, last, unknown])), {101, 102, 103}
    )
    (tmp_path / "vllm.log").write_text(PP_LOG)
    await agent.cycle()
    text = render(agent)
    assert _components(text, "0")["weights"] == 10.5 * GiB
    assert _components(text, "1")["weights"] == 12.25 * GiB
    assert "weights" not in _components(text, "2")
    assert all("kv_cache" not in _components(text, g) for g in ("0", "1", "2"))
    await agent.client.aclose()


@pytest.mark.parametrize("old_driver", [False, True])
def test_under_mps_vllm_is_found_among_the_clients(old_driver: bool) -> None:
    """With MPS the compute list holds the MPS server; vLLM and the other clients are in the MPS list (on a driver
    without its _v3 symbol, through _v2): vLLM's share is its own, the server and the other client are others'."""
    gpu = FakeGpu(
        uuid="GPU-m",
        used=int(22 * GiB),
        processes=[(50, int(0.5 * GiB))],  # nvidia-cuda-mps-server
        mps_processes=[(4242, int(20 * GiB)), (999, int(1.5 * GiB))],
        no_mps_call=old_driver,
    )
    nvml = FakeNvml([gpu])
    tried: list[str] = []
    mps_v3, mps_v2 = nvml.nvmlDeviceGetMPSComputeRunningProcesses, nvml.nvmlDeviceGetMPSComputeRunningProcesses_v2
    nvml.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: tried.append("v3") or mps_v3(h)  # type: ignore[method-assign]
    nvml.nvmlDeviceGetMPSComputeRunningProcesses_v2 = lambda h: tried.append("v2") or mps_v2(h)  # type: ignore[method-assign]
    source = NvmlSource(loader=lambda: nvml)
    (reading,) = source._read_sync()
    assert {p.pid for p in reading.processes} == {50, 4242, 999}
    b = gpu_budget(reading, vllm_pids={4242})
    assert b.identified_by == "pid" and b.vllm_pids == (4242,)
    assert b.components["other_processes"] == int(0.5 * GiB) + int(1.5 * GiB)
    source._read_sync()  # the call that answers is found once per start of NVML, not tried again each read
    assert tried == (["v3", "v2", "v2"] if old_driver else ["v3", "v3"])


async def test_a_slow_first_read_is_starting_not_a_failure(fake_vllm: FakeVllm, tmp_path) -> None:
    """Without persistence mode NVML's first read can take seconds a GPU: while it runs (up to a minute) the agent
    serves vLLM's figures, counts no failure, says once that NVML is starting, and reads the GPUs once it answers."""
    gpu = seed_gpu()
    gpu.hang = threading.Event()  # the driver initialising the GPU
    clock = FakeClock()
    agent = await _agent(
        fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu]), deadline=0.2), {4242}, monotonic=clock
    )
    with structlog.testing.capture_logs() as logs:
        snap = await agent.cycle()
        clock.advance(agent.interval)
        await agent.cycle()  # the first read still runs: not piled on, not counted
    assert snap.up and snap.engines[0].capacity_tokens == 208625
    assert not [k for k in agent.errors if k[0] == "nvml"], agent.errors
    assert [e["event"] for e in logs if e["event"].startswith("nvml")] == ["nvml_starting"]
    assert not [e for e in logs if e["event"] == "source_failed"]
    gpu.hang.set()
    (worker,) = [t for t in threading.enumerate() if t.name == "nvml"]
    await asyncio.to_thread(worker.join, 10)
    clock.advance(agent.interval)
    await agent.cycle()
    assert agent.sources["nvml"].up and agent.snapshot.gpus
    await agent.client.aclose()


async def test_a_first_read_hanging_past_the_grace_is_a_failure(fake_vllm: FakeVllm, tmp_path) -> None:
    from vllm_capacity.live.gpus import NVML_FIRST_READ_GRACE

    gpu = seed_gpu()
    gpu.hang = threading.Event()
    clock = FakeClock()
    agent = await _agent(
        fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([gpu]), deadline=0.2), {4242}, monotonic=clock
    )
    await agent.cycle()
    clock.advance(NVML_FIRST_READ_GRACE)
    await agent.cycle()
    assert agent.errors[("nvml", "hung")] == 1
    gpu.hang.set()
    await agent.client.aclose()


@pytest.mark.parametrize("mps", [False, True])
def test_drivers_with_the_32_byte_process_structure_are_read_right(mps: bool) -> None:
    """Drivers 535.43.02-535.86.x write 32-byte process structures where pynvml reads 24-byte ones: through pynvml
    the first process is right and the next ones garbage (the double reproduces it from the bytes); the agent calls
    the function itself with the wide structure and gets every process right."""
    listed = [(4242, int(20 * GiB)), (999, int(1.5 * GiB)), (1000, None)]
    gpu = FakeGpu(
        uuid="GPU-w", used=int(22 * GiB), processes=[] if mps else listed, mps_processes=listed if mps else []
    )
    fake = FakeNvml([gpu], driver="535.54.03")
    fake.nvmlInit()
    through_pynvml = (
        fake.nvmlDeviceGetMPSComputeRunningProcesses(gpu) if mps else fake.nvmlDeviceGetComputeRunningProcesses(gpu)
    )
    assert through_pynvml[0].pid == 4242 and [p.pid for p in through_pynvml[1:]] != [999, 1000]  # the defect
    # the _v2 symbol keeps the 24-byte structure on those drivers (nvml.h 535.43.02): it reads right
    v2 = fake.nvmlDeviceGetMPSComputeRunningProcesses_v2 if mps else fake.nvmlDeviceGetComputeRunningProcesses_v2
    assert [(p.pid, p.usedGpuMemory) for p in v2(gpu)] == listed
    fake.nvmlShutdown()
    (reading,) = NvmlSource(loader=lambda: fake)._read_sync()
    assert [(p.pid, p.used_bytes) for p in reading.processes] == listed


@pytest.mark.parametrize(
    ("driver", "reader", "other", "partly_hidden"),
    [
        ("550.54.15", {4242}, None, 6 * GiB),  # 535.113.01+: the neighbour's process is not listed to this reader
        ("535.104.05", {4242}, 6 * GiB, None),  # before: every process by its host PID
        ("550.54.15", None, 6 * GiB, None),  # the host's namespace (or hostPID): everything listed
    ],
)
def test_the_readers_pid_namespace_decides_what_nvml_lists(driver, reader, other, partly_hidden) -> None:
    """A GPU time-sliced between this pod's vLLM (4242, 10 GiB) and another pod's process (7777, 6 GiB). Drivers from
    535.113.01 list to a reader only the processes its PID namespace sees: the neighbour's memory is then partly
    hidden, not a confident other_processes 0; older drivers list it by its host PID."""
    gpu = FakeGpu(uuid="GPU-t", used=16 * GiB, processes=[(4242, 10 * GiB), (7777, 6 * GiB)])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([gpu], driver=driver, reader_pids=reader))._read_sync()
    b = gpu_budget(reading, vllm_pids={4242}, weights_bytes=5 * GiB, kv_cache_bytes=3 * GiB)
    assert b.components.get("other_processes") == other and b.partly_hidden_bytes == partly_hidden
    assert b.components["vllm_runtime"] == 2 * GiB  # vLLM's own shares stand either way


def test_drivers_outside_that_range_use_pynvmls_own_calls() -> None:
    listed = [(4242, int(20 * GiB)), (999, int(1.5 * GiB))]
    for driver in ("535.104.05", "530.30.02", "570.86.10"):
        fake = FakeNvml([FakeGpu(uuid="GPU-n", used=int(22 * GiB), processes=listed)], driver=driver)
        (reading,) = NvmlSource(loader=lambda fake=fake: fake)._read_sync()
        assert [(p.pid, p.used_bytes) for p in reading.processes] == listed, driver


async def test_a_lost_gpu_is_its_own_series_while_the_others_report(fake_vllm: FakeVllm, tmp_path) -> None:
    """One of two GPUs lost: it reads gpu_up 0 under the index and UUID it had, the other keeps reporting; back,
    it reads 1 again. A GPU never read (not ours) gets no series."""
    a = seed_gpu()
    b = FakeGpu(uuid="GPU-b000", used=int(4 * GiB), processes=[(777, int(4 * GiB))])
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([a, b])), {4242})
    await agent.cycle()
    b.lost = True
    await agent.cycle()
    text = render(agent)
    assert value(text, "vllm_capacity_gpu_up", gpu="0", uuid=a.uuid) == 1
    assert value(text, "vllm_capacity_gpu_up", gpu="1", uuid="GPU-b000") == 0
    assert value(text, "vllm_capacity_gpu_memory_total_bytes", gpu="1") is None  # nothing stale
    assert value(text, "vllm_capacity_source_up", source="nvml") == 1
    b.lost = False
    await agent.cycle()
    await agent.cycle()  # the lost GPU restarted NVML: the next read sees it
    assert value(render(agent), "vllm_capacity_gpu_up", gpu="1", uuid="GPU-b000") == 1
    await agent.client.aclose()


async def test_beside_dcgm_exporter_the_device_series_are_left_out_and_the_budget_stays(
    fake_vllm: FakeVllm, tmp_path
) -> None:
    """--gpu-device-series off: what dcgm-exporter already exports of the GPU (utilization, power, clocks, throttling,
    memory used and free) is left out; the memory budget it has not, vLLM's processes, the total, gpu_up and gpu_info
    stay, with the same values as beside the device series."""
    agent = await _agent(fake_vllm, tmp_path, NvmlSource(loader=lambda: FakeNvml([seed_gpu()])), {4242})
    await agent.cycle()
    full = render(agent)
    lean = generate_latest(build_registry(agent, process_metrics=False, gpu_device_series=False)).decode()
    names = {n for n, _ in samples(full) if n.startswith("vllm_capacity_gpu_")}
    kept = {n for n, _ in samples(lean) if n.startswith("vllm_capacity_gpu_")}
    assert kept == {"vllm_capacity_gpu_up", "vllm_capacity_gpu_memory_total_bytes", "vllm_capacity_gpu_memory_bytes",
                    "vllm_capacity_gpu_memory_budget_bytes", "vllm_capacity_gpu_process_memory_bytes",
                    "vllm_capacity_gpu_info"}  # fmt: skip
    assert {"vllm_capacity_gpu_power_watts", "vllm_capacity_gpu_utilization_ratio"} <= names - kept
    assert {k: v for k, v in samples(lean).items() if k[0] in kept} == {
        k: v for k, v in samples(full).items() if k[0] in kept
    }
    await agent.client.aclose()
