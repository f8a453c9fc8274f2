"""What vLLM allocates beside the weights and the KV cache from the same budget: LoRA adapter slots (vLLM 0.32's
``create_lora_weights`` of every LoRA layer; checked against a real vLLM in test_real_vllm_lora.py) and a multimodal
model's encoder cache held by its memory profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.model_configs import LLAMA_31_8B
from vllm_capacity.cli import plan_inputs
from vllm_capacity.sizing import NotModelled
from vllm_capacity.sizing.lora import LOGITS_VOCAB_LIMIT, Lora, lora_slots
from vllm_capacity.sizing.memory import MemoryBudget
from vllm_capacity.sizing.versions import LORA_SLOTS
from vllm_capacity.sources.model_config import parse_config

GiB = 2**30


def _slots(cfg: dict, lora: Lora, tp: int = 1, pp: int = 1, version: tuple[int, int, int] = LORA_SLOTS) -> int:
    return lora_slots(parse_config(cfg), lora, tp=tp, pp=pp, dtype_bytes=2, version=version).total_bytes


def test_llama_8b_slots_layer_by_layer() -> None:
    # per layer and slot-rank: qkv 3 x 4096 + 4096 + 2 x 1024, o 4096 + 4096, gate_up 2 x 4096 + 2 x 14336,
    # down 14336 + 4096; embeddings and logits (128256 + 4096) each
    per_layer = (3 * 4096 + 4096 + 2 * 1024) + (4096 + 4096) + (2 * 4096 + 2 * 14336) + (14336 + 4096)
    expected = 4 * 64 * 2 * (32 * per_layer + 2 * (128256 + 4096))
    assert _slots(LLAMA_31_8B, Lora(4, 64)) == expected == 1_477_705_728  # 1.38 GiB for 4 slots of rank 64
    # linear in the slots and the rank
    assert _slots(LLAMA_31_8B, Lora(8, 64)) == 2 * expected == 8 * _slots(LLAMA_31_8B, Lora(2, 32))


def test_tensor_and_pipeline_parallel_split_what_vllm_splits() -> None:
    one = lora_slots(parse_config(LLAMA_31_8B), Lora(1, 16), tp=1, pp=1, dtype_bytes=2, version=LORA_SLOTS)
    tp2 = lora_slots(parse_config(LLAMA_31_8B), Lora(1, 16), tp=2, pp=1, dtype_bytes=2, version=LORA_SLOTS)
    # TP halves the column outputs and the row inputs, not the A of a column layer or the B of a row layer
    split = (4096 + 2 * 1024) + 4096 + 2 * 14336 + 14336
    assert one.layers_bytes - tp2.layers_bytes == 16 * 2 * 32 * split // 2
    assert tp2.embeddings_bytes == one.embeddings_bytes  # vocabulary LoRA is not split
    # --fully-sharded-loras splits the rest of the linear layers too: the column layers' A, the row layers' B
    sharded = lora_slots(parse_config(LLAMA_31_8B), Lora(1, 16, True), tp=2, pp=1, dtype_bytes=2, version=LORA_SLOTS)
    assert tp2.layers_bytes - sharded.layers_bytes == 16 * 2 * 32 * (5 * 4096 + 2 * 4096) // 2
    assert sharded.embeddings_bytes == one.embeddings_bytes
    with pytest.raises(ValueError, match="must divide by TP 3"):
        lora_slots(parse_config({**LLAMA_31_8B, "num_attention_heads": 48, "num_key_value_heads": 48,
                                 "head_dim": 128, "intermediate_size": 14337 * 3}),
                   Lora(1, 16, True), tp=3, pp=1, dtype_bytes=2, version=LORA_SLOTS)  # fmt: skip
    pp2 = lora_slots(parse_config(LLAMA_31_8B), Lora(1, 16), tp=1, pp=2, dtype_bytes=2, version=LORA_SLOTS)
    assert (pp2.layers_bytes, pp2.embeddings_bytes) == (one.layers_bytes // 2, one.embeddings_bytes // 2)


def test_models_without_embedding_modules_have_linear_slots_only() -> None:
    qwen2 = {**LLAMA_31_8B, "architectures": ["Qwen2ForCausalLM"]}
    both = lora_slots(parse_config(LLAMA_31_8B), Lora(), tp=1, pp=1, dtype_bytes=2, version=LORA_SLOTS)
    linear = lora_slots(parse_config(qwen2), Lora(), tp=1, pp=1, dtype_bytes=2, version=LORA_SLOTS)
    assert (linear.layers_bytes, linear.embeddings_bytes) == (both.layers_bytes, 0)
    # ... which is also why a vocabulary above vLLM's limit stops only the models with embedding slots
    big_vocab = {"vocab_size": LOGITS_VOCAB_LIMIT + 1}
    assert _slots({**qwen2, **big_vocab}, Lora()) == linear.total_bytes
    with pytest.raises(NotModelled, match=r"refuses LoRA .* 258,049"):
        _slots({**LLAMA_31_8B, **big_vocab}, Lora())


@pytest.mark.parametrize(
    ("overrides", "version", "reason"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, LORA_SLOTS, "MixtralForCausalLM are not modelled"),
        ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 128}, LORA_SLOTS, "128 routed experts"),
        ({"vocab_size": None}, LORA_SLOTS, "need config.json's hidden_size, intermediate_size"),
        ({}, (0, 31, 0), r"vLLM 0\.31\.0 may differ .* PR #28545"),
    ],
)
def test_what_lora_planning_does_not_model_is_named(overrides: dict, version: tuple, reason: str) -> None:
    with pytest.raises(NotModelled, match=reason):
        _slots({**LLAMA_31_8B, **overrides}, Lora(), version=version)


def test_ranks_vllm_refuses_are_refused() -> None:
    with pytest.raises(ValueError, match="max_lora_rank 24 is not one vLLM accepts"):
        _slots(LLAMA_31_8B, Lora(1, 24))
    with pytest.raises(ValueError, match="at least 1"):
        _slots(LLAMA_31_8B, Lora(0, 16))


def test_the_budget_takes_the_slots_and_the_encoder_cache_from_the_kv_cache() -> None:
    base = MemoryBudget(80 * GiB, 0.9, 15 * GiB, GiB, GiB // 2)
    with_both = MemoryBudget(80 * GiB, 0.9, 15 * GiB, GiB, GiB // 2, lora_bytes=GiB, encoder_cache_bytes=GiB // 4)
    assert base.kv_cache_bytes - with_both.kv_cache_bytes == GiB + GiB // 4
    full = MemoryBudget(80 * GiB, 0.9, 60 * GiB, GiB, GiB, lora_bytes=11 * GiB)
    with pytest.raises(Exception, match=r"LoRA slots 11\.00 GiB .* exceed the budget"):
        full.check()


def _plan(tmp_path: Path, cfg: dict, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-config", str(tmp_path / "config.json"), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


GPU = ("--gpu-memory", "80GiB", "--weights-memory", "15GiB", "--max-model-len", "32768")


def test_plan_names_the_lora_figure_and_where_it_comes_from(tmp_path: Path) -> None:
    done = _plan(tmp_path, LLAMA_31_8B, *GPU, "--max-loras", "4", "--max-lora-rank", "64")
    assert done.returncode == 0, done.stderr
    assert "| LoRA slots               1.38 GiB" in done.stdout
    assert "LoRA: 4 adapter slots of rank 64 in bfloat16 on every linear layer and the embeddings: 1.38 GiB" in (
        done.stdout.replace("\n    ", " ")
    )
    plain = json.loads(_plan(tmp_path, LLAMA_31_8B, *GPU, "--format", "json").stdout)["memory_budget"]
    lora = json.loads(_plan(tmp_path, LLAMA_31_8B, *GPU, "--max-loras", "4", "--max-lora-rank", "64",
                            "--format", "json").stdout)  # fmt: skip
    assert plain["kv_cache_bytes"] - lora["memory_budget"]["kv_cache_bytes"] == lora["memory_budget"]["lora_bytes"]
    assert lora["inputs"]["lora"] == {"max_loras": 4, "max_rank": 64, "fully_sharded": False}
    # from vLLM's logged KV figure the slots are already taken: the plan says so and changes nothing
    logged = _plan(tmp_path, LLAMA_31_8B, "--kv-cache-memory", "40GiB", "--max-loras", "2", "--format", "json")
    doc = json.loads(logged.stdout)
    assert any("already outside the KV memory given" in n for n in doc["notes"])
    assert doc["memory_budget"]["kv_cache_bytes"] == 40 * GiB
    alone = _plan(tmp_path, LLAMA_31_8B, *GPU, "--fully-sharded-loras", "on")
    assert alone.returncode == 2 and "needs --max-loras" in alone.stderr
    # an unmodelled architecture is a named refusal, not a plan without the slots
    moe = _plan(tmp_path, {**LLAMA_31_8B, "architectures": ["MixtralForCausalLM"]}, *GPU, "--max-loras", "1")
    assert moe.returncode == 3 and "not modelled: LoRA slots of MixtralForCausalLM" in moe.stderr


def test_lora_beside_a_measured_kv_figure_plans_on_any_version(tmp_path: Path) -> None:
    """With --kv-cache-memory the adapter slots are already outside vLLM's figure: how vLLM sized them does not
    change the plan, so a version (or an architecture) whose slots are not modelled still plans, and says so. Only
    the --gpu-memory path, where the slots come out of the budget, refuses them. Options vLLM refuses are refused on
    both paths."""
    measured = ("--kv-cache-memory", "40GiB", "--max-loras", "2")
    old = _plan(tmp_path, LLAMA_31_8B, *measured, "--vllm-version", "0.25.0", "--format", "json")
    assert old.returncode == 0, old.stderr
    (note,) = [n for n in json.loads(old.stdout)["notes"] if n.startswith("LoRA")]
    assert "already outside the KV memory given" in note and "not modelled here" in note
    moe = _plan(tmp_path, {**LLAMA_31_8B, "architectures": ["MixtralForCausalLM"]}, *measured)
    assert moe.returncode == 0, moe.stderr
    budgeted = _plan(tmp_path, LLAMA_31_8B, *GPU, "--max-loras", "2", "--vllm-version", "0.25.0")
    assert budgeted.returncode == 3 and "not modelled" in budgeted.stderr
    bad_rank = _plan(tmp_path, LLAMA_31_8B, *measured, "--max-lora-rank", "48")
    assert bad_rank.returncode == 2 and "48" in bad_rank.stderr, bad_rank.stderr


def test_tp_beside_a_logged_figure_says_which_rank_to_take(tmp_path: Path) -> None:
    """vLLM sizes every rank to the smallest rank's free memory: one worker's log line can be larger."""
    tp2 = json.loads(_plan(tmp_path, LLAMA_31_8B, "--kv-cache-memory", "20GiB", "--tp", "2", "--format", "json").stdout)
    assert any(n.startswith("TP 2: vLLM sizes every rank's KV cache to the smallest") for n in tp2["notes"])
    tp1 = json.loads(_plan(tmp_path, LLAMA_31_8B, "--kv-cache-memory", "20GiB", "--format", "json").stdout)
    assert not any(n.startswith("TP ") for n in tp1["notes"])


QWEN25_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct config.json, the fields the plan reads
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
    "torch_dtype": "bfloat16", "max_position_embeddings": 128000, "vision_config": {"out_hidden_size": 3584},
}  # fmt: skip


def test_a_multimodal_model_needs_its_encoder_cache_to_plan_from_the_gpu(tmp_path: Path) -> None:
    missing = _plan(tmp_path, QWEN25_VL_7B, *GPU)
    assert missing.returncode == 2
    assert "Encoder cache will be initialized with a budget of N tokens" in missing.stderr
    old = ("--vllm-version", "0.33.0")  # the estimate-based budget: the encoder cache comes off it whole
    given = _plan(tmp_path, QWEN25_VL_7B, *GPU, *old, "--encoder-cache-tokens", "16384", "--format", "json")
    assert given.returncode == 0, given.stderr
    budget = json.loads(given.stdout)["memory_budget"]
    assert budget["encoder_cache_bytes"] == 16384 * 3584 * 2  # tokens x the decoder's hidden size x bf16
    none = json.loads(
        _plan(tmp_path, QWEN25_VL_7B, *GPU, *old, "--encoder-cache-tokens", "0", "--format", "json").stdout
    )
    assert none["memory_budget"]["kv_cache_bytes"] - budget["kv_cache_bytes"] == budget["encoder_cache_bytes"]
    # from a logged KV figure nothing is needed (given, it is named as already outside that figure); for a
    # text-only model the option is a mistake
    assert _plan(tmp_path, QWEN25_VL_7B, "--kv-cache-memory", "40GiB").returncode == 0
    logged = _plan(tmp_path, QWEN25_VL_7B, "--kv-cache-memory", "40GiB", "--encoder-cache-tokens", "16384",
                   "--format", "json")  # fmt: skip
    assert any("already outside the KV memory given" in n for n in json.loads(logged.stdout)["notes"])
    text_only = _plan(tmp_path, LLAMA_31_8B, *GPU, "--encoder-cache-tokens", "100")
    assert text_only.returncode == 2 and "no vision_config or audio_config" in text_only.stderr
    # read in vLLM 0.32's profile_run; an older release's encoder cost goes into --activation-memory instead
    old = _plan(tmp_path, QWEN25_VL_7B, *GPU, "--encoder-cache-tokens", "16384", "--vllm-version", "0.10.2")
    assert old.returncode == 3 and "measure the profile's peak into --activation-memory" in old.stderr
    zero = _plan(tmp_path, QWEN25_VL_7B, *GPU, "--encoder-cache-tokens", "0", "--vllm-version", "0.10.2")
    assert zero.returncode == 0, zero.stderr


def test_qwen3_vl_encoder_outputs_carry_the_deepstack_levels() -> None:
    cfg = {**QWEN25_VL_7B, "architectures": ["Qwen3VLForConditionalGeneration"],
           "vision_config": {"out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]}}  # fmt: skip
    g = parse_config(cfg)
    assert (g.multimodal, g.encoder_width) == ("vision_config", 4096 * 4)
    assert plan_inputs.encoder_bytes(g, 1000, budgeted=True) == 1000 * 4096 * 4 * 2
