"""The CPU tier of native KV offloading against vLLM 0.32's own sizing code on this machine
(tests/vllm_probes/offload_tier.py): vLLM's CPU backend refuses to start offloading, but the engine config, the GPU
layout of every rank, the one-copy decision for an MLA latent and the chunk count before that refusal are plain
Python, and the plan must give the tokens they give.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import lab
from support.files import PROBES
from vllm_capacity.sizing import cpu_tier_tokens
from vllm_capacity.sizing.offload import OFFLOAD_RULES

pytestmark = [pytest.mark.realvllm, pytest.mark.vllmcode]

KV_MEMORY = 16 * 2**20
CASES = {
    # name: (model, tp, pp, --kv-offloading-size GiB, one copy for all ranks)
    "mla-tp2": ("tiny-deepseek-mtp", 2, 1, 0.5, True),  # the latent is alike on both ranks: vLLM keeps one copy
    "mla-pp2": ("tiny-deepseek-mtp", 1, 2, 0.5, False),  # the stages hold other layers: a copy per rank
    "llama-tp2": ("tiny-llama", 2, 1, 0.5, False),  # the KV heads split over the ranks: both halves kept
    "llama": ("tiny-llama", 1, 1, 0.3, False),  # 0.3 GiB: not a whole number of chunks
}


CHUNKED = ("tiny-llama", 1, 1, 0.25, 3)  # kv_connector_extra_config blocks_per_chunk 3: page-aligned as one chunk


@pytest.fixture(scope="module")
def vllm_tiers() -> dict[tuple, dict]:
    """vLLM's own figures for every case (and the chunked one), from one run of its code: importing vLLM is most of
    the time."""
    cache = lab.install()
    cases = [(*c[:4], None) for c in CASES.values()] + [CHUNKED]
    asked = [{"model_dir": str(cache / m), "tp": tp, "pp": pp, "size_gib": gib, "kv_memory": KV_MEMORY,
              "blocks_per_chunk": chunk} for m, tp, pp, gib, chunk in cases]  # fmt: skip
    found = lab.run_cases(PROBES / "offload_tier.py", asked)
    return dict(zip(cases, found, strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_gives_the_cpu_tier_vllm_sizes(case: str, vllm_tiers: dict[tuple, dict]) -> None:
    model, tp, pp, gib, one_copy = CASES[case]
    vllm = vllm_tiers[(model, tp, pp, gib, None)]
    assert vllm["replicated"] == one_copy
    plan = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-dir", str(lab.install() / model), "--format", "json",
         "--kv-cache-memory", str(KV_MEMORY), "--max-model-len", "512", "--tp", str(tp), "--pp", str(pp),
         "--block-size", str(vllm["block_size"]), "--kv-offloading-size", f"{gib}GiB"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    print(f"\n{case}: vLLM {vllm}; plan {doc['cpu_tier_tokens']}")
    assert doc["kv_bytes_per_token"] * doc["block_size"] == vllm["worker_bytes_per_block"]  # one group: a rank's block
    assert doc["cpu_tier_tokens"] == vllm["tokens"] > 0
    assert any("one copy of the latent" in note for note in doc["notes"]) == one_copy


def test_chunks_of_several_blocks(vllm_tiers: dict[tuple, dict]) -> None:
    vllm = vllm_tiers[CHUNKED]
    ours = cpu_tier_tokens(offloading_bytes=2**28, worker_bytes_per_block=vllm["worker_bytes_per_block"],
                           world_size=1, block_size=vllm["block_size"], version=OFFLOAD_RULES,
                           blocks_per_chunk=3)  # fmt: skip
    assert ours == vllm["tokens"] > 0
