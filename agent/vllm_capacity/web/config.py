"""TLS and basic authentication for the sidecar's listener, the Prometheus way: ``--web.config.file`` in the
exporter-toolkit format that node_exporter and every other Prometheus exporter read.

    tls_server_config:
      cert_file: /etc/vllm-capacity/tls.crt
      key_file: /etc/vllm-capacity/tls.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: /etc/vllm-capacity/ca.crt
      min_version: TLS12                              # TLS10 .. TLS13
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2b$12$...                          # bcrypt hashes (htpasswd -nBC 12 prometheus)

Every key is checked at start: an unknown key, a missing file, a certificate that does not load or a hash that is not
bcrypt is a start-up error naming it. The file is read again on SIGHUP: new certificates serve the next handshakes
and new users the next requests, the listener stays up; a file that no longer loads keeps the previous settings.
``RequestClientCert`` and ``RequireAnyClientCert`` are refused: Python's TLS verifies every client certificate it asks
for, so only the verifying types can be honoured.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt

_TOP = {"tls_server_config", "http_server_config", "basic_auth_users"}
_TLS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
_HTTP = {"headers"}
# exporter-toolkit keys this listener does not implement: a web.yml shared with node_exporter must not stop the
# sidecar, so each is accepted and named in one warning (Python's TLS picks its own ciphers and curves, HTTP/2 is
# not served, and the connection guard bounds what a client can ask for)
_IGNORED = {
    "tls_server_config": {"cipher_suites", "curve_preferences", "prefer_server_cipher_suites"},
    "http_server_config": {"http2"},
    "": {"rate_limit"},
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


class WebConfigError(ValueError):
    """The web configuration cannot be used; the message names the key or file and why."""


@dataclass(frozen=True)
class WebConfig:
    tls: Mapping[str, str] = field(default_factory=dict)  # tls_server_config, checked
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)
    #: tls_server_config.client_allowed_sans: a client certificate must name one of these (DNS, email, IP, URI)
    allowed_sans: tuple[str, ...] = ()
    #: exporter-toolkit keys given but not implemented here (each is logged once at start and on a reload)
    ignored: tuple[str, ...] = ()


def load(path: Path) -> WebConfig:
    """Read and check a web configuration file. Raises WebConfigError."""
    doc = _read(path)
    ignored = _known(doc, _TOP, "")
    tls = _section(doc, "tls_server_config", _TLS | {"client_allowed_sans"}, ignored)
    http = _section(doc, "http_server_config", _HTTP, ignored)
    sans = tls.pop("client_allowed_sans", None) or []
    if not isinstance(sans, list) or not all(isinstance(x, str) for x in sans):
        raise WebConfigError("tls_server_config.client_allowed_sans: expected a list of names")
    if sans and tls.get("client_auth_type") != "RequireAndVerifyClientCert":
        raise WebConfigError("tls_server_config.client_allowed_sans needs client_auth_type RequireAndVerifyClientCert")
    headers = http.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise WebConfigError("http_server_config.headers: expected a mapping of header names to strings")
    config = WebConfig(
        tls={k: str(v) for k, v in tls.items()},
        users=_users(doc.get("basic_auth_users") or {}),
        headers=dict(headers),
        allowed_sans=tuple(sans),
        ignored=tuple(ignored),
    )
    if config.tls:
        new_ssl_context(config)  # every certificate and key loads now, not at the first handshake
    return config


def _read(path: Path) -> dict[str, Any]:
    import yaml  # only a sidecar given --web.config.file pays for the YAML parser (~1 MiB resident)

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise WebConfigError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise WebConfigError(f"{path} is not UTF-8 text: {err.reason} at byte {err.start}") from None
    except yaml.YAMLError as err:
        raise WebConfigError(f"{path} is not YAML: {err}") from None
    doc = doc or {}
    if not isinstance(doc, dict):
        raise WebConfigError(f"{path}: expected a mapping of {', '.join(sorted(_TOP))}")
    return doc


def _users(users: object) -> dict[str, bytes]:
    if not isinstance(users, dict):
        raise WebConfigError("basic_auth_users: expected a mapping of user names to bcrypt hashes")
    hashes = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"basic_auth_users.{user}: not a bcrypt hash ($2a$, $2b$ or $2y$)")
        try:
            bcrypt.checkpw(b"", hashed.encode())
        except ValueError as err:
            raise WebConfigError(f"basic_auth_users.{user}: not a valid bcrypt hash ({err})") from None
        hashes[str(user)] = hashed.encode()
    return hashes


def _known(section: Mapping[str, Any], allowed: set[str], where: str) -> list[str]:
    """The exporter-toolkit keys given here that are not implemented (a key neither known nor theirs: an error)."""
    tolerated = _IGNORED.get(where.rstrip("."), set())
    unknown = sorted(set(section) - allowed - tolerated)
    if unknown:
        raise WebConfigError(f"{where}{unknown[0]}: unknown key (known: {', '.join(sorted(allowed | tolerated))})")
    return [f"{where}{key}" for key in sorted(set(section) & tolerated)]


def _section(doc: Mapping[str, Any], name: str, allowed: set[str], ignored: list[str]) -> dict[str, Any]:
    section = doc.get(name) or {}
    if not isinstance(section, dict):
        raise WebConfigError(f"{name}: expected a mapping")
    ignored += _known(section, allowed, f"{name}.")
    return {k: v for k, v in section.items() if k in allowed}


def new_ssl_context(config: WebConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    configure_ssl_context(ctx, config)
    return ctx


def configure_ssl_context(ctx: ssl.SSLContext, config: WebConfig) -> None:
    """Apply ``tls_server_config`` to ``ctx`` (also to the listener's own context on a reload)."""
    tls = config.tls
    if "cert_file" not in tls or "key_file" not in tls:
        raise WebConfigError("tls_server_config: cert_file and key_file are both needed")
    auth = tls.get("client_auth_type", "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(
            f"tls_server_config.client_auth_type: {auth!r} is not one of {', '.join(_CLIENT_AUTH)} "
            "(RequestClientCert and RequireAnyClientCert cannot be honoured: Python's TLS verifies what it asks for)"
        )
    version, highest = tls.get("min_version", "TLS12"), tls.get("max_version", "TLS13")
    for key, value in (("min_version", version), ("max_version", highest)):
        if value not in _VERSIONS:
            raise WebConfigError(f"tls_server_config.{key}: {value!r} is not one of {', '.join(_VERSIONS)}")
    if _VERSIONS[highest] < _VERSIONS[version]:
        raise WebConfigError(f"tls_server_config.max_version {highest} is below min_version {version}")
    try:
        ctx.load_cert_chain(tls["cert_file"], tls["key_file"])
    except (OSError, ssl.SSLError) as err:
        raise WebConfigError(f"tls_server_config: cannot load {tls['cert_file']} with its key: {err}") from None
    if _CLIENT_AUTH[auth] != ssl.CERT_NONE:
        if "client_ca_file" not in tls:
            raise WebConfigError(f"tls_server_config.client_auth_type {auth} needs client_ca_file")
        try:
            ctx.load_verify_locations(tls["client_ca_file"])
        except (OSError, ssl.SSLError) as err:
            raise WebConfigError(f"tls_server_config.client_ca_file: cannot load it: {err}") from None
    ctx.verify_mode = _CLIENT_AUTH[auth]
    ctx.minimum_version = _VERSIONS[version]
    ctx.maximum_version = _VERSIONS[highest]


def allowed_peer(peercert: Mapping[str, Any] | None, allowed_sans: tuple[str, ...]) -> bool:
    """Whether a client certificate (``ssl``'s getpeercert()) names one of ``allowed_sans`` among its subject
    alternative names, of any type (as exporter-toolkit's client_allowed_sans); True when none are configured."""
    if not allowed_sans:
        return True
    names = {str(value) for _, value in (peercert or {}).get("subjectAltName", ())}
    return bool(names & set(allowed_sans))


BCRYPT_MAX_BYTES = 72  # bcrypt reads no further: a longer password is refused, not truncated


class Authenticator:
    """Checks HTTP basic credentials against bcrypt hashes. A bcrypt check costs tens of milliseconds on purpose;
    a successful one is remembered (keyed by a keyed hash of the credentials, never the password) so that a
    scrape every few seconds does not pay it each time."""

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self.users = dict(users)
        self._key = hashlib.sha256(b"".join(sorted(self.users.values()))).digest()
        self._good: set[bytes] = set()
        # a hash of the configured cost, so that checking an unknown user takes as long as checking a known one
        self._decoy = b""
        if self.users:
            cost = next(iter(self.users.values()))[4:6].decode()
            self._decoy = bcrypt.hashpw(b"decoy", bcrypt.gensalt(rounds=int(cost) if cost.isdigit() else 12))

    def _credentials(self, authorization: str | None) -> tuple[str, str] | None:
        if not authorization or not authorization.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(authorization[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return user, password

    def _token(self, user: str, password: str) -> bytes:
        return hmac.new(self._key, f"{user}:{password}".encode(), hashlib.sha256).digest()

    def known(self, authorization: str | None) -> bool:
        """Credentials a bcrypt check verified before (or no users at all): answered at once, no bcrypt, no thread."""
        if not self.users:
            return True
        found = self._credentials(authorization)
        return found is not None and self._token(*found) in self._good

    def allows(self, authorization: str | None) -> bool:
        if not self.users:
            return True
        found = self._credentials(authorization)
        if found is None:
            return False
        user, password = found
        hashed, secret = self.users.get(user), password.encode()
        if hashed is None or len(secret) > BCRYPT_MAX_BYTES:
            # as long as a wrong password takes: an unknown user must not answer faster than a known one. A password
            # longer than bcrypt takes (bcrypt 5 raises; Go's bcrypt, the exporter toolkit's, refuses it) is wrong.
            bcrypt.checkpw(secret[:BCRYPT_MAX_BYTES], self._decoy)
            return False
        token = self._token(user, password)
        if token in self._good:
            return True
        if bcrypt.checkpw(secret, hashed):
            self._good.add(token)
            return True
        return False


#: bcrypt checks of credentials not verified before: this many threads of their own (never the pool the agent reads
#: its sources in), and at most CHECKS_WAITING more waiting; past that a request is refused at once (429)
CHECK_THREADS, CHECKS_WAITING = 2, 16


class CredentialChecks:
    """Where the listener's bcrypt checks run: known credentials are answered on the loop without bcrypt; the others
    in a small pool of their own, at most :data:`CHECK_THREADS` + :data:`CHECKS_WAITING` at once. A flood of wrong
    passwords (no credentials needed, only the port) then costs two threads and a bounded queue: the reads of vLLM,
    the log and the scrapes with good credentials go on."""

    def __init__(self, threads: int = CHECK_THREADS, waiting: int = CHECKS_WAITING) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vllm-capacity-bcrypt")
        self.capacity = threads + waiting
        self.in_flight = 0

    async def allows(self, auth: Authenticator, authorization: str | None) -> bool | None:
        """Whether ``authorization`` is allowed; None when too many checks are under way (the request is refused)."""
        import asyncio

        if auth.known(authorization):
            return True
        if self.in_flight >= self.capacity:
            return None
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, auth.allows, authorization)
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
