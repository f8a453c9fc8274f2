"""The start-up log reader: follows the log file vLLM writes (a shared volume) for the memory figures it prints at
start (the lines themselves: :mod:`vllm_capacity.sources.vllm_log`). Its figures outlive /metrics outages: they
describe the process."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from vllm_capacity.live.status import SourceBook, internal
from vllm_capacity.sources import Reason, SourceError
from vllm_capacity.sources.vllm_log import EngineFigures, LogFollower, StartupFigures

SOURCE_LOG = "vllm_log"


class StartupLogReader:
    """Feeds each new line of vLLM's log to its figures; a file that is missing or unreadable is a failed source,
    never a crashed cycle."""

    def __init__(
        self, follower: LogFollower, sources: SourceBook, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.follower, self.sources, self.monotonic = follower, sources, monotonic
        self.figures = StartupFigures()
        self._fed = 0  # lines fed to the figures so far
        self._engines: tuple[int, dict[str, EngineFigures]] = (0, {})  # a copy of theirs, and the lines it holds
        self._long_lines_logged = False
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
        t0 = self.monotonic()
        try:
            # off the loop: the file's bytes and the patterns over its lines (a catch-up of 8 MiB at most a read)
            await asyncio.to_thread(self._read_and_feed)
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
        if self.follower.long_lines and not self._long_lines_logged:
            self._long_lines_logged = True  # once: the lines are users' text (request logs), not worth a line each
            self.sources.logger.info(
                "vllm_log_long_lines_skipped",
                lines=self.follower.long_lines,
                limit_bytes=self.follower.max_line,
                hint="lines past the limit are not read for figures (vLLM's memory lines are short)",
            )
