"""The sweep's report as one self-contained HTML file: the seed's table, the knee and its levers, and four charts
drawn by matplotlib as inline SVG (its text as paths): throughput, TTFT and TPOT p50/p99 against concurrency with
the objective's line and the knee marked, and the KV cache's tokens with the preemptions of each step. Nothing is
loaded from the network and nothing needs JavaScript. matplotlib is the ``report`` extra: the sidecar's image has
none of it (:func:`check_matplotlib` says so before any load)."""

from __future__ import annotations

import html
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.sweep.run import Step, Sweep

if TYPE_CHECKING:  # matplotlib is the report extra: imported only to draw
    from matplotlib.axes import Axes

Draw = Callable[["Axes", Sequence[Step], SweepConfig], None]

MISSING = (
    "--format html draws its charts with matplotlib, which is not installed here: "
    "pip install 'vllm-capacity[report]' (matplotlib==3.11.2)"
)


def check_matplotlib() -> str | None:
    """None when matplotlib can draw, else the one line that says how to install it."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return MISSING
    return None


def _svg(draw: Draw, steps: Sequence[Step], result: Sweep, values: SweepConfig) -> str:
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "vllm-capacity", "font.size": 9}):
        fig = Figure(figsize=(6.0, 3.2), layout="constrained")
        ax = fig.add_subplot()
        draw(ax, steps, values)
        ax.set_xscale("log", base=2)
        ax.set_xticks([s.concurrency for s in steps], [str(s.concurrency) for s in steps])
        ax.set_xlabel("concurrent requests")
        ax.grid(True, alpha=0.3)
        if result.knee.concurrency is not None:
            ax.axvline(
                result.knee.concurrency, color="tab:red", linestyle=":", label=f"knee ({result.knee.concurrency})"
            )
        pairs = [each.get_legend_handles_labels() for each in fig.axes]  # the twin axis's lines too
        ax.legend([h for p in pairs for h in p[0]], [lab for p in pairs for lab in p[1]], loc="best", fontsize=8)
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
    text = out.getvalue()
    return text[text.index("<svg") :]


def _throughput(ax: Axes, steps: Sequence[Step], _: SweepConfig) -> None:
    c = [s.concurrency for s in steps]
    ax.plot(c, [s.output_tokens_per_second for s in steps], marker="o", label="output tokens/s")
    twin = ax.twinx()
    twin.plot(c, [s.requests_per_second for s in steps], marker="s", color="tab:green", label="requests/s")
    twin.set_ylabel("requests/s")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")


def _latency(kind: str, title: str) -> Draw:
    def draw(ax: Axes, steps: Sequence[Step], values: SweepConfig) -> None:
        c = [s.concurrency for s in steps]
        for q, style in ((0.5, "-"), (0.99, "--")):
            ms = [(s.latency[kind][q] or float("nan")) * 1000 for s in steps]
            ax.plot(c, ms, style, marker="o", label=f"{kind.upper()} p{q * 100:g}")
        objective = values.slo_ttft if kind == "ttft" else values.slo_itl
        if objective is not None:
            label = f"objective {objective}"
            ax.axhline(objective.seconds * 1000, color="tab:orange", label=label)
        ax.set_ylabel("ms")
        ax.set_title(title)

    return draw


def _kv(ax: Axes, steps: Sequence[Step], _: SweepConfig) -> None:
    c = [s.concurrency for s in steps]
    ax.plot(c, [s.kv_cache_used_tokens_max or 0 for s in steps], marker="o", label="KV tokens used (max)")
    capacity = [s.kv_cache_capacity_tokens for s in steps if s.kv_cache_capacity_tokens]
    if capacity:
        ax.axhline(max(capacity), color="tab:gray", linestyle="--", label="KV capacity")
    twin = ax.twinx()
    twin.bar(
        c, [s.preemptions for s in steps], width=[x * 0.3 for x in c], alpha=0.4, color="tab:red", label="preemptions"
    )
    twin.set_ylabel("preemptions in the step")
    twin.set_ylim(bottom=0)
    ax.set_ylabel("tokens")
    ax.set_title("KV cache (vLLM's /metrics) and preemptions")


STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}
pre{white-space:pre-wrap}.charts{display:flex;flex-wrap:wrap;gap:1em}.chart{width:600px}svg{max-width:100%;height:auto}"""


def render_html(result: Sweep, values: SweepConfig, model: str, text: str) -> str:
    """The page: ``text`` (the text report) above the charts."""
    steps = [s for s in result.steps if s.failed is None]
    draws = (_throughput, _latency("ttft", "Time to first token"), _latency("tpot", "Time per output token"), _kv)
    charts = [_svg(draw, steps, result, values) for draw in draws] if steps else []
    e = html.escape
    return "\n".join([
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>vllm-capacity sweep: {e(model)}</title><style>{STYLE}</style></head><body>",
        f"<h1>vllm-capacity sweep · {e(model)}</h1>",
        f"<pre>{e(text)}</pre>",
        '<div class="charts">', *(f'<div class="chart">{svg}</div>' for svg in charts), "</div>",
        "</body></html>", "",
    ])  # fmt: skip
