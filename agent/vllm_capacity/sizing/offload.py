"""The CPU tier of vLLM's KV cache: V1's native KV offloading (``--kv-offloading-size``) and V0's swap space.

After vLLM 0.32's ``vllm/v1/kv_offload/cpu/spec.py`` (``CPUOffloadingSpec``) and
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``: the offloading buffer of
``kv_offloading_size`` GiB (the total over the TP ranks) holds chunks of ``blocks_per_chunk`` GPU blocks (1 unless the
connector's extra config says otherwise); a chunk takes every worker's bytes of those blocks (``world_size`` copies:
each worker's ``total_gpu_kv_bytes // num_blocks``), rounded up to the host page (``mmap.PAGESIZE``, 4 KiB on x86-64
Linux); ``num_chunks = int(bytes) // aligned chunk``. The tier holds ``num_chunks x blocks_per_chunk x block_size``
tokens. An MLA model's latent is the same on every TP rank, and where TP is the only parallelism, on one node with
vLLM's multiprocessing executor (the default there), the tier keeps one copy of it instead of one per rank
(``build_offloading_config``'s ``replicated_layout``). V0's swap space is the ``num_cpu_blocks`` vLLM reports, each
of ``block_size`` tokens.
"""

from __future__ import annotations

import math

from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.versions import dotted

HOST_PAGE_BYTES = 4096  # mmap.PAGESIZE on x86-64 Linux: SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
OFFLOAD_RULES = (0, 32, 0)  # the release whose CPU-tier sizing was read; the plan refuses --kv-offloading-size before


def latent_shared_by_ranks(*, mla: bool, tp: int, pp: int) -> bool:
    """Whether vLLM 0.32 may keep one host copy for all ranks: an MLA model under TP alone (``replicated_layout``,
    which also asks for one node and the multiprocessing executor, things a plan or a scrape cannot see)."""
    return mla and tp > 1 and pp == 1


def cpu_tier_tokens(
    *,
    offloading_bytes: int,
    worker_bytes_per_block: int,
    world_size: int,
    block_size: int,
    version: tuple[int, int, int],
    blocks_per_chunk: int = 1,
    copies: int | None = None,
) -> int:
    """Tokens the CPU tier of ``offloading_bytes`` holds (0.32's native CPU offloading): a chunk holds ``copies`` of
    a rank's blocks (``world_size`` unless the ranks share one, see :func:`latent_shared_by_ranks`)."""
    if version < OFFLOAD_RULES:
        raise NotModelled(
            f"the CPU tier of KV offloading is planned as vLLM {dotted(OFFLOAD_RULES)} sizes it; "
            "earlier releases were not read"
        )
    copies = world_size if copies is None else copies
    if min(worker_bytes_per_block, copies, block_size, blocks_per_chunk) < 1 or offloading_bytes < 0:
        raise ValueError("the CPU tier needs positive block bytes, copies, block size and chunk")
    chunk = worker_bytes_per_block * copies * blocks_per_chunk
    aligned = math.ceil(chunk / HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    return offloading_bytes // aligned * blocks_per_chunk * block_size
