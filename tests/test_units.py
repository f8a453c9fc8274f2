import re

import pytest

from vllm_capacity.units import format_duration, parse_duration, parse_listen, parse_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("100ms", 0.1), ("0.5s", 0.5), ("1m", 60.0), ("5", 5.0), ("2.5", 2.5), ("1h", 3600.0), (" 250ms ", 0.25),
        # Prometheus' grammar (exporter flags, scrape intervals): compound, largest unit first, d / w / y
        ("1h30m", 5400.0), ("7d", 604800.0), ("1w", 604800.0), ("1y", 365 * 86400.0), ("1m30s500ms", 90.5),
        ("2d12h", 216000.0), ("1.5h", 5400.0),
    ],
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("seconds", [0.1, 0.25, 1.0, 5.0, 60.0, 90.0, 90.5, 3600.0, 5400.0, 86400.0, 604800.0, 1e7])
def test_durations_print_in_prometheus_grammar_and_read_back(seconds: float) -> None:
    text = format_duration(seconds)
    assert re.fullmatch(r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?", text) and text, text
    assert parse_duration(text) == pytest.approx(seconds)


def test_durations_print_as_people_write_them() -> None:
    assert [format_duration(s) for s in (0.1, 60.0, 90.0, 3600.0, 604800.0)] == ["100ms", "1m", "1m30s", "1h", "1w"]


@pytest.mark.parametrize("text", ["", "fast", "5 minutes", "-1s", "ms", "30m1h", "1.5h30m", "1d1d", "1h 30m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(":9790", ("", 9790)), ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9790", ("::1", 9790))],
)
def test_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["9790", "host:", "host:99999", "host:http", "[::1]9790"])
def test_bad_listen(text: str) -> None:
    with pytest.raises(ValueError, match=r"port|host:port|ipv6"):
        parse_listen(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [("16MiB", 16 * 2**20), ("4.31 GiB", int(4.31 * 2**30)), ("2GB", 2 * 10**9), ("1024", 1024), ("1kib", 1024)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
