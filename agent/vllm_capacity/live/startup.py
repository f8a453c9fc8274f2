"""The start-up log reader: follows the log file vLLM writes (a shared volume) for the memory figures it prints at
start (the lines themselves: :mod:`vllm_capacity.sources.vllm_log`). Its figures outlive /metrics outages: they
describe the process."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_capacity.live.status import SourceBook, internal
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_log import EngineFigures, LogFollower, StartupFigures

SOURCE_LOG = "vllm_log"


class StartupLogReader:
    """Feeds each new line of vLLM's log to its figures; a file that is missing or unreadable is a failed source,
    never a crashed cycle."""

    def __init__(
        self,
        follower: LogFollower,
        sources: SourceBook,
        monotonic: Callable[[], float] = time.monotonic,
        deadline: float = 4.0,
    ) -> None:
        """``deadline``: seconds a read of the log may take (the agent's --timeout); past it the read is abandoned."""
        self.follower, self.sources, self.monotonic, self.deadline = follower, sources, monotonic, deadline
        self.figures = StartupFigures()
        self._fed = 0  # lines fed to the figures so far
        self._engines: tuple[int, dict[str, EngineFigures]] = (0, {})  # a copy of theirs, and the lines it holds
        self._long_lines_logged = False
        self._implausible_seen = 0  # the figures' count of refused lines, as last counted
        # a thread of its own: a log on a volume that hangs blocks it, never the pool the other sources read in
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-capacity-log")
        self._reading: Future[None] | None = None  # the read under way, while one has not returned
        self._since = 0.0
        sources.add(SOURCE_LOG)

    @property
    def engines(self) -> dict[str, EngineFigures]:
        """Each engine's figures as they stand: a copy, taken again only once a line was fed. The figures are filled
        in place line by line; what the derivations read must not change under them (an engine derived from the
        same inputs is kept: :mod:`vllm_capacity.live.derived`)."""
        if self._engines[0] != self._fed:
            self._engines = (self._fed, {name: dataclasses.replace(f) for name, f in self.figures.engines.items()})
        return self._engines[1]

    def _read_and_feed(self) -> None:
        for line in self.follower.read_lines():
            self.figures.feed(line)
            self._fed += 1

    async def read(self) -> None:
        """One read of the new lines, within :attr:`deadline`: vLLM's reads never wait for the log. A read past it is
        abandoned (its thread may stay blocked: a hung volume, a FIFO), counted and logged as a timeout, and no other
        read starts until it returns."""
        t0 = self.monotonic()
        if self._reading is not None and not self._reading.done():
            blocked = SourceError(
                Reason.TIMEOUT, f"the vLLM log's read of {t0 - self._since:.0f}s ago has not returned"
            )
            self.sources.fail(SOURCE_LOG, blocked, 0.0)
            return
        # off the loop: the file's bytes and the patterns over its lines (a catch-up of 8 MiB at most a read)
        self._reading, self._since = self._pool.submit(self._read_and_feed), t0
        waiting = asyncio.wrap_future(self._reading)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned read's end is seen
        try:
            await asyncio.wait_for(asyncio.shield(waiting), self.deadline)
        except TimeoutError:
            late = SourceError(Reason.TIMEOUT, f"reading the vLLM log took more than {self.deadline:g}s: abandoned")
            self.sources.fail(SOURCE_LOG, late, self.monotonic() - t0)
            return
        except FileNotFoundError as err:
            missing = SourceError(Reason.MISSING, f"vLLM log {err.filename} does not exist (yet)")
            self.sources.fail(SOURCE_LOG, missing, 0.0)
            return
        except PermissionError as err:
            self.sources.fail(SOURCE_LOG, SourceError(Reason.PERMISSION, f"cannot read vLLM log {err.filename}"), 0.0)
            return
        except OSError as err:
            self.sources.fail(SOURCE_LOG, SourceError(Reason.IO_ERROR, f"reading the vLLM log: {err}"), 0.0)
            return
        except Exception as err:  # what nothing expected: named and counted, never a crashed cycle
            self.sources.fail(SOURCE_LOG, internal(err, "reading the vLLM log"), 0.0)
            return
        self.sources.ok(SOURCE_LOG, self.monotonic() - t0)
        if self.figures.implausible_lines > self._implausible_seen:  # refused, counted each read, logged once
            self._implausible_seen = self.figures.implausible_lines
            self.sources.implausible(SOURCE_LOG, ("vllm_log_figures",))
        if self.follower.long_lines and not self._long_lines_logged:
            self._long_lines_logged = True  # once: the lines are users' text (request logs), not worth a line each
            self.sources.logger.info(
                "vllm_log_long_lines_skipped",
                lines=self.follower.long_lines,
                limit_bytes=self.follower.max_line,
                hint="lines past the limit are not read for figures (vLLM's memory lines are short)",
            )
