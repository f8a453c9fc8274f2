"""What vLLM's answers can make the sidecar hold (#54 item 4): a line with no end, a gzip bomb, labels that change on
every read. Each is refused or forgotten within a bound, before it is held, so the 128 Mi the manifests give holds
with a Prometheus scraping (bench/engines.py measures the process; docs/security.md has its figures)."""

from __future__ import annotations

import gzip
import random
import tracemalloc
import zlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from support.files import fixture_text
from support.payloads import data_parallel
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sources.vllm_metrics.memory import GENERATION_CHARS, ReaderMemory
from vllm_capacity.sources.vllm_metrics.parse import (
    CACHE_CONFIGS,
    CACHE_CONFIGS_HELD,
    LONG_LINE,
    has_long_line,
    parse_metrics,
)
from vllm_capacity.sources.vllm_metrics.scan import LINES, SERIES
from vllm_capacity.sources.vllm_metrics.stream import MetricsStream

IDLE = fixture_text("v1-0.32.0-cpu-idle.prom")
MiB = 1 << 20


def test_has_long_line_is_a_line_longer_than_the_limit_finished_or_not() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        limit = rng.randint(1, 24)
        text = "\n".join("x" * rng.randint(0, 3 * limit) for _ in range(rng.randint(0, 6))) + rng.choice(["", "\n"])
        want = any(len(line) > limit for line in text.split("\n"))
        assert has_long_line(text, limit) is want and has_long_line(text.encode(), limit) is want, (text, limit)


def test_a_line_without_an_end_is_refused_as_it_arrives_not_held() -> None:
    """A 31 MiB line (one label value) took the sidecar to 136 MiB: the unfinished line was joined again at every
    megabyte and held whole. Now a line past 1 MiB refuses the read (line_too_long) within the next megabyte or two
    of it, finished or not, and a whole text with one is refused the same way."""
    line = b'vllm:num_requests_running{x="' + b"a" * (31 * MiB) + b'"} 1\n'
    body = IDLE.encode() + line
    stream, fed = MetricsStream(), 0

    def feed_all() -> None:
        nonlocal fed
        for fed in range(0, len(body), 64 * 1024):
            stream.feed(body[fed : fed + 64 * 1024])

    with pytest.raises(SourceError) as refused:
        feed_all()
    assert refused.value.reason == Reason.LINE_TOO_LONG
    assert fed < len(IDLE) + 3 * MiB, fed  # refused within a few megabytes of the line, not at its end
    with pytest.raises(SourceError) as whole:
        parse_metrics(body.decode())
    assert whole.value.reason == Reason.LINE_TOO_LONG
    # a line just within the bound is read as before (its family left out: it passes the 8 KiB line bound)
    within = IDLE + 'vllm:num_requests_waiting{x="' + "a" * (LONG_LINE - 100) + '"} 1\n'
    assert dict(parse_metrics(within).over_limit)["vllm:num_requests_waiting"].startswith("a line of")


def test_labels_that_change_on_every_read_are_forgotten_within_a_bound() -> None:
    """cache_config_info's labels new on every read (512 engines scraped every second held 197 MiB and grew): each
    memory of the reader holds at most two generations of GENERATION_CHARS characters of text, and the parsed
    cache configs at most two generations of CACHE_CONFIGS_HELD label sets; every read still reads its own."""
    reader = ReaderMemory()
    for n in range(700):
        epoch = f"{n:05d}" * 800  # 4,000 characters, new every read: within the 8 KiB line bound
        text = IDLE.replace("vllm:cache_config_info{", f'vllm:cache_config_info{{prefix_cache_epoch="{epoch}",')
        metrics = parse_metrics(text, latency=False, reader=reader)
        assert metrics.engines[0].cache_config.labels["prefix_cache_epoch"] == epoch  # this read's, never a stale one
    for name in (SERIES, LINES):
        memory = reader.held(name)
        assert memory.previous, name  # turned: the bound was reached
        texts = [key for key in [*memory.current, *memory.previous] if isinstance(key, (str, bytes))]
        assert sum(map(len, texts)) <= 2 * GENERATION_CHARS, name
    configs = reader.held(CACHE_CONFIGS)
    assert 0 < len(configs) <= 2 * CACHE_CONFIGS_HELD


@pytest.fixture
async def compressing_vllm() -> AsyncIterator[dict[str, object]]:
    """A "vLLM" whose /metrics answers with the body and Content-Encoding set in the dict it yields."""
    state: dict[str, object] = {"body": b"", "encoding": "gzip"}

    async def metrics(_: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain", "Content-Encoding": str(state["encoding"])})
        await resp.prepare(_)
        body = state["body"]
        assert isinstance(body, bytes)
        for at in range(0, len(body), 256 * 1024):
            await resp.write(body[at : at + 256 * 1024])
        return resp

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield state
    await runner.cleanup()


def _bomb(size: int) -> bytes:
    """``size`` bytes of one character, gzipped (about a thousandth of it), made a megabyte at a time."""
    zipper = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    out = [zipper.compress(IDLE.encode())]
    block = (b"#" * 1023 + b"\n") * 1024  # comment lines: a body of whole lines, only too large
    out += [zipper.compress(block) for _ in range(size // MiB)]
    return b"".join([*out, zipper.flush()])


async def test_a_gzip_bomb_is_refused_at_the_cap_without_inflating_past_it(compressing_vllm: dict) -> None:
    """vLLM is asked for identity; a server that compresses anyway is read, inflated a megabyte at a time and
    counted against --max-body-size as it inflates. A 256 MiB bomb (its chunks inflate a thousandfold: aiohttp
    inflated each whole, 64 MiB at once) is refused at the 32 MiB cap with a few MiB in memory."""
    compressing_vllm["body"] = _bomb(256 * MiB)
    client = VllmClient(str(compressing_vllm["url"]), timeout=30)
    tracemalloc.start()
    try:
        with pytest.raises(SourceError) as refused:
            await client.fetch_metrics(latency=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        await client.aclose()
    assert refused.value.reason == Reason.BODY_TOO_LARGE
    assert peak < 12 * MiB, f"{peak / MiB:.1f} MiB held while refusing a gzip bomb"


async def test_a_compressed_body_reads_as_the_same_body_plain(compressing_vllm: dict) -> None:
    """gzip and deflate bodies read exactly as the plain one; one cut short is truncated, one that is not gzip a
    parse error, an encoding the agent cannot inflate (br) named: each a one-line SourceError."""
    text = data_parallel(8)
    plain = parse_metrics(text)
    client = VllmClient(str(compressing_vllm["url"]), timeout=30)
    try:
        for encoding, body in (("gzip", gzip.compress(text.encode())), ("deflate", zlib.compress(text.encode()))):
            compressing_vllm["encoding"], compressing_vllm["body"] = encoding, body
            assert await client.fetch_metrics() == plain, encoding
        for encoding, body, reason in (
            ("gzip", gzip.compress(text.encode())[:-4000], Reason.TRUNCATED),
            ("gzip", b"not gzip at all" * 100, Reason.PARSE_ERROR),
            ("br", b"\x0b\x02\x80hello", Reason.PARSE_ERROR),
        ):
            compressing_vllm["encoding"], compressing_vllm["body"] = encoding, body
            with pytest.raises(SourceError) as failed:
                await client.fetch_metrics()
            assert failed.value.reason == reason and "\n" not in str(failed.value), (encoding, failed.value)
    finally:
        await client.aclose()
