"""The planner's hybrid KV-cache groups against the real vLLM CPU server, on three tiny random-weight hybrid models
(scripts/vllm-cpu/make_tiny_hybrids.py):

* tiny-gemma3: 3 sliding-window layers (window 64) and 2 full-attention layers: 3 groups of 2 layers, one padded;
  a small --max-num-batched-tokens so that the sliding groups' per-request bound is below max_model_len.
* tiny-gemma4: 2 sliding-window layers (2 KV heads x 32) and 3 full-attention layers of global_head_dim 64: pages of
  two sizes, the sliding layers in blocks twice as long (vLLM 0.32 unify_kv_cache_spec_page_size).
* tiny-granite-hybrid: 3 Mamba-2 layers and 1 attention layer: the Mamba page padded to the attention page, and the
  'align' Mamba cache mode that prefix caching selects (3 blocks per request and Mamba-2 group).
* tiny-qwen3-next: 3 Gated DeltaNet layers and 1 attention layer (2 blocks per request and GDN group in 'align').
* tiny-jamba: 3 Mamba-1 layers and 1 attention layer (2 blocks per request and Mamba-1 group in 'align'); vLLM's
  CPU wheel cannot run Mamba-1, so the test reads the server's start-up only.
* tiny-llama4: 3 chunked local attention layers (chunks of 256) and 1 global layer: 4 groups of 1 layer, each chunked
  group holding chunk + in-flight tokens per request, fewer blocks than the full group.
* tiny-granite-hybrid and tiny-qwen3-next with n-gram speculation (2 tokens, no drafter model): a state block per
  speculative token, and a conv state widened by the speculative tokens, which changes the padding vLLM logs.

`vllm-capacity plan`, given the server's model directory and the settings vLLM reports, must give the server's own
block count, KV cache size in tokens and maximum concurrency, exactly, and the same padding vLLM logs. The agent,
given the model's config.json and vLLM's log, lays out the same groups live and finds vLLM's capacity in agreement.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

import lab
from support.exposition import samples
from support.files import run_plan, selected_cases

pytestmark = pytest.mark.realvllm
KV_BYTES = str(4 * 2**20)

MAMBA_PADDING = r"Padding mamba page size by ([\d.]+)%"
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CASES = {
    # case: (model, max_model_len, vLLM's extra arguments, what vLLM logs about padding, --speculative-config)
    "tiny-gemma3": ("tiny-gemma3", 2048, ("--max-num-batched-tokens", "256"), r"Add (\d+) padding layers", None),
    "tiny-gemma4": ("tiny-gemma4", 1024, ("--max-num-batched-tokens", "256"), r"Add (\d+) padding layers", None),
    "tiny-granite-hybrid": ("tiny-granite-hybrid", 1024, (), MAMBA_PADDING, None),
    "tiny-qwen3-next": ("tiny-qwen3-next", 1024, (), MAMBA_PADDING, None),
    "tiny-llama4": ("tiny-llama4", 2048, ("--max-num-batched-tokens", "256"), None, None),
    "tiny-jamba": ("tiny-jamba", 2048, (), MAMBA_PADDING, None),
    "tiny-granite-hybrid-ngram": ("tiny-granite-hybrid", 1024, (), MAMBA_PADDING, NGRAM),
    "tiny-qwen3-next-ngram": ("tiny-qwen3-next", 1024, (), MAMBA_PADDING, NGRAM),
}


def _vllm_args(case: str) -> tuple[str, ...]:
    _, _, extra_args, _, speculation = CASES[case]
    if speculation is not None:
        extra_args = (*extra_args, "--speculative-config", json.dumps(speculation))
    return extra_args


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[lab.StartAhead]:
    """Each case's server, the next one booting while a test reads its own."""
    lab.install()

    def make(case: str) -> lab.VllmServer:
        model, max_model_len, *_ = CASES[case]
        return lab.VllmServer(
            log_path=tmp_path_factory.mktemp(case) / "vllm.log",
            model=model,
            max_model_len=max_model_len,
            extra_args=("--kv-cache-memory-bytes", KV_BYTES, *_vllm_args(case)),
        )

    order = selected_cases(request, "test_plan_agrees_with_the_real_server_on_a_hybrid_model")
    with lab.StartAhead(make, order) as ahead:
        yield ahead


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_agrees_with_the_real_server_on_a_hybrid_model(case: str, servers: lab.StartAhead) -> None:
    model, max_model_len, _, padding_line, speculation = CASES[case]
    extra_args = _vllm_args(case)
    server = servers.take(case)
    try:
        server.wait_ready()
        raw = httpx.get(server.url + "/metrics").text
        version = httpx.get(server.url + "/version").json()["version"]
        report = subprocess.run(
            [sys.executable, "-m", "vllm_capacity", "report", "--vllm-url", server.url, "--format", "json",
             "--model-config", str(server.cache / model / "config.json"), "--vllm-log", str(server.log_path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        server.stop()
    (cc,) = [dict(labels) for name, labels in samples(raw) if name == "vllm:cache_config_info"]
    logged = server.startup_figures()
    # What vLLM's CPU backend decides for itself, passed on as an operator would pass their server's flags:
    # it turns async scheduling off, and keeps the Mamba SSM state in float32 (its label says so; with speculation
    # it keeps the model's dtype, "auto").
    plan_args = ["--async-scheduling", "off", "--mamba-ssm-cache-dtype", cc["mamba_ssm_cache_dtype"]]
    if speculation is not None:
        plan_args += ["--speculative-method", "ngram", "--num-speculative-tokens", str(NGRAM["num_speculative_tokens"])]
    if "--max-num-batched-tokens" in extra_args:
        plan_args += ["--max-num-batched-tokens", extra_args[extra_args.index("--max-num-batched-tokens") + 1]]
    plan = run_plan(server.cache / server.model, cc, server.max_model_len, version, *plan_args)
    print(
        f"\n{model}: vLLM {logged}, blocks {cc['num_gpu_blocks']}; plan {plan['kv_cache_tokens']} tokens, "
        f"{plan['max_concurrency']:.4f}x, {plan['num_gpu_blocks']} blocks, groups {plan['groups']}"
    )
    assert plan["num_gpu_blocks"] == int(cc["num_gpu_blocks"])
    assert plan["kv_cache_tokens"] == int(cc["kv_cache_size_tokens"]) == logged["kv_cache_tokens"]
    assert plan["max_concurrency"] == pytest.approx(float(cc["kv_cache_max_concurrency"]), rel=1e-12)
    assert f"{plan['max_concurrency']:.2f}" == f"{logged['max_concurrency']:.2f}"
    assert len(plan["groups"]) > 1  # a hybrid layout, not the single group of a dense model
    assert report.returncode == 0, report.stderr
    notes = " ".join(plan["notes"])
    if speculation is not None:  # a state block per speculative token, and the conv state widened for them
        assert "conv state widened by 2 speculative token(s)" in notes
        assert {g["blocks_per_request"] for g in plan["groups"] if g["kind"] != "full"} == {
            (3 if model == "tiny-granite-hybrid" else 2) + NGRAM["num_speculative_tokens"]
        }
    # live: the agent's layout is the plan's (the speculation read from vLLM's log), and it finds vLLM in agreement
    (engine,) = json.loads(report.stdout)["engines"]
    groups: dict[str, int] = {}
    per_request: dict[str, int] = {}
    for g in plan["groups"]:
        groups[g["kind"]] = groups.get(g["kind"], 0) + 1
        per_request[g["kind"]] = per_request.get(g["kind"], 0) + g["blocks_per_request"]
    layout = engine["layout"]
    assert (layout["groups"], layout["blocks_per_request"]) == (groups, per_request), layout
    assert layout["mismatch"] is False and layout["planned_tokens"] == int(cc["kv_cache_size_tokens"])
    if padding_line is None:  # tiny-llama4: no padding, and chunked groups bounded by chunk + in-flight tokens
        assert not re.search(r"Add \d+ padding layers", server.log_text()) and "padding" not in notes
        by_kind = {g["kind"]: g["blocks_per_request"] for g in plan["groups"]}
        block = int(cc["block_size"])
        assert by_kind == {"chunked": -(-(256 + 256) // block), "full": max_model_len // block}
        assert "chunked local attention layers have KV-cache groups of their own" in notes
        return
    # the padding vLLM logs is the padding the plan explains
    (padding,) = re.findall(padding_line, server.log_text())
    if model == "tiny-gemma4":  # the full layers' pages are twice the sliding ones': 2-block-long sliding blocks
        assert f"{padding} padding layer(s) for the full layers" in notes
        assert "vLLM gives them 256-token blocks" in notes and int(cc["block_size"]) == 128
    elif model == "tiny-gemma3":
        assert f"{padding} padding layer(s) for the sliding layers" in notes
        # the sliding groups stop at window - 1 + max_num_batched_tokens: fewer blocks than a full group
        by_kind = {g["kind"]: g["blocks_per_request"] for g in plan["groups"]}
        assert by_kind["sliding"] < by_kind["full"] == max_model_len // int(cc["block_size"])
    else:
        assert f"page padded by {padding}%" in notes
        assert cc["mamba_cache_mode"] == "align" and "Mamba cache mode align" in notes
