"""LoRA adapter slots against a real vLLM 0.32 on this machine's CPU: the plan's figure equals the bytes of every
``lora_*`` tensor vLLM allocates when it loads the model with LoRA on (scripts/vllm-cpu/lora_slots.py), on the
fullest rank, with and without the embeddings' slots, under tensor and pipeline parallelism.

vLLM's CPU backend sizes its KV cache from a fixed space, so the slots' effect on the KV budget cannot be seen here;
on a GPU they are part of "Model loading took", which the budget subtracts like weights (docs/planning.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import lab

pytestmark = pytest.mark.realvllm

CASES = {
    # name: (model, max_loras, max_lora_rank, tp, pp, --fully-sharded-loras)
    "llama": ("tiny-llama", 2, 16, 1, 1, False),  # Llama declares embedding_modules: embeddings and logits get slots
    "gemma3": ("tiny-gemma3", 3, 8, 1, 1, False),  # Gemma 3 does not: linear layers only
    "llama-tp2": ("tiny-llama", 2, 16, 2, 1, False),  # column outputs and row inputs split, embeddings whole
    "llama-tp2-sharded": ("tiny-llama", 2, 16, 2, 1, True),  # the column layers' A and row layers' B split too
    "llama-pp2": ("tiny-llama", 1, 32, 1, 2, False),  # a layer per stage, the embedding on the first, logits last
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_gives_the_lora_slots_vllm_allocates(case: str) -> None:
    cache = lab.install()
    model, max_loras, rank, tp, pp, sharded = CASES[case]
    venv_python = cache / f"vllm-cpu-{lab.VLLM_CPU_VERSION}" / "bin" / "python"
    measured = subprocess.run(
        ["nice", "-n", "10", str(venv_python), str(lab.HERE / "lora_slots.py"), str(cache / model),
         str(max_loras), str(rank), str(tp), str(pp), "fully-sharded" if sharded else "whole"],
        capture_output=True, text=True, timeout=300, cwd=lab.HERE,
        env=lab.vllm_env(cache),
    )  # fmt: skip
    assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
    (line,) = [x for x in measured.stdout.splitlines() if x.startswith('{"per_rank"')]  # workers log to stdout too
    vllm = json.loads(line)
    assert len(vllm["per_rank"]) == tp * pp
    plan = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(cache / model), "--format", "json",
         "--gpu-memory", "1GiB", "--max-model-len", "512", "--tp", str(tp), "--pp", str(pp),
         "--max-loras", str(max_loras), "--max-lora-rank", str(rank),
         "--fully-sharded-loras", "on" if sharded else "off"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    print(f"\n{case}: vLLM {vllm}; plan {doc['memory_budget']['lora_bytes']}")
    assert doc["memory_budget"]["lora_bytes"] == max(vllm["per_rank"]) > 0
    assert ("embed_tokens" in vllm["by_module"]) == (model == "tiny-llama")
    without = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(cache / model), "--format", "json",
         "--gpu-memory", "1GiB", "--max-model-len", "512", "--tp", str(tp), "--pp", str(pp)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # the slots come out of the KV cache, byte for byte
    kv_without = json.loads(without.stdout)["memory_budget"]["kv_cache_bytes"]
    assert kv_without - doc["memory_budget"]["kv_cache_bytes"] == doc["memory_budget"]["lora_bytes"]
