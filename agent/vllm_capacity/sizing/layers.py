"""What one layer costs in vLLM's KV cache, and how many blocks a request holds in it, per layer kind.

The layer-kind specs follow vLLM's ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``, ``SlidingWindowSpec``,
``MambaSpec``): each knows the blocks one request holds in a layer of its kind, at ``max_model_len`` and at a shorter
context. In vLLM's hybrid layout every kind shares one page size (the state page is padded to the attention page),
so the page is the planner's, not the spec's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllm_capacity.geometry import Geometry

KV_DTYPE_BYTES = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
}  # fmt: skip


# DeepSeek sparse attention's packed latent formats, bytes per token and layer (vLLM 0.32
# ``MLAAttention.get_kv_cache_spec`` ``state_content_bytes``; fp8_ds_mla: 512 fp8 values, 4 float32 scales, 64 bf16
# RoPE values, flashmla_sparse.py)
PACKED_LATENT_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


# Per-token-head quantisation (vLLM 0.32, the Triton attention backend alone takes it): each head's K and V rows of
# one-byte values (int4: two to a byte; here: values per byte), each row followed by its float32 scale
# (``TritonAttentionBackend.customize_spec``)
PER_TOKEN_HEAD = {"int8_per_token_head": 1, "fp8_per_token_head": 1, "int4_per_token_head": 2}
ROW_SCALE_BYTES = 4


def packed_rows(geometry: Geometry, kv_cache_dtype: str) -> Geometry:
    """A cache format whose rows are not whole values of one dtype, as rows of bytes (of one byte each, which
    :func:`kv_dtype_bytes` gives those formats): a sparse-attention model's packed latent, as wide as its bytes; a
    per-token-head format's K or V row of a head, its values and their scale. The geometry as it is under any other
    dtype; ValueError for a format the model's layers cannot take."""
    name = kv_cache_dtype.lower()
    if name in PER_TOKEN_HEAD:
        if "mla" in geometry.layer_kinds:
            raise ValueError(
                f"--kv-cache-dtype {kv_cache_dtype}: vLLM's MLA backends do not take per-token-head scales"
            )
        per_byte = PER_TOKEN_HEAD[name]

        def row(head_dim: int) -> int:
            return head_dim // per_byte + ROW_SCALE_BYTES

        full = (geometry.full_shape[0], row(geometry.full_shape[1])) if geometry.full_shape else None
        return replace(geometry, head_dim=row(geometry.head_dim), full_shape=full)
    blob = PACKED_LATENT_BYTES.get(name)
    if blob is None:
        return geometry
    if geometry.indexer_bytes is None:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is the packed latent of DeepSeek sparse attention's backends; "
            f"{geometry.architecture} is not a sparse-attention (index_topk) MLA model"
        )
    return replace(geometry, head_dim=blob)


def sparse_latent_assumption(geometry: Geometry, kv_cache_dtype: str) -> str | None:
    """What a plan of a sparse-attention model assumes of its latent's format, which vLLM 0.32 leaves to the attention
    backend of the GPU (``_canonicalize_sparse_mla_kv_cache_dtype``): None where the dtype settles it (a packed
    format, or a 16-bit dtype named outright)."""
    name = kv_cache_dtype.lower()
    if geometry.indexer_bytes is None or name in PACKED_LATENT_BYTES:
        return None
    if name == "auto":
        return (
            "assumed: a GPU other than an SM120 one (RTX PRO 6000, RTX 50xx), whose sparse backend stores auto as "
            "fp8_ds_mla (656 B); there, pass --kv-cache-dtype fp8_ds_mla"
        )
    if name.startswith("fp8"):
        return (
            f"assumed: a plain {name} latent (576 B, as FlashInfer's sparse MLA keeps it); FLASHMLA_SPARSE and SM120 "
            "GPUs store fp8_ds_mla (656 B): pass --kv-cache-dtype fp8_ds_mla when vLLM logs 'Using fp8_ds_mla KV "
            "cache format'"
        )
    return None


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str | None) -> int:
    """``auto`` follows the model's dtype; fp8 variants and int8 are one byte (and the formats whose rows
    :func:`packed_rows` gives in bytes)."""
    name = kv_cache_dtype.lower()
    if name in PACKED_LATENT_BYTES or name in PER_TOKEN_HEAD:
        return 1
    if name == "auto":
        if model_dtype is None:
            raise ValueError("--kv-cache-dtype auto needs the model's dtype, and config.json has no torch_dtype")
        name = str(model_dtype).lower().removeprefix("torch.")
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {name!r} (known: auto, {', '.join(KV_DTYPE_BYTES)})")
    return KV_DTYPE_BYTES[name]


def layers_per_rank(kv_layers: int, pp: int) -> int:
    """KV layers on the fullest pipeline stage (every rank is sized to the smallest block count)."""
    return math.ceil(kv_layers / pp)


def bytes_per_token_per_layer(geometry: Geometry, tp: int, dtype_bytes: int) -> int:
    if "mla" in geometry.layer_kinds:  # one latent vector, no separate V; and a sparse model's indexer keys
        return geometry.head_dim * dtype_bytes + (geometry.indexer_bytes or 0)
    return 2 * max(1, geometry.num_kv_heads // tp) * geometry.head_dim * dtype_bytes


STATE_KINDS = ("mamba", "linear")  # layers holding one state per request (Mamba-2, Gated DeltaNet), not KV per token


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention: a request holds a block for every ``block_size`` tokens of its context."""

    block_size: int
    max_model_len: int
    lookahead: int = 0  # slots reserved for speculative drafts (vLLM's num_lookahead_tokens), up to max_model_len
    kind = "full"

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def blocks_at(self, context_tokens: int) -> int:
        return min(self.blocks_per_request, math.ceil((context_tokens + self.lookahead) / self.block_size))


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention: a request holds its window, plus the tokens scheduled but not yet settled
    (0.32 ``VllmConfig.max_in_flight_tokens``), and one block more for a window that straddles two blocks."""

    block_size: int
    max_model_len: int
    window: int
    in_flight_tokens: int
    lookahead: int = 0  # slots reserved for speculative drafts
    retained: int = 0  # tokens kept below the window for a multi-layer MTP drafter (0.32 ``extra_retained_tokens``)
    kind = "sliding"

    @property
    def blocks_per_request(self) -> int:
        kept = min(self.window - 1 + self.retained + self.in_flight_tokens, self.max_model_len)
        return math.ceil(kept / self.block_size) + 1

    def blocks_at(self, context_tokens: int) -> int:
        return min(self.blocks_per_request, math.ceil((context_tokens + self.lookahead) / self.block_size) + 1)


@dataclass(frozen=True)
class ChunkedLocalSpec:
    """Chunked local attention (Llama 4): a request holds its current chunk and the in-flight tokens, never more than
    ``max_model_len`` (0.32 ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request``; no straddling block: a
    chunk starts on a block boundary)."""

    block_size: int
    max_model_len: int
    chunk: int
    in_flight_tokens: int
    lookahead: int = 0
    kind = "chunked"

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(min(self.chunk + self.in_flight_tokens, self.max_model_len) / self.block_size)

    def blocks_at(self, context_tokens: int) -> int:
        return min(self.blocks_per_request, math.ceil((context_tokens + self.lookahead) / self.block_size))


@dataclass(frozen=True)
class StateSpec:
    """Mamba-2 or Gated DeltaNet (vLLM's ``MambaSpec``): a fixed number of state blocks per request, whatever its
    context (1, or 2-3 in the 'align' mode prefix caching uses; one more per speculative token)."""

    kind: str  # "mamba" or "linear"
    blocks: int

    @property
    def blocks_per_request(self) -> int:
        return self.blocks

    def blocks_at(self, context_tokens: int) -> int:
        return self.blocks


LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec | StateSpec
