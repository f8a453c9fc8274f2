"""vLLM's HTTP API: ``/metrics`` every interval, ``/v1/models`` (max_model_len) and ``/version`` now and then.

I/O only: bodies are handed to :mod:`.vllm_metrics.stream` as they arrive, and a large one is finished
in a worker thread, so that the event loop (and with it ``/healthz`` and the agent's own ``/metrics``) never waits on
work proportional to the body. Every
failure becomes a :class:`SourceError` with the :class:`Reason` of the HTTP part (connect, timeout, http_5xx,
body_too_large, ...).

The client is aiohttp's, like the server: measured on the same body from a loopback server (bench/cycle.py), an
aiohttp GET costs a fifth of an httpx one at 1 engine (53 KiB) and under half at 64 engines (2.2 MiB). One keep-alive
connection; no TLS context is built for ``http://``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import ssl
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp

from vllm_capacity import __version__
from vllm_capacity.redaction import redact, redact_url, url_secrets
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory
from vllm_capacity.sources.vllm_metrics.records import VllmMetrics
from vllm_capacity.sources.vllm_metrics.stream import MetricsStream
from vllm_capacity.units import KiB, MiB

DEFAULT_MAX_BODY_BYTES = 32 * MiB
# A body up to this size is parsed on the event loop (one engine's /metrics is ~55 KiB: well under a millisecond, less
# than waking the parse thread and the loop again costs); a larger one in the parse thread, so that nothing in
# proportion to a large body ever holds up /healthz or a scrape (docs/performance.md)
INLINE_PARSE_BYTES = 128 * KiB
# /v1/models: a card is ~200 bytes, so 4 MiB lists 20,000 adapters; a JSON document costs about ten times its size in
# Python objects (14.6 MB of it held 166 MiB): the cap keeps that inside the sidecar's memory limit. /version is tiny.
MODELS_MAX_BYTES = 4 * MiB
VERSION_MAX_BYTES = 64 * KiB


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
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.display_url = redact_url(self.base_url)  # the URL as it may be printed: no userinfo
        self._secrets = [*url_secrets(self.base_url), *([api_key] if api_key else [])]
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self._api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # credentials in the URL go as basic auth on every request but those that carry the API key (/v1/*): a
        # request has one Authorization header, and aiohttp refuses both (then /v1/models was never read)
        parts = urlsplit(self.base_url)
        self._basic: dict[str, str] = {}  # the Authorization header of the URL's credentials, if it has some
        self._session_url = self.base_url
        if parts.username is not None or parts.password is not None:
            basic = aiohttp.encode_basic_auth(unquote(parts.username or ""), unquote(parts.password or ""))
            self._basic = {"Authorization": basic}
            self._session_url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the event loop
        # one thread: parses never run side by side, and one thread means one more malloc arena, not several
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-capacity-parse")
        # what the lines of this server's /metrics read as, keyed by each whole line: bounded, and this client's
        self._reader = ReaderMemory()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            https = self.base_url.startswith("https://")
            self._session = aiohttp.ClientSession(
                self._session_url + "/",
                # one deadline for each whole exchange: the connection, the request, the headers and the last byte
                # of the body (aiohttp's "total"; never rounded up to a whole second, as it does from 5 s). The same
                # deadline as asyncio.timeout around the exchange, without its ~50 Python calls a read (a sixth more)
                timeout=aiohttp.ClientTimeout(total=self.timeout, ceil_threshold=math.inf),
                connector=aiohttp.TCPConnector(
                    limit=1, ssl=ssl.create_default_context() if https else False, enable_cleanup_closed=False
                ),
                # never "gzip": a server that honours it (prometheus-client's own exposition: vLLM's /metrics before PR
                # #15657, March 2025) compresses every read at level 9 on its API server, for a loopback sidecar
                headers={"User-Agent": f"vllm-capacity/{__version__}", "Accept-Encoding": "identity"},
                # a server that compresses anyway is still read, inflated here a megabyte at a time (_inflated):
                # aiohttp inflates each chunk whole, and a 1 GiB gzip bomb's first chunk became 64 MiB at once
                auto_decompress=False,
                read_bufsize=1 << 20,  # a large body is read on while less than 2 MiB of it waits unread
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def _get(
        self,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        accept: str = "*/*",
        cap: int | None = None,
        sink: Callable[[bytes], None] | None = None,
    ) -> tuple[bytearray, str]:
        """GET ``path`` within one deadline for the whole exchange; returns (body, content-type). The body is at most
        ``cap`` bytes (at most --max-body-size); with ``sink`` each chunk goes to it as it arrives and the body
        returned is empty. Every failure is a SourceError whose message carries no secret (the URL's userinfo, the
        API key)."""
        cap = self.max_body_bytes if cap is None else min(cap, self.max_body_bytes)
        try:
            return await self._exchange(path, headers or {}, accept, cap, sink)
        except SourceError as err:
            raise SourceError(err.reason, redact(str(err), self._secrets)) from None
        except Exception as err:  # what nothing below expected (a header value refused, ...): named, not a crash
            message = f"{self.display_url}{path}: {type(err).__name__}: {err}"
            raise SourceError(Reason.INTERNAL, redact(message, self._secrets)) from None

    async def _exchange(
        self, path: str, headers: dict[str, str], accept: str, cap: int, sink: Callable[[bytes], None] | None
    ) -> tuple[bytearray, str]:
        url = self.display_url + path
        try:
            async with self._client().get(  # within the session's deadline (_client)
                path.lstrip("/"), headers={"Accept": accept, **self._basic, **headers}, allow_redirects=False
            ) as resp:
                if resp.status in (401, 403):
                    if "Authorization" in headers:
                        hint = "check --api-key-file"
                    elif self._basic:
                        hint = "check the credentials in --vllm-url"
                    else:
                        hint = "vLLM asks for authentication here, and the API key is sent to /v1/* only"
                    raise SourceError(Reason.UNAUTHORIZED, f"{url} answered {resp.status}: {hint}")
                if 300 <= resp.status < 400:  # not followed: the agent reads the server it was pointed at
                    where = redact_url(resp.headers.get("Location", "")) or "nowhere said"
                    raise SourceError(
                        Reason.REDIRECT,
                        f"{url} answered HTTP {resp.status} to {where}: point --vllm-url at vLLM itself",
                    )
                if resp.status >= 400:
                    kind = Reason.HTTP_5XX if resp.status >= 500 else Reason.HTTP_4XX
                    raise SourceError(kind, f"{url} answered HTTP {resp.status} {resp.reason or ''}".rstrip())
                declared = resp.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > cap:
                    raise SourceError(Reason.BODY_TOO_LARGE, f"{url} body is {declared} bytes, over the {cap} cap")
                body = await _read_body(resp, url, cap, sink)
                content_type = resp.headers.get("Content-Type", "")
        except TimeoutError as err:
            raise SourceError(Reason.TIMEOUT, f"{url} did not answer in full within {self.timeout:g}s") from err
        except aiohttp.ClientConnectorError as err:
            raise SourceError(Reason.CONNECT, f"cannot connect to {url}: {_cause(err)}") from err
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as err:
            raise SourceError(Reason.TRUNCATED, f"{url} closed the connection mid-response: {_cause(err)}") from err
        except aiohttp.ClientError as err:
            raise SourceError(Reason.CONNECTION_ERROR, f"{url}: {_cause(err)}") from err
        return body, content_type

    def _check_metrics_type(self, content_type: str) -> None:
        if "html" in content_type or "json" in content_type:
            raise SourceError(
                Reason.NOT_METRICS, f"{self.display_url}/metrics returned {content_type}, not metrics text"
            )

    async def fetch_metrics(self, *, latency: bool = True) -> VllmMetrics:
        # the body is scanned as it arrives, a megabyte of lines at a time, and never held whole (MetricsStream)
        stream = MetricsStream(latency=latency, reader=self._reader)
        _, content_type = await self._get("/metrics", accept="text/plain;version=0.0.4;q=1,*/*;q=0.1", sink=stream.feed)
        self._check_metrics_type(content_type)
        if stream.size <= INLINE_PARSE_BYTES:  # a parse shorter than the hand-off to a thread and back
            return stream.finish()
        return await asyncio.get_running_loop().run_in_executor(self._parser, stream.finish)

    async def fetch_models(self) -> ModelsInfo:
        body, _ = await self._get(
            "/v1/models", headers=self._api_headers, accept="application/json", cap=MODELS_MAX_BYTES
        )
        parse = functools.partial(_parse_models_body, body, self.display_url)
        if len(body) <= INLINE_PARSE_BYTES:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(self._parser, parse)  # off the loop

    async def fetch_version(self) -> str | None:
        """vLLM's ``/version`` (``{"version": "0.10.2"}``); None when absent. Never raises."""
        try:
            body, _ = await self._get("/version", accept="application/json", cap=VERSION_MAX_BYTES)
            version = json.loads(body).get("version")
        except (SourceError, ValueError, AttributeError, RecursionError):
            return None
        return str(version) if version else None


async def _read_body(
    resp: aiohttp.ClientResponse, url: str, cap: int, sink: Callable[[bytes], None] | None
) -> bytearray:
    """The body as it arrives (inflated, if it came compressed), at most ``cap`` bytes; each piece to ``sink`` when
    given (then the body returned is empty)."""
    inflate = _inflater(resp.headers.get("Content-Encoding", ""), url)
    # one growing buffer (a large one grows in place): never the chunks and their join side by side
    body, size = bytearray(), 0
    while chunk := await resp.content.readany():  # what has arrived, as it came: no join
        for piece in (chunk,) if inflate is None else _inflated(inflate, chunk, url):
            size += len(piece)
            if size > cap:
                raise SourceError(Reason.BODY_TOO_LARGE, f"{url} body exceeds the {cap}-byte cap")
            if sink is None:
                body += piece
            else:
                sink(piece)
    if inflate is not None and not inflate.eof:
        raise SourceError(Reason.TRUNCATED, f"{url} compressed body ends before its end: truncated")
    return body


#: The most a compressed body inflates to in one step: what a chunk of it costs in memory, whatever its ratio.
INFLATE_STEP = 1 << 20


def _inflater(encoding: str, url: str) -> Any:
    """A zlib decompressor for a body in gzip or deflate (the agent asks for identity; a server may compress anyway),
    None for one as it is. Another encoding (br, zstd) is refused: the agent cannot read it."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)  # a gzip or a zlib header, told apart by zlib
    raise SourceError(Reason.PARSE_ERROR, f"{url} answered in {encoding!r} encoding, which the agent does not read")


def _inflated(inflate: Any, chunk: bytes, url: str) -> Iterator[bytes]:
    """``chunk`` inflated, at most INFLATE_STEP bytes at a time (the caller counts each against its cap)."""
    try:
        data = chunk
        while data and not inflate.eof:
            piece = inflate.decompress(data, INFLATE_STEP)
            data = inflate.unconsumed_tail
            if piece:
                yield piece
    except zlib.error as err:
        raise SourceError(Reason.PARSE_ERROR, f"{url} body is not valid gzip or deflate: {err}") from None


def _parse_models_body(body: bytes | bytearray, display_url: str) -> ModelsInfo:
    return parse_models(_decode(body, display_url + "/v1/models"), display_url)


def _decode(body: bytes | bytearray, url: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError(Reason.PARSE_ERROR, f"{url} body is not UTF-8 text") from err


def _cause(err: BaseException) -> str:
    """What went wrong, in words: a client error may carry no message of its own (a reset read was 'ReadError: '),
    so the first cause down the chain that has one is named with it."""
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
    except RecursionError as err:  # nested deeper than the JSON parser goes: not a model list
        raise SourceError(Reason.PARSE_ERROR, f"{base_url}/v1/models is nested too deeply to be a model list") from err
    except (ValueError, KeyError, TypeError) as err:
        raise SourceError(Reason.PARSE_ERROR, f"{base_url}/v1/models is not an OpenAI model list: {err}") from err
    found: dict[str, int] = {}
    for card in cards:
        if not isinstance(card, dict) or card.get("parent"):
            continue  # LoRA adapter cards have a parent and no max_model_len
        mml = card.get("max_model_len")
        if isinstance(mml, int) and not isinstance(mml, bool) and 0 < mml <= 2**31 - 1:  # a 32-bit int in vLLM
            found[str(card.get("id", ""))] = mml
    if not found:
        raise SourceError(
            Reason.MISSING_MAX_MODEL_LEN,
            f"{base_url}/v1/models lists no base model with max_model_len (vLLM < 0.5.0?): use --max-model-len",
        )
    return ModelsInfo(max_model_len=found)
