"""``vllm-capacity advise``: what to change, from a window of real traffic in Prometheus, each recommendation with
the numbers that justify it and the PromQL that re-reads them. Prometheus unreachable, a selector that matches
nothing, a window with too little data: exit 2 and one line (:class:`~vllm_capacity.advise.observe.AdviseError`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm_capacity.advise.observe import AdviseError, Window, matchers, observe, promql
from vllm_capacity.cli.advise_config import AdviseConfig, window_text
from vllm_capacity.cli.options import UsageError
from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.levers.traffic import advise
from vllm_capacity.levers.window import Asked, Figure, Finding, Observed
from vllm_capacity.sources.prometheus import PrometheusAuth, PrometheusClient, PrometheusError

#: vLLM's histogram for each objective's kind, in the names 0.32 to 0.34 serve (docs/metrics.md)
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds"}


@dataclass(frozen=True)
class Objectives:
    """Each objective given (--slo-ttft, --slo-itl) against vLLM's own histogram over the window."""

    held: tuple[tuple[Objective, Figure], ...] = ()


@dataclass(frozen=True)
class Advice:
    """One deployment's figures, findings and objectives."""

    observed: Observed
    findings: list[Finding]
    objectives: Objectives


def _client(values: AdviseConfig) -> PrometheusClient:
    if values.prometheus_url is None:
        raise UsageError("--prometheus-url is required: the Prometheus that holds the sidecar's series")
    if values.basic_auth_password_file and not values.basic_auth_user:
        raise UsageError("--basic-auth-password-file needs --basic-auth-user")
    if values.bearer_token_file and values.basic_auth_user:
        raise UsageError("give one of --bearer-token-file or --basic-auth-user, not both")
    auth = PrometheusAuth(
        bearer_token=values.bearer_token_file,
        username=values.basic_auth_user,
        password=values.basic_auth_password_file,
        ca_file=values.ca_file,
        insecure=values.insecure_skip_verify,
    )
    return PrometheusClient(values.prometheus_url, auth=auth, timeout=values.timeout)


async def run_advise(values: AdviseConfig) -> list[Advice]:
    """The advice for every deployment the selector matches. Raises UsageError (exit 2) where none can be given."""
    window = Window(window_text(values.window), values.window, values.end if values.end is not None else time.time())
    asked = Asked(headroom=values.headroom, geometry=values.model_config, tp=values.tp)
    try:
        sel = matchers(values.selector)
        async with _client(values) as client:
            deployments = await observe(client, values.selector, window)
            models = sorted({o.group.get("model_name", "") for o in deployments})
            if values.model_config is not None and len(models) > 1:
                raise UsageError(
                    f"--model-config describes one model; the selector matches {len(models)} ({', '.join(models)}): "
                    "narrow it, e.g. --selector '{model_name=\"" + models[0] + "\"}'"
                )
            out = []
            for o in deployments:
                objectives = await _objectives(client, values, o, sel, window)
                out.append(Advice(o, advise(o, asked), objectives))
    except (AdviseError, PrometheusError) as err:
        raise UsageError(str(err)) from None
    return out


async def _objectives(
    client: PrometheusClient, values: AdviseConfig, o: Observed, sel: str, window: Window
) -> Objectives:
    held = []
    own = "".join(f',{k}="{v}"' for k, v in o.group.items() if v)
    for objective in (values.slo_ttft, values.slo_itl):
        if objective is None:
            continue
        query = promql(
            f"histogram_quantile({objective.q:g}, sum by ($by, le) "
            f"(increase({HISTOGRAMS[objective.kind]}_bucket{{$sel{own}}}[$w])))",
            sel,
            window.text,
        )
        answer = await client.query(query, window.end)
        value = answer[0].value if answer else None
        held.append((objective, Figure(value, query, window.end)))
    return Objectives(tuple(held))
