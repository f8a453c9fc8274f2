"""advise's report: text for people, JSON for scripts (its schema in docs/advise.md), one self-contained HTML file.
Every figure a recommendation cites is printed with the PromQL and the time that re-read it."""

from __future__ import annotations

import datetime
import html
import json
from typing import TYPE_CHECKING, Any

from vllm_capacity.levers.window import Figure, NotAdvised, Recommendation

if TYPE_CHECKING:
    from vllm_capacity.cli.advise import Advice


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _name(a: Advice) -> str:
    g = a.observed.group
    return " / ".join(v for v in (g.get("cluster"), g.get("namespace"), g.get("model_name")) if v) or "(no labels)"


def _figure(f: Figure) -> dict[str, Any]:
    doc: dict[str, Any] = {"value": f.value, "promql": f.promql, "time": _when(f.at)}
    if f.start is not None:
        doc.update(start=_when(f.start), step=f.step)
    return doc


def _how(f: Figure) -> str:
    if f.start is not None:
        return f"query_range start={_when(f.start)} end={_when(f.at)} step={f.step:g}s: {f.promql}"
    return f"at {_when(f.at)}: {f.promql}"


def render_json(advice: list[Advice]) -> str:
    models = []
    for a in advice:
        o = a.observed
        models.append(
            {
                "model_name": o.group.get("model_name", ""),
                "cluster": o.group.get("cluster", ""),
                "namespace": o.group.get("namespace", ""),
                "window": o.window,
                "observed": {name: _figure(f) for name, f in sorted(o.figures.items())} | {"info": dict(o.info)},
                "objectives": [
                    {"objective": str(obj), "value_seconds": f.value, "held": _held(obj.seconds, f), **_figure(f)}
                    for obj, f in a.objectives.held
                ],
                "recommendations": [
                    {
                        "flag": r.flag,
                        "current": r.current,
                        "advised": r.advised,
                        "effect": r.effect,
                        "rule": r.rule,
                        "numbers": dict(r.numbers),
                        "evidence": [_figure(f) for f in r.evidence],
                    }
                    for r in a.findings
                    if isinstance(r, Recommendation)
                ],
                "not_advised": [
                    {"flag": n.flag, "reason": n.reason, "gap": n.gap} for n in a.findings if isinstance(n, NotAdvised)
                ],
            }
        )
    return json.dumps({"models": models}, indent=2) + "\n"


def _held(limit: float, f: Figure) -> bool | None:
    return None if f.value is None else f.value <= limit


def render_text(advice: list[Advice]) -> str:
    lines = []
    for a in advice:
        o = a.observed
        lines += [f"{_name(a)}: {o.window} to {_when(o.get('capacity_tokens').at)}", ""]
        for obj, f in a.objectives.held:
            state = "no data" if f.value is None else ("held" if f.value <= obj.seconds else "broken")
            shown = f"{f.value:.3f} s" if f.value is not None else "-"
            lines.append(f"  objective {obj}: {shown} over the window ({state})")
        recs = [r for r in a.findings if isinstance(r, Recommendation)]
        if not recs:
            lines.append("  nothing to change:")
        for r in recs:
            lines += [f"  {r.flag}: {r.current} -> {r.advised}", f"      {r.effect}", f"      rule: {r.rule}"]
            lines += [f"      {f.value:,.6g} = {_how(f)}" for f in r.evidence if f.value is not None]
        skipped = [n for n in a.findings if isinstance(n, NotAdvised)]
        if recs and skipped:
            lines.append("  not advised:")
        lines += [f"    {n.flag}: {'missing: ' if n.gap else ''}{n.reason}" for n in skipped]
        lines.append("")
    return "\n".join(lines)


def render_html(advice: list[Advice]) -> str:
    """One file, no scripts, no network resources: a section per deployment."""
    body = []
    for a in advice:
        body.append(f"<h2>{html.escape(_name(a))} <small>({html.escape(a.observed.window)})</small></h2>")
        rows = "".join(
            f"<tr><td><code>{html.escape(r.flag)}</code></td><td>{html.escape(r.current)}</td>"
            f"<td><b>{html.escape(r.advised)}</b></td><td>{html.escape(r.effect)}<details><summary>evidence"
            "</summary><ul>"
            + "".join(f"<li>{f.value:,.6g}: <code>{html.escape(_how(f))}</code></li>" for f in r.evidence if f)
            + f"</ul><p>rule: {html.escape(r.rule)}</p></details></td></tr>"
            for r in a.findings
            if isinstance(r, Recommendation)
        )
        if rows:
            body.append(f"<table><tr><th>flag</th><th>now</th><th>advised</th><th>what it buys</th></tr>{rows}</table>")
        else:
            body.append("<p>Nothing to change.</p>")
        body.append(
            "<ul>"
            + "".join(
                f"<li><code>{html.escape(n.flag)}</code>: {'missing: ' if n.gap else ''}{html.escape(n.reason)}</li>"
                for n in a.findings
                if isinstance(n, NotAdvised)
            )
            + "</ul>"
        )
    style = (
        "body{font-family:sans-serif;max-width:70em;margin:1em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top}code{font-size:90%}"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>vllm-capacity advise</title>'
        f"<style>{style}</style></head><body><h1>vllm-capacity advise</h1>{''.join(body)}</body></html>\n"
    )
