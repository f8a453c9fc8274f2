"""The example Alertmanager configuration's inhibitions, in a real Alertmanager (Debian's prometheus-alertmanager):
a crashed sidecar silences only what the sidecar computes, never a page Prometheus computes from vLLM's own series."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from support.promql import load_generator, metric_names

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "alerts" / "alertmanager.yaml"
generate = load_generator("alerts")
SIDECAR_DOWN = "VLLMCapacityExporterDown"


def _rules() -> tuple[list[dict], dict[str, str]]:
    """Every alert the generator makes (the TTFT burn-rate alerts too), and every recording rule's expression."""
    alerts, records = [], {}
    for doc in generate.documents(slo=True).values():
        for group in doc["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    alerts.append(rule)
                else:
                    records[rule["record"]] = rule["expr"]
    return alerts, records


def _reads_sidecar(expr: str, records: dict[str, str]) -> bool:
    """Whether an expression reads a series the sidecar exports, itself or through a recording rule."""
    for name in metric_names(expr):
        if name in records:
            if _reads_sidecar(records[name], records):
                return True
        elif name.startswith("vllm_capacity_"):
            return True
    return False


def _sidecar_down_targets() -> re.Pattern[str]:
    doc = yaml.safe_load(CONFIG.read_text())
    rule = next(r for r in doc["inhibit_rules"] if r["source_matchers"] == [f'alertname="{SIDECAR_DOWN}"'])
    (matcher,) = rule["target_matchers"]
    return re.compile(re.fullmatch(r'alertname=~"([^"]+)"', matcher)[1])


def test_sidecar_down_silences_exactly_the_alerts_on_its_series() -> None:
    alerts, records = _rules()
    targets = _sidecar_down_targets()
    never = {SIDECAR_DOWN, "VLLMCapacityTargetMissing", "VLLMTargetDown"}  # the sidecar's own and vLLM-down pages
    for rule in alerts:
        name = rule["alert"]
        silenced = bool(targets.fullmatch(name))
        if name in never:
            assert not silenced, f"{SIDECAR_DOWN} silences {name}"
        elif _reads_sidecar(rule["expr"], records):
            assert silenced, f"{name} reads the sidecar's series but a sidecar outage does not silence it"
        else:
            assert not silenced, f"{name} is computed from vLLM's own series: a sidecar outage must not hide it"
    assert any(not _reads_sidecar(r["expr"], records) for r in alerts if r["alert"] not in never), "no vLLM-only alert"


class _Receiver:
    """Alertmanager's webhook receiver: the alerts each receiver was sent."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.received.extend((self.path.strip("/"), a) for a in body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def names(self, receiver: str) -> set[str]:
        return {a["labels"]["alertname"] for path, a in self.received if path == receiver}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[tuple[str, _Receiver]]:
    binary = shutil.which("prometheus-alertmanager")
    assert binary, "prometheus-alertmanager missing: scripts/setup installs Debian's prometheus-alertmanager"
    receiver = _Receiver()
    config = yaml.safe_load(CONFIG.read_text())  # the shipped example, its receivers pointed here, waits shortened
    for r in config["receivers"]:
        r["webhook_configs"][0]["url"] = f"{receiver.url}/{r['name']}"
    config["route"].update(group_wait="1s", group_interval="1s")
    (tmp_path / "am.yaml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (tmp_path / "am.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'am.yaml'}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "am.log").read_text()
            time.sleep(0.1)
        yield url, receiver
    finally:
        proc.terminate()
        proc.wait(10)
        receiver.server.shutdown()
        receiver.server.server_close()
        log.close()


def test_a_ttft_page_reaches_the_pager_while_the_sidecar_is_down(alertmanager: tuple[str, _Receiver]) -> None:
    url, receiver = alertmanager
    pod = {"cluster": "west", "namespace": "serving", "pod": "vllm-0"}
    now = datetime.now(UTC).isoformat()
    firing = [
        {"labels": {**pod, "alertname": SIDECAR_DOWN, "severity": "critical", "job": "vllm-capacity"}},
        {"labels": {**pod, "alertname": "VLLMTTFTSLOBreach", "severity": "critical", "model_name": "m"}},
        {"labels": {**pod, "alertname": "VLLMTTFTErrorBudgetBurnFast", "severity": "critical", "model_name": "m"}},
        {"labels": {**pod, "alertname": "VLLMKVCacheSaturated", "severity": "critical", "model_name": "m"}},
        {"labels": {**pod, "alertname": "VLLMRequestsShed", "severity": "critical", "model_name": "m"}},
    ]
    for alert in firing:
        alert["startsAt"] = now
    assert httpx.post(f"{url}/api/v2/alerts", json=firing, timeout=5).status_code == 200
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not {"VLLMTTFTSLOBreach", "VLLMTTFTErrorBudgetBurnFast"} <= receiver.names(
        "pager"
    ):
        time.sleep(0.2)
    time.sleep(2)  # two group intervals more: an inhibited alert would have been sent by now had it not been
    paged = receiver.names("pager")
    assert {SIDECAR_DOWN, "VLLMTTFTSLOBreach", "VLLMTTFTErrorBudgetBurnFast"} <= paged, paged
    assert not {"VLLMKVCacheSaturated", "VLLMRequestsShed"} & paged, paged  # the sidecar's own: silenced
    states = {a["labels"]["alertname"]: a["status"] for a in httpx.get(f"{url}/api/v2/alerts", timeout=5).json()}
    assert states["VLLMKVCacheSaturated"]["state"] == "suppressed"
    assert states["VLLMKVCacheSaturated"]["inhibitedBy"]
    assert states["VLLMTTFTSLOBreach"]["state"] == "active"
