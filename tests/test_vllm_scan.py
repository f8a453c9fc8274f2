"""The selective scanner against prometheus-client's parser: a differential test on the real captures and on
generated mutations of them (escapes, quotes, ``#`` and ``}`` in label values, unicode, exemplars, ``# EOF``, CRLF,
NaN/Inf, timestamps, duplicated, dropped, moved and truncated lines, odd spacing, retyped families, lines over the
length limit). For every payload:

* the fast selection equals the line-by-line definition of it (over the string, and over the bytes of an ASCII
  body, which the agent scans without decoding), and
* the fast parse of the selected lines equals ``list(text_string_to_metric_families(selected))``: the same families,
  documentation, types, sample names, labels, values (``int`` vs ``float`` included) and timestamps, or the same
  exception.

VLLM_CAPACITY_SCAN_CASES sets how many payloads are generated (2,000 by default: 9 s on the development machine, 36 s
under the full run's coverage tracing; ``scripts/test --fast`` runs 500; ``bench/cycle.py --fuzz`` runs 100,000 or
more).
"""

from __future__ import annotations

import os
import random
import re

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from support.files import fixture_text
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_metrics.memory import ReaderMemory
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.sources.vllm_metrics.records import LATENCY_BUCKETS, META, WANTED, VllmMetrics
from vllm_capacity.sources.vllm_metrics.scan import parse_selected
from vllm_capacity.sources.vllm_metrics.select import MAX_LINE, family_key, select_lines, select_lines_plainly
from vllm_capacity.sources.vllm_metrics.stream import MetricsStream, parse_metrics_body

CASES = int(os.environ.get("VLLM_CAPACITY_SCAN_CASES", "2000"))
CAPTURES = (
    "v1-0.32.0-cpu-saturated.prom",
    "v1-0.32.0-cpu-idle.prom",
    "v1-0.24-seed.prom",
    "v1-0.10.2-dp2.prom",
    "v1-0.8.5-legacy.prom",
    "v0-0.6.6-multiprocess.prom",
)
NAMES = (*WANTED, *META)


def _canon(families: list[Metric]) -> list[tuple[object, ...]]:
    """Families as comparable data: NaN compares equal to NaN, an int is not a float."""
    return [
        (
            f.name,
            f.documentation,
            f.type,
            [
                (s.name, sorted(s.labels.items()), type(s.value).__name__, repr(s.value), repr(s.timestamp))
                for s in f.samples
            ],
        )
        for f in families
    ]


def _selection(select, text):  # type: ignore[no-untyped-def]
    selected = select(text, WANTED, META)
    return list(selected), dict(selected.over_limit)


def _name(line: str) -> str:
    return line[1:].split()[1] if line.startswith("#") and len(line[1:].split()) > 1 else line.split("{")[0].split()[0]


def _outcome(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return "ok", fn(*args)
    except Exception as err:
        return "raised", type(err).__name__


WARM = ReaderMemory()  # one reader's memory across every text the differential tests read


def _check(text: str) -> str:
    """Assert the scanner agrees with its definitions on ``text``; returns which path read it."""
    plain = _outcome(_selection, select_lines_plainly, text)
    fast = _outcome(_selection, select_lines, text)
    assert fast == plain, text
    body = text.encode()
    # as the agent reads it from the network: fed in pieces of any size, segments of a few lines, with the memory of
    # a reader that read every text before this one (a warm memory reads what a fresh one reads)
    stream = MetricsStream(segment=300, reader=WARM)
    for at in range(0, len(body), 997):
        stream.feed(body[at : at + 997])
    assert _outcome(stream.finish) == _outcome(parse_metrics, text), text
    if body.isascii():  # the agent scans an ASCII body's bytes as they came
        assert _outcome(_selection, select_lines, body) == plain, text
        assert _outcome(parse_metrics_body, body) == _outcome(parse_metrics, text), text
    assert plain[0] == "ok", plain  # the selection never raises: a family past its bounds is left out
    lines, over_limit = plain[1]
    if over_limit:
        assert not any(family_key(_name(line)) in over_limit for line in lines)
        return "over limit"
    library = _outcome(lambda: _canon(list(text_string_to_metric_families("\n".join(lines) + "\n"))))
    ours = _outcome(lambda: _canon(parse_selected(lines)))
    assert ours == library, "\n".join(lines)
    return "parsed" if library[0] == "ok" else "parse error"


@pytest.mark.parametrize("name", CAPTURES)
def test_every_capture_reads_as_the_library_reads_the_whole_body(name: str) -> None:
    """On real captures the selection loses nothing: the samples the agent reads come out in the same families
    (name, documentation, type) as a parse of the whole body gives them (a histogram's _sum and _count aside)."""
    text = fixture_text(name)
    assert _check(text) == "parsed"

    def read(families: list[Metric]) -> list[tuple[object, ...]]:
        for f in families:
            f.samples = [s for s in f.samples if s.name in WANTED]
        return _canon([f for f in families if f.samples])

    assert read(parse_selected(select_lines(text, WANTED, META))) == read(list(text_string_to_metric_families(text)))


# --- generated payloads ------------------------------------------------------------------------------------------

ODD_VALUES = (
    "NaN",
    "+Inf",
    "-Inf",
    "Inf",
    "-1",
    "-0",
    "1e300",
    "1.7e308",
    "1" + "0" * 400,
    "0.5",
    "7",
    "1.",
    ".5",
    "1e-300",
    "abc",
    "0x10",
    "1_0",
    "nan",
    "inf",
    "+5",
    "05",
    "1E5",
    "",
)
ODD_LABEL_VALUES = (
    'a\\"b',
    "a\\\\",
    "a\\n",
    "a\\t",
    "}",
    "a,b",
    "#",
    "a # b",
    "x=y",
    "ünï",
    "\u2028",
    "{",
    "\\",
    "vllm:num_requests_running 5",
    "",
)
INSERTS = (
    "# EOF",
    "# HELP vllm:num_requests_running",
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running counter",
    "# TYPE vllm:num_requests_running histogram",
    "# TYPE vllm:num_requests_running bogus",
    "# TYPE vllm:num_requests_running",
    "# TYPE vllm:num_preemptions counter",
    'vllm:num_preemptions{engine="0",model_name="m"} 3',
    "# HELP vllm:inter_token_latency_seconds_total a counter",
    "# TYPE vllm:inter_token_latency_seconds_total counter",
    "# TYPE vllm:time_per_output_token_seconds histogram",
    "#  HELP  vllm:kv_cache_usage_perc  spaced",
    "#\tTYPE\tvllm:kv_cache_usage_perc\tgauge",
    '# HELP "vllm:kv_cache_usage_perc" quoted',
    "# a comment naming vllm:kv_cache_usage_perc",
    "#HELP vllm:kv_cache_usage_perc no space",
    '{__name__="vllm:num_requests_running",engine="0",model_name="m"} 4',
    'vllm:num_requests_running{engine="0",model_name="m"} 4 1700000000000',
    'vllm:num_requests_running{engine="0",model_name="m"} 4 ' + "9" * 400,
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5 # {trace_id="abc"} 1.0',
    'vllm:kv_cache_usage_perc {engine="0",model_name="m"} 0.5',
    'vllm:kv_cache_usage_perc{engine="0",model_name="m",} 0.5',
    'vllm:kv_cache_usage_perc{engine="0",engine="1"} 0.5',
    'vllm:kv_cache_usage_perc{engine="0"}0.5',
    "vllm:kv_cache_usage_perc 0.25",
    "vllm:kv_cache_usage_perc\t0.25",
    'vllm:kv_cache_usage_perc_total{engine="0"} 1',
    "   vllm:num_requests_waiting 2   ",
    'other_metric{label="vllm:num_requests_waiting"} 1',
    "# HELP vllm:num_requests_waiting " + "x " * (MAX_LINE // 2),
    'vllm:num_requests_waiting{model_name="' + "m" * MAX_LINE + '"} 1',
)


def _sample_line(rng: random.Random, lines: list[str]) -> int:
    """An index, most often of a line the agent reads."""
    ours = [i for i, line in enumerate(lines) if any(n in line for n in NAMES)]
    return rng.choice(ours) if ours and rng.random() < 0.85 else rng.randrange(len(lines))


def _mutate(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = _sample_line(rng, lines)
    line = lines[i]
    kind = rng.randrange(16)
    if kind == 0:  # an odd value
        head, _, _ = line.rpartition(" ")
        lines[i] = f"{head or line} {rng.choice(ODD_VALUES)}"
    elif kind == 1:  # an odd label value
        at = line.find('="')
        if at >= 0:
            end = line.find('"', at + 2)
            lines[i] = line[: at + 2] + rng.choice(ODD_LABEL_VALUES) + line[max(end, at + 2) :]
    elif kind == 2:
        del lines[i]
    elif kind == 3:
        lines.insert(i, line)
    elif kind == 4:  # a line moved elsewhere
        lines.insert(rng.randrange(len(lines)), lines.pop(i))
    elif kind == 5:  # a byte replaced
        if line:
            j = rng.randrange(len(line))
            lines[i] = line[:j] + rng.choice('{}",=\\ x0-.:#\t\r_ü') + line[j + 1 :]
    elif kind == 6:  # a byte inserted
        j = rng.randrange(len(line) + 1)
        lines[i] = line[:j] + rng.choice('{}",=\\ \t#\r\x0b\xa0\u2028') + line[j:]
    elif kind == 7:  # CRLF line ends
        lines = [x + "\r" for x in lines]
    elif kind == 8:  # truncated anywhere
        return text[: rng.randrange(len(text) + 1)]
    elif kind == 9:  # a line of its own inserted
        lines.insert(i, rng.choice(INSERTS))
    elif kind == 10:  # leading or trailing whitespace
        lines[i] = rng.choice((" ", "\t", "  ")) + line if rng.random() < 0.5 else line + rng.choice((" ", "\t", "\r"))
    elif kind == 11:  # spacing doubled
        lines[i] = line.replace(" ", rng.choice(("  ", "\t", " \t")), 1)
    elif kind == 12:  # a family retyped
        lines[i] = line.replace(" gauge", rng.choice((" counter", " histogram", " summary", " info", " untyped")))
        lines[i] = lines[i].replace(" counter", rng.choice((" gauge", " histogram", " summary")))
    elif kind == 13:  # HELP text with escapes and quotes
        if line.startswith("# HELP"):
            lines[i] = line + rng.choice((' with "quotes"', " back\\\\slash", " new\\nline", ' odd"quote', " #"))
    elif kind == 14:  # a label added, or one removed
        if "{" in line:
            lines[i] = line.replace("{", rng.choice(('{extra="1",', '{__name__="x",', "{", '{a="1",a="2",')), 1)
    else:  # an engine's series moved to another engine
        lines[i] = line.replace('engine="0"', 'engine="1"')
    return "\n".join(lines)


def test_generated_payloads_read_exactly_as_the_library_reads_them() -> None:
    rng = random.Random(20261201)
    seeds = [fixture_text(name) for name in CAPTURES]
    outcomes: dict[str, int] = {}
    for _ in range(CASES):
        text = rng.choice(seeds)
        for _ in range(rng.randrange(1, 5)):
            text = _mutate(text, rng)
        result = _check(text)
        outcomes[result] = outcomes.get(result, 0) + 1
    # the generator reaches every outcome (a generator that only ever made valid text would prove little)
    assert set(outcomes) == {"parsed", "parse error", "over limit"}, outcomes
    assert outcomes["parsed"] > CASES / 3, outcomes


def test_only_the_name_of_a_help_or_type_line_is_searched() -> None:
    """A comment is selected for the name right after HELP or TYPE (quoted too: prometheus-client unquotes it), never
    for a name in its text: the parser ignores other comments and a HELP text's words, and searching every
    comment's text for every name was three quarters of a read's scan."""
    text = (
        "# a comment naming vllm:num_requests_running\n"
        "# HELP vllm:other_thing counts like vllm:num_requests_running does\n"
        '# HELP "vllm:num_requests_running" quoted\n'
        "#\tTYPE  vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
    )
    for select in (select_lines, select_lines_plainly):
        assert list(select(text, WANTED, META)) == text.splitlines()[2:], select.__name__
    assert list(select_lines(text.encode(), WANTED, META)) == text.splitlines()[2:]
    (family,) = parse_selected(list(select_lines(text, WANTED, META)))
    assert (family.documentation, family.type) == ("quoted", "gauge")


def test_the_fast_path_reads_canonical_lines_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real capture the library is never called (a canonical line it would have to read is a slow cycle)."""
    import vllm_capacity.sources.vllm_metrics.scan as scan

    def refuse(_: str) -> None:
        raise AssertionError("the library parser was called")

    monkeypatch.setattr(scan, "text_string_to_metric_families", refuse)
    for name in CAPTURES:
        assert parse_metrics(fixture_text(name)).engines


def test_a_line_over_the_limit_leaves_its_family_out_not_the_scrape() -> None:
    """prometheus-client's parser is quadratic in some lines (a HELP of spaces, a value of escaped quotes): a line
    of the families the agent reads longer than MAX_LINE is never parsed; found in time linear in the body, it
    leaves that family out (named, with why) and the rest is read as before."""
    idle = fixture_text("v1-0.32.0-cpu-idle.prom")
    text = idle + "# HELP vllm:num_requests_running " + " x" * MAX_LINE + "\n"
    selected = select_lines(text, WANTED, META)
    assert list(selected.over_limit) == ["vllm:num_requests_running"]
    assert "limit is 8192" in selected.over_limit["vllm:num_requests_running"]
    assert not any("vllm:num_requests_running" in line.split(" ")[0 if line[0] != "#" else 2] for line in selected)
    metrics = parse_metrics(text)
    assert metrics.engines[0].running is None and metrics.engines[0].kv_cache_usage is not None
    assert metrics.over_limit == (("vllm:num_requests_running", selected.over_limit["vllm:num_requests_running"]),)
    # lines of other families may be as long as they like: they are never parsed, never counted
    other = idle + "# HELP vllm:other_family " + " x" * MAX_LINE + "\n"
    assert select_lines(other, WANTED, META).over_limit == {}


@pytest.mark.parametrize(
    ("family_lines", "lines", "chars"),
    [(40, 10**6, 10**9), (10**6, 300, 10**9), (10**6, 10**6, 20_000), (40, 300, 20_000)],
    ids=["family lines", "all lines", "all characters", "all three"],
)
def test_the_bounds_fall_alike_on_lines_found_a_batch_at_a_time(
    monkeypatch: pytest.MonkeyPatch, family_lines: int, lines: int, chars: int
) -> None:
    """select_lines adds the lines it finds a batch at a time, all at once when no bound is passed: with bounds that
    8 engines pass part way through a batch, it leaves out exactly what the line-by-line definition leaves out."""
    import vllm_capacity.sources.vllm_metrics.select as select
    from support.payloads import data_parallel

    body = data_parallel(8)
    monkeypatch.setattr(select, "FOUND_BATCH", 7)
    for name, bound in (("MAX_FAMILY_LINES", family_lines), ("MAX_SELECTED", lines), ("MAX_SELECTED_CHARS", chars)):
        monkeypatch.setattr(select, name, bound)
    plain = _selection(select_lines_plainly, body)
    assert plain[1] and len(plain[0]) > 7  # something was left out, and something kept
    assert _selection(select_lines, body) == _selection(select_lines, body.encode()) == plain


def test_a_thousand_engines_read_their_capacity_and_leave_the_largest_histograms_out() -> None:
    """1,024 data-parallel engines (35 MiB, over the 16,384 lines all families may select with the latency
    histograms): the capacity families of every engine are read, the largest latency families are left out and
    named, and up stays 1 (it read as parse_error from ~420 engines, the latency read retried every cycle)."""
    from support.payloads import data_parallel

    body = data_parallel(1024).encode()
    metrics = parse_metrics_body(body)
    assert len(metrics.engines) == 1024 and metrics.dp_engines == 1024
    assert all(m.kv_cache_usage is not None and m.running is not None for m in metrics.engines)
    left_out = dict(metrics.over_limit)
    # what is left out is the latency histograms, each by one of the bounds, never a capacity family
    assert "vllm:time_to_first_token_seconds" in left_out
    assert set(left_out) <= {family_key(name) for name in LATENCY_BUCKETS}, left_out
    assert all(why == "more than 16384 lines" or "largest family" in why for why in left_out.values()), left_out
    # at 220 engines only the largest is left out: the other histograms are read for every engine
    metrics = parse_metrics_body(data_parallel(220).encode())
    assert [family for family, _ in metrics.over_limit] == ["vllm:time_to_first_token_seconds"]
    assert all(set(m.latency) == {"itl", "prompt", "generation", "steps"} for m in metrics.engines)
    # without the latency histograms (most cycles) nothing is left out
    assert parse_metrics_body(body, latency=False).over_limit == ()


def test_fifty_thousand_lora_series_leave_lora_out_not_the_scrape() -> None:
    """vLLM never deletes a vllm:lora_requests_info series (each new pair of adapter lists is a new one): 50,000 of
    them pass the family's bound; the LoRA read is left out, the rest of the scrape is served."""
    idle = fixture_text("v1-0.32.0-cpu-idle.prom")
    lora = "".join(
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="a{i}",waiting_lora_adapters=""}} {i}.0\n'
        for i in range(50_000)
    )
    text = idle + "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    text += "# TYPE vllm:lora_requests_info gauge\n" + lora
    metrics = parse_metrics_body(text.encode())
    ((family, why),) = metrics.over_limit  # by the family's bound or the whole read's, both 16,384 lines
    assert metrics.lora is None and family == "vllm:lora_requests_info" and "16384 lines" in why, why
    assert metrics.engines[0].kv_cache_usage is not None
    # one adapter-list line of 8,667 characters: the same, by the line bound
    long_line = (
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{"a," * 4333}",waiting_lora_adapters=""}} 1.0\n'
    )
    metrics = parse_metrics_body((idle + long_line).encode())
    assert (
        list(dict(metrics.over_limit)) == ["vllm:lora_requests_info"] and metrics.engines[0].kv_cache_usage is not None
    )


def test_one_non_ascii_character_costs_its_chunk_not_the_body() -> None:
    """One emoji in a 31 MiB body decoded all of it (203 MiB peak, over the 128 Mi limit): now the bytes are read a
    megabyte of lines at a time and only a chunk that is not ASCII is decoded. The read is the same as a parse of
    the decoded text."""

    line = 'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.5",model_name="tiny-llama"} 3.0\n'
    text = fixture_text("v1-0.32.0-cpu-saturated.prom") + "# HELP vllm:other ünïcode \U0001f680\n"
    text += line * (31 * 1024 * 1024 // len(line))
    body = text.encode()
    metrics, peak = _parsed_with_peak(body)
    assert peak < 8 * 1024 * 1024, f"parsing a {len(body) >> 20} MiB body with one emoji allocated {peak >> 20} MiB"
    assert metrics == parse_metrics(text)


def test_a_body_that_is_not_utf8_is_a_parse_error() -> None:
    body = fixture_text("v1-0.32.0-cpu-idle.prom").encode() + b'vllm:num_requests_running{model_name="\xff"} 1\n'
    with pytest.raises(SourceError, match="not UTF-8") as err:
        parse_metrics_body(body)
    assert err.value.reason == Reason.PARSE_ERROR
    # UTF-8 beyond ASCII is read as text, as the library reads it
    accented = fixture_text("v1-0.32.0-cpu-idle.prom").replace("tiny-llama", "tïny-llama")
    assert parse_metrics_body(accented.encode()).engines[0].model_name == "tïny-llama"


def _parsed_with_peak(body: bytes) -> tuple[VllmMetrics, int]:
    """parse_metrics_body(body), and the most memory it held at once (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        metrics = parse_metrics_body(body)
        return metrics, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_body_near_the_cap_is_read_without_a_copy() -> None:
    """A 31 MiB body (the default --max-body-size is 32 MiB, the shipped memory limit 128 Mi) is parsed allocating
    a small fraction of its size: an ASCII body is scanned as bytes, never decoded whole (it cost two to three times
    the body, and 469 MiB with many lines of a read family). bench/cycle.py measures the process's peak RSS."""

    line = 'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.5",model_name="tiny-llama"} 3.0\n'
    body = (fixture_text("v1-0.32.0-cpu-saturated.prom") + line * (31 * 1024 * 1024 // len(line))).encode()
    metrics, peak = _parsed_with_peak(body)
    assert metrics.engines
    assert peak < 4 * 1024 * 1024, f"parsing a {len(body) >> 20} MiB body allocated {peak >> 20} MiB at its peak"
    # as many lines of a family the agent reads: that family is left out at its bound, before it costs memory
    wanted = 'vllm:num_requests_running{engine="%d",model_name="tiny-llama"} 1.0\n'
    many = (fixture_text("v1-0.32.0-cpu-saturated.prom") + "".join(wanted % i for i in range(400_000))).encode()
    metrics, peak = _parsed_with_peak(many)
    assert [family for family, _ in metrics.over_limit] == ["vllm:num_requests_running"]
    assert metrics.engines[0].kv_cache_usage is not None and metrics.engines[0].running is None
    assert peak < 12 * 1024 * 1024, f"reading {len(many) >> 20} MiB of wanted lines allocated {peak >> 20} MiB"


def test_series_no_longer_served_are_forgotten() -> None:
    """The series cache (a series' name and labels, read once) kept every series until it was full: 5,000 models
    served in turn held ~20 MiB of them. Series no longer served are dropped within two generations now, and the
    series still served stay read (the second generation moves them back)."""
    import vllm_capacity.sources.vllm_metrics.scan as scan
    import vllm_capacity.sources.vllm_metrics.select as select

    reader = ReaderMemory()
    body = fixture_text("v1-0.32.0-cpu-saturated.prom")
    for i in range(300):
        parse_metrics(body.replace("tiny-llama", f"model-{i}"), reader=reader)
    assert len(reader.held(scan.SERIES)) > 1000  # what the churn left, before it is forgotten
    for _ in range(2 * max(scan.SERIES_GENERATION, select.FOUND_GENERATION)):
        metrics = parse_metrics(body, reader=reader)
    served = len(select_lines(body, WANTED, META))
    assert len(reader.held(scan.SERIES)) <= served
    assert len(reader.held(scan.LINES)) <= served  # the lines read whole go the same way
    scanner = select._scanner(tuple(WANTED), tuple(META))
    assert len(reader.held(scanner.key)) <= len(scanner.findall(body))  # and what each line found was
    assert metrics.engines[0].model_name == "tiny-llama"


def test_remembered_lines_stay_bounded_and_read_as_the_parser_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A selected line read once is remembered whole (a HELP, a TYPE, a value that did not move come back every
    read); a line whose value changes every read is a new entry each time. The memory stays bounded
    (MAX_LINES a generation, and MAX_FOUND for what each line found was) and every read is still the parser's."""
    import vllm_capacity.sources.vllm_metrics.scan as scan
    import vllm_capacity.sources.vllm_metrics.select as select

    monkeypatch.setattr(scan, "MAX_LINES", 64)  # the bounds' logic, at a size a test runs through quickly
    monkeypatch.setattr(select, "MAX_FOUND", 64)
    reader = ReaderMemory()
    key = select._scanner(tuple(WANTED), tuple(META)).key
    body = fixture_text("v1-0.32.0-cpu-saturated.prom")
    running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", body, re.M)
    assert running is not None
    for i in range(3 * scan.MAX_LINES):
        moved = body.replace(running[0], running[0].removesuffix(running[1]) + f"{i}.0")
        lines = select_lines(moved, WANTED, META, reader=reader)
        assert scan.parse_selected(lines, reader) == list(text_string_to_metric_families("\n".join(lines) + "\n"))
        remembered, found = reader.held(scan.LINES), reader.held(key)
        assert len(remembered.current) <= scan.MAX_LINES and len(remembered.previous) <= scan.MAX_LINES
        assert len(found.current) <= select.MAX_FOUND and len(found.previous) <= select.MAX_FOUND
    assert parse_metrics(moved, reader=reader).engines[0].running == 3 * scan.MAX_LINES - 1
    for i in range(2 * select.MAX_FOUND):
        assert select_lines(f"# HELP vllm:num_requests_running {i}\n", WANTED, META, reader=reader) == [
            f"# HELP vllm:num_requests_running {i}"
        ]
        found = reader.held(key)
        assert len(found.current) <= select.MAX_FOUND and len(found.previous) <= select.MAX_FOUND
