"""Units, and the human-readable values operators type and read: durations, sizes, listen addresses, bytes.

Pure functions; each parser raises ValueError with a message that names what was wrong, ready for a one-line error.
"""

from __future__ import annotations

import re

KiB, MiB, GiB = 2**10, 2**20, 2**30
# context lengths a report or a plan shows the concurrency at, beside max_model_len and the observed context
CONTEXTS = (2048, 4096, 8192)


def format_bytes(value: float | None) -> str:
    """1536 -> '1.50 KiB', 4.31 * 2**30 -> '4.31 GiB', None -> 'unknown'."""
    if value is None:
        return "unknown"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


# Prometheus' duration grammar (model.ParseDuration): whole numbers with units, largest first, e.g. 1h30m, 7d, 1w,
# 250ms; a year is 365 days, a week 7. Also a single number with an optional unit, fractions allowed (0.5s, 2.5, 1.5h):
# what the flags took before, kept.
_PROMETHEUS_UNITS = (("y", 365 * 86400.0), ("w", 7 * 86400.0), ("d", 86400.0), ("h", 3600.0), ("m", 60.0),
                     ("s", 1.0), ("ms", 0.001))  # fmt: skip
_PROMETHEUS_DURATION = re.compile("".join(rf"(?:(?P<{u}>\d+){u})?" for u, _ in _PROMETHEUS_UNITS))
_SINGLE_DURATION = re.compile(r"(?P<num>\d+(?:\.\d+)?|\.\d+)(?P<unit>ms|s|m|h|d|w|y)?")
_UNIT_SECONDS = dict(_PROMETHEUS_UNITS)


def parse_duration(text: str) -> float:
    """Seconds from a duration in Prometheus' grammar (``1h30m``, ``7d``, ``1w``, ``250ms``), a single number with a
    unit (``0.5s``, ``1.5h``), or plain seconds (``5``, ``2.5``)."""
    stripped = str(text).strip()
    single = _SINGLE_DURATION.fullmatch(stripped)
    if single:
        return float(single["num"]) * _UNIT_SECONDS.get(single["unit"] or "s", 1.0)
    compound = _PROMETHEUS_DURATION.fullmatch(stripped)
    if not stripped or compound is None:
        raise ValueError(f"{text!r} is not a duration (examples: 100ms, 0.5s, 5s, 1m, 1h30m, 7d, or plain seconds)")
    return sum(int(compound[u]) * seconds for u, seconds in _PROMETHEUS_UNITS if compound[u])


def format_duration(seconds: float) -> str:
    """A duration in Prometheus' grammar, as parse_duration reads it: 0.1 -> '100ms', 90 -> '1m30s', 604800 -> '1w',
    0 -> '0s'. Below a millisecond, what is left is rounded to it."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    parts = []
    for unit, size in _PROMETHEUS_UNITS:
        count, ms = divmod(ms, round(size * 1000))
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def parse_listen(text: str) -> tuple[str, int]:
    """Parse ``host:port``, ``:port`` or ``[v6addr]:port`` into (host, port); the host of ``:port`` is "" (every
    interface, IPv4 and IPv6: a pod network may be IPv6 only)."""
    text = str(text).strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"{text!r} is not [ipv6]:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} is not host:port (example: 0.0.0.0:9790 or :9790)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: port must be a number from 1 to 65535")
    return host, int(port)


_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parse ``16MiB``, ``4.31 GiB``, ``2GB`` or plain bytes into bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 16MiB, 4.31GiB, 2GB, or plain bytes)")
    unit = (m["unit"] or "B").lower()
    return int(float(m["num"]) * _SIZE_UNITS[unit])
