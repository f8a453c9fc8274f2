"""Cache formats the CPU server cannot run, against vLLM 0.32's own layout code on this machine
(tests/vllm_probes/spec_layout.py): each layer's specs as its layers build them on a GPU, and the blocks, "KV cache
size" and "Maximum concurrency" vLLM derives from them, are plain Python; the plan must give the same.

* DeepSeek sparse attention (V3.2; the CPU backend refuses sparse attention): each layer's latent (as MLAAttention
  builds its spec) and its indexer's keys (vLLM's own DeepseekV32IndexerCache), for each format the latent can take.
* per-token-head quantisation (int8 / fp8 / int4_per_token_head; the CPU backend takes only auto and fp8): the
  scales the Triton backend packs beside each head's values (its own customize_spec).
* Kimi Linear (its KDA kernels need Triton): MLA layers beside KDA state layers, the state from the model class's
  own shape function, grouped by vLLM's get_kv_cache_configs.
* DeepSeek-V4 (its CPU kernels are not the GPU's layout): each layer's sliding window, compressed latents, indexer
  keys and compressor states from vLLM's own cache classes, packed into groups by get_kv_cache_configs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lab
from support.files import PROBES
from support.model_configs import DEEPSEEK_V4_FLASH, DEEPSEEK_V4_NO_INDEXER, DEEPSEEK_V4_PRO, KIMI_LINEAR

pytestmark = [pytest.mark.realvllm, pytest.mark.vllmcode]

# a DeepSeek-V3.2-shaped config, 3 layers (its MTP layer unused without speculation); index_head_dim 128 as V3.2's
CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": 3,
    "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": 128,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "index_head_dim": 128, "index_n_heads": 4,
    "index_topk": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "vocab_size": 1000,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rope_theta": 10000, "num_nextn_predict_layers": 1,
}  # fmt: skip
KV_MEMORY, BLOCK, MAX_MODEL_LEN = 16 * 2**20, 64, 2048  # a block of 64: the indexer kernel's only size on CUDA
KIMI_MEMORY = 2**30  # Kimi Linear's 1,920-token blocks of 2.1 MiB in groups of 7: a pool of 69
# DeepSeek-V4: (config, cache dtype, KV memory, max_model_len, max_num_batched_tokens) as a GPU serves them
V4 = {"flash": DEEPSEEK_V4_FLASH, "pro": DEEPSEEK_V4_PRO, "no-indexer": DEEPSEEK_V4_NO_INDEXER}
V4_CASES = (
    ("flash", "auto", 20 * 2**30, 131072, 2048),
    ("flash", "bfloat16", 20 * 2**30, 131072, 8192),
    ("flash", "fp8_ds_mla", 6 * 2**30, 1048576, 2048),
    ("pro", "auto", 30 * 2**30, 65536, 8192),
    ("no-indexer", "auto", 2**30, 32768, 2048),
)


SPARSE = ("auto", "fp8_ds_mla", "fp8")
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The models' config.json: the V3.2-shaped and Kimi Linear ones written here, the tiny Llama (2 KV heads x 32)
    built."""
    sparse = tmp_path_factory.mktemp("deepseek-v32") / "config.json"
    sparse.write_text(json.dumps(CONFIG))
    kimi = tmp_path_factory.mktemp("kimi-linear") / "config.json"
    kimi.write_text(json.dumps(KIMI_LINEAR))
    found = {"sparse": sparse, "llama": lab.install() / "tiny-llama" / "config.json", "kimi": kimi}
    for name, config in V4.items():
        found[name] = tmp_path_factory.mktemp(f"deepseek-v4-{name}") / "config.json"
        found[name].write_text(json.dumps(config))
    return found


@pytest.fixture(scope="module")
def vllm_layouts(configs: dict[str, Path]) -> dict[tuple[str, str], dict]:
    """vLLM's own layout of every case, from one run of its code: importing vLLM is most of the time."""
    cases = [("sparse", d, BLOCK) for d in SPARSE] + [("llama", d, 16) for d in PER_TOKEN_HEAD]
    asked = [{"config_path": str(configs[m]), "cache_dtype": d, "kv_memory": KV_MEMORY, "block_size": b,
              "max_model_len": MAX_MODEL_LEN} for m, d, b in cases]  # fmt: skip
    # Kimi Linear's engine config from the tiny Llama's (the CPU platform will not make one of an MLA hybrid)
    kimi = {"config_path": str(configs["kimi"]), "cache_dtype": "auto", "kv_memory": KIMI_MEMORY, "block_size": 16}
    asked.append({**kimi, "max_model_len": MAX_MODEL_LEN, "engine_config_path": str(configs["llama"])})
    v4 = [{"config_path": str(configs[m]), "cache_dtype": d, "kv_memory": kv, "block_size": 256, "max_model_len": mml,
           "max_num_batched_tokens": batch} for m, d, kv, mml, batch in V4_CASES]  # fmt: skip
    found = lab.run_cases(PROBES / "spec_layout.py", asked + v4)
    keys = [*((m, d) for m, d, _ in cases), ("kimi", "auto"), *((m, d) for m, d, *_ in V4_CASES)]
    return dict(zip(keys, found, strict=True))


def plan_against_vllm(config: Path, vllm: dict, *args: str) -> dict:
    """The plan of ``config`` for vLLM 0.32.0 with ``args``: its blocks, tokens and concurrency checked against
    vLLM's layout ``vllm``; its JSON."""
    plan = subprocess.run(
        [sys.executable, "-m", "vllm_capacity", "plan", "--model-config", str(config), "--format", "json",
         "--vllm-version", "0.32.0", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    print(f"\n{config.parent.name} {args}: vLLM {vllm}; plan {doc['num_gpu_blocks']} blocks, {doc['kv_cache_tokens']}")
    assert (doc["num_gpu_blocks"], doc["kv_cache_tokens"]) == (vllm["num_blocks"], vllm["tokens"])
    assert doc["max_concurrency"] == pytest.approx(vllm["max_concurrency"], rel=1e-12)
    return doc


def one_group(config: Path, dtype: str, block: int, vllm: dict) -> dict:
    """:func:`plan_against_vllm` for KV_MEMORY and MAX_MODEL_LEN under ``dtype``, of a layout of one group."""
    assert vllm["groups"] == 1
    sizes = ("--kv-cache-memory", str(KV_MEMORY), "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(block))
    return plan_against_vllm(config, vllm, *sizes, "--kv-cache-dtype", dtype)


@pytest.mark.parametrize("dtype", SPARSE)
def test_plan_gives_vllms_sparse_attention_layout(dtype: str, configs: dict, vllm_layouts: dict) -> None:
    vllm = vllm_layouts[("sparse", dtype)]
    doc = one_group(configs["sparse"], dtype, BLOCK, vllm)
    assert doc["kv_bytes_per_token"] * BLOCK == vllm["page_bytes"]  # one group's page: every latent and indexer
    assert any("indexer" in n for n in doc["notes"])


@pytest.mark.parametrize("dtype", PER_TOKEN_HEAD)
def test_plan_gives_vllms_per_token_head_layout(dtype: str, configs: dict, vllm_layouts: dict) -> None:
    vllm = vllm_layouts[("llama", dtype)]
    doc = one_group(configs["llama"], dtype, 16, vllm)
    assert doc["kv_bytes_per_token"] * 16 == vllm["page_bytes"] * doc["kv_layers_per_rank"]  # a layer's page each
    assert any("float32 scale" in n for n in doc["notes"])


def test_plan_gives_vllms_kimi_linear_layout(configs: dict, vllm_layouts: dict) -> None:
    """MLA beside KDA: the plan's blocks, tokens, concurrency, groups and page are vLLM's own."""
    vllm = vllm_layouts[("kimi", "auto")]
    sizes = ("--kv-cache-memory", str(KIMI_MEMORY), "--max-model-len", str(MAX_MODEL_LEN))
    doc = plan_against_vllm(configs["kimi"], vllm, *sizes)
    assert (len(doc["groups"]), doc["page_bytes"]) == (vllm["groups"], vllm["page_bytes"])


@pytest.mark.parametrize(("model", "dtype", "memory", "max_model_len", "batch"), V4_CASES)
def test_plan_gives_vllms_deepseek_v4_layout(
    model: str, dtype: str, memory: int, max_model_len: int, batch: int, configs: dict, vllm_layouts: dict
) -> None:
    """DeepSeek-V4's packed groups: the plan's blocks, tokens, concurrency, group count and block bytes are vLLM's."""
    vllm = vllm_layouts[(model, dtype)]
    sizes = ("--kv-cache-memory", str(memory), "--max-model-len", str(max_model_len))
    asked = ("--kv-cache-dtype", dtype, "--max-num-batched-tokens", str(batch), "--async-scheduling", "off")
    doc = plan_against_vllm(configs[model], vllm, *sizes, *asked)
    assert (len(doc["groups"]), doc["page_bytes"]) == (vllm["groups"], vllm["block_bytes"])
