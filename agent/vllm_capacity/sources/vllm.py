"""vLLM's HTTP API: ``/metrics`` every interval, ``/v1/models`` (max_model_len) and ``/version`` now and then.

I/O only: bodies are handed to :mod:`vllm_capacity.sources.vllm_parse`. Every failure becomes a
:class:`SourceError` with the :class:`Reason` of the HTTP part (connect, timeout, http_5xx, body_too_large, ...).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from vllm_capacity import __version__
from vllm_capacity.redaction import redact, redact_url, url_secrets
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_parse import VllmMetrics, parse_metrics
from vllm_capacity.units import MiB

DEFAULT_MAX_BODY_BYTES = 32 * MiB


@dataclass(frozen=True)
class ModelsInfo:
    """From ``/v1/models``: max_model_len of each base model (LoRA adapter cards carry none)."""

    max_model_len: dict[str, int]


class VllmClient:
    """An async keep-alive client for one vLLM server."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.display_url = redact_url(self.base_url)  # the URL as it may be printed: no userinfo
        self._secrets = [*url_secrets(self.base_url), *([api_key] if api_key else [])]
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self._api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=2),
            headers={"User-Agent": f"vllm-capacity/{__version__}"},
            transport=transport,
            follow_redirects=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, path: str, *, headers: dict[str, str] | None = None, accept: str = "*/*") -> tuple[str, str]:
        """GET ``path`` within one deadline for the whole exchange; returns (body, content-type). Every failure is a
        SourceError whose message carries no secret (the URL's userinfo, the API key)."""
        try:
            return await self._exchange(path, headers or {}, accept)
        except SourceError as err:
            raise SourceError(err.reason, redact(str(err), self._secrets)) from None
        except Exception as err:  # what nothing below expected (a header value h11 refuses, ...): named, not a crash
            message = f"{self.display_url}{path}: {type(err).__name__}: {err}"
            raise SourceError(Reason.INTERNAL, redact(message, self._secrets)) from None

    async def _exchange(self, path: str, headers: dict[str, str], accept: str) -> tuple[str, str]:
        url = self.display_url + path
        try:
            async with asyncio.timeout(self.timeout):
                async with self._client.stream("GET", path, headers={"Accept": accept, **headers}) as resp:
                    if resp.status_code in (401, 403):
                        hint = (
                            "check --api-key-file"
                            if "Authorization" in headers
                            else "vLLM asks for authentication here, and the API key is sent to /v1/* only"
                        )
                        raise SourceError(Reason.UNAUTHORIZED, f"{url} answered {resp.status_code}: {hint}")
                    if resp.status_code >= 400:
                        kind = Reason.HTTP_5XX if resp.status_code >= 500 else Reason.HTTP_4XX
                        raise SourceError(kind, f"{url} answered HTTP {resp.status_code} {resp.reason_phrase}")
                    declared = resp.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
                        raise SourceError(
                            Reason.BODY_TOO_LARGE, f"{url} body is {declared} bytes, over the {self.max_body_bytes} cap"
                        )
                    chunks, size = [], 0
                    async for chunk in resp.aiter_bytes():
                        size += len(chunk)
                        if size > self.max_body_bytes:
                            raise SourceError(
                                Reason.BODY_TOO_LARGE, f"{url} body exceeds the {self.max_body_bytes}-byte cap"
                            )
                        chunks.append(chunk)
                    content_type = resp.headers.get("content-type", "")
        except TimeoutError as err:
            raise SourceError(Reason.TIMEOUT, f"{url} did not answer in full within {self.timeout:g}s") from err
        except httpx.TimeoutException as err:
            raise SourceError(
                Reason.TIMEOUT, f"{url} timed out after {self.timeout:g}s ({type(err).__name__})"
            ) from err
        except httpx.ConnectError as err:
            raise SourceError(Reason.CONNECT, f"cannot connect to {url}: {_cause(err)}") from err
        except httpx.RemoteProtocolError as err:
            raise SourceError(Reason.TRUNCATED, f"{url} closed the connection mid-response: {_cause(err)}") from err
        except httpx.HTTPError as err:
            raise SourceError(Reason.CONNECTION_ERROR, f"{url}: {_cause(err)}") from err
        body = b"".join(chunks)
        try:
            return body.decode("utf-8"), content_type
        except UnicodeDecodeError as err:
            raise SourceError(Reason.PARSE_ERROR, f"{url} body is not UTF-8 text") from err

    async def fetch_metrics_text(self) -> str:
        text, content_type = await self._get("/metrics", accept="text/plain;version=0.0.4;q=1,*/*;q=0.1")
        if "html" in content_type or "json" in content_type:
            raise SourceError(
                Reason.NOT_METRICS, f"{self.display_url}/metrics returned {content_type}, not metrics text"
            )
        return text

    async def fetch_metrics(self) -> VllmMetrics:
        return parse_metrics(await self.fetch_metrics_text())

    async def fetch_models(self) -> ModelsInfo:
        text, _ = await self._get("/v1/models", headers=self._api_headers, accept="application/json")
        return parse_models(text, self.display_url)

    async def fetch_version(self) -> str | None:
        """vLLM's ``/version`` (``{"version": "0.10.2"}``); None when absent. Never raises."""
        try:
            text, _ = await self._get("/version", accept="application/json")
            version = json.loads(text).get("version")
        except (SourceError, ValueError, AttributeError):
            return None
        return str(version) if version else None


def _cause(err: BaseException) -> str:
    """What went wrong, in words: httpx's errors often carry no message of their own (a reset read is 'ReadError: '),
    so the first cause down the chain that has one is named with them."""
    seen: BaseException | None = err
    while seen is not None:
        if str(seen):
            return f"{type(err).__name__}: {seen}" if seen is not err else f"{type(err).__name__}: {err}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(err).__name__} (no detail: the connection was closed or reset)"


def parse_models(text: str, base_url: str = "vLLM") -> ModelsInfo:
    """Parse a ``/v1/models`` body into max_model_len per base model."""
    try:
        doc = json.loads(text)
        cards = doc["data"]
        if not isinstance(cards, list):
            raise TypeError("data is not a list")
    except (ValueError, KeyError, TypeError) as err:
        raise SourceError(Reason.PARSE_ERROR, f"{base_url}/v1/models is not an OpenAI model list: {err}") from err
    found: dict[str, int] = {}
    for card in cards:
        if not isinstance(card, dict) or card.get("parent"):
            continue  # LoRA adapter cards have a parent and no max_model_len
        mml = card.get("max_model_len")
        if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
            found[str(card.get("id", ""))] = mml
    if not found:
        raise SourceError(
            Reason.MISSING_MAX_MODEL_LEN,
            f"{base_url}/v1/models lists no base model with max_model_len (vLLM < 0.5.0?): use --max-model-len",
        )
    return ModelsInfo(max_model_len=found)
