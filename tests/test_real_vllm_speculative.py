"""Speculative decoding against the real vLLM CPU server, on tiny random-weight drafters
(scripts/vllm-cpu/make_tiny_drafters.py):

* the tiny Llama with an EAGLE-1 head of one layer shaped like its own: the plan with --speculative-method eagle,
  with and without the head's config.json, gives vLLM's blocks, tokens and concurrency exactly; and the agent's
  report reads vLLM's spec_decode_* counters after a few requests and gives the acceptance they imply.
* the tiny Llama with a smaller draft model (3 layers of 1 KV head: half the target's page): one group of per-layer
  page sizes, as the plan's draft_model rule says.
* the tiny Gemma 3 (3 sliding + 2 full layers) with the EAGLE head: the drafter's full layer changes vLLM's group
  layout from 3 groups of 2 to 2 groups of 3.
* a tiny DeepSeek-V3 (2 MLA layers) with its own MTP layer (--speculative-config.method mtp): one MLA layer more in
  the pool, on vLLM's CPU MLA backend.
* the tiny Gemma 4 with its assistant (method mtp, a gemma4_assistant drafter whose layers read the target's K/V): no
  page more, the blocks of the target alone, and the assistant drafts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

import lab
from support.exposition import samples
from support.files import run_plan, selected_cases

pytestmark = pytest.mark.realvllm
TOKENS = 2

CASES = {
    # name: (target, drafter (None: the model's own MTP layers), method, max_model_len, KV MiB, vLLM's extra
    #        arguments, the plan's group size with and without the drafter, or None)
    "llama-eagle": ("tiny-llama", "tiny-llama-eagle", "eagle", 1024, 4, (), None),
    "llama-draft-model": ("tiny-llama", "tiny-llama-draft", "draft_model", 1024, 4, (), None),
    "gemma3-eagle": ("tiny-gemma3", "tiny-llama-eagle", "eagle", 2048, 4, ("--max-num-batched-tokens", "256"), (3, 2)),
    "deepseek-mtp": ("tiny-deepseek-mtp", None, "mtp", 2048, 16, (), None),
    "gemma4-mtp": ("tiny-gemma4", "tiny-gemma4-assistant", "mtp", 1024, 4, ("--max-num-batched-tokens", "256"), None),
}
READS_TARGET_KV = ("gemma4-mtp",)  # drafters without pages of their own: the target's blocks alone


def _report(url: str, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "report", "--vllm-url", url, "--format", "json", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[lab.StartAhead]:
    """Each case's server, the next one booting while a test reads its own."""
    lab.install()

    def make(case: str) -> lab.VllmServer:
        target, drafter, method, max_model_len, kv_mib, extra_args, _ = CASES[case]
        spec = {"method": method, "num_speculative_tokens": TOKENS}
        if drafter is not None:
            spec["model"] = str(lab.cache_dir() / drafter)
        return lab.VllmServer(
            log_path=tmp_path_factory.mktemp(case) / "vllm.log",
            model=target,
            max_model_len=max_model_len,
            extra_args=(
                *("--kv-cache-memory-bytes", str(kv_mib * 2**20), *extra_args),
                *("--speculative-config", json.dumps(spec)),
            ),
        )

    order = selected_cases(request, "test_plan_and_report_agree_with_a_real_speculative_server")
    with lab.StartAhead(make, order) as ahead:
        yield ahead


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_and_report_agree_with_a_real_speculative_server(case: str, servers: lab.StartAhead) -> None:
    target, drafter, method, max_model_len, _, extra_args, layout = CASES[case]
    server = servers.take(case)
    report = None
    try:
        server.wait_ready()
        version = httpx.get(server.url + "/version").json()["version"]
        if case in ("llama-eagle", "gemma4-mtp"):  # a few requests, so that the drafter drafts and vLLM counts it
            for i in range(3):
                body = {"model": target, "prompt": f"the quick brown fox {i}", "max_tokens": 24, "ignore_eos": True}
                assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
            model_config = str(server.cache / target / "config.json")
            report = _report(server.url, "--model-config", model_config, "--vllm-log", str(server.log_path))
        raw = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    (cc,) = [dict(labels) for (name, labels) in samples(raw) if name == "vllm:cache_config_info"]
    logged = server.startup_figures()
    plan_args = ["--async-scheduling", "off", "--speculative-method", method, "--num-speculative-tokens", str(TOKENS)]
    plan_args += list(extra_args)
    if drafter is not None:
        draft_config = str(lab.cache_dir() / drafter / "config.json")
        plans = [run_plan(server.cache / target, cc, max_model_len, version, *plan_args, "--draft-model-config",
                          draft_config)]  # fmt: skip
        if case in READS_TARGET_KV:  # MTP on a Gemma 4 without the assistant's config: what a live server's log says
            plans.append(run_plan(server.cache / target, cc, max_model_len, version, *plan_args))
            assert all(any("reads the target's KV cache" in n for n in p["notes"]) for p in plans)
            drafts = sum(v for (n, _), v in samples(raw).items() if n == "vllm:spec_decode_num_drafts_total")
            assert drafts > 0  # the assistant drafted, reading the pages the plan gave the target alone
    else:  # MTP: the target's own layers
        plans = [run_plan(server.cache / target, cc, max_model_len, version, *plan_args)]
        assert plans[0]["kv_layers_per_rank"] == 3  # 2 MLA layers and the MTP layer
    if method == "eagle":  # the default rule (one layer of the target's shape) gives the same, and says it assumed
        assumed = run_plan(server.cache / target, cc, max_model_len, version, *plan_args)
        assert any("assumed" in n for n in assumed["notes"])
        plans.append(assumed)
    alone = run_plan(server.cache / target, cc, max_model_len, version, "--async-scheduling", "off", *extra_args)
    for plan in plans:
        print(f"\n{case}: vLLM {logged}, blocks {cc['num_gpu_blocks']}; plan {plan['num_gpu_blocks']} blocks")
        assert plan["num_gpu_blocks"] == int(cc["num_gpu_blocks"])
        if case in READS_TARGET_KV:
            assert plan["num_gpu_blocks"] == alone["num_gpu_blocks"]
        else:
            assert plan["num_gpu_blocks"] < alone["num_gpu_blocks"]
        assert plan["kv_cache_tokens"] == int(cc["kv_cache_size_tokens"]) == logged["kv_cache_tokens"]
        assert plan["max_concurrency"] == pytest.approx(float(cc["kv_cache_max_concurrency"]), rel=1e-12)
        if layout is not None:
            assert (len(plan["groups"]), plan["group_size"]) == (len(alone["groups"]) - 1, layout[0])
            assert (len(alone["groups"]), alone["group_size"]) == (3, layout[1])
    if report is not None:
        (engine,) = report["engines"]
        # live: the agent read the speculative config from vLLM's log and plans the drafter's layers in the pool too
        # (EAGLE: the head's layer; Gemma 4's assistant: none, it reads the target's)
        layout = engine["layout"]
        assert layout["mismatch"] is False and layout["planned_tokens"] == int(cc["kv_cache_size_tokens"])
        assert f"{'MTP' if method == 'mtp' else method} speculation of 2 tokens" in layout["assumed"]
        # and its bytes per token from config.json count the head's layer, as vLLM's own figure does
        per_token = engine["kv_bytes_per_token_model"]
        if case in READS_TARGET_KV:  # Gemma 4's layers of two shapes: no one figure per token, as for it alone
            assert per_token is None
        else:
            assert per_token == plans[0]["kv_bytes_per_token"] > alone["kv_bytes_per_token"]
            block = int(cc["block_size"])
            assert int(cc["kv_cache_memory_bytes"]) // (per_token * block) == int(cc["num_gpu_blocks"])  # vLLM's
        sd = engine["spec_decode"]
        draft_tokens = sum(v for (n, _), v in samples(raw).items() if n == "vllm:spec_decode_num_draft_tokens_total")
        accepted = sum(v for (n, _), v in samples(raw).items() if n == "vllm:spec_decode_num_accepted_tokens_total")
        drafts = sum(v for (n, _), v in samples(raw).items() if n == "vllm:spec_decode_num_drafts_total")
        assert sd["draft_tokens"] == draft_tokens > 0 and sd["accepted_tokens"] == accepted
        assert sd["acceptance_ratio"] == pytest.approx(accepted / draft_tokens)
        assert sd["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
