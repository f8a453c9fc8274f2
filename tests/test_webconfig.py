"""TLS and basic authentication on the sidecar's listener (--web.config.file, the exporter-toolkit format), with
certificates made in the test (trustme) and Debian's Prometheus scraping it over TLS with credentials."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import httpx
import pytest
import trustme
import yaml

from lab import free_port, stop_process
from vllm_capacity.web.config import WebConfigError, load


def _hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()  # cheap rounds: a test


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, the sidecar's certificate for 127.0.0.1, a client certificate from the CA and one from another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("prometheus@monitoring")
    other = ca.issue_cert("grafana@monitoring")  # from the same CA, another name
    rogue = stranger.issue_cert("rogue")
    paths = {
        "ca": d / "ca.crt",
        "cert": d / "tls.crt",
        "key": d / "tls.key",
        "client": d / "client.pem",
        "rogue": d / "rogue.pem",
        "other": d / "other.pem",
        "stranger_ca": d / "stranger-ca.crt",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    stranger.cert_pem.write_to_path(str(paths["stranger_ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(paths["client"]))
    rogue.private_key_and_cert_chain_pem.write_to_path(str(paths["rogue"]))
    other.private_key_and_cert_chain_pem.write_to_path(str(paths["other"]))
    return paths


def _write(path: Path, pki: dict[str, Path], users: dict[str, str], **tls: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {"cert_file": str(pki["cert"]), "key_file": str(pki["key"]), **tls},
                "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
                "basic_auth_users": {user: _hash(pw) for user, pw in users.items()},
            }
        )
    )
    return path


def _client(pki: dict[str, Path], cert: str | None = None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert:
        ctx.load_cert_chain(str(pki[cert]))
    return httpx.Client(verify=ctx, timeout=10)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tls_server_config": {"cert_file": "x", "key_file": "y", "cipher": "z"}}, "tls_server_config.cipher"),
        ({"basic_auth_users": {"p": "plain-text"}}, "basic_auth_users.p: not a bcrypt hash"),
        ({"basic_auth_users": {"p": "$2b$12$short"}}, "basic_auth_users.p: not a valid bcrypt hash"),
        ({"tls_server_config": {"cert_file": "/nope.crt", "key_file": "/nope.key"}}, "cannot load /nope.crt"),
        ({"http_server_config": {"http3": True}}, "http_server_config.http3: unknown key"),
        (
            {"tls_server_config": {"cert_file": "x", "key_file": "y", "client_allowed_sans": ["a"]}},
            "client_allowed_sans needs client_auth_type RequireAndVerifyClientCert",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "x",
                    "key_file": "y",
                    "client_allowed_sans": "a",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "client_allowed_sans: expected a list",
        ),
        ({"tls": {}}, "tls: unknown key"),
    ],
)
def test_a_web_config_that_cannot_be_used_is_refused(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(WebConfigError, match=message.replace(".", r"\.")):
        load(path)


def test_exporter_toolkit_keys_not_implemented_are_accepted_and_named(tmp_path: Path, pki: dict[str, Path]) -> None:
    """A web.yml shared with node_exporter: cipher_suites, curve_preferences, http2 and rate_limit stopped the
    sidecar at start. They are accepted now, each named for one warning; max_version is applied."""
    path = _write(tmp_path / "web.yml", pki, {}, max_version="TLS12", cipher_suites=["TLS_AES_128_GCM_SHA256"],
                  curve_preferences=["X25519"])  # fmt: skip
    doc = yaml.safe_load(path.read_text())
    doc["http_server_config"]["http2"] = False
    doc["rate_limit"] = {"interval": "1s", "burst": 10}
    path.write_text(yaml.safe_dump(doc))
    config = load(path)
    assert sorted(config.ignored) == [
        "http_server_config.http2",
        "rate_limit",
        "tls_server_config.cipher_suites",
        "tls_server_config.curve_preferences",
    ]
    from vllm_capacity.web.config import new_ssl_context

    assert new_ssl_context(config).maximum_version == ssl.TLSVersion.TLSv1_2
    path = _write(tmp_path / "web.yml", pki, {}, min_version="TLS13", max_version="TLS12")
    with pytest.raises(WebConfigError, match="max_version TLS12 is below min_version TLS13"):
        load(path)


def test_client_allowed_sans(fake_vllm_thread: str, pki: dict[str, Path], tmp_path: Path) -> None:
    """client_allowed_sans: a client certificate from the CA must also name one of the allowed names; another name
    from the same CA is answered 403 (the probes, which carry no certificate, are on their own port)."""
    web = _write(tmp_path / "web.yml", pki, {}, client_auth_type="RequireAndVerifyClientCert",
                 client_ca_file=str(pki["ca"]), client_allowed_sans=["prometheus@monitoring"])  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [*(sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", fake_vllm_thread),
         *("--listen", f"127.0.0.1:{port}", "--web.config.file", str(web))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        with _client(pki, "client") as allowed, _client(pki, "other") as other:
            for _ in range(600):
                try:
                    status = allowed.get(url).status_code
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert status == 200
            assert other.get(url).status_code == 403
    finally:
        stop_process(proc)


def test_client_auth_types_python_cannot_honour_are_refused(tmp_path: Path, pki: dict[str, Path]) -> None:
    path = _write(tmp_path / "web.yml", pki, {}, client_auth_type="RequireAnyClientCert")
    with pytest.raises(WebConfigError, match="RequireAnyClientCert"):
        load(path)
    path = _write(tmp_path / "web.yml", pki, {}, client_auth_type="RequireAndVerifyClientCert")
    with pytest.raises(WebConfigError, match="needs client_ca_file"):
        load(path)


def test_a_bad_web_config_is_a_start_up_error(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: {prometheus: secret}\n")
    result = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "serve", "--web.config.file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "vllm-capacity serve: error: --web.config.file: basic_auth_users.prometheus: not a bcrypt hash "
        "($2a$, $2b$ or $2y$)"
    )


@pytest.fixture
def secured(
    fake_vllm_thread: str, pki: dict[str, Path], tmp_path: Path
) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    web = _write(
        tmp_path / "web.yml",
        pki,
        {"prometheus": "scrape-pw"},
        client_auth_type="VerifyClientCertIfGiven",
        client_ca_file=str(pki["ca"]),
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", fake_vllm_thread),
            *("--listen", f"127.0.0.1:{port}", "--web.config.file", str(web), "--interval", "200ms"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    with _client(pki) as client:
        for _ in range(600):  # a loaded machine starts the sidecar in seconds
            try:
                client.get(url + "/healthz")
                break
            except httpx.TransportError:
                time.sleep(0.1)
    try:
        yield url, web, proc
    finally:
        stop_process(proc)


def test_tls_basic_auth_and_headers(secured: tuple[str, Path, subprocess.Popen], pki: dict[str, Path]) -> None:
    url, _, _ = secured
    with _client(pki) as client:
        assert client.get(url + "/healthz").status_code == 200  # probes need no credentials
        denied = client.get(url + "/metrics")
        assert denied.status_code == 401 and denied.headers["WWW-Authenticate"].startswith("Basic")
        assert client.get(url + "/metrics", auth=("prometheus", "wrong")).status_code == 401
        assert client.get(url + "/", auth=("nobody", "scrape-pw")).status_code == 401
        ok = client.get(url + "/metrics", auth=("prometheus", "scrape-pw"))
        assert ok.status_code == 200 and "vllm_capacity_up" in ok.text
        assert ok.headers["X-Content-Type-Options"] == "nosniff"
    with _client(pki, "client") as client:  # a client certificate from the CA: verified and accepted
        assert client.get(url + "/metrics", auth=("prometheus", "scrape-pw")).status_code == 200
    with _client(pki, "rogue") as client, pytest.raises(httpx.TransportError):  # another CA's: refused in TLS
        client.get(url + "/metrics", auth=("prometheus", "scrape-pw"))
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served
        httpx.get(url.replace("https", "http") + "/metrics", timeout=5)


# the client_auth_types the docs offer (Python's TLS cannot honour RequestClientCert and RequireAnyClientCert)
CLIENT_AUTH_TYPES = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


def _kubelet_probe(url: str) -> int | None:
    """An HTTP(S) probe as the kubelet makes it: no client certificate, no credentials, the server's certificate not
    verified. The status, or None when the connection or the handshake fails."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        return httpx.get(url, verify=context, timeout=5).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("client_auth", CLIENT_AUTH_TYPES)
def test_the_rendered_probes_pass_under_every_client_auth_type(
    client_auth: str, fake_vllm_thread: str, pki: dict[str, Path], tmp_path: Path
) -> None:
    """The web-config component's probes, run as the kubelet runs them against the sidecar its env starts: they pass
    whatever client_auth_type the web configuration asks (over HTTPS on the main port they failed the handshake
    under RequireAndVerifyClientCert, and a native sidecar whose startup probe never passes keeps vLLM from
    starting)."""
    from support.kustomize import kustomize, overlay, sidecars

    (sidecar,) = sidecars(kustomize(overlay(tmp_path / "overlay", "vllm-capacity-sidecar", "vllm-capacity-web-config")))
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    probe_port, main_port = free_port(), free_port()
    local = {ports["capacity"]: main_port, ports["probes"]: probe_port}  # the pod's ports, here
    web = _write(tmp_path / "web.yml", pki, {"prometheus": "scrape-pw"}, client_auth_type=client_auth,
                 **({"client_ca_file": str(pki["ca"])} if "Verify" in client_auth else {}))  # fmt: skip
    run_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAPACITY_")},
        "VLLM_CAPACITY_VLLM_URL": fake_vllm_thread,
        "VLLM_CAPACITY_LISTEN": f"127.0.0.1:{main_port}",
        "VLLM_CAPACITY_WEB_CONFIG_FILE": str(web),
        "VLLM_CAPACITY_PROBE_LISTEN": env["VLLM_CAPACITY_PROBE_LISTEN"].replace(
            f":{ports['probes']}", f"127.0.0.1:{probe_port}"
        ),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_capacity", "serve", "--interval", "200ms"],
        env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = sidecar[name]["httpGet"]
            port = local[ports[get["port"]] if isinstance(get["port"], str) else get["port"]]
            url = f"{get.get('scheme', 'HTTP').lower()}://127.0.0.1:{port}{get['path']}"
            status = None
            for _ in range(300):  # the kubelet retries until the failure threshold; a loaded machine starts slowly
                status = _kubelet_probe(url)
                if status == 200:
                    break
                time.sleep(0.1)
            assert status == 200, (name, url, status)
        # the reason for the probe port: under RequireAndVerifyClientCert the main port refuses the kubelet
        main = _kubelet_probe(f"https://127.0.0.1:{main_port}/healthz")
        assert main == (None if client_auth == "RequireAndVerifyClientCert" else 200), main
        assert _kubelet_probe(f"http://127.0.0.1:{probe_port}/metrics") == 404  # the probe port serves probes alone
    finally:
        stop_process(proc)


def test_sighup_re_reads_the_web_config_without_dropping_the_listener(
    secured: tuple[str, Path, subprocess.Popen], pki: dict[str, Path]
) -> None:
    url, web, proc = secured
    _write(web, pki, {"grafana": "new-pw"}, client_auth_type="VerifyClientCertIfGiven", client_ca_file=str(pki["ca"]))
    proc.send_signal(signal.SIGHUP)
    with _client(pki) as client:
        for _ in range(100):
            if client.get(url + "/metrics", auth=("grafana", "new-pw")).status_code == 200:
                break
            time.sleep(0.1)
        assert client.get(url + "/metrics", auth=("grafana", "new-pw")).status_code == 200
        assert client.get(url + "/metrics", auth=("prometheus", "scrape-pw")).status_code == 401
    # a broken file, then one that is not UTF-8 text, keep the settings in force (the second once escaped as an
    # asyncio traceback)
    for broken in (b"basic_auth_users: {x: not-a-hash}\n", b"\xff\xfe not text\n"):
        web.write_bytes(broken)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        with _client(pki) as client:
            assert client.get(url + "/metrics", auth=("grafana", "new-pw")).status_code == 200
    assert proc.poll() is None
    _, stderr = stop_process(proc)
    events = [json.loads(line)["msg"] for line in stderr.splitlines()]
    assert "web_config_reloaded" in events and events.count("web_config_reload_failed") == 2, events
    assert "new-pw" not in stderr and "scrape-pw" not in stderr


def test_a_rotated_client_ca_is_a_retired_ca(secured: tuple[str, Path, subprocess.Popen], pki: dict[str, Path]) -> None:
    """A SIGHUP that replaced client_ca_file added the new CA to the live TLS context and never removed the old one:
    a certificate from the retired CA still got 200. A reload builds a fresh context: the next connections trust
    exactly the file as it is now."""
    url, web, proc = secured
    with _client(pki, "client") as client:  # the CA in force: its client certificate is accepted
        assert client.get(url + "/metrics", auth=("prometheus", "scrape-pw")).status_code == 200
    _write(web, pki, {"prometheus": "scrape-pw"}, client_auth_type="RequireAndVerifyClientCert",
           client_ca_file=str(pki["stranger_ca"]))  # fmt: skip
    proc.send_signal(signal.SIGHUP)
    for _ in range(100):
        with contextlib.suppress(httpx.TransportError), _client(pki, "rogue") as client:
            if client.get(url + "/metrics", auth=("prometheus", "scrape-pw")).status_code == 200:
                break
        time.sleep(0.1)
    with _client(pki, "rogue") as client:  # the new CA's certificate: accepted
        assert client.get(url + "/metrics", auth=("prometheus", "scrape-pw")).status_code == 200
    with _client(pki, "client") as client, pytest.raises(httpx.TransportError):  # the retired CA's: refused in TLS
        client.get(url + "/metrics", auth=("prometheus", "scrape-pw"))
    assert proc.poll() is None


def test_sighup_without_a_web_config_is_ignored_not_fatal(fake_vllm_thread: str) -> None:
    """Without --web.config.file there is nothing to re-read: SIGHUP (a config reloader's habit, or a terminal
    hang-up) once ended the sidecar, as SIGHUP's default action does. It says so in its log and serves on."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", fake_vllm_thread),
            *("--listen", f"127.0.0.1:{port}", "--interval", "200ms"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/healthz")
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None, "SIGHUP ended the sidecar"
    assert httpx.get(url + "/healthz").status_code == 200
    _, stderr = stop_process(proc)
    assert "sighup_ignored" in [json.loads(line)["msg"] for line in stderr.splitlines()]


def test_a_web_config_that_is_not_utf8_is_a_start_up_error(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_bytes(b"\xff\xfe\n")
    with pytest.raises(WebConfigError, match="is not UTF-8 text"):
        load(web)


def test_prometheus_scrapes_over_tls_with_basic_auth_and_a_client_certificate(
    secured: tuple[str, Path, subprocess.Popen], pki: dict[str, Path], tmp_path: Path
) -> None:
    """Debian's Prometheus, configured as a user would (scheme https, basic_auth, tls_config with the CA and a client
    certificate), scrapes the sidecar: up is 1 and the agent's series arrive."""
    url, _, _ = secured
    prom_port = free_port()
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "vllm-capacity",
                "scheme": "https",
                "basic_auth": {"username": "prometheus", "password": "scrape-pw"},
                "tls_config": {
                    "ca_file": str(pki["ca"]),
                    "cert_file": str(pki["client"]),
                    "key_file": str(pki["client"]),
                },
                "static_configs": [{"targets": [url.removeprefix("https://")]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus missing: scripts/setup installs Debian's prometheus"
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result: list = []
        for _ in range(300):
            time.sleep(0.2)
            try:
                r = httpx.get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": "vllm_capacity_up"}, timeout=5
                )
            except httpx.TransportError:
                continue
            result = r.json()["data"]["result"] if r.status_code == 200 else []
            if result:
                break
        assert result, "Prometheus never scraped the sidecar over TLS with basic auth"
        up = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": "up"}, timeout=5).json()
        assert [s["value"][1] for s in up["data"]["result"]] == ["1"]
    finally:
        stop_process(proc)


@pytest.mark.parametrize("password", ["p" * 73, "é" * 37, "p" * 4096], ids=["73 bytes", "74 bytes of é", "4 KiB"])
def test_a_password_longer_than_bcrypt_reads_is_refused_not_an_error(password: str) -> None:
    """bcrypt reads 72 bytes; bcrypt 5 raises on more, which was an HTTP 500 and a traceback a minute. A longer
    password is a wrong one (Go's bcrypt, the exporter toolkit's, refuses it too), for a known user and an unknown
    one; the right password still passes."""
    import base64

    from vllm_capacity.web.config import Authenticator

    auth = Authenticator({"prometheus": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=4))})

    def basic(user: str, pw: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()

    assert auth.allows(basic("prometheus", password)) is False
    assert auth.allows(basic("nobody", password)) is False
    assert auth.allows(basic("prometheus", "right")) is True
