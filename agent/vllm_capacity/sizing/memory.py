"""vLLM's memory budget on one GPU rank, and what it leaves for the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_capacity.sizing.errors import ImpossiblePlan
from vllm_capacity.units import GiB


@dataclass(frozen=True)
class MemoryBudget:
    """Per GPU rank: total x gpu_memory_utilization = weights + LoRA slots + activation peak + encoder cache + CUDA
    graphs + KV cache, where the graphs are in the budget (``graphs_in_budget``: from vLLM 0.20, else they are
    captured after the cache, outside it). ``not_given``: the figures nobody gave ("activations", "CUDA graphs"),
    estimated or taken as 0, which the plan then says."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    lora_bytes: int = 0  # the adapter slots vLLM preallocates with the weights (sizing.lora)
    encoder_cache_bytes: int = 0  # the multimodal encoder outputs vLLM's memory profile holds at its peak
    graphs_in_budget: bool = True
    not_given: tuple[str, ...] = ()

    @property
    def outside_kv_bytes(self) -> dict[str, int]:
        """What the budget holds beside the KV cache, by name, in the order vLLM allocates it."""
        return {
            "weights": self.weights_bytes,
            "LoRA slots": self.lora_bytes,
            "activations": self.activation_bytes,
            "encoder cache": self.encoder_cache_bytes,
            "CUDA graphs": self.cuda_graph_bytes if self.graphs_in_budget else 0,
        }

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget_bytes - sum(self.outside_kv_bytes.values())

    def check(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ImpossiblePlan(f"gpu_memory_utilization {self.gpu_memory_utilization} is not in (0, 1]")
        if self.kv_cache_bytes <= 0:
            held = " + ".join(
                f"{name} {size / GiB:.2f} GiB"
                for name, size in self.outside_kv_bytes.items()
                if size or name in ("weights", "activations") or (name == "CUDA graphs" and self.graphs_in_budget)
            )
            raise ImpossiblePlan(
                f"{held} exceed the budget of "
                f"{self.budget_bytes / GiB:.2f} GiB ({self.gpu_memory_bytes / GiB:.2f} GiB x "
                f"{self.gpu_memory_utilization}): no memory is left for the KV cache"
            )


def encoder_cache_bytes(tokens: int, width: int, dtype_bytes: int) -> int:
    """The multimodal encoder outputs vLLM's memory profile holds while it measures the peak (0.32
    ``GPUModelRunner.profile_run``: a dummy batch of the largest items fills the encoder cache budget it logs as
    "Encoder cache will be initialized with a budget of N tokens", embeddings of ``width`` (the decoder's hidden
    size; Qwen3-VL's carry its deepstack levels too) in the model's dtype); the encoder's own activations come on
    top, in the activation peak."""
    return tokens * width * dtype_bytes


# vLLM V1's activation peak is its sampler's warm-up (``_dummy_sampler_run``: max_num_seqs dummy requests over the
# whole vocabulary, in fp32, top-k and top-p on) wherever the forward pass of max_num_batched_tokens needs less: the
# peaks vLLM 0.10.2 and 0.11.0 logged ('torch peak memory increase' / 'PyTorch activation peak memory') for
# Qwen3-0.6B (1,024 sequences, vocabulary 151,936: 5.56 GiB), gpt-oss-120b (1,024 x 201,088: 7.38 GiB) and
# Qwen3-235B-A22B-FP8 at TP 4 (256 x 151,936: 1.40 GiB, every rank samples the gathered logits) are 9.59, 9.62 and
# 9.66 fp32 copies of those logits (tests/fixtures/cases/capacity-dev.json).
SAMPLER_PEAK_LOGIT_COPIES = 9.6


def sampler_peak_bytes(vocab_size: int, max_num_seqs: int) -> int:
    """The activation peak of vLLM V1's profile run, estimated as its sampler's warm-up: SAMPLER_PEAK_LOGIT_COPIES
    fp32 copies of max_num_seqs x vocab_size logits."""
    return int(SAMPLER_PEAK_LOGIT_COPIES * 4 * max_num_seqs * vocab_size)
