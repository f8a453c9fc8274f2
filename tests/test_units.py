import pytest

from vllm_capacity.units import parse_duration, parse_listen, parse_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("100ms", 0.1), ("0.5s", 0.5), ("1m", 60.0), ("5", 5.0), ("2.5", 2.5), ("1h", 3600.0), (" 250ms ", 0.25)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "fast", "5 minutes", "-1s", "1d", "ms"])
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
