"""What a plan is asked for: the memory, the context length and the vLLM options that decide the KV-cache layout."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_capacity.sizing.lora import Lora
from vllm_capacity.sizing.speculative import Speculation
from vllm_capacity.sizing.versions import NEWEST_RULES, V1_BY_DEFAULT, EngineVersion, Version
from vllm_capacity.units import GiB


@dataclass(frozen=True)
class PlanInputs:
    """One vLLM configuration to size, per GPU rank. ``max_num_batched_tokens`` and ``async_scheduling`` matter only
    for sliding-window layers, the ``mamba_*`` options only for state layers (vLLM's flags of the same names;
    vLLM's CPU backend turns async scheduling off). ``engine_version`` (V0 or V1; None: the version's default).
    ``speculation``: vLLM's ``--speculative-config``, whose drafter shares the pool."""

    kv_cache_memory_bytes: int
    max_model_len: int
    tp: int = 1
    pp: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    version: tuple[int, int, int] = (*NEWEST_RULES, 0)
    engine_version: EngineVersion | None = None  # --engine
    max_num_batched_tokens: int = 2048
    mamba_cache_mode: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    async_scheduling: bool = True
    speculation: Speculation | None = None
    chunked_local_hybrid: str = "auto"  # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE: on, off, or the default
    kv_offloading_bytes: int | None = None  # --kv-offloading-size: the CPU tier's buffer over all TP ranks
    lora: Lora | None = None  # --enable-lora's --max-loras and --max-lora-rank: slots taken from the budget
    encoder_cache_tokens: int | None = None  # a multimodal model's encoder cache budget, as vLLM logs it

    def check(self) -> None:
        """Raise ValueError for inputs no vLLM would accept."""
        if min(self.tp, self.pp, self.block_size, self.max_model_len, self.max_num_batched_tokens) < 1:
            raise ValueError("tp, pp, block_size, max_model_len and max_num_batched_tokens must be positive")
        if self.engine_version not in (None, "v0", "v1"):
            raise ValueError(f"engine {self.engine_version!r} is not v0 or v1")
        if self.speculation is not None:
            self.speculation.check()
        if self.lora is not None:
            self.lora.check()
        if self.encoder_cache_tokens is not None and self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens {self.encoder_cache_tokens} is negative")
        if self.chunked_local_hybrid not in ("auto", "on", "off"):
            raise ValueError(f"chunked_local_hybrid {self.chunked_local_hybrid!r} is not auto, on or off")

    @property
    def lookahead_tokens(self) -> int:
        return self.speculation.lookahead_tokens(self.version) if self.speculation else 0

    @property
    def resolved_engine_version(self) -> EngineVersion:
        """The engine vLLM ``version`` runs: the one asked for, else its default."""
        return resolved_engine_version(self.engine_version, self.version)


def resolved_engine_version(engine_version: EngineVersion | None, version: Version) -> EngineVersion:
    """The engine vLLM ``version`` runs (V0, V1): the one asked for, else that version's default."""
    return engine_version or ("v0" if version < V1_BY_DEFAULT else "v1")


# `vllm serve`'s defaults by the GPU's memory, one row a tier (0.32 ``arg_utils``, for the OpenAI server, as from
# 0.11): (from bytes, max_num_seqs, max_num_batched_tokens). vLLM keeps A100s of 80 GB in the last row by their name,
# which the size alone cannot tell.
SERVE_DEFAULTS = ((160 * GiB, 1024, 16384), (70 * GiB, 1024, 8192), (0, 256, 2048))


def _serve_defaults(gpu_memory_bytes: int | None) -> tuple[int, int]:
    memory = gpu_memory_bytes or 0
    return next((seqs, tokens) for floor, seqs, tokens in SERVE_DEFAULTS if memory >= floor)


def default_max_num_seqs(gpu_memory_bytes: int | None) -> int:
    """`vllm serve`'s default --max-num-seqs on a GPU of this size: 1024 from 70 GiB, else 256."""
    return _serve_defaults(gpu_memory_bytes)[0]


def default_max_num_batched_tokens(gpu_memory_bytes: int | None) -> int:
    """`vllm serve`'s default on a GPU of this size: 16384 from 160 GiB, 8192 from 70 GiB, else 2048. It bounds what a
    sliding-window layer holds per request."""
    return _serve_defaults(gpu_memory_bytes)[1]
