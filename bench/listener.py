"""The listener under many connections: the real ``vllm-capacity serve`` with TLS (a certificate made here with
trustme), its RSS against its own baseline in the same run.

usage: .venv/bin/python bench/listener.py [--connections 500]

Rows (each from a fresh baseline of the same process, after the previous row's connections are gone):

1. ``idle TCP``: connections that never send a byte (no ClientHello). Before #28 row 1 these were uncounted, had no
   deadline and held ~300 KiB each (asyncio's TLS protocol and its 256 KiB buffer, made at accept).
2. ``partial ClientHello``: connections that send the first bytes of a handshake and stall: a TLS session each,
   until the 5 s handshake deadline or the 10 s head deadline closes them.
3. After each row the connections are closed, then the RSS is read again: freed memory goes back to the system
   (malloc_trim) once most connections are gone.

The figures are printed as MiB and as a ratio to the baseline; docs/security.md quotes them.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trustme
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "vllm-cpu"))

from lab import free_port  # noqa: E402


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def _wait_for(port: int) -> None:
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"bench/listener.py: the sidecar did not listen on {port}")


def _web_config(d: Path) -> Path:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(d / "tls.crt"))
    cert.private_key_pem.write_to_path(str(d / "tls.key"))
    config = {"tls_server_config": {"cert_file": str(d / "tls.crt"), "key_file": str(d / "tls.key")}}
    (d / "web.yml").write_text(yaml.safe_dump(config))
    return d / "web.yml"


def _row(pid: int, port: int, n: int, first: bytes) -> tuple[float, float, float, int]:
    """(baseline, with n connections, after they closed) MiB, and how many the sidecar closed itself."""
    base = _rss_mib(pid)
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if first:
            s.sendall(first)
        conns.append(s)
    time.sleep(1.0)
    held = _rss_mib(pid)
    deadline = time.monotonic() + 15  # the head deadline (10 s) closes them all
    closed = 0
    for s in conns:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    time.sleep(1.0)
    return base, held, _rss_mib(pid), closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=500)
    n = parser.parse_args().connections
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", "http://127.0.0.1:9",
             "--listen", f"127.0.0.1:{port}", "--web.config.file", str(_web_config(Path(tmp)))],
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_for(port)
            time.sleep(1.0)
            print(f"TLS listener, {n} connections at once (RSS of the serve process)\n")
            print("| connections | baseline MiB | held MiB | per connection KiB | after they go MiB | closed by it |")
            print("|---|---|---|---|---|---|")
            for name, first in (("idle TCP, no ClientHello", b""), ("partial ClientHello", b"\x16\x03\x01")):
                base, held, after, closed = _row(proc.pid, port, n, first)
                per = (held - base) * 1024 / n
                print(f"| {name} | {base:.1f} | {held:.1f} ({held / base:.2f}x) | {per:.0f} | {after:.1f} "
                      f"({after / base:.2f}x) | {closed}/{n} |")  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
