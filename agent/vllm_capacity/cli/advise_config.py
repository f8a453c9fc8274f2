"""What ``vllm-capacity advise`` is asked: a field per option (the options themselves: :mod:`.options`), and the
parsers only its options use."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.geometry import Geometry


@dataclass(frozen=True)
class AdviseConfig:
    prometheus_url: str | None
    window: float
    end: float | None  # Unix seconds; None: now
    selector: str | None
    model_config: Geometry | None
    tp: int
    headroom: float
    slo_ttft: Objective | None
    slo_itl: Objective | None
    bearer_token_file: str | None  # the token read from the file, not its path; never logged
    basic_auth_user: str | None
    basic_auth_password_file: str | None  # the password read from the file
    ca_file: str | None
    insecure_skip_verify: bool
    timeout: float
    format: Literal["text", "json", "html"]
    output: str | None


def parse_headroom(text: str) -> float:
    """``20%`` or ``0.2``: the share of the peak kept free, 0 to 10 (1000 %)."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a share like 20% or 0.2") from None
    if not 0 <= value <= 10:
        raise ValueError(f"{text!r} is not between 0 % and 1000 %")
    return value


def parse_time(text: str) -> float:
    """Unix seconds, or an RFC 3339 time (2026-12-01T00:00:00Z), as Prometheus's API takes them."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither Unix seconds nor an RFC 3339 time") from None
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone (add Z for UTC)")
    return when.timestamp()


def window_text(seconds: float) -> str:
    """A window in Prometheus's duration syntax, in its largest whole unit (7d, 36h, 90m, 45s)."""
    whole = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"
