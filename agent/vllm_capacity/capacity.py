"""vLLM's KV-cache sizing rules, per version: from geometry and memory to blocks, tokens and max concurrency.

Pure functions over plain data (``../shared/reference/vllm-kv-sizing.md``):

* bytes per token per GPU rank, per KV layer: ``2 x max(1, kv_heads // tp) x head_dim x kv_dtype_bytes``
  (MLA: ``1 x latent x kv_dtype_bytes``); pipeline parallelism splits the layers over stages.
* blocks: V0 ``int(kv_memory // (block_size x bytes_per_token))``; V1 ``int(kv_memory // page // layers)``.
* "KV cache size" tokens: ``blocks x block_size`` (V1 0.8 - 0.19); ``int(max_concurrency x max_model_len)`` (>= 0.20).
* "Maximum concurrency": V0 and V1 <= 0.9.0 ``blocks x block_size / max_model_len``; V1 >= 0.9.1
  ``blocks / ceil(max_model_len / block_size)``.

Only vLLM's single-group case (every KV layer full attention, or every layer MLA) is modelled. Sliding-window,
hybrid Mamba / linear-attention and shared-KV models raise :class:`NotModelled` with the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from vllm_capacity.sources.model_config import Geometry

NEWEST_RULES = (0, 33)
KV_DTYPE_BYTES = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
}  # fmt: skip


class NotModelled(ValueError):
    """vLLM sizes this model with rules the planner does not implement (yet); the message says which."""


class ImpossiblePlan(ValueError):
    """The plan cannot run: the message gives the numbers."""


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a vLLM version such as 0.10.2")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str | None) -> int:
    """``auto`` follows the model's dtype; fp8 variants and int8 are one byte."""
    name = kv_cache_dtype.lower()
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
    if "mla" in geometry.layer_kinds:
        return geometry.head_dim * dtype_bytes  # one latent vector, no separate V
    return 2 * max(1, geometry.num_kv_heads // tp) * geometry.head_dim * dtype_bytes


def observed_bytes_per_token(kv_cache_memory_bytes: float, kv_cache_tokens: int) -> float:
    """What vLLM's two startup figures imply: 'Available KV cache memory' / 'KV cache size' tokens (per rank)."""
    return kv_cache_memory_bytes / kv_cache_tokens


@dataclass(frozen=True)
class KvPlan:
    kv_bytes_per_token: int  # per GPU rank
    kv_layers_per_rank: int
    block_size: int
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    kv_cache_memory_bytes: int  # per GPU rank
    rules: str
    notes: list[str] = field(default_factory=list)

    def concurrency_at(self, context_tokens: int) -> float:
        return self.kv_cache_tokens / context_tokens


def plan_kv(
    geometry: Geometry,
    *,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    tp: int = 1,
    pp: int = 1,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    version: tuple[int, int, int] = (*NEWEST_RULES, 0),
    engine: str | None = None,
) -> KvPlan:
    """Size the KV cache as vLLM ``version`` does for a per-rank budget of ``kv_cache_memory_bytes``."""
    if not geometry.uniform:
        kinds = sorted(set(geometry.layer_kinds) - {"none"})
        raise NotModelled(
            f"{geometry.architecture} mixes layer kinds {kinds}: vLLM sizes it with hybrid KV-cache groups "
            "(sliding-window / Mamba / linear-attention / shared-KV), which the planner does not model yet; "
            "use vLLM's startup log for this model"
        )
    if tp < 1 or pp < 1 or block_size < 1 or max_model_len < 1:
        raise ValueError("tp, pp, block_size and max_model_len must be positive")
    # V0 is the default engine before 0.8 (V1 was opt-in); from 0.8 V1 is, with V0 as a fallback until 0.10.
    engine = engine or ("v0" if version < (0, 8, 0) else "v1")
    if engine not in ("v0", "v1"):
        raise ValueError(f"engine {engine!r} is not v0 or v1")
    dtype_bytes = kv_dtype_bytes(kv_cache_dtype, geometry.dtype)
    per_layer = bytes_per_token_per_layer(geometry, tp, dtype_bytes)
    layers = layers_per_rank(geometry.kv_layers, pp)
    bytes_per_token = per_layer * layers
    page = per_layer * block_size
    if kv_cache_memory_bytes <= 0:
        raise ImpossiblePlan(f"no memory is left for the KV cache ({kv_cache_memory_bytes / 2**30:.2f} GiB)")
    if engine == "v0":
        blocks = int(kv_cache_memory_bytes // (page * layers))
    else:
        blocks = int(kv_cache_memory_bytes // page // layers)
    blocks_per_request = math.ceil(max_model_len / block_size)
    if engine == "v0" or version < (0, 9, 1):
        concurrency = blocks * block_size / max_model_len
        rules = f"{engine} <= 0.9.0: blocks x block_size / max_model_len"
    else:
        concurrency = blocks / blocks_per_request
        rules = "v1 >= 0.9.1: blocks / ceil(max_model_len / block_size)"
    tokens = int(concurrency * max_model_len) if engine == "v1" and version >= (0, 20, 0) else blocks * block_size
    if blocks < blocks_per_request:
        needed = blocks_per_request * page * layers
        raise ImpossiblePlan(
            f"one request of max_model_len {max_model_len:,} tokens needs {needed / 2**30:.2f} GiB of KV cache per "
            f"GPU, more than the {kv_cache_memory_bytes / 2**30:.2f} GiB available; vLLM would refuse to start. "
            f"Estimated maximum model length: {blocks * block_size:,}"
        )
    return KvPlan(
        kv_bytes_per_token=bytes_per_token,
        kv_layers_per_rank=layers,
        block_size=block_size,
        num_gpu_blocks=blocks,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        rules=rules,
    )


@dataclass(frozen=True)
class MemoryBudget:
    """Per GPU rank: total x gpu_memory_utilization = weights + activation peak + CUDA graphs + KV cache."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget_bytes - self.weights_bytes - self.activation_bytes - self.cuda_graph_bytes

    def check(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ImpossiblePlan(f"gpu_memory_utilization {self.gpu_memory_utilization} is not in (0, 1]")
        if self.kv_cache_bytes <= 0:
            raise ImpossiblePlan(
                f"weights {self.weights_bytes / 2**30:.2f} GiB + activations {self.activation_bytes / 2**30:.2f} GiB"
                f" + CUDA graphs {self.cuda_graph_bytes / 2**30:.2f} GiB exceed the budget of "
                f"{self.budget_bytes / 2**30:.2f} GiB ({self.gpu_memory_bytes / 2**30:.2f} GiB x "
                f"{self.gpu_memory_utilization}): no memory is left for the KV cache"
            )
