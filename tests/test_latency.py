"""Latency by concurrency from synthetic histogram sequences with a known knee; quantiles against Prometheus'."""

from __future__ import annotations

import itertools
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_capacity.derive.latency_curve import (
    ITL,
    MAX_BINS,
    TTFT,
    LatencyCurve,
    Objective,
    bin_bounds,
    histogram_quantile,
    parse_objective,
    slo_bound,
)

LE = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.1, 0.5, math.inf)


def itl_at(concurrency: float) -> float:
    """The synthetic server: inter-token latency grows with concurrency (10 ms alone, 40 ms at 16)."""
    return 0.008 + 0.002 * concurrency


class Server:
    """Cumulative histograms as vLLM exports them, fed with observations at a given concurrency."""

    def __init__(self, le: tuple[float, ...] = LE) -> None:
        self.le = le
        self.counts = {ITL: [0.0] * len(le), TTFT: [0.0] * len(le)}

    def serve(self, concurrency: float, tokens: int = 2000, rng: random.Random | None = None) -> None:
        rng = rng or random.Random(1)
        for _ in range(tokens):
            latency = itl_at(concurrency) * rng.uniform(0.9, 1.1)
            for i, le in enumerate(self.le):
                if latency <= le:
                    self.counts[ITL][i] += 1
        for i, le in enumerate(self.le):  # first tokens: one per 10 tokens, 50 ms x concurrency
            if 0.05 * concurrency <= le:
                self.counts[TTFT][i] += tokens / 10

    def histograms(self) -> dict[str, list[tuple[float, float]]]:
        return {k: list(zip(self.le, v, strict=True)) for k, v in self.counts.items()}


def stepped(
    curve: LatencyCurve, server: Server, steps: list[int], cycles: int = 5, max_concurrency: float = 32
) -> None:
    for c in steps:
        for _ in range(cycles):
            server.serve(c)
            curve.observe(server.histograms(), c, 1.0, max_concurrency)


def test_bins_are_bounded_and_cover_the_kv_bound() -> None:
    for top in (1, 3, 16, 100, 5000, None):
        bins = bin_bounds(top)
        assert len(bins) <= MAX_BINS and bins[0] == 1 and list(bins) == sorted(set(bins))
        assert bins[-1] >= (top or 256)


def test_a_stepped_load_gives_the_curve_and_the_knee() -> None:
    curve, server = LatencyCurve(), Server()
    stepped(curve, server, [1, 2, 4, 8, 16])
    q = curve.quantiles()
    p50 = {b: v for (kind, b, qq), v in q.items() if kind == ITL and qq == 0.5}
    curve_p50 = [p50[b] for b in sorted(p50)]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(curve_p50))  # rises with concurrency
    assert curve_p50[-1] > 3 * curve_p50[0]
    assert set(p50) == {1, 2, 4, 8, 16}  # the bins the load went through
    # an objective between the latency at 8 (24 ms) and at 16 (40 ms): the bound is 8, the knee seen
    bound = slo_bound(curve, [parse_objective(ITL, "p99<=30ms")])
    assert bound.max_concurrency == 8 and bound.knee_observed
    # one never crossed: the highest bin with enough observations, a lower bound only
    bound = slo_bound(curve, [parse_objective(ITL, "p99<=500ms")])
    assert bound.max_concurrency == 16 and not bound.knee_observed
    # two objectives: both must hold (time to first token: 100 ms at 2, 200 ms at 4)
    bound = slo_bound(curve, [parse_objective(ITL, "p99<=500ms"), parse_objective(TTFT, "p90<=150ms")])
    assert bound.max_concurrency == 2 and bound.knee_observed


def test_too_few_observations_say_nothing() -> None:
    curve, server = LatencyCurve(), Server()
    for c in (1, 1, 1):
        server.serve(c, tokens=50)
        curve.observe(server.histograms(), c, 1.0, 32)
    assert (ITL, 1, 0.5) in curve.quantiles()  # 100 observations: p50 and p90 are known...
    assert (ITL, 1, 0.99) not in curve.quantiles()  # ... p99 needs 1,000
    assert slo_bound(curve, [parse_objective(ITL, "p99<=1s")]).max_concurrency is None


def test_a_restart_a_new_layout_and_idle_intervals() -> None:
    curve, server = LatencyCurve(), Server()
    stepped(curve, server, [4], cycles=3)
    before = curve.observations()[(ITL, 4)]
    # idle: the counters stand still; nothing is learned and nothing ages
    for _ in range(10):
        curve.observe(server.histograms(), 0, 600.0, 32)
    assert curve.observations()[(ITL, 4)] == before
    # vLLM restarts: its counters start again from 0; that interval is skipped, then learning goes on
    fresh = Server()
    fresh.serve(4)
    curve.observe(fresh.histograms(), 4, 1.0, 32)
    assert curve.observations()[(ITL, 4)] == before
    fresh.serve(4)
    curve.observe(fresh.histograms(), 4, 1.0, 32)
    assert curve.observations()[(ITL, 4)] > before
    # another bucket layout: that kind starts afresh
    other = Server(le=(0.005, 0.05, math.inf))
    other.serve(4)
    curve.observe(other.histograms(), 4, 1.0, 32)
    assert (ITL, 4) not in curve.observations()


def test_decay_forgets_old_traffic() -> None:
    """Yesterday the server was slow at 4 requests; today it is fast. With a half-life of an hour of traffic, a day
    of today's traffic leaves yesterday's observations a negligible share."""
    curve = LatencyCurve(half_life=3600)
    slow = Server(le=(0.01, 0.1, math.inf))
    for _ in range(10):
        slow.counts[ITL] = [c + d for c, d in zip(slow.counts[ITL], (0, 1000, 1000), strict=True)]
        curve.observe(slow.histograms(), 4, 60.0, 32)
    assert curve.quantiles()[(ITL, 4, 0.5)] > 0.01
    for _ in range(24 * 60):  # a day of today's traffic, a cycle a minute
        slow.counts[ITL] = [c + d for c, d in zip(slow.counts[ITL], (100, 100, 100), strict=True)]
        curve.observe(slow.histograms(), 4, 60.0, 32)
    assert curve.quantiles()[(ITL, 4, 0.5)] <= 0.01


def test_new_bins_when_the_kv_bound_changes() -> None:
    curve, server = LatencyCurve(), Server()
    stepped(curve, server, [4], cycles=3, max_concurrency=32)
    stepped(curve, server, [4], cycles=1, max_concurrency=100)
    assert curve.bins == bin_bounds(100)
    # what was learned in the old bins is gone; the one interval since is in the new bins
    assert curve.observations() == {(ITL, 5): 2000.0, (TTFT, 5): 200.0}


@pytest.mark.parametrize(
    ("text", "objective"),
    [("p99<=50ms", Objective(ITL, 0.99, 0.05)), ("p90<=2s", Objective(ITL, 0.9, 2.0)), ("p99.9 <= 1s", None)],
)
def test_objectives_parse(text: str, objective: Objective | None) -> None:
    parsed = parse_objective(ITL, text)
    assert objective is None or parsed == objective


@pytest.mark.parametrize("text", ["99<=50ms", "p100<=1s", "p0<=1s", "p99<=0ms", "p99<50ms", "p99<=soon", ""])
def test_bad_objectives_say_why(text: str) -> None:
    with pytest.raises(ValueError, match=r"objective|quantile|positive|duration"):
        parse_objective(ITL, text)


CASES = [
    [(0.01, 0), (0.02, 10), (0.05, 40), (0.1, 90), (math.inf, 100)],
    [(0.01, 100), (0.02, 100), (math.inf, 100)],
    [(0.01, 0), (0.02, 0), (math.inf, 100)],  # everything in +Inf: the highest finite bound
    [(0.5, 3), (1.0, 3), (2.0, 7), (math.inf, 7)],
    [(1.0, 5), (math.inf, 5)],
    [(0.25, 1), (0.5, 2), (1.0, 4), (2.5, 8), (5.0, 16), (math.inf, 17)],
]


def test_quantiles_match_prometheus_histogram_quantile(tmp_path: Path) -> None:
    """Our interpolation against the real thing: a promtool unit test whose expected values are ours."""
    series, tests = [], []
    for i, case in enumerate(CASES):
        for le, count in case:
            le_text = "+Inf" if math.isinf(le) else repr(le)
            series.append({"series": f'h_bucket{{case="{i}",le="{le_text}"}}', "values": f"0 {count:g}"})
        for q in (0.1, 0.5, 0.9, 0.99):
            ours = histogram_quantile(q, case)
            assert ours is not None
            tests.append(
                {
                    "expr": f'histogram_quantile({q}, h_bucket{{case="{i}"}})',
                    "eval_time": "1m",
                    "exp_samples": [{"labels": f'{{case="{i}"}}', "value": ours}],
                }
            )
    doc = {"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup installs Debian's prometheus"
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yaml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_p90_context_of_finished_requests() -> None:
    """Prompt and generation histograms of finished requests: p90 context = p90 prompt + p90 generation."""
    from vllm_capacity.derive.latency_curve import GENERATION, PROMPT, ContextTokens

    le = (64.0, 128.0, 256.0, 512.0, math.inf)
    context = ContextTokens()
    prompt, generation = [0.0] * 5, [0.0] * 5
    assert context.quantile() is None
    for _ in range(3):  # 100 requests a read: prompts of 100-128 tokens, answers of 200-256
        prompt = [p + d for p, d in zip(prompt, (0, 100, 100, 100, 100), strict=True)]
        generation = [g + d for g, d in zip(generation, (0, 0, 100, 100, 100), strict=True)]
        context.observe(
            {PROMPT: list(zip(le, prompt, strict=True)), GENERATION: list(zip(le, generation, strict=True))}, 5
        )
    expected = histogram_quantile(0.9, [(b, c) for b, c in zip(le, (0, 200, 200, 200, 200), strict=True)])
    expected += histogram_quantile(0.9, [(b, c) for b, c in zip(le, (0, 0, 200, 200, 200), strict=True)])  # type: ignore[operator]
    assert context.quantile() == pytest.approx(expected, rel=1e-3)
    assert 300 < context.quantile() < 400  # type: ignore[operator]
