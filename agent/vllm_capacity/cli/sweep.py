"""``vllm-capacity sweep``: the concurrency sweep operators run before they tune, with the limit at its knee and the
flags that would move it. Checks first (vLLM answers, serves the model, takes requests of the asked length: else
exit 2 and one line), a line per step as it finishes (and a progress bar on a terminal), the report at the end,
also after Ctrl-C (exit 130) or when vLLM stopped answering (exit 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from vllm_capacity.cli.options import UsageError
from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.levers.advice import Lever, Situation, levers
from vllm_capacity.sizing import parse_version
from vllm_capacity.sources import SourceError
from vllm_capacity.sources.vllm import VllmClient
from vllm_capacity.sweep.budget import MemoryBudget, read_budget
from vllm_capacity.sweep.load import LoadSpec
from vllm_capacity.sweep.run import Refused, Step, Sweep, SweepSpec, step_size, sweep

INTERRUPTED = 130  # the shell's code for a run ended by Ctrl-C
VLLM_WENT_AWAY = 1


@dataclass(frozen=True)
class Server:
    """What the checks read of the server before the load: its model, max_model_len, version and cache."""

    model: str
    max_model_len: int | None
    version: str | None
    kv_cache_dtype: str | None
    block_size: int | None


async def _server(client: VllmClient, values: SweepConfig) -> Server:
    """The checks before any load; UsageError (exit 2) with the reason when the sweep cannot run."""
    try:
        models = (await client.fetch_models()).max_model_len
        metrics = await client.fetch_metrics(latency=False)
    except SourceError as err:
        raise UsageError(f"cannot read vLLM at {client.display_url}: {err}") from None
    served = sorted(models) or sorted({e.model_name for e in metrics.engines})
    if not served:
        raise UsageError(f"{client.display_url} lists no model in /v1/models")
    model = values.model or served[0]
    if model not in served:
        raise UsageError(f"--model {model!r}: {client.display_url} serves {', '.join(served)}")
    mml = models.get(model)
    if mml is not None and values.prompt_tokens + values.max_tokens > mml:
        raise UsageError(
            f"--prompt-tokens {values.prompt_tokens} + --max-tokens {values.max_tokens} is more than {model}'s "
            f"max_model_len {mml}: vLLM would refuse every request"
        )
    cc = next((e.cache_config for e in metrics.engines if e.model_name == model and e.cache_config), None)
    version = await client.fetch_version()
    return Server(model, mml, version, cc.cache_dtype if cc else None, cc.block_size if cc else None)


def _spec(values: SweepConfig, server: Server) -> SweepSpec:
    load = LoadSpec(
        url=values.vllm_url.rstrip("/"),
        model=server.model,
        prompt_tokens=values.prompt_tokens,
        max_tokens=values.max_tokens,
        api_key=values.api_key_file,
        request_timeout=values.timeout,
    )
    return SweepSpec(
        load=load,
        concurrencies=values.concurrency,
        requests_per_step=values.requests_per_step,
        duration_per_step=values.duration_per_step,
        warmup=values.warmup_requests,
        sample_interval=values.sample_interval,
        objectives=tuple(o for o in (values.slo_ttft, values.slo_itl) if o is not None),
        flags=values.flags,
        max_model_len=server.max_model_len,
    )


def knee_levers(result: Sweep, values: SweepConfig, server: Server, budget: MemoryBudget | None = None) -> list[Lever]:
    """The levers for the limit at the knee, from the step where it binds."""
    knee = result.knee
    if knee.limit is None or knee.concurrency is None:
        return []
    at = next((s for s in result.steps if s.binding is not None and s.binding.limit == knee.limit), None)
    step = at or next(s for s in result.steps if s.concurrency == knee.concurrency)
    version = None
    if server.version:
        try:
            version = parse_version(server.version)
        except ValueError:
            version = None
    return levers(
        Situation(
            limit=knee.limit,
            concurrency=knee.concurrency,
            request_tokens=values.prompt_tokens + values.max_tokens,
            kv_capacity_tokens=step.kv_cache_capacity_tokens,
            kv_usage_max=step.kv_cache_usage_max,
            max_model_len=server.max_model_len,
            kv_cache_dtype=server.kv_cache_dtype,
            block_size=server.block_size,
            max_num_seqs=values.flags.max_num_seqs,
            max_num_batched_tokens=values.flags.max_num_batched_tokens,
            geometry=values.model_config,
            version=version,
            pool_bytes=budget.kv_cache_bytes if budget else None,
            weights_bytes=budget.weights_bytes if budget else None,
        )
    )


def _step_line(step: Step) -> str:
    if step.failed is not None:
        return f"sweep: concurrency {step.concurrency}: failed: {step.failed}"
    ttft, tpot = step.latency["ttft"][0.5], step.latency["tpot"][0.5]
    limit = step.binding.limit if step.binding else "?"
    errors = f", {sum(step.errors.values())} errors" if step.errors else ""
    return (
        f"sweep: concurrency {step.concurrency}: {step.requests} requests{errors}, "
        f"{step.output_tokens_per_second:.1f} output tokens/s, TTFT p50 {_ms(ttft)}, TPOT p50 {_ms(tpot)}, "
        f"limit {limit}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


class Progress:
    """What the sweep says as it runs: a line per step as it finishes and, on a terminal, a bar for the step under
    way (its requests done of its count, or its seconds of its duration), redrawn in place and cleared by the next
    line."""

    WIDTH = 30

    def __init__(self, err: TextIO, spec: SweepSpec, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.err, self.spec, self.monotonic = err, spec, monotonic
        self.tty = err.isatty()
        self.index, self.done, self.started = 0, 0, monotonic()

    def bar(self) -> str:
        """The bar of the step under way."""
        concurrency = self.spec.concurrencies[min(self.index, len(self.spec.concurrencies) - 1)]
        count, duration = step_size(self.spec, concurrency)
        if count is not None:
            share, tail = self.done / count, f"{self.done}/{count} requests"
        else:
            elapsed = self.monotonic() - self.started
            share, tail = elapsed / (duration or 1.0), f"{elapsed:.0f}/{duration:.0f} s, {self.done} requests"
        filled = round(min(1.0, share) * self.WIDTH)
        where = f"concurrency {concurrency} (step {self.index + 1} of {len(self.spec.concurrencies)})"
        return f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {where}: {tail}"

    def request(self) -> None:
        self.done += 1
        if self.tty:
            self.err.write("\r" + self.bar())
            self.err.flush()

    def step(self, step: Step) -> None:
        self.err.write(("\r\x1b[K" if self.tty else "") + _step_line(step) + "\n")
        self.err.flush()
        self.index, self.done, self.started = self.index + 1, 0, self.monotonic()


async def run_sweep(values: SweepConfig, err: TextIO) -> tuple[int, str]:
    """The sweep's exit status and its report (which the caller writes where --output says)."""
    from vllm_capacity.cli.sweep_report import render

    client = VllmClient(values.vllm_url, timeout=10.0, api_key=values.api_key_file)
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt.set)
    try:
        server = await _server(client, values)
        spec = _spec(values, server)
        progress = Progress(err, spec)
        result = await sweep(client, spec, on_step=progress.step, on_request=progress.request, interrupt=interrupt)
    except Refused as refused:
        raise UsageError(str(refused)) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await client.aclose()
    budget = read_budget(values.vllm_log) if values.vllm_log else None  # once, after the load: the start is logged
    report = render(values.format, result, knee_levers(result, values, server, budget), values, server.model, budget)
    if result.interrupted:
        err.write("sweep: interrupted: the report holds the steps that finished\n")
        return INTERRUPTED, report
    return (VLLM_WENT_AWAY if any(s.failed for s in result.steps) else 0), report


def check_output(path: str | None) -> None:
    """--output names a file that can be written (before minutes of load, not after)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--output {path}: is a directory")
    if not target.parent.is_dir():
        raise UsageError(f"--output {path}: {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"--output {path}: not writable")
