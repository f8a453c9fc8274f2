"""Command line: ``vllm-capacity serve`` (the sidecar), ``report`` (one snapshot), ``plan`` (offline), ``sweep``
(a concurrency sweep against a server) and ``advise`` (what to change, from a window of traffic in Prometheus).

The options, their environment twins and the typed configuration of each command are in
:mod:`vllm_capacity.cli.options`; this module runs the commands. Invalid flags or values exit with status 2 and one
line that says which flag (or variable) and why.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

from vllm_capacity.cli.advise_config import AdviseConfig
from vllm_capacity.cli.configs import PlanConfig, ReportConfig, ServeConfig
from vllm_capacity.cli.options import PLAN_DOES_NOT_FIT, PLAN_NOT_MODELLED, UsageError, build_parser, config
from vllm_capacity.cli.serve import build_agent, check_combination, note_early_stop, run_serve
from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.redaction import redact_url


async def _report(values: ReportConfig) -> int:
    import asyncio
    import signal

    from vllm_capacity.cli.report import render_text
    from vllm_capacity.cli.report_json import render_json

    agent = build_agent(values, values.watch or 1.0)
    client = agent.client
    url = redact_url(values.vllm_url)
    render = render_json if values.format == "json" else render_text
    # Ctrl-C and SIGTERM end the report, whatever this process inherited: a shell starts a background job (`&`)
    # with SIGINT ignored, and Python then leaves it ignored, so `report --watch &` never stopped on SIGINT
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        while True:
            snap = await agent.cycle()
            if not snap.up and not values.watch:
                status = agent.sources["vllm"]
                print(
                    f"vllm-capacity report: error: cannot read {url}/metrics ({status.failing_reason})",
                    file=sys.stderr,
                )
                return 1
            if not values.watch:
                sys.stdout.write(render(snap, url))
                return 0
            # --watch: on a terminal redraw in place (home, clear), the curve filling in as the agent learns; into a
            # pipe or a file, one frame after another, no terminal escapes
            shown = render_text(snap, url) if snap.up else f"vllm-capacity report: cannot read {url}/metrics\n"
            home = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
            sys.stdout.write(home + shown + f"\n(every {values.watch:g}s; Ctrl-C to stop)\n")
            sys.stdout.flush()
            await asyncio.sleep(values.watch)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    except BrokenPipeError:  # `report --watch | head`: the reader has gone; end quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush into the pipe at exit
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await client.aclose()


def _plan_compared(values: PlanConfig) -> int:
    """plan --tp 1,2 ...: every combination side by side; exit 2 when none can be planned."""
    from vllm_capacity.cli import plan_compare

    keys, cells = plan_compare.compare(values)
    if all(c.refused is not None for c in cells):
        raise UsageError(f"no combination can be planned: {cells[0].refused}")
    render = plan_compare.render_json if values.format == "json" else plan_compare.render_text
    sys.stdout.write(render(keys, cells))
    return 0


def _plan(values: PlanConfig) -> int:
    from vllm_capacity import sizing
    from vllm_capacity.cli import plan as planning
    from vllm_capacity.cli import plan_inputs
    from vllm_capacity.cli.plan_json import render_json as plan_json
    from vllm_capacity.geometry import GeometryError

    if values.compared:
        return _plan_compared(values)
    try:
        geometry, inputs, budget = plan_inputs.assemble(values)
        result = sizing.plan(geometry, inputs)
    except plan_inputs.MissingInput as err:
        raise UsageError(str(err)) from None
    except (GeometryError, sizing.NotModelled, sizing.ImpossiblePlan, ValueError) as err:
        # the exit codes plan --help lists: 2 input vLLM would not take, 1 does not fit, 3 not modelled (by kind, so
        # that a narrower error raised later keeps its code; all three are ValueErrors, the fallback)
        kind, code = next(
            (kind, code)
            for cls, kind, code in (
                (sizing.NotModelled, "not modelled", PLAN_NOT_MODELLED),
                (sizing.ImpossiblePlan, "does not fit", PLAN_DOES_NOT_FIT),
                (GeometryError, "model config", 2),
                (Exception, "error", 2),
            )
            if isinstance(err, cls)
        )
        print(f"vllm-capacity plan: {kind}: {err}", file=sys.stderr)
        return code
    render = plan_json if values.format == "json" else planning.render_text
    sys.stdout.write(render(result, geometry, inputs, budget))
    return 0


def _advise(values: AdviseConfig) -> int:
    """The advice; Prometheus unreachable, nothing matched, too little data: UsageError (exit 2)."""
    import asyncio
    from pathlib import Path

    from vllm_capacity.cli import advise_report
    from vllm_capacity.cli.advise import run_advise

    advice = asyncio.run(run_advise(values))
    render = {"json": advise_report.render_json, "html": advise_report.render_html}.get(
        values.format, advise_report.render_text
    )
    text = render(advice)
    if values.output:
        try:
            Path(values.output).write_text(text)
        except OSError as err:
            raise UsageError(f"--output {values.output}: {err.strerror}") from None
    else:
        sys.stdout.write(text)
    return 0


def _sweep(values: SweepConfig) -> int:
    """The sweep; its checks' UsageError (exit 2) reach main's one line."""
    import asyncio

    from vllm_capacity import log
    from vllm_capacity.cli.sweep import check_output, run_sweep

    check_output(values.output)
    if values.format == "html":
        from vllm_capacity.cli.sweep_html import check_matplotlib

        if (missing := check_matplotlib()) is not None:
            raise UsageError(missing)
    log.configure("console", "error")
    code, report = asyncio.run(run_sweep(values, sys.stderr))
    if values.output:
        with open(values.output, "w", encoding="utf-8") as f:
            f.write(report)
    else:
        sys.stdout.write(report)
    return code


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    # --help and usage errors import nothing beyond argparse and the options (asyncio, aiohttp, structlog come later)
    serving = (sys.argv[1:] if argv is None else list(argv))[:1] == ["serve"]
    if serving and threading.current_thread() is threading.main_thread():
        # before anything slow (the imports take a few tenths of a second): a SIGTERM now is a clean exit, not -15
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, note_early_stop)
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        values = config(ns.command, ns, dict(os.environ if environ is None else environ))
        if isinstance(values, PlanConfig):
            return _plan(values)
        if isinstance(values, SweepConfig):
            return _sweep(values)
        if isinstance(values, AdviseConfig):
            return _advise(values)
        check_combination(values)  # before anything starts
    except UsageError as err:
        print(f"vllm-capacity {ns.command}: error: {err}", file=sys.stderr)
        return 2
    import asyncio

    from vllm_capacity import log

    if isinstance(values, ServeConfig):
        log.configure(values.log_format, values.log_level)
        return run_serve(values)
    log.configure("console", "error")  # a report prints its result; only errors go to stderr
    return asyncio.run(_report(values))
