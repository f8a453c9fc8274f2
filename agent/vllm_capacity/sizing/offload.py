"""The CPU tier of vLLM's KV cache: V1's native KV offloading (``--kv-offloading-size``) and V0's swap space.

After vLLM 0.32's ``vllm/v1/kv_offload/cpu/spec.py`` (``CPUOffloadingSpec``) and
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``: the offloading buffer of
``kv_offloading_size`` GiB (the total over the TP ranks) holds chunks of ``blocks_per_chunk`` GPU blocks (1 unless the
connector's extra config says otherwise); a chunk takes every worker's bytes of those blocks (``world_size`` copies:
each worker's ``total_gpu_kv_bytes // num_blocks``), rounded up to the host page (``mmap.PAGESIZE``, 4 KiB on x86-64
Linux); ``num_chunks = int(bytes) // aligned chunk``. The tier holds ``num_chunks x blocks_per_chunk x block_size``
tokens. V0's swap space is the ``num_cpu_blocks`` vLLM reports, each of ``block_size`` tokens.
"""

from __future__ import annotations

import math

from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.versions import dotted

HOST_PAGE_BYTES = 4096  # mmap.PAGESIZE on x86-64 Linux: SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
OFFLOAD_RULES = (0, 32, 0)  # the release whose CPU-tier sizing was read; the plan refuses --kv-offloading-size before


def cpu_tier_tokens(
    *,
    offloading_bytes: int,
    worker_bytes_per_block: int,
    world_size: int,
    block_size: int,
    version: tuple[int, int, int],
    blocks_per_chunk: int = 1,
) -> int:
    """Tokens the CPU tier of ``offloading_bytes`` holds (0.32's native CPU offloading)."""
    if version < OFFLOAD_RULES:
        raise NotModelled(
            f"the CPU tier of KV offloading is planned as vLLM {dotted(OFFLOAD_RULES)} sizes it; "
            "earlier releases were not read"
        )
    if min(worker_bytes_per_block, world_size, block_size, blocks_per_chunk) < 1 or offloading_bytes < 0:
        raise ValueError("the CPU tier needs positive block bytes, world size, block size and chunk")
    chunk = worker_bytes_per_block * world_size * blocks_per_chunk
    aligned = math.ceil(chunk / HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    return offloading_bytes // aligned * blocks_per_chunk * block_size
