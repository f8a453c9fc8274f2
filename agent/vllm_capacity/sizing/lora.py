"""LoRA adapter slots: the buffers vLLM allocates for ``--max-loras`` adapters of rank ``--max-lora-rank``.

vLLM wraps every linear layer (and, for models that declare ``embedding_modules``, the input embedding and the
logits processor) in a LoRA layer that preallocates ``max_loras`` stacked A and B matrices of the largest rank,
whether or not an adapter is ever loaded (0.32 ``vllm/lora/layers/*.create_lora_weights``, called from
``LoRAModelManager._create_lora_modules``). It does so inside ``load_model``, so vLLM's "Model loading took" figure
includes them and the KV cache gets what is left: they come out of the KV budget like weights.

Per layer of a Llama-style decoder on one TP rank, with ``L`` slots of rank ``r`` (the A of a column-parallel layer
is ``r x input``, its B ``output/tp x r``; a row-parallel layer's A ``r x input/tp``, its B ``output x r``):

* ``qkv_proj`` (3 slices): ``L r (3 hidden + q/tp + 2 kv/tp)``, kv per rank at least one head as vLLM replicates;
* ``o_proj``: ``L r (q/tp + hidden)``; ``gate_up_proj`` (2 slices): ``L r (2 hidden + 2 intermediate/tp)``;
* ``down_proj``: ``L r (intermediate/tp + hidden)``; with ``--fully-sharded-loras`` the column layers' A and the row
  layers' B are split by TP too (``hidden/tp``);
* with embedding slots: ``embed_tokens`` and the logits processor ``L r (vocab + hidden)`` each, not split by TP;
  under pipeline parallelism the first stage holds the one and the last stage the other.

Checked element for element against the tensors a real vLLM 0.32 allocates (``tests/test_real_vllm_lora.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.versions import LORA_SLOTS, dotted

# vLLM's accepted --max-lora-rank values (0.32 ``vllm/config/lora.py`` MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# ``LogitsProcessorWithLoRA`` refuses larger vocabularies ("When using LoRA, vocab size must be <= 258048")
LOGITS_VOCAB_LIMIT = 258048

# The architectures whose LoRA layers are the four of a Llama-style decoder (merged qkv_proj and gate_up_proj,
# o_proj, down_proj), read in vLLM 0.32's model files; True where the model class declares ``embedding_modules``
# (embed_tokens, lm_head), which gives the input embedding and the logits processor slots too.
EMBEDDING_SLOTS = {
    "LlamaForCausalLM": True,  # llama.py
    "MistralForCausalLM": True,  # mistral.py, a LlamaForCausalLM
    "Phi3ForCausalLM": True,  # phi3.py, a LlamaForCausalLM
    "GraniteForCausalLM": True,  # granite.py
    "Qwen3ForCausalLM": True,  # qwen3.py
    "Qwen2ForCausalLM": False,  # qwen2.py: no embedding_modules
    "Gemma2ForCausalLM": False,  # gemma2.py
    "Gemma3ForCausalLM": False,  # gemma3.py
}


# the way out where the slots are not modelled: vLLM's own figure, which holds them
_MEASURE = "give vLLM's 'Model loading took' of a LoRA server as --weights-memory, without --max-loras"


@dataclass(frozen=True)
class Lora:
    """vLLM's ``--max-loras`` and ``--max-lora-rank`` (with its defaults); the slots are in the model's dtype, as
    vLLM's ``--lora-dtype auto`` makes them."""

    max_loras: int = 1
    max_rank: int = 16
    fully_sharded: bool = False  # --fully-sharded-loras: the A of column layers and the B of row layers split by TP

    def check(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras {self.max_loras} must be at least 1")
        if self.max_rank not in LORA_RANKS:
            accepted = ", ".join(map(str, LORA_RANKS))
            raise ValueError(f"max_lora_rank {self.max_rank} is not one vLLM accepts ({accepted})")


@dataclass(frozen=True)
class LoraSlots:
    """The adapter slots on the fullest GPU rank: the decoder layers' part and the embeddings' part, in bytes."""

    layers_bytes: int
    embeddings_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.layers_bytes + self.embeddings_bytes


def lora_slots(
    geometry: Geometry, lora: Lora, *, tp: int, pp: int, dtype_bytes: int, version: tuple[int, int, int]
) -> LoraSlots:
    """The bytes vLLM ``version`` preallocates for ``lora`` on the fullest rank; NotModelled names what it cannot
    size."""
    lora.check()
    if version < LORA_SLOTS:
        raise NotModelled(
            f"LoRA slots are sized as vLLM {dotted(LORA_SLOTS)} allocates them; vLLM {dotted(version)} may differ "
            f"(before PR #28545, November 2025, the embeddings kept lora_extra_vocab_size rows more): {_MEASURE}"
        )
    shapes = geometry.linear
    if geometry.architecture not in EMBEDDING_SLOTS:
        raise NotModelled(
            f"LoRA slots of {geometry.architecture} are not modelled (sized for "
            f"{', '.join(sorted(EMBEDDING_SLOTS))}): {_MEASURE}"
        )
    if shapes is None:
        raise NotModelled(
            "LoRA slots need config.json's hidden_size, intermediate_size, num_attention_heads and vocab_size"
        )
    if shapes.experts:
        raise NotModelled(f"LoRA slots of {shapes.experts} routed experts are not modelled")
    if shapes.num_heads % tp or shapes.intermediate_size % tp:
        raise ValueError(f"attention heads {shapes.num_heads} or intermediate_size not divisible by TP {tp}")
    hidden, r, slots = shapes.hidden_size, lora.max_rank, lora.max_loras
    q = shapes.num_heads // tp * geometry.head_dim
    kv = max(1, geometry.num_kv_heads // tp) * geometry.head_dim
    inter = shapes.intermediate_size // tp
    # per unit of rank: the column layers' A (rank x input) and the row layers' B (output x rank), which
    # --fully-sharded-loras splits over the TP ranks, and the rest, which it does not
    if lora.fully_sharded and (r % tp or hidden % tp):
        raise ValueError(f"--fully-sharded-loras: rank {r} and hidden_size {hidden} must divide by TP {tp}")
    split = tp if lora.fully_sharded else 1
    column_a = (3 * hidden + 2 * hidden) // split
    row_b = (hidden + hidden) // split
    per_layer = column_a + row_b + (q + 2 * kv) + q + 2 * inter + inter
    layers = math.ceil(geometry.num_layers / pp)
    embeddings = 0
    if EMBEDDING_SLOTS[geometry.architecture]:
        if shapes.vocab_size > LOGITS_VOCAB_LIMIT:
            raise NotModelled(
                f"vLLM refuses LoRA for {geometry.architecture} with a vocabulary of {shapes.vocab_size:,} "
                f"(above {LOGITS_VOCAB_LIMIT:,}: 'When using LoRA, vocab size must be <= {LOGITS_VOCAB_LIMIT}')"
            )
        embeddings = (2 if pp == 1 else 1) * (shapes.vocab_size + hidden)
    unit = slots * r * dtype_bytes
    return LoraSlots(layers_bytes=unit * layers * per_layer, embeddings_bytes=unit * embeddings)
