"""Keep secrets out of every output: the password in a URL's userinfo and the API key, wherever a URL or an
exception message may carry them (logs, /metrics, the landing page, reports, error lines)."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def redact_url(url: str) -> str:
    """``http://user:pass@host:8000/x`` -> ``http://***@host:8000/x``; a URL without userinfo is returned as it is."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK if "@" in url else url
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{MASK}@{host}"))


def url_secrets(url: str) -> list[str]:
    """The parts of a URL's userinfo that must never be printed (the password, and the whole userinfo)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    if "@" not in parts.netloc:
        return []
    userinfo = parts.netloc.rsplit("@", 1)[0]
    return [s for s in (userinfo, parts.password) if s]


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ***, longest first."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
