"""vLLM's memory budget on one GPU rank, and what it leaves for the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_capacity.sizing.errors import ImpossiblePlan
from vllm_capacity.units import GiB


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
                f"weights {self.weights_bytes / GiB:.2f} GiB + activations {self.activation_bytes / GiB:.2f} GiB"
                f" + CUDA graphs {self.cuda_graph_bytes / GiB:.2f} GiB exceed the budget of "
                f"{self.budget_bytes / GiB:.2f} GiB ({self.gpu_memory_bytes / GiB:.2f} GiB x "
                f"{self.gpu_memory_utilization}): no memory is left for the KV cache"
            )
