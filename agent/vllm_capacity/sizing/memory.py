"""vLLM's memory budget on one GPU rank, and what it leaves for the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_capacity.sizing.errors import ImpossiblePlan
from vllm_capacity.units import GiB

# vLLM 0.34's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py of the 0.34.0 wheel): the margin it keeps
# below the device's headroom, KV_CACHE_MARGIN_FLOOR_BYTES (3 GiB on ROCm, 1 GiB elsewhere) or
# KV_CACHE_MARGIN_FRACTION of the transient peak, whichever is larger
EXTENSIBLE_MARGIN_FLOOR = {"cuda": 1 << 30, "rocm": 3 << 30}
EXTENSIBLE_MARGIN_FRACTION = 0.75


def extensible_kv_bytes(
    *,
    init_free_memory: int,
    non_kv_used: int,
    requested_memory: int,
    transient_peak_bytes: int,
    margin_floor_bytes: int,
    torch_reserve_growth_bytes: int = 0,
) -> int:
    """vLLM 0.34's ``measure_kv_cache_bytes`` for a plan: what the engine holds after warm-up beside the cache
    (``non_kv_used``: weights, LoRA slots, CUDA graphs) leaves the rest of the requested budget, capped by the
    device's headroom (the memory free at start less that) less the margin, less the transient peak kept free.
    The measured form, ``init_free - free - committed``, is this with ``free + committed = init_free - non_kv_used``
    (tests/test_vllm_034.py runs vLLM's function beside it)."""
    headroom = init_free_memory - non_kv_used
    margin = max(margin_floor_bytes, int(transient_peak_bytes * EXTENSIBLE_MARGIN_FRACTION))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


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
    #: vLLM 0.34's extensible KV cache: sized from the memory measured after warm-up and graph capture
    #: (:func:`extensible_kv_bytes`), not from the estimate above
    extensible: bool = False
    margin_floor_bytes: int = EXTENSIBLE_MARGIN_FLOOR["cuda"]

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
    def transient_bytes(self) -> int:
        """What the extensible cache keeps free beside it: the activation peak (the encoder outputs of a multimodal
        profile among them)."""
        return self.activation_bytes + self.encoder_cache_bytes

    @property
    def margin_bytes(self) -> int:
        """The extensible cache's margin below the device's headroom: max(floor, 0.75 x the transient peak)."""
        return max(self.margin_floor_bytes, int(self.transient_bytes * EXTENSIBLE_MARGIN_FRACTION))

    @property
    def kv_cache_bytes(self) -> int:
        if self.extensible:
            resident = self.weights_bytes + self.lora_bytes + self.cuda_graph_bytes
            return extensible_kv_bytes(
                init_free_memory=self.gpu_memory_bytes,
                non_kv_used=resident,
                requested_memory=self.budget_bytes,
                transient_peak_bytes=self.transient_bytes,
                margin_floor_bytes=self.margin_floor_bytes,
            )
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
            if self.extensible:
                held += (
                    f" + the margin vLLM's extensible KV cache keeps free {self.margin_bytes / GiB:.2f} GiB "
                    f"(max({self.margin_floor_bytes / GiB:.2f} GiB, 0.75 x activations))"
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
