"""DeepSeek-V4's KV cache as vLLM 0.32 lays it out: each layer's caches (``models/deepseek_v4``) packed into groups
of one pool (``_get_packed_kv_cache_groups`` in ``v1/core/kv_cache_utils.py``).

Every layer keeps a sliding window of latents (``DeepseekV4SWACache``: 64-token blocks). A layer of compress ratio r
(4 or 128) also keeps one latent per r tokens (``DeepseekV4Attention.get_kv_cache_spec``: 256-token blocks, 256 / r
latents a page) and its compressor's float32 state (``CompressorStateCache``: a window of (1 + (r == 4)) x r tokens in
blocks of 4 or 8, 2 x (1 + (r == 4)) x head_dim values a token); a ratio-4 layer also keeps its indexer's keys
(``DeepseekV4IndexerCache``: index_head_dim fp8 values and a float32 scale per 128, one per 4 tokens) and the
indexer's own compressor state. A latent is 584 packed bytes in the fp8_ds_mla format vLLM's default backends store
(FlashMLA; FlashInfer on SM120), or head_dim values of the KV dtype in plain rows (the FlashInfer backend); a page
is rounded up to 576 bytes in fp8_ds_mla, else to 512.

The backends need a block-outermost layout (the indexer backend's ``supported_kv_cache_layouts``), so the groups are
packed: the caches are bucketed by kind (block size and window); a bucket with as many caches of each of its page
sizes ("balanced") is cut into groups of ``repeats`` of them, the repeats chosen by ``_approximate_gcd`` to pad
least and at least the largest mixed bucket's; other buckets stay whole, and with no mixed bucket a sliding one is
cut into groups no wider than the widest group's page. One block of the pool is the widest group's page; a request
holds, in each group, what its caches need at max_model_len.
"""

from __future__ import annotations

import math
from collections import Counter

from vllm_capacity.geometry import Geometry, indexer_key_bytes
from vllm_capacity.sizing.errors import ImpossiblePlan, NotModelled
from vllm_capacity.sizing.hybrid import in_flight_tokens
from vllm_capacity.sizing.inputs import PlanInputs
from vllm_capacity.sizing.layers import FullAttentionSpec, LayerSpec, SlidingWindowSpec
from vllm_capacity.sizing.result import KvGroup, KvPlan
from vllm_capacity.sizing.versions import DEEPSEEK_V4, dotted
from vllm_capacity.units import GiB, MiB

MLA_BLOCK = 256  # the sparse MLA and indexer backends' one kernel block size (``get_supported_kernel_block_sizes``)
WINDOW_BLOCK = 64  # DeepseekV4SWACache's block_size
STATE_BLOCK = {4: 4, 128: 8}  # CompressorStateCache's block_size by ratio
PACKED = {"auto", "fp8", "fp8_e4m3", "fp8_ds_mla"}  # stored as fp8_ds_mla by the default backends
PLAIN = {"bfloat16", "float16"}  # plain bfloat16 rows: FlashInfer's DeepSeek-V4 backend, the one that takes them
PACKED_LATENT, PACKED_ALIGN, PLAIN_ALIGN = 584, 576, 512

Bucket = tuple[str, int, int]  # vLLM's uniform type: kind ("full" or "sliding"), block size, window


def plan_compressed(geometry: Geometry, inputs: PlanInputs) -> KvPlan:
    """vLLM's blocks, tokens and maximum concurrency for DeepSeek-V4."""
    _refuse_unread(geometry, inputs)
    packed = _packed_latents(inputs)
    caches = layer_caches(geometry, packed)
    groups = packed_groups(caches)
    block = max(page for _, _, page in groups)
    blocks = inputs.kv_cache_memory_bytes // block
    in_flight = in_flight_tokens(inputs)
    specs = [(layers, _spec(bucket, inputs, in_flight)) for bucket, layers, _ in groups]
    per_request = sum(spec.blocks_per_request for _, spec in specs)
    concurrency = blocks / per_request
    if concurrency < 1:
        raise ImpossiblePlan(
            f"one request of max_model_len {inputs.max_model_len:,} tokens needs {per_request:,} blocks of "
            f"{block / MiB:.2f} MiB ({per_request * block / GiB:.2f} GiB) per GPU, more than the "
            f"{inputs.kv_cache_memory_bytes / GiB:.2f} GiB available; vLLM would refuse to start"
        )
    growing = sum(1 for bucket, _, _ in groups if bucket[0] == "full")
    return KvPlan(
        kv_bytes_per_token=math.ceil(growing * block / MLA_BLOCK),
        kv_layers_per_rank=geometry.num_layers,
        block_size=MLA_BLOCK,
        num_gpu_blocks=blocks,
        kv_cache_tokens=int(concurrency * inputs.max_model_len),
        max_concurrency=concurrency,
        max_model_len=inputs.max_model_len,
        kv_cache_memory_bytes=inputs.kv_cache_memory_bytes,
        rules=(
            f"v1 >= {dotted(DEEPSEEK_V4)} DeepSeek-V4 packed groups: blocks / {per_request} blocks per request; "
            "tokens int(max_concurrency x max_model_len)"
        ),
        notes=_notes(geometry, inputs, packed, groups, block, in_flight),
        groups=tuple(KvGroup(layers, spec) for layers, spec in specs),
        group_size=1,
        page_bytes=block,
    )


def _refuse_unread(geometry: Geometry, inputs: PlanInputs) -> None:
    """Refuse what vLLM 0.32 was not read doing with DeepSeek-V4 (NotModelled)."""
    refused = None
    if inputs.resolved_engine_version != "v1" or inputs.version < DEEPSEEK_V4:
        refused = f"is planned as vLLM {dotted(DEEPSEEK_V4)} (V1) lays it out; earlier releases were not read"
    elif inputs.pp > 1:
        refused = "under pipeline parallelism: how the stages split its layers' caches is not modelled; use PP 1"
    elif inputs.speculation is not None:
        refused = "with a drafter (its MTP layers, or DSpark's): the drafter's caches are not modelled"
    elif inputs.kv_offloading_bytes:
        refused = "with KV offloading (--kv-offloading-size): its CPU tier of packed groups is not modelled"
    if refused:
        raise NotModelled(f"{geometry.architecture}: DeepSeek-V4's compressed attention {refused}")


def _packed_latents(inputs: PlanInputs) -> bool:
    """Whether the latents are packed fp8_ds_mla (else plain rows); a dtype the backends do not store is invalid."""
    name = inputs.kv_cache_dtype.lower()
    if name not in PACKED and name not in PLAIN:
        raise ValueError(
            f"--kv-cache-dtype {inputs.kv_cache_dtype}: DeepSeek-V4's backends store auto, fp8 or fp8_ds_mla "
            "(fp8_ds_mla) or bfloat16 (plain rows)"
        )
    return name in PACKED


def layer_caches(geometry: Geometry, packed: bool) -> list[tuple[Bucket, int]]:
    """Each layer's caches (its bucket and page bytes), in the order vLLM registers them: the indexer's keys and
    compressor state, the sliding window, the compressed latents, their compressor state."""
    assert geometry.compressed is not None
    head, window = geometry.head_dim, geometry.sliding_window or 0
    content = PACKED_LATENT if packed else head * 2
    align = PACKED_ALIGN if packed else PLAIN_ALIGN
    index_head = geometry.compressed.index_head_dim
    index_bytes = indexer_key_bytes(index_head)

    def page(states: int, state_bytes: int) -> int:
        return math.ceil(states * state_bytes / align) * align

    def state(ratio: int, width: int) -> tuple[Bucket, int]:
        overlap = 1 + (ratio == 4)
        block = STATE_BLOCK[ratio]
        return ("sliding", block, overlap * ratio), page(block, 2 * overlap * width * 4)

    caches = []
    for ratio in geometry.compressed.ratios:
        if ratio == 4:
            caches += [(("full", MLA_BLOCK, 0), page(MLA_BLOCK // ratio, index_bytes)), state(ratio, index_head)]
        caches.append((("sliding", WINDOW_BLOCK, window), page(WINDOW_BLOCK, content)))
        if ratio > 1:
            caches += [(("full", MLA_BLOCK, 0), page(MLA_BLOCK // ratio, content)), state(ratio, head)]
    return caches


def packed_groups(caches: list[tuple[Bucket, int]]) -> list[tuple[Bucket, int, int]]:
    """vLLM's packed groups of ``caches`` (``_get_packed_kv_cache_groups``): each group's bucket, caches and page."""
    buckets: dict[Bucket, Counter[int]] = {}
    for bucket, page in caches:
        buckets.setdefault(bucket, Counter())[page] += 1
    balanced = {b: len(set(pages.values())) == 1 for b, pages in buckets.items()}
    widest = {b: max(pages.values()) for b, pages in buckets.items()}  # get_max_layers_per_page_size
    floor = max((widest[b] for b in buckets if balanced[b] and len(buckets[b]) > 1), default=0)
    repeats = approximate_gcd([widest[b] for b in buckets if balanced[b]], floor) if floor else None

    def cut(b: Bucket) -> int:
        return math.ceil(widest[b] / repeats) if balanced[b] and repeats else 1

    def alone(b: Bucket) -> bool:  # a state bucket: may go down to one cache a group
        return repeats is None and b[0] == "sliding"

    def group_bytes(b: Bucket, n: int) -> int:
        return sum(math.ceil(count / n) * page for page, count in buckets[b].items())

    anchor = max(group_bytes(b, sum(buckets[b].values()) if alone(b) else cut(b)) for b in buckets)
    groups = []
    for b, pages in buckets.items():
        n = cut(b)
        if alone(b):
            n = max(n, math.ceil(sum(pages.values()) / max(anchor // next(iter(pages)), 1)))
        if n == 1:
            groups.append((b, sum(pages.values()), sum(p * c for p, c in pages.items())))
            continue
        pattern = min(pages.values())  # repeats of one cache of each page size
        for i in range(n):
            k = len(range(i, pattern, n))
            groups.append((b, k * len(pages), k * sum(pages)))
    return groups


def approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's ``_approximate_gcd``: the chunk from ``lower_bound`` to the largest value that pads the values least
    when each is rounded up to a multiple of it, the larger on a tie."""
    best, best_pad = lower_bound, None
    for d in range(lower_bound, max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _spec(bucket: Bucket, inputs: PlanInputs, in_flight: int) -> LayerSpec:
    kind, block, window = bucket
    if kind == "full":
        return FullAttentionSpec(block, inputs.max_model_len)
    return SlidingWindowSpec(block, inputs.max_model_len, window, in_flight)


def _notes(
    geometry: Geometry,
    inputs: PlanInputs,
    packed: bool,
    groups: list[tuple[Bucket, int, int]],
    block: int,
    in_flight: int,
) -> list[str]:
    assert geometry.compressed is not None
    ratios = Counter(geometry.compressed.ratios)
    name = inputs.kv_cache_dtype.lower()
    notes = [
        f"DeepSeek-V4: every layer keeps a sliding window of {geometry.sliding_window} latents; "
        f"{ratios[4]} layer(s) of compress ratio 4 one latent per 4 tokens, an indexer's keys and two compressor "
        f"states; {ratios[128]} of ratio 128 one latent per 128 tokens and a compressor state",
        f"{len(groups)} KV-cache groups packed into blocks of {block:,} bytes (the widest group's page; vLLM's "
        f"block-outermost layout), {MLA_BLOCK} tokens of the compressed latents a block",
        f"sliding windows and compressor states hold at most window - 1 + {in_flight:,} in-flight tokens per request "
        f"(max_num_batched_tokens {inputs.max_num_batched_tokens:,}"
        + (" x 2 batches under async scheduling)" if in_flight != inputs.max_num_batched_tokens else ")"),
    ]
    if packed and name != "fp8_ds_mla":
        notes.append(
            f"assumed: {name} stored as fp8_ds_mla, {PACKED_LATENT} B a latent, as vLLM's default DeepSeek-V4 backends "
            "(FlashMLA; FlashInfer on SM120) store it; FlashInfer's (FLASHINFER_MLA_SPARSE_DSV4) keeps plain rows"
        )
    if not packed:
        notes.append(
            f"{name}: plain rows of {geometry.head_dim} values a latent, as only FlashInfer's DeepSeek-V4 backend "
            "(--attention-backend FLASHINFER_MLA_SPARSE_DSV4) stores them; the default backends refuse it"
        )
    if inputs.block_size != MLA_BLOCK:
        notes.append(f"block size {MLA_BLOCK}: the only one DeepSeek-V4's sparse MLA and indexer kernels take")
    return notes
