"""The real ``vllm-capacity serve`` against one very large vLLM: its RSS while it reads ``N`` data-parallel engines
every second (the vLLM 0.32.0 capture with every per-engine series repeated, tests/support/payloads.py).

usage: .venv/bin/python bench/engines.py [--engines 1024] [--seconds 40]

Prints the RSS at the end, the most sampled and the kernel's high-water mark (VmHWM), against the sidecar's 128 Mi
limit, and what the read says (up, and the families left out at the scan's bounds). docs/performance.md and
docs/security.md quote the 1,024-engine figures (34 MiB a read: --max-body-size 64MiB).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1024)
    parser.add_argument("--seconds", type=int, default=40)
    args = parser.parse_args()
    body = data_parallel(args.engines).encode()

    class Vllm(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            answer = {"/metrics": body, "/v1/models": MODELS}.get(self.path, b'{"version":"0.32.0"}')
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_: object) -> None:
            pass

    vllm = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", f"http://127.0.0.1:{vllm.server_address[1]}",
         "--listen", f"127.0.0.1:{port}", "--interval", "1s", "--max-body-size", "64MiB", "--nvml", "off"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        samples = []
        for _ in range(args.seconds):
            time.sleep(1)
            samples.append(_status(proc.pid, "VmRSS"))
        peak = _status(proc.pid, "VmHWM")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    finally:
        proc.terminate()
        proc.wait(10)
        vllm.shutdown()
    up = next((line.split()[-1] for line in text.splitlines() if line.startswith("vllm_capacity_up ")), "?")
    left = [line for line in text.splitlines() if 'reason="family_over_limit"' in line]
    print(f"{args.engines} engines, a read of {len(body) / 2**20:.1f} MiB every second for {args.seconds} s:")
    print(f"  RSS at the end {samples[-1]} MiB, most sampled {max(samples)} MiB, high-water mark {peak} MiB "
          f"({peak / 128:.0%} of the 128 Mi limit)")  # fmt: skip
    print(f"  vllm_capacity_up {up}; {left[0] if left else 'no family left out'}")


if __name__ == "__main__":
    main()
