"""The sources' states, their failures counted by reason and logged once, and the log-once memory the readers share."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from vllm_capacity.snapshot import SourceState
from vllm_capacity.sources import Reason, SourceError

LOG_EVERY = 10.0  # seconds: at most one line a source about its state changes


@dataclass
class SourceStatus:
    up: bool = False
    duration_seconds: float | None = None
    failing_reason: str | None = None  # the current failure's reason; None while the source is up
    # what the log last said of this source (None: up, or never logged), when, and the changes not logged since
    logged_reason: str | None = None
    logged_at: float = -float("inf")
    unlogged_changes: int = 0
    reasons_logged: set[str] = field(default_factory=set)  # every failure reason the log has said once


def internal(err: Exception, doing: str) -> SourceError:
    """What nothing expected, named and counted (reason internal), never a crashed cycle."""
    return SourceError(Reason.INTERNAL, f"{doing}: {type(err).__name__}: {err}")


def first_time(seen: set[Any], cause: object, remember: int = 256) -> bool:
    """Whether ``cause`` is new to ``seen`` (then remembered). Causes are remembered up to ``remember``, then forgotten
    all at once: a stream of distinct causes (a count in each message, say) cannot grow the set without bound."""
    if cause in seen:
        return False
    if len(seen) >= remember:
        seen.clear()
    seen.add(cause)
    return True


class SourceBook:
    """Each source's status, the failures counted by (source, reason), and what the log says of them: a state
    change is logged once (again when the reason changes or after a recovery), at most once per LOG_EVERY seconds a
    source, except a failure reason the log has never given, which is said at once."""

    def __init__(self, names: Iterable[str], monotonic: Callable[[], float] = time.monotonic) -> None:
        self._status = {name: SourceStatus() for name in names}
        self.errors: Counter[tuple[str, str]] = Counter()
        self.monotonic = monotonic
        self.logger = structlog.get_logger("vllm_capacity")
        self._implausible_logged: set[tuple[str, ...]] = set()
        self._over_limit_logged: set[tuple[str, ...]] = set()

    def add(self, name: str) -> None:
        self._status[name] = SourceStatus()

    def remove(self, name: str) -> None:
        del self._status[name]

    def __getitem__(self, name: str) -> SourceStatus:
        return self._status[name]

    def __contains__(self, name: object) -> bool:
        return name in self._status

    def states(self) -> dict[str, SourceState]:
        """What the snapshot shows of each source."""
        return {name: SourceState(s.up, s.duration_seconds) for name, s in self._status.items()}

    def ok(self, source: str, duration: float) -> None:
        status = self._status[source]
        if status.failing_reason is not None:
            status.unlogged_changes += 1
        status.up, status.duration_seconds, status.failing_reason = True, duration, None
        self._log_state(source, status, None)

    def fail(self, source: str, err: SourceError, duration: float) -> None:
        """Count the failure; log its cause once (again when the reason changes or after a recovery)."""
        status = self._status[source]
        self.errors[(source, err.reason)] += 1
        if status.failing_reason != err.reason:
            status.unlogged_changes += 1
        status.up, status.duration_seconds, status.failing_reason = False, duration, err.reason
        self._log_state(source, status, err)

    def implausible(self, source: str, families: tuple[str, ...]) -> None:
        """Values a source sent that cannot be right (left out of this cycle): counted each cycle, logged once a
        cause."""
        if not families:
            return
        self.errors[(source, Reason.IMPLAUSIBLE_VALUE)] += 1
        if first_time(self._implausible_logged, families):
            self.logger.warning("implausible_values", families=list(families), hint="left out of this cycle's metrics")

    def over_limit(self, source: str, families: tuple[tuple[str, str], ...]) -> None:
        """Families a source sent beyond the bounds it reads (left out of this read): counted each read, logged once
        a set of families."""
        if not families:
            return
        self.errors[(source, Reason.FAMILY_OVER_LIMIT)] += 1
        if first_time(self._over_limit_logged, tuple(f for f, _ in families)):
            self.logger.warning(
                "families_over_limit",
                families={family: why for family, why in families},
                hint="left out of this read, the rest is read; docs/security.md gives the bounds",
            )

    def _log_state(self, source: str, status: SourceStatus, err: SourceError | None) -> None:
        """Log a source's state when it differs from what the log last said, at most once per LOG_EVERY seconds a
        source: a source that flaps every cycle makes a line every LOG_EVERY seconds (with the changes in between
        counted), not one a cycle; the log always comes to say the state the source is in."""
        same = status.failing_reason == status.logged_reason
        if same and not status.unlogged_changes:
            return
        now = self.monotonic()
        # a reason the log has never given is said at once, whatever the rate limit: a cause that came and went
        # between two lines (503s, then a body that is not vLLM's) would otherwise never reach the log
        new_reason = err is not None and first_time(status.reasons_logged, err.reason)
        if now - status.logged_at < LOG_EVERY and not new_reason:
            return
        changes = {"changes_since_last_line": status.unlogged_changes} if status.unlogged_changes > 1 else {}
        if same:  # back where the last line left it, after changes in between: it flaps
            self.logger.warning("source_flapping", source=source, state=status.failing_reason or "up", **changes)
        elif err is None:
            self.logger.info("source_recovered", source=source, after=status.logged_reason, **changes)
        else:
            self.logger.warning("source_failed", source=source, reason=err.reason, error=str(err), **changes)
        status.logged_reason, status.logged_at, status.unlogged_changes = status.failing_reason, now, 0
