"""Read the few families the agent needs out of a vLLM ``/metrics`` body, fast, and exactly as prometheus-client would.

A vLLM server with 64 data-parallel engines serves 2 MiB of exposition, almost all of it histograms the agent never
reads; prometheus-client's parser takes a second over the whole body. This module does it in two steps, each with a
plain definition and a fast implementation that the tests hold to it:

1. **Select** the lines that concern the families the agent reads. A line is selected when, stripped as the parser
   strips it, it is either a HELP or TYPE comment whose name token (the word after HELP or TYPE, after its opening
   quote if quoted) starts with one of the names the agent reads (also those of other families, since the parser's
   notion of "the current family" depends on them), or a sample whose name token (the text up to the first ``{``,
   space or tab) is one of :data:`SAMPLE_NAMES`. Other comments are never read by the parser and never selected.
   :func:`select_lines` finds them with one regular expression (C speed) instead of looking at every line;
   :func:`select_lines_plainly` is the line-by-line definition, kept for the tests.
2. **Parse** the selected lines. :func:`parse_selected` reads lines in the canonical form every prometheus-client
   exposition uses (``# HELP name doc``, ``# TYPE name type``, ``name{label="value",...} value [timestamp]``) itself
   and runs the parser's own family state machine over them; the moment a line is in any other form (an exemplar,
   odd spacing, a quoted name, a duplicated label...) it hands all selected lines to prometheus-client's parser.
   Either way the result is ``list(text_string_to_metric_families(selected))``, never an approximation of it. A line
   read before is remembered whole with what it read as (most come back unchanged every read: HELP, TYPE, a counter
   that did not move), in two bounded generations.

Bounded cost whatever the body: selection is linear in the body, and what it keeps is bounded per family
(prometheus-client's parser is quadratic in the length of some lines: a 1 MB HELP line of spaces takes tens of
seconds; and the bounds keep the parse's memory small). A family that passes a bound (a line longer than
:data:`MAX_LINE`, more than :data:`MAX_FAMILY_LINES` lines) is left out of the selection, all its lines, and named in
``over_limit``; when all the families together pass :data:`MAX_SELECTED` lines or :data:`MAX_SELECTED_CHARS`
characters, the one with the most lines is, until the rest fit. The other families are read as usual: 40,000 LoRA
series or a thousand engines' latency histograms cost those families, never the scrape. For ASCII bodies (vLLM's) the
selection reads the bytes as they came, decoding only the selected lines.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vllm_capacity.sources.remembered import Remembered

#: Longest selected line read (vLLM 0.32's longest, cache_config_info, is about 700 characters).
MAX_LINE = 8192
#: Most lines of one family: a 23-bucket histogram of 700 engines (64 engines select 1,472 lines of the largest).
MAX_FAMILY_LINES = 16384
#: Most selected lines, and characters in them, of all the families together: a dozen samples for each of 2,048
#: data-parallel engines fits with room (64 engines select 727 lines, 118 KiB, without the latency histograms; 5,799
#: and 567 KiB with them). They bound the parse's memory.
MAX_SELECTED = 32768
MAX_SELECTED_CHARS = 4 * 1024 * 1024
OTHER_COMMENTS = "#other"  # the family key of comment lines that belong to no family the agent reads


# The comment and sample forms the fast path reads; anything else goes to prometheus-client.
_WS = " \t\n\r\x0b\x0c"  # string.whitespace: what the parser's tokenizer splits comment lines on
_META = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t\r\x0b\x0c]+([^ \t\r\x0b\x0c].*))?", re.DOTALL)
_VALUE = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?Inf|NaN"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
_SERIES_FORM = re.compile(rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?", re.DOTALL)
_VALUES = re.compile(rf" ({_VALUE})(?: ({_VALUE}))?")


#: series part of a sample line -> (name, labels), as read before (a generation holds MAX_SELECTED; both memories
#: turn every SERIES_GENERATION parses too, in parse_selected)
_SERIES: Remembered[tuple[str, dict[str, str]]] = Remembered(lambda: MAX_SELECTED)
SERIES_GENERATION = 64
_parses = 0
_LABELS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', re.DOTALL)
_TOKEN_END = re.compile(r"[{ \t]")
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


def _token(stripped: str) -> str:
    end = _TOKEN_END.search(stripped)
    return stripped if end is None else stripped[: end.start()]


_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


@functools.lru_cache(maxsize=4096)  # a read asks for the same few dozen names each time
def family_key(name: str) -> str:
    """The family a sample or comment name belongs to, as the bounds count it: ``vllm:iteration_tokens`` for
    ``vllm:iteration_tokens_total_bucket`` and ``# HELP vllm:iteration_tokens_total`` alike."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.removesuffix("_total")


@functools.cache
def _wanted_families(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(family_key(n) for n in names)


class Selection(list[str]):
    """The selected lines, within the bounds: a list that also knows each line's family and what each family holds;
    ``over_limit`` names the families left out, and why."""

    def __init__(self, sample_names: Iterable[str], meta_names: Iterable[str]) -> None:
        super().__init__()
        self._wanted = _wanted_families((*sample_names, *meta_names))
        self._family: list[str] = []  # each line's family
        self._lines: dict[str, int] = {}  # each family's lines and characters
        self._chars: dict[str, int] = {}
        self.chars = 0
        self.over_limit: dict[str, str] = {}

    def keep(self, line: str, sample_names: frozenset[str]) -> None:
        """Append the stripped line if it is selected (the caller knows it contains one of the names) and its family
        is within the bounds."""
        classified = _classified(line, sample_names)
        if classified is not None:
            self.add(*classified)

    def add(self, stripped: str, name: str) -> None:
        """Append a selected line (stripped, and its name token) if its family is within the bounds."""
        family = family_key(name)
        if family not in self._wanted:
            family = OTHER_COMMENTS  # a bounded set of keys, whatever the body names
        if family in self.over_limit:
            return
        size = len(stripped)
        if size > MAX_LINE:
            self._leave_out(family, f"a line of {size} characters; the limit is {MAX_LINE}")
            return
        self.append(stripped)
        self._family.append(family)
        lines = self._lines[family] = self._lines.get(family, 0) + 1
        self._chars[family] = self._chars.get(family, 0) + size
        self.chars += size
        if lines > MAX_FAMILY_LINES:
            self._leave_out(family, f"more than {MAX_FAMILY_LINES} lines")
        while len(self) > MAX_SELECTED or self.chars > MAX_SELECTED_CHARS:
            largest = max(self._lines, key=self._lines.__getitem__)
            self._leave_out(
                largest,
                f"the largest family ({self._lines[largest]} lines) when those read passed {MAX_SELECTED} lines "
                f"or {MAX_SELECTED_CHARS // 1024 // 1024} MiB",
            )

    def _leave_out(self, family: str, why: str) -> None:
        self.over_limit[family] = why
        if self._lines.pop(family, 0):
            self.chars -= self._chars.pop(family)
            kept = [i for i, f in enumerate(self._family) if f != family]
            self[:] = [self[i] for i in kept]
            self._family = [self._family[i] for i in kept]


def _classified(line: str, sample_names: frozenset[str]) -> tuple[str, str] | None:
    """(the stripped line, its name token) when the line is selected: a comment (its name "" unless HELP or TYPE), or
    a sample of one of ``sample_names``; None for a sample of another name."""
    stripped = line.strip()
    if stripped.startswith("#"):
        words = stripped[1:].split(None, 2)
        return stripped, (words[1] if len(words) > 1 and words[0] in ("HELP", "TYPE") else "")
    name = _token(stripped)
    return (stripped, name) if name in sample_names else None


#: a comment line as it came (bytes or text) -> its classification: vLLM serves the same HELP and TYPE lines every
#: read, and at one engine they are two thirds of the lines read (bounded: cleared when full)
_COMMENTS: dict[str | bytes, tuple[str, str]] = {}
MAX_COMMENTS = 4096


def select_lines_plainly(text: str, sample_names: Iterable[str], meta_names: Iterable[str]) -> Selection:
    """The selection, defined line by line (see the module's docstring); the tests hold :func:`select_lines` to it."""
    samples, names = frozenset(sample_names), (*sample_names, *meta_names)
    selected = Selection(sample_names, meta_names)
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            words = stripped[1:].split(None, 2)
            named = words[1] if len(words) > 1 and words[0] in ("HELP", "TYPE") else ""
            if named.removeprefix('"').startswith(names):
                selected.keep(line, samples)
        elif any(name in line for name in names):
            selected.keep(line, samples)
    return selected


def select_lines(
    text: str | bytes | bytearray,
    sample_names: Sequence[str],
    meta_names: Sequence[str],
    selected: Selection | None = None,
) -> Selection:
    """The same lines as :func:`select_lines_plainly`, found without visiting the lines that name nothing wanted.

    A selected line either starts (after whitespace) with a sample name or is a HELP or TYPE line whose name token
    starts with one of the names: one regular expression finds both kinds from the newline before them, jumping from
    newline to newline in C. Only a comment's name token is searched, never its text (HELP text is most of a
    comment's length: searching it for every name cost three quarters of the scan).

    ``text`` may be the body's bytes when they are ASCII (vLLM's are; ``MetricsStream`` sees to it): then only the
    selected lines are ever decoded, and a body of megabytes is never copied into a string."""
    samples = frozenset(sample_names)
    binary = isinstance(text, bytes | bytearray)
    starts_pattern = _starts_pattern(tuple(sample_names), tuple(meta_names), binary)
    newline: str | bytes = b"\n" if binary else "\n"
    selected = Selection(sample_names, meta_names) if selected is None else selected
    first = starts_pattern.match(newline + text[: _line_end(text, 0)])  # type: ignore[operator]
    comments, add = _COMMENTS, selected.add
    # each whole line found and cut in C, in the order of the text (the bounds stop a body of a million wanted lines
    # early)
    for found in itertools.chain((first,) if first is not None else (), starts_pattern.finditer(text)):
        raw = found[1]
        known = comments.get(raw) or _classify(raw, samples)
        if known is not None:
            add(*known)
    return selected


def _classify(raw: str | bytes, samples: frozenset[str]) -> tuple[str, str] | None:
    """:func:`_classified` of a line as found (bytes of an ASCII body, or text); a comment's is remembered."""
    known = _classified(raw.decode("ascii") if isinstance(raw, bytes) else raw, samples)
    if known is not None and known[0].startswith("#") and len(raw) <= MAX_LINE:
        if len(_COMMENTS) >= MAX_COMMENTS:
            _COMMENTS.clear()
        _COMMENTS[raw] = known
    return known


@functools.cache
def _starts_pattern(sample_names: tuple[str, ...], meta_names: tuple[str, ...], binary: bool) -> re.Pattern[Any]:
    """From a newline, whitespace (what ``str.strip`` and ``str.split`` take for it: ``\\s`` in a string, spelled out
    for ASCII bytes), then the start of a sample name, or a HELP or TYPE comment whose name token starts with one of
    the names (most comment lines name none: they are passed over in C, never looked at in Python). The names are
    written as a trie (:func:`_alternatives`) so that the expression tries few branches."""
    space = r"[ \t\r\x0b\x0c\x1c-\x1f]" if binary else r"[^\S\n]"
    pattern = (
        r"\n(" + space + r"*(?:#" + space + r"*(?:HELP|TYPE)" + space + '+"?'
        + _alternatives((*sample_names, *meta_names)) + "|" + _alternatives(sample_names) + ")[^\n]*)"
    )  # fmt: skip
    return re.compile(pattern.encode("ascii") if binary else pattern)


def _alternatives(names: tuple[str, ...]) -> str:
    """A group matching any of ``names``, as a trie: the names' common prefixes are tried once, so that a line that
    starts with ``vllm:`` and none of the names is refused after a character or two, not after trying each name."""
    if names == ("",):
        return ""
    by_first: dict[str, list[str]] = {}
    for name in names:
        if name:
            by_first.setdefault(name[0], []).append(name[1:])
    branches = [re.escape(first) + _alternatives(tuple(rests)) for first, rests in by_first.items()]
    optional = "" in names  # a name that is a prefix of another one ends here too
    if len(branches) == 1 and not optional:
        return branches[0]
    return "(?:" + "|".join(branches) + ")" + ("?" if optional else "")


def _line_end(text: str | bytes | bytearray, at: int) -> int:
    end = text.find(b"\n" if isinstance(text, bytes | bytearray) else "\n", at)  # type: ignore[arg-type]
    return len(text) if end < 0 else end


def parse_selected(lines: list[str]) -> list[Metric]:
    """``list(text_string_to_metric_families("\\n".join(lines)))``, read by the fast path when every line is in the
    canonical form, else by prometheus-client. Raises what the parser raises (ValueError and kin)."""
    global _parses  # counts the parses for the series cache's generations
    _parses += 1
    if _parses % SERIES_GENERATION == 0:
        _SERIES.turn()
        _LINES.turn()
    try:
        return list(_families(_items(lines)))
    except _NotCanonical:
        return list(text_string_to_metric_families("\n".join(lines) + "\n"))


_Item = tuple[str, str, str | None] | Sample  # ("HELP", name, its text unescaped), ("TYPE", name, type) or a sample
#: a selected line -> what it reads as, as the series are remembered: most lines come back unchanged every read (a
#: family's HELP and TYPE, the cache config, a counter that did not move); their samples are shared between reads,
#: read-only like every parse result. A generation holds MAX_LINES: a line that changed is a new entry, and a thousand
#: engines change most of theirs every read.
MAX_LINES = 4096
_LINES: Remembered[_Item] = Remembered(lambda: MAX_LINES)


def _items(lines: list[str]) -> list[_Item]:
    known, items = _LINES.current, []
    for line in lines:
        item = known.get(line)
        if item is None:
            item = _LINES.recall(line)
            if item is None:
                item = _item(line)
                _LINES.remember(line, item)
            known = _LINES.current  # a new generation may have begun
        items.append(item)
    return items


def _item(line: str) -> _Item:
    if not line.startswith("#"):
        return _sample(line)
    meta = _META.fullmatch(line)
    if meta is None:
        raise _NotCanonical
    kind, name, rest = meta.groups()
    if kind == "HELP":  # the parser's unescaping of HELP text
        return kind, name, _HELP_ESCAPE.sub(_unescape, rest) if rest else ""
    return kind, name, rest


def _sample(line: str) -> Sample:
    # The series part (name and labels) is read once and remembered: the same series come back every scrape with
    # only their values changed. In a canonical line the series part ends at the last "}" (values hold none), or
    # at the first space when there are no labels.
    brace = line.rfind("}")
    cut = brace + 1 if brace > 0 else line.find(" ")
    series = (_SERIES.current.get(line[:cut]) or _SERIES.recall(line[:cut])) if cut > 0 else None
    if series is None:
        series = _series(line[:cut] if cut > 0 else line)
    m = _VALUES.fullmatch(line, cut)
    if m is None:
        raise _NotCanonical
    value_text, timestamp_text = m.groups()
    try:
        timestamp = _number(timestamp_text) / 1000 if timestamp_text else None
    except OverflowError:  # an integer timestamp beyond a float: the parser's error to raise
        raise _NotCanonical from None
    return Sample(series[0], dict(series[1]), _number(value_text), timestamp)


def _series(text: str) -> tuple[str, dict[str, str]]:
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
    _SERIES.remember(text, (name, labels))
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
