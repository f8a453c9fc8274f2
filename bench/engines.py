"""The real ``vllm-capacity serve`` against one very large or hostile vLLM, read every second while Prometheus-like
scrapers fetch /metrics every second (gzip, OpenMetrics, as Prometheus asks): its RSS against the 128 Mi limit.

usage: .venv/bin/python bench/engines.py [--shape engines] [--engines 1024] [--scrapers 1] [--seconds 40]

Shapes: ``engines`` (the vLLM 0.32.0 capture with every per-engine series repeated for N data-parallel engines,
tests/support/payloads.py; --max-body-size 64MiB), ``long-line`` (one 31 MiB line at the default flags),
``gzip-bomb`` (a 1 GiB body gzipped to about 1 MiB, Content-Encoding gzip), ``cache-churn`` (cache_config_info's
labels changing on every read, 512 engines).

Prints the RSS at the end, the most sampled and the kernel's high-water mark (VmHWM), against the sidecar's 128 Mi
limit, what the read says (up, and the families left out at the scan's bounds) and the scrapes that failed.
docs/security.md quotes these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts" / "vllm-cpu")]

from lab import free_port  # noqa: E402
from support.payloads import data_parallel  # noqa: E402

MODELS = b'{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":1024}]}'


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status figure in MiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in text.splitlines() if line.startswith(field)).split()[1]) // 1024


def _body(shape: str, engines: int) -> tuple[object, dict[str, str], list[str]]:
    """What vLLM answers /metrics with (bytes, or a function giving each read's), its headers, the agent's flags."""
    if shape == "engines":
        return data_parallel(engines).encode(), {}, ["--max-body-size", "64MiB"]
    if shape == "long-line":
        line = "vllm:num_requests_running{" + 'x="' + "a" * (31 * 2**20) + '"} 1\n'
        return (data_parallel(1) + line).encode(), {}, []
    if shape == "gzip-bomb":
        lines = (b"#" * 1023 + b"\n") * 1024  # a MiB of comment lines: a body of whole lines, only too large
        bomb = gzip.compress(data_parallel(1).encode() + lines * 1024, compresslevel=9)
        return bomb, {"Content-Encoding": "gzip"}, []
    if shape == "cache-churn":
        text, counter = data_parallel(engines), itertools.count()

        def churn() -> bytes:  # a label of its own, new every read, on every engine's cache_config_info
            n = next(counter)
            return text.replace(
                "vllm:cache_config_info{", f'vllm:cache_config_info{{prefix_cache_epoch="{n}",'
            ).encode()

        return churn, {}, ["--max-body-size", "64MiB"]
    raise SystemExit(f"unknown shape {shape!r}")


def _scrape(url: str, stop: threading.Event, failed: list[str]) -> None:
    """A Prometheus scraping every second, asking as Prometheus does (gzip, OpenMetrics first)."""
    accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1"
    while not stop.wait(1.0):
        request = urllib.request.Request(url, headers={"Accept": accept, "Accept-Encoding": "gzip"})  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
                gzip.decompress(answer.read())
        except OSError as err:
            failed.append(type(err).__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("engines", "long-line", "gzip-bomb", "cache-churn"), default="engines")
    parser.add_argument("--engines", type=int, default=1024)
    parser.add_argument("--scrapers", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=40)
    args = parser.parse_args()
    body, headers, flags = _body(args.shape, args.engines if args.shape != "cache-churn" else min(args.engines, 512))

    class Vllm(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            metrics = body() if callable(body) else body
            answer = {"/metrics": metrics, "/v1/models": MODELS}.get(self.path, b'{"version":"0.32.0"}')
            self.send_response(200)
            for name, value in headers.items() if self.path == "/metrics" else ():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            with contextlib.suppress(ConnectionError):  # the agent hangs up on a body it refuses midway
                self.wfile.write(answer)

        def log_message(self, *_: object) -> None:
            pass

    vllm = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", f"http://127.0.0.1:{vllm.server_address[1]}",
         "--listen", f"127.0.0.1:{port}", "--interval", "1s", "--nvml", "off", *flags],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stop, failed = threading.Event(), []
    scrapers = [
        threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{port}/metrics", stop, failed), daemon=True)
        for _ in range(args.scrapers)
    ]
    try:
        for t in scrapers:
            t.start()
        samples = []
        for _ in range(args.seconds):
            time.sleep(1)
            samples.append(_status(proc.pid, "VmRSS"))
        peak = _status(proc.pid, "VmHWM")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)
        vllm.shutdown()
    up = next((line.split()[-1] for line in text.splitlines() if line.startswith("vllm_capacity_up ")), "?")
    left = [line for line in text.splitlines() if 'reason="family_over_limit"' in line]
    failed_reads = sorted(
        {
            re.search(r'reason="(\w+)"', line)[1]
            for line in text.splitlines()  # type: ignore[index]
            if line.startswith("vllm_capacity_source_errors_total{") and 'source="vllm"' in line
        }
    )
    size = len(body() if callable(body) else body) / 2**20
    what = f"{args.engines} engines" if args.shape == "engines" else args.shape
    print(f"{what}, a read of {size:.1f} MiB every second for {args.seconds} s, {args.scrapers} scraper(s):")
    print(f"  RSS at the end {samples[-1]} MiB, most sampled {max(samples)} MiB, high-water mark {peak} MiB "
          f"({peak / 128:.0%} of the 128 Mi limit)")  # fmt: skip
    print(f"  vllm_capacity_up {up}; {left[0] if left else 'no family left out'}; reads failed as {failed_reads}; "
          f"failed scrapes: {len(failed)}")  # fmt: skip


if __name__ == "__main__":
    main()
