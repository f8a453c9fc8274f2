"""Benchmark one agent cycle (parse, derive, render) on real vLLM payloads, against a plain full parse.

usage: .venv/bin/python bench/cycle.py [--seconds 2]

Payload: the real vLLM 0.32.0 capture (tests/fixtures/vllm/v1-0.32.0-cpu-saturated.prom), with every per-engine
series repeated for 1, 8 and 64 data-parallel engines. For each it prints the time of one agent cycle, the time of
``list(text_string_to_metric_families(payload))`` over the same text, their ratio (target <= 0.25), and microseconds
per KiB (linear growth = a flat figure). Then it runs the real ``vllm-capacity serve`` process against a loopback
server with the 64-engine payload at a 100 ms interval and prints its peak RSS (target < 60 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import sys
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_capacity.agent import Agent
from vllm_capacity.derive import derive_all
from vllm_capacity.exposition import build_registry
from vllm_capacity.snapshot import Snapshot
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_parse import parse_metrics

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "fixtures" / "vllm" / "v1-0.32.0-cpu-saturated.prom"


def payload(engines: int) -> str:
    """The capture with each series that has engine="0" repeated for engines 0..n-1 (kept inside its family)."""
    out = []
    for line in CAPTURE.read_text().splitlines():
        if 'engine="0"' in line and not line.startswith("#"):
            out.extend(line.replace('engine="0"', f'engine="{i}"') for i in range(engines))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def per_call(fn, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def bench_cycle(seconds: float) -> None:
    agent = Agent(VllmClient("http://127.0.0.1:9", timeout=1), interval=1)
    registry = build_registry(agent, process_metrics=False)
    print(f"{'engines':>8} {'payload':>10} {'cycle':>10} {'full parse':>11} {'ratio':>7} {'cycle us/KiB':>13}")
    for engines in (1, 8, 64):
        text = payload(engines)

        def cycle(text: str = text) -> None:
            m = parse_metrics(text)
            engines_ = tuple(derive_all(m, {"tiny-llama": 1024}, None))
            agent.snapshot = Snapshot(up=True, timestamp=0.0, schema=m.schema, engines=engines_)
            generate_latest(registry)

        def full(text: str = text) -> None:
            for family in text_string_to_metric_families(text):
                for _ in family.samples:
                    pass

        c, f = per_call(cycle, seconds), per_call(full, seconds)
        kib = len(text) / 1024
        print(f"{engines:>8} {kib:>8.0f}KiB {c * 1e3:>8.2f}ms {f * 1e3:>9.2f}ms {c / f:>7.3f} {c * 1e6 / kib:>13.1f}")


async def bench_rss(seconds: float) -> None:
    text = payload(64)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny-llama", "max_model_len": 1024}]})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/v1/models", models)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_capacity",
        "serve",
        "--vllm-url",
        url,
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        "100ms",
        "--log-level",
        "warning",
    )
    await asyncio.sleep(max(seconds, 2))  # started, and a few cycles in
    latencies = await _healthz_under_scrapes(f"http://127.0.0.1:{port}", max(seconds * 2, 4))
    if proc.returncode is not None:
        raise SystemExit(f"the agent exited with {proc.returncode}")
    status = await asyncio.to_thread(Path(f"/proc/{proc.pid}/status").read_text)
    proc.terminate()
    await proc.wait()
    await runner.cleanup()
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1024  # type: ignore[index]
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024  # type: ignore[index]
    print()
    print(
        f"agent process, 64-engine payload ({len(text) / 1024:.0f} KiB) every 100 ms: "
        f"RSS {rss:.1f} MiB, peak {peak:.1f} MiB (target < 60 MiB)"
    )
    latencies.sort()
    p50, p95 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.95)]
    print(
        f"/healthz while 3 clients scrape /metrics without pause: p50 {p50 * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms "
        f"({len(latencies)} probes)"
    )


async def _healthz_under_scrapes(agent: str, seconds: float) -> list[float]:
    """/healthz latencies, probed every 50 ms while three clients scrape the agent's /metrics back to back."""
    import httpx

    stop = asyncio.Event()
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:

        async def scrape() -> None:
            while not stop.is_set():
                await client.get(agent + "/metrics")

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await client.get(agent + "/healthz")
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(scrape()) for _ in range(3)] + [asyncio.create_task(probe())]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent on each measurement")
    args = ap.parse_args()
    bench_cycle(args.seconds)
    asyncio.run(bench_rss(args.seconds))


if __name__ == "__main__":
    main()
