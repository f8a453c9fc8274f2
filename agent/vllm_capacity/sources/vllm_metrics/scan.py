"""Read the few families the agent needs out of a vLLM ``/metrics`` body, fast, and exactly as prometheus-client would.

A vLLM server with 64 data-parallel engines serves 2 MiB of exposition, almost all of it histograms the agent never
reads; prometheus-client's parser takes a second over the whole body. This is done in two steps, each with a plain
definition and a fast implementation that the tests hold to it:

1. **Select** the lines that concern the families the agent reads, within bounds:
   :mod:`vllm_capacity.sources.vllm_metrics.select`.
2. **Parse** the selected lines (this module). :func:`parse_selected` reads lines in the canonical form every
   prometheus-client exposition uses (``# HELP name doc``, ``# TYPE name type``, ``name{label="value",...} value
   [timestamp]``) itself and runs the parser's own family state machine over them; the moment a line is in any other
   form (an exemplar, odd spacing, a quoted name, a duplicated label...) it hands all selected lines to
   prometheus-client's parser. Either way the result is ``list(text_string_to_metric_families(selected))``, never an
   approximation of it. A line read before is remembered whole with what it read as (most come back unchanged every
   read: HELP, TYPE, a counter that did not move), in two bounded generations, in the memory of the reader that
   reads (:class:`~vllm_capacity.sources.vllm_metrics.memory.ReaderMemory`, the client's): no module keeps any.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory, Remembered
from vllm_capacity.sources.vllm_metrics.select import MAX_SELECTED

# The comment and sample forms the fast path reads; anything else goes to prometheus-client.
_WS = " \t\n\r\x0b\x0c"  # string.whitespace: what the parser's tokenizer splits comment lines on
_META = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t\r\x0b\x0c]+([^ \t\r\x0b\x0c].*))?", re.DOTALL)
_VALUE = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?Inf|NaN"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
_SERIES_FORM = re.compile(rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?", re.DOTALL)
_VALUES = re.compile(rf" ({_VALUE})(?: ({_VALUE}))?")


#: the reader's memories of the parse (ReaderMemory): the series part of a sample line -> (name, labels), as read
#: before (a generation holds MAX_SELECTED), and each selected line -> what it read as (MAX_LINES); both turn every
#: SERIES_GENERATION parses too
SERIES, LINES = "series", "lines"
SERIES_GENERATION = 64
_LABELS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', re.DOTALL)
# the parser's unescaping of label values and HELP text
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_LABEL_ESCAPE = re.compile(r'\\[\\n"]')
_HELP_ESCAPE = re.compile(r"\\[\\n]")
_ALLOWED_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_TYPES = {"counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "untyped", "info", "stateset"}


class _NotCanonical(Exception):
    """A selected line the fast path does not read: prometheus-client reads them all instead."""


def parse_selected(lines: list[str], reader: ReaderMemory | None = None) -> list[Metric]:
    """``list(text_string_to_metric_families("\\n".join(lines)))``, read by the fast path when every line is in the
    canonical form, else by prometheus-client. Raises what the parser raises (ValueError and kin). What lines and
    series read as is remembered in ``reader`` (a fresh memory when none is given: the same result, slower)."""
    reader = ReaderMemory() if reader is None else reader
    for key in (SERIES, LINES):
        reader.use(key, SERIES_GENERATION)
    series: _Series = reader.of(SERIES, lambda: MAX_SELECTED)
    try:
        return list(_families(_items(lines, reader.of(LINES, lambda: MAX_LINES), series)))
    except _NotCanonical:
        return list(text_string_to_metric_families("\n".join(lines) + "\n"))


_Item = tuple[str, str, str | None] | Sample  # ("HELP", name, its text unescaped), ("TYPE", name, type) or a sample
#: a selected line -> what it reads as, as the series are remembered: most lines come back unchanged every read (a
#: family's HELP and TYPE, the cache config, a counter that did not move); their samples are shared between reads,
#: read-only like every parse result. A generation holds MAX_LINES: a line that changed is a new entry, and a thousand
#: engines change most of theirs every read.
MAX_LINES = 4096
_Series = Remembered[str, tuple[str, dict[str, str]]]


def _items(lines: list[str], remembered: Remembered[str, _Item], series: _Series) -> list[_Item]:
    known, items = remembered.current, []
    for line in lines:
        item = known.get(line)
        if item is None:
            item = remembered.recall(line)
            if item is None:
                item = _item(line, series)
                remembered.remember(line, item)
            known = remembered.current  # a new generation may have begun
        items.append(item)
    return items


def _item(line: str, series: _Series) -> _Item:
    if not line.startswith("#"):
        return _sample(line, series)
    meta = _META.fullmatch(line)
    if meta is None:
        raise _NotCanonical
    kind, name, rest = meta.groups()
    if kind == "HELP":  # the parser's unescaping of HELP text
        return kind, name, _HELP_ESCAPE.sub(_unescape, rest) if rest else ""
    return kind, name, rest


def _sample(line: str, remembered: _Series) -> Sample:
    # The series part (name and labels) is read once and remembered: the same series come back every scrape with
    # only their values changed. In a canonical line the series part ends at the last "}" (values hold none), or
    # at the first space when there are no labels.
    brace = line.rfind("}")
    cut = brace + 1 if brace > 0 else line.find(" ")
    series = (remembered.current.get(line[:cut]) or remembered.recall(line[:cut])) if cut > 0 else None
    if series is None:
        series = _series(line[:cut] if cut > 0 else line, remembered)
    m = _VALUES.fullmatch(line, cut)
    if m is None:
        raise _NotCanonical
    value_text, timestamp_text = m.groups()
    try:
        timestamp = _number(timestamp_text) / 1000 if timestamp_text else None
    except OverflowError:  # an integer timestamp beyond a float: the parser's error to raise
        raise _NotCanonical from None
    return Sample(series[0], dict(series[1]), _number(value_text), timestamp)


def _series(text: str, remembered: _Series) -> tuple[str, dict[str, str]]:
    m = _SERIES_FORM.fullmatch(text)
    if m is None:
        raise _NotCanonical
    name, labels_text = m.groups()
    labels: dict[str, str] = {}
    if labels_text:
        for label, raw in _LABELS.findall(labels_text):
            if label in labels or label.startswith("__"):  # a duplicate is the parser's error; __ names are reserved
                raise _NotCanonical
            labels[label] = _LABEL_ESCAPE.sub(_unescape, raw) if "\\" in raw else raw
    remembered.remember(text, (name, labels))
    return name, labels


def _unescape(match: re.Match[str]) -> str:
    return _ESCAPES[match[0]]


def _number(text: str) -> int | float:
    """As the parser reads a value: an integer where it is one (beyond a float's range too), else a float. (The
    parser tries int() first; a value with a point or an exponent, most of them, is not tried: the exception is
    the costly part. The text has passed the canonical value grammar.)"""
    if text[-1:].isdigit() and text.lstrip("+-").isdigit():
        try:
            return int(text)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits): the parser's float
            pass
    return float(text)


def _families(items: Iterable[_Item]) -> Iterator[Metric]:
    """prometheus-client's ``text_fd_to_metric_families`` state machine, over already-parsed lines."""
    name, documentation, typ = "", "", "untyped"
    samples: list[Sample] = []
    allowed: tuple[str, ...] = ()
    for item in items:
        if isinstance(item, Sample):
            if item.name in allowed:
                samples.append(item)
                continue
            if name:
                yield _build(name, documentation, typ, samples)
            name, documentation, typ, samples, allowed = "", "", "untyped", [], ()
            yield _build(item.name, "", "untyped", [item])
            continue
        kind, candidate, rest = item
        if kind == "HELP":
            if candidate != name:
                if name:
                    yield _build(name, documentation, typ, samples)
                name, typ, samples, allowed = candidate, "untyped", [], (candidate,)
            documentation = rest or ""
        else:
            if rest is None or rest not in _TYPES:  # no type, or one the parser refuses: its error to raise
                raise _NotCanonical
            if candidate != name:
                if name:
                    yield _build(name, documentation, typ, samples)
                name, documentation, samples = candidate, "", []
            typ = rest
            allowed = tuple(name + suffix for suffix in _ALLOWED_SUFFIXES.get(typ, ("",)))
    if name:
        yield _build(name, documentation, typ, samples)


def _build(name: str, documentation: str, typ: str, samples: list[Sample]) -> Metric:
    # the parser's build_metric: a counter's family name loses "_total"; its samples gain it where they lack it
    if typ == "counter":
        if name.endswith("_total"):
            name = name[:-6]
        else:
            samples = [Sample(s.name + "_total", *s[1:]) for s in samples]
    metric = Metric(name, documentation, typ)
    metric.samples = samples
    return metric
