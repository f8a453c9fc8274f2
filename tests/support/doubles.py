"""Doubles of what a test cannot wait for or break at will: a clock that moves when told, and the state of a
loopback "vLLM" (``fake_vllm`` in conftest.py serves it) that tests change between scrapes."""

from __future__ import annotations

from dataclasses import dataclass, field


class FakeClock:
    """A monotonic clock that moves only when the test moves it, for ``Agent(monotonic=...)``: backoffs and
    intervals are then exercised exactly, without waiting for them in real time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeVllm:
    """What the loopback "vLLM" answers. Tests change these fields between scrapes."""

    metrics: str = ""
    models: str = '{"object":"list","data":[{"id":"tiny-llama","object":"model","max_model_len":1024}]}'
    version: str = '{"version":"0.32.0"}'
    status: int = 200
    location: str | None = None  # a Location header (with a 3xx status: a redirect, and no body)
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"
    delay: float = 0.0
    truncate_to: int | None = None  # send a Content-Length for the whole body but only this many bytes
    drip: float = 0.0  # seconds between the body's 20 pieces: the status and headers at once, the body slowly
    metrics_bytes: bytes | None = None  # sent instead of ``metrics`` when set (a body that is not UTF-8)
    requests: list[str] = field(default_factory=list)
    authorization: dict[str, str | None] = field(default_factory=dict)  # path -> the last Authorization header
    url: str = ""
