"""vLLM payloads made from the real captures: bigger ones for the load test and the benchmark, damaged ones for the
fault matrix (no pytest here: bench/ imports it too)."""

from __future__ import annotations

import re
from pathlib import Path

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "v1-0.32.0-cpu-saturated.prom"


def data_parallel(engines: int, model: str = "tiny-llama", capture: Path = CAPTURE) -> str:
    """The capture as a server with ``engines`` data-parallel engines: each series with engine="0" repeated for
    engines 0..n-1, kept inside its family (the 0.32.0 capture: 53 KiB at 1 engine, 2.2 MiB at 64)."""
    out = []
    for line in capture.read_text().splitlines():
        line = line.replace('model_name="tiny-llama"', f'model_name="{model}"')
        if 'engine="0"' in line and not line.startswith("#"):
            out.extend(line.replace('engine="0"', f'engine="{i}"') for i in range(engines))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


ENGINE = '{engine="0",model_name="tiny-llama"}'


def with_value(text: str, family: str, raw: str) -> str:
    """``text`` with the value of ``family``'s one sample of engine 0 of tiny-llama replaced by ``raw``."""
    line = re.search(rf"^{re.escape(family + ENGINE)} \S+$", text, re.MULTILINE)
    assert line, family
    return text.replace(line[0], f"{family}{ENGINE} {raw}")


def without_queue(text: str) -> str:
    """``text`` with nothing waiting at engine 0 of tiny-llama (waiting and waiting for capacity 0): a calm engine,
    whose headroom the model-based bounds give."""
    text = with_value(text, "vllm:num_requests_waiting", "0.0")
    return text.replace(
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 8.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 0.0',
    )


def with_cache_label(text: str, label: str, raw: str) -> str:
    """``text`` with one label of vllm:cache_config_info set to ``raw``."""
    replaced = re.sub(rf'(vllm:cache_config_info\{{[^}}]*\b{label}=)"[^"]*"', rf'\g<1>"{raw}"', text)
    assert replaced != text, label
    return replaced
