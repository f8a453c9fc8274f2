"""Select the lines of a vLLM ``/metrics`` body that concern the families the agent reads: step 1 of
:mod:`.scan`, with a plain definition and a fast implementation that the tests hold to it.

A line is selected when, stripped as the parser strips it, it is either a HELP or TYPE comment whose name token (the
word after HELP or TYPE, after its opening quote if quoted) starts with one of the names the agent reads (also those
of other families, since the parser's notion of "the current family" depends on them), or a sample whose name token
(the text up to the first ``{``, space or tab) is one of the sample names. Other comments are never read by the
parser and never selected. :func:`select_lines` finds them with one regular expression (C speed) instead of looking
at every line, and remembers what each line it found was; :func:`select_lines_plainly` is the line-by-line
definition, kept for the tests.

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
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory, Remembered

#: Longest selected line read (vLLM 0.32's longest, cache_config_info, is about 700 characters).
MAX_LINE = 8192
#: Most lines of one family: a 23-bucket histogram of 700 engines (64 engines select 1,472 lines of the largest).
MAX_FAMILY_LINES = 16384
#: Most selected lines, and characters in them, of all the families together: a dozen samples for each of 1,024
#: data-parallel engines fits with room (64 engines select 727 lines, 118 KiB, without the latency histograms; 5,799
#: and 567 KiB with them). They bound the parse's memory: at twice these, 512 engines scraped every second took the
#: sidecar to 116 MiB of its 128 Mi limit (bench/engines.py), 92 MiB at these.
MAX_SELECTED = 16384
MAX_SELECTED_CHARS = 2 * 1024 * 1024
OTHER_COMMENTS = "#other"  # the family key of comment lines that belong to no family the agent reads
_TOKEN_END = re.compile(r"[{ \t]")
#: what each line found was: a generation holds MAX_FOUND lines, and turns every FOUND_GENERATION selections. One
#: engine finds ~130 lines with the latency histograms, 8 engines ~760 without; at 4,096 a generation, a soak whose
#: model was renamed every 3 s held 2.3 MiB more after 600 s (two memories of two generations of ~470 bytes a line).
MAX_FOUND = 1024
FOUND_GENERATION = 64


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
        self._lines: Counter[str] = Counter()  # each family's lines
        self.chars = 0
        self.over_limit: dict[str, str] = {}

    def family(self, name: str) -> str:
        """The family key a line named ``name`` counts under: its family, or one key for comments of no wanted family
        (a bounded set of keys, whatever the body names)."""
        family = family_key(name)
        return family if family in self._wanted else OTHER_COMMENTS

    def keep(self, line: str, sample_names: frozenset[str]) -> None:
        """Append the stripped line if it is selected (the caller knows it contains one of the names) and its family
        is within the bounds."""
        classified = _classified(line, sample_names)
        if classified is not None:
            self.add(classified[0], self.family(classified[1]))

    def add_all(self, found: list[tuple[str, str]]) -> None:
        """:meth:`add` each (stripped line, family) in turn; all at once when, all added, no bound is passed (counts
        only grow: then none was passed on the way either, and one by one would have kept them all)."""
        if not found:
            return
        lines, families = zip(*found, strict=True)
        counts, chars = Counter(families), sum(map(len, lines))
        if (
            len(self) + len(lines) > MAX_SELECTED
            or self.chars + chars > MAX_SELECTED_CHARS
            or max(map(len, lines)) > MAX_LINE
            or any(f in self.over_limit or self._lines[f] + n > MAX_FAMILY_LINES for f, n in counts.items())
        ):
            for line, family in found:
                self.add(line, family)
            return
        self.extend(lines)
        self._family.extend(families)
        self._lines.update(counts)
        self.chars += chars

    def add(self, stripped: str, family: str) -> None:
        """Append a selected line (stripped, and its :meth:`family`) if its family is within the bounds."""
        if family in self.over_limit:
            return
        size = len(stripped)
        if size > MAX_LINE:
            self._leave_out(family, f"a line of {size} characters; the limit is {MAX_LINE}")
            return
        self.append(stripped)
        self._family.append(family)
        self._lines[family] += 1
        self.chars += size
        if self._lines[family] > MAX_FAMILY_LINES:
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
            kept = [i for i, f in enumerate(self._family) if f != family]
            self[:] = [self[i] for i in kept]
            self._family = [self._family[i] for i in kept]
            self.chars = sum(map(len, self))


def _classified(line: str, sample_names: frozenset[str]) -> tuple[str, str] | None:
    """(the stripped line, its name token) when the line is selected: a comment (its name "" unless HELP or TYPE), or
    a sample of one of ``sample_names``; None for a sample of another name."""
    stripped = line.strip()
    if stripped.startswith("#"):
        words = stripped[1:].split(None, 2)
        return stripped, (words[1] if len(words) > 1 and words[0] in ("HELP", "TYPE") else "")
    name = _token(stripped)
    return (stripped, name) if name in sample_names else None


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
    text: str | bytes,
    sample_names: Sequence[str],
    meta_names: Sequence[str],
    selected: Selection | None = None,
    reader: ReaderMemory | None = None,
) -> Selection:
    """The same lines as :func:`select_lines_plainly`, found without visiting the lines that name nothing wanted.

    A selected line either starts (after whitespace) with a sample name or is a HELP or TYPE line whose name token
    starts with one of the names: one regular expression finds both kinds from the newline before them, jumping from
    newline to newline in C. Only a comment's name token is searched, never its text (HELP text is most of a
    comment's length: searching it for every name cost three quarters of the scan). What each line found was is
    remembered in ``reader``, the reader's memory (a fresh one when none is given: the same selection, slower).

    ``text`` may be the body's bytes when they are ASCII (vLLM's are; ``MetricsStream`` sees to it): then only the
    selected lines are ever decoded, and a body of megabytes is never copied into a string. ``selected``, to go on
    with: a selection of the same names."""
    scanner = _scanner(tuple(sample_names), tuple(meta_names))
    return _select(scanner, scanner.lines(text), sample_names, meta_names, selected, reader)


def found_lines(
    text: str | bytes, sample_names: Sequence[str], meta_names: Sequence[str], start: int = 0, end: int | None = None
) -> list[str | bytes]:
    """The lines of ``text`` that :func:`select_lines` looks at, as they are in it, in order (a line is a whole line
    without its newline; ``text`` starts at a line's start): the selection is a function of them. For a segment of a
    body (the whole lines are in memory already). With ``start`` and ``end`` (a line's start, a line's end or the
    text's), those of the lines in between, found without copying them: the lines of consecutive spans are those of
    the text they make up."""
    return _scanner(tuple(sample_names), tuple(meta_names)).findall(text, start, end)


def select_found(
    found: list[str | bytes],
    sample_names: Sequence[str],
    meta_names: Sequence[str],
    selected: Selection | None = None,
    reader: ReaderMemory | None = None,
) -> Selection:
    """:func:`select_lines` of the text where :func:`found_lines` found ``found``."""
    scanner = _scanner(tuple(sample_names), tuple(meta_names))
    return _select(scanner, found, sample_names, meta_names, selected, reader)


def _select(
    scanner: _Scanner,
    found: Iterable[str | bytes],
    sample_names: Sequence[str],
    meta_names: Sequence[str],
    selected: Selection | None,
    reader: ReaderMemory | None,
) -> Selection:
    selected = Selection(sample_names, meta_names) if selected is None else selected
    for batch in scanner.known(found, ReaderMemory() if reader is None else reader):
        selected.add_all(batch)
    return selected


#: lines found, in batches of this many: the bounds are applied batch by batch, so a body of a million wanted lines
#: never holds a million found at once
FOUND_BATCH = 4096

_Found = tuple[str, str] | tuple[()]  # (the stripped line, its family), or () for a sample of another name


class _Scanner:
    """:func:`select_lines` for one set of names: the expression (one for bytes, one for text); nothing of a body.
    What each line found was is remembered in the reader's memory (:class:`ReaderMemory`, under :attr:`key`): most
    lines come back every read (a HELP, a TYPE, a gauge or a counter that did not move), and a line that was read
    before is not decoded, stripped and cut again (at one engine two thirds of the selection's CPU). That memory
    turns every :data:`FOUND_GENERATION` selections and when a generation holds :data:`MAX_FOUND`, as the parse's
    memories do."""

    def __init__(self, sample_names: tuple[str, ...], meta_names: tuple[str, ...]) -> None:
        self.key = ("found", sample_names, meta_names)
        self.patterns = {binary: _starts_pattern(sample_names, meta_names, binary) for binary in (True, False)}
        self.samples = frozenset(sample_names)
        self.selection = Selection(sample_names, meta_names)  # its family(), for the lines found

    def _first(self, text: str | bytes) -> list[str | bytes]:
        """The first line, when it is one to look at (the expression finds lines from the newline before them)."""
        binary = isinstance(text, bytes)
        first = self.patterns[binary].match((b"\n" if binary else "\n") + text[: _line_end(text, 0)])  # type: ignore[operator]
        return [] if first is None else [first[1]]

    def lines(self, text: str | bytes) -> Iterator[str | bytes]:
        """The lines found, one at a time (a whole line cut in C; a body of a million wanted lines is never listed)."""
        yield from self._first(text)
        for match in self.patterns[isinstance(text, bytes)].finditer(text):
            yield match[1]

    def findall(self, text: str | bytes, start: int = 0, end: int | None = None) -> list[str | bytes]:
        """The lines found between ``start`` and ``end`` (the text's end), listed in one call (after the first line, a
        line is found from the newline before it)."""
        end = len(text) if end is None else end
        if start >= end:
            return []
        found = self._first(text) if start == 0 else []
        found += self.patterns[isinstance(text, bytes)].findall(text, max(start - 1, 0), end)
        return found

    def known(self, found: Iterable[str | bytes], reader: ReaderMemory) -> Iterator[list[tuple[str, str]]]:
        """The selected lines' (stripped line, family), in order, a batch at a time."""
        reader.use(self.key, FOUND_GENERATION)
        remembered: Remembered[str | bytes, _Found] = reader.of(self.key, lambda: MAX_FOUND)
        memory, batch = remembered.current, []
        for raw in found:
            known = memory.get(raw)
            if known is None:
                known = self._recall(raw, remembered)
                memory = remembered.current  # a new generation may have begun
            if known:
                batch.append(known)
                if len(batch) == FOUND_BATCH:
                    yield batch
                    batch = []
        yield batch

    def _recall(self, raw: str | bytes, remembered: Remembered[str | bytes, _Found]) -> _Found:
        known = remembered.recall(raw)
        if known is None:
            classified = _classified(raw.decode("ascii") if isinstance(raw, bytes) else raw, self.samples)
            known = () if classified is None else (classified[0], self.selection.family(classified[1]))
            if len(raw) <= MAX_LINE:  # a line over the bound is its family's end, never worth remembering
                remembered.remember(raw, known)
        return known


@functools.cache  # the expressions of a set of names: a function of the names alone
def _scanner(sample_names: tuple[str, ...], meta_names: tuple[str, ...]) -> _Scanner:
    return _Scanner(sample_names, meta_names)


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


def _line_end(text: str | bytes, at: int) -> int:
    end = text.find(b"\n" if isinstance(text, bytes) else "\n", at)  # type: ignore[arg-type]
    return len(text) if end < 0 else end
