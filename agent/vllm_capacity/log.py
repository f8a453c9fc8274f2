"""structlog set-up: one event per line, JSON or logfmt with promslog's keys (for log pipelines) or console (for
people).

The standard library's loggers (aiohttp's server and access loggers, asyncio) go through the same renderer, so a
protocol error from a client (a request line over 8 KiB, say) is one JSON object too, its traceback a field of it;
and such errors are logged once per cause and counted (:class:`OncePerCause`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter

import structlog

REPEAT_EVERY = 60.0  # seconds: a foreign error with the same cause is logged again at most this often


class OncePerCause(logging.Filter):
    """For the standard library's loggers (aiohttp's server, asyncio): an error is logged once per cause (logger,
    message, exception type) and then at most every REPEAT_EVERY seconds, with how many were held back
    (``repeated``); a client sending bad requests, or a listener at the file-descriptor limit, cannot flood the log.
    Each is counted by kind into ``counts`` when the server gives one (``vllm_capacity_http_errors_total``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] | None = None
        self._last: dict[tuple[str, str, str], float] = {}
        self._held: Counter[tuple[str, str, str]] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name.startswith("vllm_capacity"):
            return True
        kind = _kind(record)
        if kind is not None and self.counts is not None:
            self.counts[kind] += 1
        exc = record.exc_info[1] if record.exc_info else None
        cause = (record.name, str(record.msg), type(exc).__name__ if exc else "")
        now = time.monotonic()
        last = self._last.get(cause)
        if last is not None and now - last < REPEAT_EVERY:
            self._held[cause] += 1
            return False
        if len(self._last) >= 256:
            self._last.clear()
        self._last[cause] = now
        record.repeated = self._held.pop(cause, 0)
        return True


def _kind(record: logging.LogRecord) -> str | None:
    if record.name.startswith("aiohttp.server"):
        return "bad_request"
    if record.name == "asyncio" and "accept" in str(record.msg):
        return "accept"  # socket.accept() failed: out of file descriptors, mostly
    return None


_ONCE = OncePerCause()


def count_foreign_errors(counts: Counter[str]) -> None:
    """Count aiohttp's and asyncio's error logs by kind into ``counts`` (the agent's ``http_errors``)."""
    _ONCE.counts = counts


# promslog's level names (Go's slog): what a Prometheus exporter's log pipeline already matches on
PROMSLOG_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARN", "warn": "WARN", "error": "ERROR",
                   "critical": "ERROR", "exception": "ERROR"}  # fmt: skip


def promslog_keys(_: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """An event as promslog writes one: ``time``, ``level`` (INFO, WARN, ...) and ``msg`` first, then its fields."""
    level = str(event.pop("level", ""))
    head = {
        "time": event.pop("time", None),
        "level": PROMSLOG_LEVELS.get(level, level.upper()),
        "msg": event.pop("msg", None),
    }
    return {**{k: v for k, v in head.items() if v is not None}, **event}


def configure(fmt: str = "console", level: str = "info") -> None:
    """JSON and logfmt with promslog's keys (``time``, ``level``, ``msg``, as Prometheus and its exporters log);
    console for a person at a terminal (structlog's own layout)."""
    renderer: structlog.typing.Processor
    keys: list[structlog.typing.Processor] = [structlog.processors.EventRenamer("msg"), promslog_keys]
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    elif fmt == "logfmt":
        renderer = structlog.processors.LogfmtRenderer()
    else:
        renderer, keys = structlog.dev.ConsoleRenderer(colors=False), []
    common: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="time" if keys else "timestamp"),
    ]
    structlog.configure(
        processors=[*common, structlog.processors.format_exc_info, *keys, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *keys, renderer],
            foreign_pre_chain=[
                *common,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(allow=("repeated",)),
                structlog.processors.format_exc_info,
            ],
        )
    )
    handler.addFilter(_ONCE)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
