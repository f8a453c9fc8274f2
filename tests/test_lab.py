"""The real-vLLM harness's own logic that needs no vLLM (scripts/vllm-cpu/lab.py): which servers StartAhead starts,
when, on which cores, and that none outlives its module."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import lab


@dataclass
class _Server:
    """Stands in for lab.VllmServer: records what StartAhead does with it."""

    case: str
    log: list[str]
    cpus: str | None = None
    state: list[str] = field(default_factory=list)

    def start(self) -> _Server:
        self.log.append(f"start {self.case}")
        self.state.append("started")
        return self

    def stop(self) -> None:
        self.log.append(f"stop {self.case}")
        self.state.append("stopped")


def test_each_take_starts_the_next_selected_case_and_leaving_stops_the_untaken() -> None:
    log: list[str] = []
    servers: list[_Server] = []

    def make(case: str) -> _Server:
        servers.append(_Server(case, log))
        return servers[-1]

    with lab.StartAhead(make, ["a", "b", "c"]) as ahead:
        first = ahead.take("a")
        assert (first.case, log) == ("a", ["start a", "start b"])
        second = ahead.take("b")  # started ahead: not again
        assert (second.case, log[2:]) == ("b", ["start c"])
        assert ahead.take("x").case == "x" and log[3:] == ["start x"]  # outside the order: started when taken
        first.stop()  # the taker stops what it took
    # c was started ahead and never taken: leaving stops it; what the tests took is theirs to stop
    assert log[4:] == ["stop a", "stop c"]
    assert [s.state for s in servers if s.case in ("b", "x")] == [["started"], ["started"]]


def test_workers_are_bound_to_this_processs_cores_in_turn() -> None:
    cores = sorted(os.sched_getaffinity(0))
    log: list[str] = []
    with lab.StartAhead(lambda case: _Server(case, log), ["a", "b", "c"]) as ahead:
        taken = [ahead.take(case) for case in ("a", "b", "c")]
    assert [s.cpus for s in taken] == [str(cores[i % len(cores)]) for i in range(3)]
