"""vLLM's ``/metrics`` body read as it arrives (:class:`MetricsStream`): never held whole, scanned a segment of whole
lines at a time, with the same checks and the same result as :func:`~.parse.parse_metrics` of
the whole text. Each body is read whole: nothing of the last one is kept but what the reader's memory
(:class:`~.memory.ReaderMemory`, the client's) holds of lines, keyed by each whole line.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory
from vllm_capacity.sources.vllm_metrics.parse import (
    LEADING_SPACE,
    LEADING_SPACE_BYTES,
    LONG_LINE,
    check_head,
    has_long_line,
    long_line,
    read_selected,
)
from vllm_capacity.sources.vllm_metrics.records import META, PRESENCE_ONLY, WANTED, WANTED_WITHOUT_LATENCY, VllmMetrics
from vllm_capacity.sources.vllm_metrics.select import Selection, found_lines, select_found, select_lines


def parse_metrics_body(
    body: bytes | bytearray, *, latency: bool = True, reader: ReaderMemory | None = None
) -> VllmMetrics:
    """:func:`~.parse.parse_metrics` of the body's bytes, as :class:`MetricsStream` reads
    them off the network: a megabyte at a time, ASCII segments (vLLM's) never copied into a string and any other
    decoded alone (one emoji in a 31 MiB body decoded all of it: 203 MiB)."""
    stream = MetricsStream(latency=latency, reader=reader)
    view = memoryview(body)
    for at in range(0, len(body), 1 << 20):
        stream.feed(view[at : at + (1 << 20)])
    return stream.finish()


#: Most characters of found lines a read keeps before it selects them (one engine finds ~3 KiB, 64 engines
#: ~120 KiB): a body that finds more is selected a segment at a time.
FOUND_CHARS = 128 * 1024


class MetricsStream:
    """:func:`parse_metrics_body` of a body read as it arrives: :meth:`feed` each chunk, then :meth:`finish`. The body
    is never held whole: its lines are selected a segment (about a megabyte of whole lines) at a time and dropped,
    so a 34 MiB /metrics (1,024 data-parallel engines) costs its selected lines, not its size. The same checks, in
    the same order, and the same result as a parse of the whole body (the tests hold it to that). Nothing is kept
    from one body to the next."""

    def __init__(self, *, latency: bool = True, segment: int = 1 << 20, reader: ReaderMemory | None = None) -> None:
        self._reader = ReaderMemory() if reader is None else reader  # the client's, that outlives the body
        self._names: tuple[str, ...] = WANTED if latency else WANTED_WITHOUT_LATENCY
        self._meta: tuple[str, ...] = META if latency else PRESENCE_ONLY
        self.selected: Selection | None = None  # a body of many found lines' selection, a segment at a time
        # the lines found, while they are few (FOUND_CHARS): selected at the end; None once they passed it (then each
        # segment is selected as it is scanned)
        self._found: list[str | bytes] | None = []
        self._found_chars = 0
        self.size = 0  # bytes fed
        self._segment = segment
        # what is not scanned yet, as it came (a body of one chunk is scanned without a copy): less than a segment with
        # the chunk that reached it, and the unfinished last line
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._head: str | None = None  # the body's first 200 characters after leading whitespace, once seen
        self._vllm = False  # "vllm:" seen
        self._bad_utf8: UnicodeDecodeError | None = None

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        self.size += len(chunk)
        self._pending.append(chunk if isinstance(chunk, bytes) else bytes(chunk))  # never a buffer the caller reuses
        self._pending_size += len(chunk)
        if self._pending_size >= self._segment:
            self._scan_whole_lines()

    def finish(self) -> VllmMetrics:
        self._scan_whole_lines()
        rest = self._take()  # an unfinished last line: its text counts for the checks, it is never read
        if has_long_line(rest):
            raise long_line(LONG_LINE)
        if rest:
            self._scan(rest, select=False)
        if self._bad_utf8 is not None:
            raise SourceError(Reason.PARSE_ERROR, f"vLLM /metrics body is not UTF-8 text: {self._bad_utf8}")
        if self._head is None:
            raise SourceError(Reason.EMPTY_BODY, "vLLM /metrics returned an empty body")
        check_head(self._head)
        if rest:
            raise SourceError(Reason.TRUNCATED, "vLLM /metrics body does not end with a newline: truncated")
        if not self._vllm:
            raise SourceError(
                Reason.NOT_VLLM, "the /metrics body has no vllm: metric at all: is --vllm-url a vLLM server?"
            )
        if self._found is None:
            assert self.selected is not None  # the found lines were selected as they passed the bound
            return read_selected(self.selected, self._reader)
        return read_selected(select_found(self._found, self._names, self._meta, reader=self._reader), self._reader)

    def _take(self) -> bytes:
        """What is pending, as one bytes (the chunk itself when there is one), and nothing pending after."""
        pending = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._pending_size = [], 0
        return pending

    def _scan_whole_lines(self) -> None:
        """Scan the whole lines pending."""
        pending = self._take()
        end = pending.rfind(b"\n") + 1
        if has_long_line(pending):  # a line past the bound, finished or not: refused before more of it is held
            raise long_line(LONG_LINE)
        if end < len(pending):  # an unfinished last line waits for the rest of it
            self._pending, self._pending_size = [pending[end:]], len(pending) - end
        if end:
            self._scan(pending if end == len(pending) else pending[:end], select=True)

    def _scan(self, segment: bytes, *, select: bool) -> None:
        if self._bad_utf8 is not None:
            return
        text: str | bytes
        if segment.isascii():
            text = segment
        else:
            try:
                text = segment.decode("utf-8")
            except UnicodeDecodeError as err:
                self._bad_utf8 = err
                return
        self._see(text)
        if not select:
            return
        if self._found is None:
            self.selected = select_lines(text, self._names, self._meta, self.selected, self._reader)
            return
        self._keep(found_lines(text, self._names, self._meta))

    def _see(self, text: str | bytes) -> None:
        """What the checks read of a segment: the body's head (its first one), and whether it names ``vllm:``."""
        if self._head is None:
            leading: re.Pattern[Any] = LEADING_SPACE if isinstance(text, str) else LEADING_SPACE_BYTES
            start = leading.match(text).end()  # type: ignore[union-attr]  # \s* always matches
            if start < len(text):
                head = text[start : start + 200]
                self._head = head if isinstance(head, str) else head.decode("ascii")
        self._vllm = self._vllm or (("vllm:" if isinstance(text, str) else b"vllm:") in text)  # type: ignore[operator]

    def _keep(self, found: list[str | bytes]) -> None:
        assert self._found is not None
        self._found += found
        self._found_chars += sum(map(len, found))
        if self._found_chars > FOUND_CHARS:  # many lines: selected a segment at a time from here, never kept
            self.selected = select_found(self._found, self._names, self._meta, self.selected, self._reader)
            self._found = None
