"""vLLM's ``/metrics`` body read as it arrives (:class:`MetricsStream`): never held whole, scanned a segment of whole
lines at a time, with the same checks and the same result as :func:`~vllm_capacity.sources.vllm_parse.parse_metrics`
of the whole text; and the last read remembered (:class:`LastRead`), so that an idle server's unchanged lines are not
selected and read again.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_parse import LEADING_SPACE, LEADING_SPACE_BYTES, check_head, read_selected
from vllm_capacity.sources.vllm_records import META, PRESENCE_ONLY, WANTED, WANTED_WITHOUT_LATENCY, VllmMetrics
from vllm_capacity.sources.vllm_select import Selection, found_lines, select_found, select_lines


def parse_metrics_body(body: bytes | bytearray, *, latency: bool = True) -> VllmMetrics:
    """:func:`~vllm_capacity.sources.vllm_parse.parse_metrics` of the body's bytes, as :class:`MetricsStream` reads
    them off the network: a megabyte at a time, ASCII segments (vLLM's) never copied into a string and any other
    decoded alone (one emoji in a 31 MiB body decoded all of it: 203 MiB)."""
    stream = MetricsStream(latency=latency)
    view = memoryview(body)
    for at in range(0, len(body), 1 << 20):
        stream.feed(view[at : at + (1 << 20)])
    return stream.finish()


#: Most characters of found lines a read keeps for :class:`LastRead` (one engine finds ~3 KiB, 64 engines ~120 KiB):
#: a body that finds more is selected a segment at a time, and its lines are not kept.
LAST_READ_CHARS = 128 * 1024


class LastRead:
    """The last read's lines found (:func:`found_lines`) and what they read as. An idle server serves the same
    selected lines read after read (its gauges still, its counters unmoved; its own process counters move, but they
    are not looked at), and the selection and its reading (:func:`read_selected`) are functions of the lines found:
    the same lines give the same record, which is returned again instead of selected and read again (at one engine
    the selection's Python work and the parse: only the expression that finds the lines runs). One per client and
    read kind."""

    def __init__(self) -> None:
        self._last: tuple[list[str | bytes], VllmMetrics] | None = None
        # the last body's three parts (views of it: never a copy), each with the lines found in it
        self._parts: list[tuple[memoryview, list[str | bytes]] | None] = [None, None, None]

    def found(self, body: bytes, find: Callable[[int, int], list[str | bytes]]) -> list[str | bytes] | None:
        """``find(0, len(body))``, the lines found in a whole body, given ``find(start, end)``, the lines found in a
        span of whole lines; None when a part to search is not ASCII (then the body is read as text, not through
        here). The body is cut in three: what comes before the first line that names ``vllm:``, vLLM's own families
        up to the last line that names it, and what follows; a part is looked at again only when it differs from the
        last body's same part, which was ASCII. An idle vLLM's body differs only around its families: its process
        series (first) move every read, its HTTP server's (last) with each request. Any cut at line ends gives the
        same lines, so the result is always the whole body's; this one keeps apart what stays the same, and checks
        only what changed for bytes outside ASCII (the 46 KiB of one engine's families are not read again)."""
        named = body.find(b"vllm:")
        if named < 0:  # no family of vLLM's: all of it is the first part
            start = end = len(body)
        else:
            start = body.rfind(b"\n", 0, named) + 1
            end = body.find(b"\n", body.rfind(b"vllm:")) + 1 or len(body)
        found: list[str | bytes] = []
        for i, (at, to) in enumerate(((0, start), (start, end), (end, len(body)))):
            kept = self._parts[i]
            if kept is not None and len(kept[0]) == to - at and body.startswith(kept[0], at):  # memcmp, no copy
                part = kept[1]
            elif not body[at:to].isascii():
                return None
            else:
                part = find(at, to)
                self._parts[i] = (memoryview(body)[at:to], part)
            found += part
        return found

    def recall(self, found: list[str | bytes]) -> VllmMetrics | None:
        last = self._last
        return last[1] if last is not None and last[0] == found else None

    def keep(self, found: list[str | bytes], metrics: VllmMetrics) -> None:
        self._last = (found, metrics)


class MetricsStream:
    """:func:`parse_metrics_body` of a body read as it arrives: :meth:`feed` each chunk, then :meth:`finish`. The body
    is never held whole: its lines are selected a segment (about a megabyte of whole lines) at a time and dropped,
    so a 34 MiB /metrics (1,024 data-parallel engines) costs its selected lines, not its size. The same checks, in
    the same order, and the same result as a parse of the whole body (the tests hold it to that). With ``last``, the
    lines are read through it (:class:`LastRead`)."""

    def __init__(self, *, latency: bool = True, segment: int = 1 << 20, last: LastRead | None = None) -> None:
        self._last = last
        self._names: tuple[str, ...] = WANTED if latency else WANTED_WITHOUT_LATENCY
        self._meta: tuple[str, ...] = META if latency else PRESENCE_ONLY
        self.selected: Selection | None = None  # a body of many found lines' selection, a segment at a time
        # the lines found, while they are few (LAST_READ_CHARS): selected at the end, or not at all when they are the
        # last read's; None once they passed it (then each segment is selected as it is scanned)
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
        self._scanned = False  # a segment of whole lines was scanned

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        self.size += len(chunk)
        self._pending.append(chunk if isinstance(chunk, bytes) else bytes(chunk))  # never a buffer the caller reuses
        self._pending_size += len(chunk)
        if self._pending_size >= self._segment:
            self._scan_whole_lines()

    def finish(self) -> VllmMetrics:
        self._scan_whole_lines(whole=not self._scanned)
        rest = self._take()  # an unfinished last line: its text counts for the checks, it is never read
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
            return read_selected(self.selected)
        metrics = self._last.recall(self._found) if self._last is not None else None
        if metrics is None:
            metrics = read_selected(select_found(self._found, self._names, self._meta))
            if self._last is not None:
                self._last.keep(self._found, metrics)
        return metrics

    def _take(self) -> bytes:
        """What is pending, as one bytes (the chunk itself when there is one), and nothing pending after."""
        pending = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._pending_size = [], 0
        return pending

    def _scan_whole_lines(self, *, whole: bool = False) -> None:
        """Scan the whole lines pending; ``whole``: they are all the body's (none was scanned before)."""
        pending = self._take()
        end = pending.rfind(b"\n") + 1
        if end < len(pending):  # an unfinished last line waits for the rest of it
            self._pending, self._pending_size = [pending[end:]], len(pending) - end
        if end:
            self._scanned = True
            self._scan(pending if end == len(pending) else pending[:end], select=True, whole=whole)

    def _scan(self, segment: bytes, *, select: bool, whole: bool = False) -> None:
        if self._bad_utf8 is not None:
            return
        if whole and select and self._last is not None:  # the whole body in one segment: through the last read
            found = self._last.found(segment, functools.partial(found_lines, segment, self._names, self._meta))
            if found is not None:  # ASCII: the parts searched again were checked, the others are the last body's
                self._see(segment)
                self._keep(found)
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
            self.selected = select_lines(text, self._names, self._meta, self.selected)
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
        if self._found_chars > LAST_READ_CHARS:  # many lines: selected a segment at a time from here, never kept
            self.selected = select_found(self._found, self._names, self._meta, self.selected)
            self._found = None
