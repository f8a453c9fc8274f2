"""Capture real vLLM exposition for the test fixtures: idle, saturated and after-load /metrics, /v1/models.

usage: capture.py OUT_DIR [--url URL]
Without --url it starts its own small-KV server (32 blocks, 16 seqs) from the cache made by ``install``.
Writes v1-<version>-cpu-{idle,saturated,after}.prom, v1-<version>-cpu-models.json and the startup log's KV lines.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx

import lab


def busiest_sample(url: str, run) -> str:
    """Sample /metrics while ``run()`` drives load; return the sample with the fullest cache and longest queue."""
    samples: list[tuple[tuple[float, float, float], str]] = []
    stop = threading.Event()

    def key(text: str, name: str) -> float:
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        return float(m[1]) if m else 0.0

    def sampler() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                text = client.get(url + "/metrics").text
                score = tuple(
                    key(text, n)
                    for n in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")
                )
                samples.append((score, text))  # type: ignore[arg-type]
                time.sleep(0.1)

    th = threading.Thread(target=sampler)
    th.start()
    try:
        run()
    finally:
        stop.set()
        th.join()
    return max(samples, key=lambda s: s[0])[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--url")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.url
    if not url:
        lab.install()
        server = lab.VllmServer(log_path=Path(tempfile.mkdtemp()) / "vllm.log", extra_args=lab.SMALL_KV_ARGS)
        server.start().wait_ready()
        url = server.url
    try:
        version = httpx.get(url + "/version").json()["version"]
        stem = f"v1-{version}-cpu"
        (args.out / f"{stem}-idle.prom").write_text(httpx.get(url + "/metrics").text)
        (args.out / f"{stem}-models.json").write_text(httpx.get(url + "/v1/models").text)
        saturated = busiest_sample(url, lambda: lab.drive_load(url, parallel=24, max_tokens=512))
        (args.out / f"{stem}-saturated.prom").write_text(saturated)
        time.sleep(1)
        (args.out / f"{stem}-after.prom").write_text(httpx.get(url + "/metrics").text)
        if server:
            kv = [
                ln
                for ln in server.log_text().splitlines()
                if re.search(r"\[(kv_cache_utils|cpu_worker|gpu_worker)\.py", ln)
            ]
            (args.out / f"{stem}-startup.log").write_text("\n".join(kv) + "\n")
    finally:
        if server:
            with contextlib.suppress(Exception):
                server.stop()
    print("captured into", args.out)


if __name__ == "__main__":
    main()
