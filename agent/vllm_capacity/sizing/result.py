"""A plan: the blocks, tokens and concurrency vLLM would give, and the KV-cache groups of a hybrid model."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_capacity.sizing.layers import LayerSpec
from vllm_capacity.sizing.speculative import DraftPages


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV-cache groups (V1 >= 0.9.1 hybrid models): layers of one kind sharing a block table."""

    layers: int  # real layers in the group; group_size - layers are padding layers
    spec: LayerSpec  # the kind of its layers, and the blocks a request holds in each

    @property
    def kind(self) -> str:  # full | sliding | mamba | linear
        return self.spec.kind

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len holds in this group."""
        return self.spec.blocks_per_request


@dataclass(frozen=True)
class KvPlan:
    kv_bytes_per_token: int  # per GPU rank, of the layers whose cache grows with every token (full attention / MLA)
    kv_layers_per_rank: int
    block_size: int
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    kv_cache_memory_bytes: int  # per GPU rank
    rules: str
    notes: list[str] = field(default_factory=list)
    groups: tuple[KvGroup, ...] = ()  # hybrid models only
    group_size: int = 0  # layers per group, padding included (hybrid models only)
    page_bytes: int = 0  # bytes of one block of one layer
    lookahead_tokens: int = 0  # slots each request reserves for speculative drafts, up to max_model_len
    draft_pages: DraftPages | None = None  # a speculative drafter's layers of other pages (in kv_bytes_per_token)
    cpu_tier_tokens: int | None = None  # the CPU tier of KV offloading (--kv-offloading-size), in tokens

    @property
    def worker_bytes_per_block(self) -> int:
        """Bytes one block takes on one GPU rank, over every layer (vLLM's ``total_gpu_kv_bytes // num_blocks``)."""
        if self.groups:
            return self.page_bytes * self.group_size
        return self.kv_bytes_per_token * self.block_size

    def _held(self, context_tokens: int) -> int:
        """Tokens of KV one request of ``context_tokens`` holds in a full-attention layer: its own and the drafts'."""
        return min(context_tokens + self.lookahead_tokens, max(self.max_model_len, context_tokens))

    def blocks_at(self, context_tokens: int) -> int:
        """Blocks one request of ``context_tokens`` holds across the groups of a hybrid model (vLLM's per-group
        bounds: full groups grow with the context, sliding-window and Mamba groups stop at theirs)."""
        return sum(g.spec.blocks_at(context_tokens) for g in self.groups)

    def concurrency_at(self, context_tokens: int) -> float:
        if self.groups:
            return self.num_gpu_blocks / self.blocks_at(context_tokens)
        return self.kv_cache_tokens / self._held(context_tokens)

    def request_bytes(self, context_tokens: int) -> int:
        """KV memory per GPU rank one request of ``context_tokens`` holds."""
        if self.groups:
            return self.blocks_at(context_tokens) * self.page_bytes * self.group_size
        return self._held(context_tokens) * self.kv_bytes_per_token
