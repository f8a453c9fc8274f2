"""Speculative decoding in the planner: each rule of how a drafter shares vLLM's KV pool, one test each, and what is
refused. The rules against the real vLLM CPU server are in test_real_vllm_speculative.py; the EAGLE case from a
public log in test_sizing.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from support.model_configs import GEMMA4
from vllm_capacity import sizing
from vllm_capacity.geometry import GeometryError
from vllm_capacity.sizing import NotModelled, PlanInputs, Speculation
from vllm_capacity.sizing.versions import (
    MAMBA2_SPECULATIVE,
    MIXED_PAGE_SIZES,
    SLIDING_MTP_RETAINED,
    SPECULATIVE_RULES,
    STATE_SPECULATIVE_BLOCKS,
)
from vllm_capacity.sources.model_config import parse_config

GiB, MiB = 2**30, 2**20
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
# a Llama-3.2-1B-like draft model: 16 layers of 8 KV heads x 64, so a page half the 8B's
LLAMA_1B = {**LLAMA_8B, "num_hidden_layers": 16, "head_dim": 64, "hidden_size": 2048}
# DeepSeek-V3's attention: 61 MLA layers of latent 512 + 64, one MTP layer
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
# Qwen3-Next-80B-A3B's layout: 48 layers, every 4th full attention (2 KV heads x 256), the rest Gated DeltaNet
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
KW = {"kv_cache_memory_bytes": 40 * GiB, "max_model_len": 32768}


def test_eagle_adds_one_layer_of_the_targets_shape() -> None:
    target = parse_config(LLAMA_8B)
    alone = sizing.plan(target, PlanInputs(**KW))
    eagle = sizing.plan(target, PlanInputs(**KW, speculation=Speculation("eagle", 3)))
    assert eagle.kv_layers_per_rank == 33 and eagle.kv_bytes_per_token == alone.kv_bytes_per_token * 33 // 32
    assert eagle.num_gpu_blocks == 40 * GiB // (33 * 4096 * 16)
    assert eagle.max_concurrency == eagle.num_gpu_blocks / (32768 / 16)
    assert "assumed" in eagle.notes[0]  # no --draft-model-config: said, not hidden
    # the head's own config.json decides: a 2-layer EAGLE-3 head adds two, and says whose they are
    head = parse_config({**LLAMA_8B, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 2})
    eagle3 = sizing.plan(target, PlanInputs(**KW, speculation=Speculation("eagle3", 3, head)))
    assert eagle3.kv_layers_per_rank == 34 and "LlamaForCausalLMEagle3" in eagle3.notes[0]


def test_eagle_1_conversions_nest_the_decoder_config() -> None:
    """vLLM's EAGLE-1 conversions (yuhuili/EAGLE-*) write {"model_type": "eagle", "model": {...the decoder...}}."""
    nested = parse_config({"model_type": "eagle", "model": {**LLAMA_8B, "num_hidden_layers": 1}})
    assert (nested.kv_layers, nested.num_kv_heads, nested.head_dim) == (1, 8, 128)


def test_ngram_holds_no_cache() -> None:
    target = parse_config(LLAMA_8B)
    ngram = sizing.plan(target, PlanInputs(**KW, speculation=Speculation("ngram", 4)))
    alone = sizing.plan(target, PlanInputs(**KW))
    assert (ngram.num_gpu_blocks, ngram.kv_cache_tokens) == (alone.num_gpu_blocks, alone.kv_cache_tokens)
    assert ngram.lookahead_tokens == 0


def test_look_ahead_slots_count_below_max_model_len_only() -> None:
    """vLLM allocates num_tokens + num_lookahead_tokens, capped at max_model_len (kv_cache_manager.allocate_slots)."""
    target = parse_config(LLAMA_8B)
    plan = sizing.plan(target, PlanInputs(**KW, speculation=Speculation("eagle", 4)))
    assert plan.concurrency_at(32768) == plan.kv_cache_tokens / 32768  # capped
    assert plan.concurrency_at(4096) == plan.kv_cache_tokens / (4096 + 4)
    assert plan.request_bytes(4096) == (4096 + 4) * plan.kv_bytes_per_token


def test_mtp_layers_are_the_models_own_of_its_kind() -> None:
    deepseek = parse_config(DEEPSEEK_V3)
    assert deepseek.mtp_layers == 1
    plan = sizing.plan(deepseek, PlanInputs(kv_cache_memory_bytes=40 * GiB, max_model_len=32768, tp=8,
                   speculation=Speculation("mtp", 1)))  # fmt: skip
    assert plan.kv_layers_per_rank == 62 and plan.kv_bytes_per_token == 62 * 576 * 2  # MLA: one latent per token
    with pytest.raises(NotModelled, match="names no MTP layers"):
        sizing.plan(parse_config(LLAMA_8B), PlanInputs(**KW, speculation=Speculation("mtp", 1)))
    assert parse_config({**QWEN3_NEXT, "num_nextn_predict_layers": None, "mtp_num_hidden_layers": 2}).mtp_layers == 2
    with pytest.raises(GeometryError, match="num_nextn_predict_layers"):
        parse_config({**LLAMA_8B, "num_nextn_predict_layers": -1})


def test_mtp_on_a_gated_deltanet_hybrid_adds_a_full_layer_and_state_blocks() -> None:
    """Qwen3-Next: the MTP layer is full attention (12 full + 1), and every GDN group keeps one state block per
    speculative token besides its own (MambaSpec.num_speculative_blocks)."""
    g = parse_config(QWEN3_NEXT)
    kw = {"kv_cache_memory_bytes": 40 * GiB, "max_model_len": 32768, "version": (0, 32, 0)}
    alone, mtp = sizing.plan(g, PlanInputs(**kw)), sizing.plan(g, PlanInputs(**kw, speculation=Speculation("mtp", 2)))
    full = lambda p: sum(x.layers for x in p.groups if x.kind == "full")  # noqa: E731
    assert (full(alone), full(mtp)) == (12, 13)
    state = lambda p: {x.blocks_per_request for x in p.groups if x.kind == "linear"}  # noqa: E731
    assert state(mtp) == {x + 2 for x in state(alone)}
    assert any("one per speculative token" in n for n in mtp.notes)


# Granite-4.0-H-Tiny's Mamba-2 layers (ibm-granite/granite-4.0-h-tiny config.json): 4 attention layers in 40
GRANITE_4_H = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "num_hidden_layers": 40,
    "layers_block_type": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "hidden_size": 1536,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}


def test_the_conv_state_keeps_room_for_the_speculative_tokens() -> None:
    """vLLM 0.32's mamba2_state_shape / gated_delta_net_state_shape: ``conv_kernel - 1 + num_spec`` columns, which
    can raise the attention block size (Mamba-1 keeps none). Checked on the real CPU server in
    test_real_vllm_hybrid.py (the padding vLLM logs)."""
    g = parse_config(GRANITE_4_H)
    conv_dim = 2 * 1536 + 2 * 128  # mamba_expand x hidden + 2 groups' B and C
    ssm = 48 * 64 * 128 * 2
    assert g.state.state_bytes(1, 2, 2) == 3 * conv_dim * 2 + ssm
    assert g.state.state_bytes(1, 2, 2, spec_columns=3) == 6 * conv_dim * 2 + ssm
    kw = {"kv_cache_memory_bytes": 20 * GiB, "max_model_len": 32768, "version": MAMBA2_SPECULATIVE}
    alone, spec = (
        sizing.plan(g, PlanInputs(**kw)),
        sizing.plan(g, PlanInputs(**kw, speculation=Speculation("ngram", 3))),
    )
    note = next(n for n in spec.notes if "Mamba cache mode" in n)
    assert "conv state widened by 3 speculative token(s)" in note
    # the attention page must hold the wider state: 4 KV heads x 128 x 2 x 2 B = 2 KiB a token, so 806,400 B of
    # state need 393.75 tokens (400 in steps of 16) alone and 826,368 B need 403.5 (416) with the 3 columns
    assert (alone.block_size, spec.block_size) == (400, 416)
    assert spec.num_gpu_blocks < alone.num_gpu_blocks
    with pytest.raises(NotModelled, match=r"beside Mamba-2 layers is planned from vLLM 0\.32\.0"):
        sizing.plan(g, PlanInputs(**{**kw, "version": (0, 31, 0)}, speculation=Speculation("ngram", 3)))


def test_where_the_speculative_rules_apply() -> None:
    """Each release boundary: refused before it, planned from it."""
    target = parse_config(LLAMA_8B)
    before = tuple(v - (i == 2) for i, v in enumerate(SPECULATIVE_RULES))
    with pytest.raises(NotModelled, match=r"planned from vLLM 0\.9\.1"):
        sizing.plan(target, PlanInputs(**KW, version=before, speculation=Speculation("eagle", 2)))
    first = sizing.plan(target, PlanInputs(**KW, version=SPECULATIVE_RULES, speculation=Speculation("eagle", 2)))
    assert first.kv_layers_per_rank == 33

    draft = parse_config(LLAMA_1B)
    with pytest.raises(NotModelled, match="refused it"):
        sizing.plan(target, PlanInputs(**KW, version=(0, 10, 2), speculation=Speculation("draft_model", 2, draft)))
    mixed = sizing.plan(
        target, PlanInputs(**KW, version=MIXED_PAGE_SIZES, speculation=Speculation("draft_model", 2, draft))
    )
    # one group of per-layer pages: a block costs 32 pages of the target's and 16 of the draft's (half the size)
    per_token = 32 * 2 * 8 * 128 * 2 + 16 * 2 * 8 * 64 * 2
    assert mixed.kv_bytes_per_token == per_token and mixed.num_gpu_blocks == 40 * GiB // (per_token * 16)

    qwen = parse_config(QWEN3_NEXT)
    kw = {"kv_cache_memory_bytes": 40 * GiB, "max_model_len": 32768}
    with pytest.raises(NotModelled, match="beside state layers"):
        sizing.plan(qwen, PlanInputs(**kw, version=(0, 10, 1), speculation=Speculation("mtp", 1)))
    assert sizing.plan(
        qwen, PlanInputs(**kw, version=STATE_SPECULATIVE_BLOCKS, speculation=Speculation("mtp", 1))
    ).groups

    # sliding layers keep num_speculative_tokens - 1 more tokens beside a multi-layer MTP drafter
    layers = ["sliding_attention"] * 8 + ["full_attention"] * 4
    mimo = parse_config({**LLAMA_8B, "num_hidden_layers": 12, "layer_types": layers, "sliding_window": 128,
                         "num_nextn_predict_layers": 3})  # fmt: skip
    kw = {"kv_cache_memory_bytes": 8 * GiB, "max_model_len": 32768, "max_num_batched_tokens": 2048}
    with pytest.raises(NotModelled, match="multi-layer MTP"):
        sizing.plan(mimo, PlanInputs(**kw, version=(0, 31, 0), speculation=Speculation("mtp", 3)))
    plan = sizing.plan(
        mimo, PlanInputs(**kw, version=SLIDING_MTP_RETAINED, speculation=Speculation("mtp", 3), async_scheduling=False)
    )
    sliding = {x.blocks_per_request for x in plan.groups if x.kind == "sliding"}
    assert sliding == {math.ceil((128 - 1 + 2 + 2048) / 16) + 1}
    one_token = sizing.plan(mimo, PlanInputs(**kw, version=SLIDING_MTP_RETAINED, speculation=Speculation("mtp", 1),
                        async_scheduling=False))  # fmt: skip
    assert {x.blocks_per_request for x in one_token.groups if x.kind == "sliding"} == {math.ceil(2175 / 16) + 1}


def test_what_is_refused_is_named() -> None:
    target = parse_config(LLAMA_8B)
    with pytest.raises(NotModelled, match="V0"):
        sizing.plan(
            target, PlanInputs(**KW, version=(0, 9, 1), engine_version="v0", speculation=Speculation("eagle", 2))
        )
    with pytest.raises(NotModelled, match="pipeline parallelism"):
        sizing.plan(target, PlanInputs(**KW, pp=2, speculation=Speculation("eagle", 2)))
    with pytest.raises(NotModelled, match="a mla drafter beside full"):
        sizing.plan(target, PlanInputs(**KW, speculation=Speculation("draft_model", 2, parse_config(DEEPSEEK_V3))))
    gemma = parse_config({**LLAMA_8B, "num_hidden_layers": 6, "sliding_window": 1024, "sliding_window_pattern": 6})
    with pytest.raises(NotModelled, match="hybrid layout"):
        sizing.plan(gemma, PlanInputs(**KW, speculation=Speculation("draft_model", 2, parse_config(LLAMA_1B))))
    hybrid_draft = parse_config({**LLAMA_8B, "num_hidden_layers": 6, "sliding_window": 1024})
    with pytest.raises(NotModelled, match="sliding layers"):
        sizing.plan(target, PlanInputs(**KW, speculation=Speculation("draft_model", 2, hybrid_draft)))
    for bad, message in (
        (Speculation("medusa", 2), "not one of"),
        (Speculation("eagle", 0), "positive"),
        (Speculation("draft_model", 2), "needs the draft model"),
        (Speculation("mtp", 2, target), "only for Gemma 4's assistant"),
    ):
        with pytest.raises(ValueError, match=message):
            sizing.plan(target, PlanInputs(**KW, speculation=bad))


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_command_line(tmp_path: Path) -> None:
    target, draft = tmp_path / "target.json", tmp_path / "draft.json"
    target.write_text(json.dumps(LLAMA_8B))
    draft.write_text(json.dumps(LLAMA_1B))
    base = ("--model-config", str(target), "--kv-cache-memory", "40GiB", "--max-model-len", "32768")
    done = _plan(*base, "--format", "json", "--speculative-method", "draft_model", "--num-speculative-tokens", "4",
                 "--draft-model-config", str(draft))  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["inputs"]["speculation"]["method"] == "draft_model" and doc["kv_layers_per_rank"] == 48
    assert any("pages of their own" in n for n in doc["notes"])
    text = _plan(*base, "--speculative-method", "eagle", "--num-speculative-tokens", "2")
    assert text.returncode == 0 and "speculative decoding (eagle, 2 token(s))" in text.stdout
    for args, message in (
        (("--speculative-method", "eagle"), "needs --num-speculative-tokens"),
        (("--num-speculative-tokens", "2"), "need --speculative-method"),
        (("--speculative-method", "draft_model", "--num-speculative-tokens", "2"), "needs --draft-model-config"),
        (("--speculative-method", "ngram", "--num-speculative-tokens", "2", "--draft-model-config", str(draft)),
         "takes no --draft-model-config"),
        (("--speculative-method", "mtp", "--num-speculative-tokens", "2", "--draft-model-config", str(draft)),
         "only for Gemma 4's assistant"),
        (("--speculative-method", "medusa", "--num-speculative-tokens", "2"), "not one of"),
    ):  # fmt: skip
        done = _plan(*base, *args)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    refused = _plan(*base, "--speculative-method", "mtp", "--num-speculative-tokens", "1")
    assert refused.returncode == 3 and "not modelled" in refused.stderr


def test_dflash_adds_its_drafters_layers_and_a_bonus_slot() -> None:
    """DFlash (a block-diffusion drafter with a config.json of its own, from vLLM 0.20.0) registers its layers in the
    pool as a draft model does, and each request reserves num_speculative_tokens + 1 look-ahead slots from 0.23.0 (its
    bonus query and one per drafted token), num_speculative_tokens before; it needs the drafter's config."""
    target = parse_config(LLAMA_8B)
    draft = parse_config({**LLAMA_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5})
    plan = sizing.plan(target, PlanInputs(**KW, version=(0, 32, 0), speculation=Speculation("dflash", 15, draft)))
    assert plan.kv_layers_per_rank == 37 and plan.num_gpu_blocks == 40 * GiB // (37 * 4096 * 16)
    assert plan.lookahead_tokens == 16
    assert plan.concurrency_at(4096) == plan.kv_cache_tokens / (4096 + 16)
    assert any("DFlashDraftModel" in n for n in plan.notes)
    # from its first release (0.20.0); the bonus slot from 0.23.0 (the scheduler's extra slot), not in 0.22.1
    for version, lookahead in (((0, 20, 0), 15), ((0, 22, 1), 15), ((0, 23, 0), 16), ((0, 25, 1), 16)):
        then = sizing.plan(target, PlanInputs(**KW, version=version, speculation=Speculation("dflash", 15, draft)))
        assert (then.num_gpu_blocks, then.lookahead_tokens) == (plan.num_gpu_blocks, lookahead)
    with pytest.raises(NotModelled, match=r"vLLM 0\.19\.1 has no DFlash \(first in 0\.20\.0\)"):
        sizing.plan(target, PlanInputs(**KW, version=(0, 19, 1), speculation=Speculation("dflash", 15, draft)))
    with pytest.raises(ValueError, match=r"dflash needs the draft model's config\.json"):
        sizing.plan(target, PlanInputs(**KW, speculation=Speculation("dflash", 15)))
    # dflash_config.use_swa (MiMo-V2.5-Pro's drafter) makes every drafter layer sliding-window in vLLM 0.32, the
    # window swa_window_size: a sliding drafter beside full layers is refused, not planned as full layers
    swa = {**LLAMA_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5}
    sliding = parse_config({**swa, "dflash_config": {"use_swa": True, "swa_window_size": 2048}})
    assert set(sliding.layer_kinds) == {"sliding"} and sliding.sliding_window == 2048
    for version in ((0, 25, 0), (0, 32, 0)):
        with pytest.raises(NotModelled, match="sliding"):
            sizing.plan(target, PlanInputs(**KW, version=version, speculation=Speculation("dflash", 15, sliding)))
    # before 0.25.0 qwen3_dflash.py had no sliding window: the same drafter ran as full layers, and is planned so
    ran = sizing.plan(target, PlanInputs(**KW, version=(0, 24, 0), speculation=Speculation("dflash", 15, sliding)))
    assert ran.kv_layers_per_rank == 37 and any("runs every DFlash drafter layer as full" in n for n in ran.notes)
    assert parse_config({**swa, "dflash_config": {"use_swa": False}}).layer_kinds == ("full",) * 5
    for bad, field in (({"use_swa": True}, "swa_window_size"), ([1], "dflash_config")):
        with pytest.raises(GeometryError, match=field):
            parse_config({**swa, "dflash_config": bad})


# Gemma 4's assistant, as transformers writes it: its text_config names no architecture, and all its layers are
# KV-shared (Gemma4AssistantConfig requires num_kv_shared_layers == num_hidden_layers)
GEMMA4_ASSISTANT = {
    "architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant", "backbone_hidden_size": 2560,
    "dtype": "bfloat16",
    "text_config": {
        "architectures": None, "model_type": "gemma4_text", "num_hidden_layers": 4, "num_kv_shared_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 256,
        "sliding_window": 1024, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
}  # fmt: skip


def test_gemma4_assistant_reads_the_targets_kv_and_adds_no_page() -> None:
    """Gemma 4's assistant (vLLM's gemma4_mtp, run as method mtp from 0.21.0) has Q-only layers that read the K/V of
    the target's last layer of their type: the pool is the target's alone, and each request still reserves
    num_speculative_tokens look-ahead slots. Without its config.json (what a live server's log gives: method mtp),
    MTP on a Gemma 4, which has no MTP layers, is the assistant. On the real CPU server in
    test_real_vllm_speculative.py."""
    target, assistant = parse_config(GEMMA4), parse_config(GEMMA4_ASSISTANT)
    assert assistant.architecture == "Gemma4AssistantForCausalLM"
    assert assistant.reads_target_kv and assistant.kv_layers == 0 and not target.reads_target_kv
    kw = {"kv_cache_memory_bytes": 20 * GiB, "max_model_len": 32768, "max_num_batched_tokens": 8192}
    for speculation in (Speculation("mtp", 3, assistant), Speculation("mtp", 3)):
        for version in ((0, 21, 0), (0, 32, 0)):
            alone = sizing.plan(target, PlanInputs(**kw, version=version))
            plan = sizing.plan(target, PlanInputs(**kw, version=version, speculation=speculation))
            assert (plan.num_gpu_blocks, plan.kv_cache_tokens) == (alone.num_gpu_blocks, alone.kv_cache_tokens)
            assert plan.concurrency_at(4096) < alone.concurrency_at(4096)  # the look-ahead slots, in every group
            assert any("reads the target's KV cache" in n for n in plan.notes)
        with pytest.raises(NotModelled, match=r"planned from vLLM 0\.21\.0"):
            sizing.plan(target, PlanInputs(**kw, version=(0, 20, 2), speculation=speculation))
    # the unified model's assistant came later (read in 0.25.1, not in 0.21.0)
    unified = parse_config({**GEMMA4_ASSISTANT, "model_type": "gemma4_unified_assistant",
                            "architectures": ["Gemma4UnifiedAssistantForCausalLM"]})  # fmt: skip
    assert sizing.plan(
        target, PlanInputs(**kw, version=(0, 25, 1), speculation=Speculation("mtp", 3, unified))
    ).num_gpu_blocks == (sizing.plan(target, PlanInputs(**kw, version=(0, 25, 1))).num_gpu_blocks)
    with pytest.raises(NotModelled, match=r"planned from vLLM 0\.25\.1"):
        sizing.plan(target, PlanInputs(**kw, version=(0, 25, 0), speculation=Speculation("mtp", 3, unified)))
    # what vLLM would not run
    with pytest.raises(NotModelled, match="vLLM pairs Gemma 4's assistant with a Gemma 4 only"):
        sizing.plan(parse_config(LLAMA_8B), PlanInputs(**KW, speculation=Speculation("mtp", 3, assistant)))
    with pytest.raises(ValueError, match="runs as speculative method mtp"):
        sizing.plan(target, PlanInputs(**kw, speculation=Speculation("draft_model", 3, assistant)))
    with pytest.raises(ValueError, match="only for Gemma 4's assistant"):
        sizing.plan(target, PlanInputs(**kw, speculation=Speculation("mtp", 3, parse_config(LLAMA_1B))))
    # an ordinary Gemma 4 config still refuses a count of KV-shared layers that is all of them
    with pytest.raises(GeometryError, match="num_kv_shared_layers"):
        parse_config({**GEMMA4, "num_kv_shared_layers": 12})
