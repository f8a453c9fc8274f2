"""`plan` given several values of a flag: one table of every combination, each cell the single-value plan's number."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from support.model_configs import LLAMA_31_8B
from test_cli import _main


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    return path


def _single(*args: str) -> dict:
    result = _main("plan", *args, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_table_is_the_single_value_plans_cell_by_cell(llama: Path) -> None:
    base = ("--model-config", str(llama), "--kv-cache-memory", "16GiB", "--vllm-version", "0.33.0")
    compared = ("--tp", "1,2", "--kv-cache-dtype", "auto,fp8", "--max-model-len", "8192,32768")
    result = _main("plan", *base, *compared, "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["compared"] == ["tp", "kv_cache_dtype", "max_model_len"]
    assert len(doc["plans"]) == 8
    combos = list(itertools.product((1, 2), ("auto", "fp8"), (8192, 32768)))
    assert [(p["tp"], p["kv_cache_dtype"], p["max_model_len"]) for p in doc["plans"]] == combos
    for row, (tp, dtype, mml) in zip(doc["plans"], combos, strict=True):
        alone = _single(*base, "--tp", str(tp), "--kv-cache-dtype", dtype, "--max-model-len", str(mml))
        assert row["kv_cache_tokens"] == alone["kv_cache_tokens"]
        assert row["max_concurrency"] == alone["max_concurrency"]
        assert row["concurrency_at_typical_context"] == alone["concurrency_at_context"]["8192"]
        assert row["gpus_per_replica"] == tp and row["refused"] is None
    # fp8 halves a 16-bit cache's bytes per token: twice the tokens in the same memory
    by = {(p["tp"], p["kv_cache_dtype"], p["max_model_len"]): p for p in doc["plans"]}
    assert by[(1, "fp8", 8192)]["kv_cache_tokens"] == pytest.approx(2 * by[(1, "auto", 8192)]["kv_cache_tokens"], 1e-3)


def test_the_memory_budget_compared_by_utilization(llama: Path) -> None:
    base = ("--model-config", str(llama), "--gpu-memory", "80GiB", "--weights-memory", "14.96GiB",
            "--cuda-graph-memory", "0.5GiB", "--activation-memory", "1.2GiB", "--vllm-version", "0.33.0")  # fmt: skip
    result = _main("plan", *base, "--gpu-memory-utilization", "0.85,0.9,0.95", "--format", "json")
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)["plans"]
    tokens = [p["kv_cache_tokens"] for p in plans]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3  # more of the GPU, more KV cache
    for row in plans:
        alone = _single(*base, "--gpu-memory-utilization", str(row["gpu_memory_utilization"]))
        assert (row["kv_cache_tokens"], row["max_concurrency"]) == (alone["kv_cache_tokens"], alone["max_concurrency"])
        assert row["weights_bytes_per_gpu"] == alone["memory_budget"]["weights_bytes"]
    text = _main("plan", *base, "--gpu-memory-utilization", "0.85,0.9,0.95")
    assert text.returncode == 0 and "3 combinations of --gpu-memory-utilization" in text.stdout
    assert f"{tokens[0]:,}" in text.stdout and "max conc @ max_model_len" in text.stdout


def test_a_combination_vllm_refuses_is_named_in_its_row(llama: Path) -> None:
    """TP 3 cannot shard 8 KV heads: that row says so, the others are planned."""
    result = _main("plan", "--model-config", str(llama), "--kv-cache-memory", "16GiB", "--tp", "1,3")
    assert result.returncode == 0, result.stderr
    (row3,) = [line for line in result.stdout.splitlines() if line.startswith("3 ")]
    assert "refused:" in row3 and "--tp 3" in row3
    only_bad = _main("plan", "--model-config", str(llama), "--kv-cache-memory", "16GiB", "--tp", "3,5")
    assert only_bad.returncode == 2 and only_bad.stderr.count("\n") == 1
    assert "no combination can be planned" in only_bad.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "1,2", "--gpu-memory", "80GiB", "--weights-memory", "15GiB"], "one rank's weights"),
        (["--gpu-memory-utilization", "0.8,0.9", "--kv-cache-memory", "16GiB"], "needs --gpu-memory"),
        (["--tp", "1,,2", "--kv-cache-memory", "16GiB"], "an empty value"),
        (["--kv-cache-dtype", "auto,fp9", "--kv-cache-memory", "16GiB"], "'fp9' is not one of"),
    ],
)
def test_a_comparison_that_would_mislead_is_refused(llama: Path, args: list[str], message: str) -> None:
    result = _main("plan", "--model-config", str(llama), *args)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
