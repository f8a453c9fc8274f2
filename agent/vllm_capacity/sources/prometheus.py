"""A Prometheus server's HTTP API (``/api/v1/query``, ``/api/v1/query_range``), for ``advise``: instant and range
queries as plain data, with the usual auth (a bearer token file, basic auth) and TLS (a CA file, or no verification
when asked). Every failure is a :class:`PrometheusError` with one line that says what and where."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_capacity.redaction import redact_url


class PrometheusError(Exception):
    """Prometheus could not be read, or refused a query; the message is one line."""


@dataclass(frozen=True)
class PrometheusAuth:
    """How to reach Prometheus: a bearer token, or a basic-auth user and password (read from files, never logged),
    a CA bundle for its TLS certificate, or no verification (``insecure``)."""

    bearer_token: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class Sample:
    """One series of an instant vector: its labels and value (NaN: Prometheus said NaN)."""

    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and (timestamp, value) points."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...] = field(default=())


class PrometheusClient:
    """One Prometheus server, queried over its HTTP API."""

    def __init__(self, url: str, *, auth: PrometheusAuth | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.display_url = redact_url(self.url)
        self.auth = auth or PrometheusAuth()
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PrometheusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Accept": "application/json"}
            if self.auth.bearer_token:
                headers["Authorization"] = f"Bearer {self.auth.bearer_token}"
            elif self.auth.username:
                headers["Authorization"] = aiohttp.encode_basic_auth(self.auth.username, self.auth.password or "")
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(ssl=self._ssl()),
            )
        return self._session

    def _ssl(self) -> ssl.SSLContext | bool:
        if self.auth.insecure:
            return False
        if self.auth.ca_file:
            try:
                return ssl.create_default_context(cafile=self.auth.ca_file)
            except (OSError, ssl.SSLError) as err:
                raise PrometheusError(f"--prometheus-ca-file {self.auth.ca_file}: {err}") from None
        return True

    async def _api(self, path: str, params: dict[str, str]) -> Any:
        where = f"Prometheus at {self.display_url}"
        try:
            async with self._client().post(self.url + path, data=params) as resp:
                text = await resp.text()
                if resp.status in (401, 403):
                    raise PrometheusError(f"{where} refused the credentials (HTTP {resp.status})")
                try:
                    doc = await resp.json(content_type=None)
                except ValueError:
                    raise PrometheusError(
                        f"{where} answered HTTP {resp.status} with no Prometheus API response: {text[:80]!r}"
                    ) from None
        except aiohttp.ClientError as err:
            raise PrometheusError(f"cannot reach {where}: {err.__class__.__name__}: {err}") from None
        except TimeoutError:
            raise PrometheusError(f"{where} did not answer within {self.timeout:g}s") from None
        if not isinstance(doc, dict) or doc.get("status") != "success":
            error = doc.get("error") if isinstance(doc, dict) else None
            raise PrometheusError(f"{where} refused the query {params.get('query', '')!r}: {error or doc!r}")
        return doc["data"]

    async def query(self, expr: str, at: float) -> list[Sample]:
        """An instant query at ``at`` (Unix seconds): its vector (a scalar: one sample without labels). Prometheus's
        value strings (numbers, NaN, +Inf, -Inf) are all ones float() reads."""
        data = await self._api("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        if data.get("resultType") == "scalar":
            return [Sample({}, float(data["result"][1]))]
        if data.get("resultType") != "vector":
            raise PrometheusError(f"{expr!r}: Prometheus answered a {data.get('resultType')}, not a vector")
        return [Sample(r.get("metric", {}), float(r["value"][1])) for r in data["result"]]

    async def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """A range query from ``start`` to ``end`` every ``step`` seconds."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        data = await self._api("/api/v1/query_range", params)
        return [
            Series(r.get("metric", {}), tuple((float(t), float(v)) for t, v in r["values"])) for r in data["result"]
        ]
