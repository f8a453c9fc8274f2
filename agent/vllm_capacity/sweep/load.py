"""Closed-loop load like ``vllm bench serve --max-concurrency c``: ``c`` workers, each sending its next request when
its last one ends, streaming ``/v1/completions``.

No tokenizer: a prompt is a list of token IDs (the OpenAI completions API takes one), of exactly the asked length,
each its own (a seeded random sequence: the prefix cache cannot serve one request's blocks to another), and the
output is exactly ``max_tokens`` long (vLLM's ``ignore_eos`` and ``min_tokens``). Times come from the client's
monotonic clock at each streamed chunk that carries text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

#: token IDs prompts are drawn from: inside the smallest vocabulary served (the tests' tiny model has 369 tokens; a
#: real model's tens of thousands), above the few special tokens most models keep at the bottom of theirs. An ID
#: past the model's vocabulary ends the request at once with no output (vLLM 0.32): the warm-up request says so.
TOKEN_IDS = range(100, 300)


@dataclass(frozen=True)
class RequestResult:
    """One request: when it started and ended (monotonic seconds), its first token and every later one, the tokens
    vLLM says it generated, or the kind of error that ended it."""

    start: float
    end: float
    token_times: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None  # http_4xx, http_5xx, vllm_error, connect, timeout, stream, short
    detail: str = ""  # what vLLM said of an error (its message, cut short)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (end-to-end - TTFT) / (tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class LoadSpec:
    url: str
    model: str
    prompt_tokens: int
    max_tokens: int
    api_key: str | None = None
    request_timeout: float = 600.0
    seed: int = 0


def prompt(seed: int, length: int) -> list[int]:
    """A prompt of ``length`` token IDs of its own."""
    rng = random.Random(seed)  # noqa: S311  (a prompt, not a secret)
    return [rng.choice(TOKEN_IDS) for _ in range(length)]


async def _stream(resp: aiohttp.ClientResponse, times: list[float]) -> tuple[dict[str, Any], str | None]:
    """Read the server-sent events of a streamed completion: the time of each chunk with text goes to ``times``;
    the usage vLLM reports at the end, and vLLM's error when it sends one inside the stream."""
    usage: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk or chunk.get("object") == "error":
            return usage, str(chunk.get("error") or chunk.get("message"))[:300]
        if any(c.get("text") for c in chunk.get("choices") or ()):
            times.append(time.monotonic())
        usage = chunk.get("usage") or usage
    return usage, None


async def one_request(session: aiohttp.ClientSession, spec: LoadSpec, number: int) -> RequestResult:
    body = {
        "model": spec.model,
        "prompt": prompt(spec.seed * 1_000_003 + number, spec.prompt_tokens),
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    start = time.monotonic()
    times: list[float] = []
    try:
        async with asyncio.timeout(spec.request_timeout):
            async with session.post(f"{spec.url}/v1/completions", json=body, headers=headers) as resp:
                if resp.status >= 400:
                    said = (await resp.text(errors="replace"))[:300]
                    return RequestResult(start, time.monotonic(), error=f"http_{resp.status // 100}xx", detail=said)
                usage, refused = await _stream(resp, times)
                if refused is not None:
                    return RequestResult(start, time.monotonic(), tuple(times), error="vllm_error", detail=refused)
    except TimeoutError:
        return RequestResult(start, time.monotonic(), tuple(times), error="timeout")
    except aiohttp.ClientConnectionError:
        return RequestResult(start, time.monotonic(), tuple(times), error="connect" if not times else "stream")
    except (aiohttp.ClientError, ValueError):
        return RequestResult(start, time.monotonic(), tuple(times), error="stream")
    end = time.monotonic()
    generated = int(usage.get("completion_tokens") or len(times))
    short = generated < spec.max_tokens
    detail = f"{generated} of {spec.max_tokens} tokens generated" if short else ""
    prompt_read = int(usage.get("prompt_tokens") or 0)
    return RequestResult(start, end, tuple(times), generated, prompt_read, "short" if short else None, detail)


@dataclass
class StepLoad:
    """The requests of one step: ``count`` of them (or as many as ``duration`` allows) over ``concurrency``
    workers; what finished, in the order they finished."""

    concurrency: int
    count: int | None = None
    duration: float | None = None
    results: list[RequestResult] = field(default_factory=list)


async def run_step(
    session: aiohttp.ClientSession,
    spec: LoadSpec,
    step: StepLoad,
    first: int,
    on_done: Callable[[], None] = lambda: None,
) -> None:
    """Run the step's workers until its requests are done (or its time is up); ``first``: the number of its first
    request (every request of a sweep has its own prompt)."""
    issued = 0
    deadline = time.monotonic() + step.duration if step.duration is not None else None

    async def worker() -> None:
        nonlocal issued
        while (step.count is None or issued < step.count) and (deadline is None or time.monotonic() < deadline):
            number = first + issued
            issued += 1
            step.results.append(await one_request(session, spec, number))
            on_done()

    await asyncio.gather(*(worker() for _ in range(step.concurrency)))
