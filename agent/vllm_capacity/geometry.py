"""A model's geometry as vLLM's KV-cache sizing sees it: its layers by kind, KV heads and head size, dtype, sliding
window, and the per-request state shape of Mamba-2 / Gated DeltaNet layers. Plain data and shape maths, no I/O:
:mod:`vllm_capacity.sources.model_config` reads it from a ``config.json``.

Layer kinds: ``full`` (full attention), ``sliding`` (sliding-window attention), ``chunked`` (Llama 4's chunked local
attention: a token attends within its chunk of ``attention_chunk_size``), ``mla`` (multi-head latent
attention: one latent vector per token), ``mamba`` / ``linear`` (per-request state instead of per-token KV),
``shared`` (reuses an earlier layer's KV), ``none`` (no cache, e.g. an MLP-only layer of a hybrid pattern).

State layers carry their per-request state shape: Mamba-2 (``mamba``) in :class:`MambaGeometry` (the fields vLLM's
``MambaStateShapeCalculator.mamba2_state_shape`` reads: Granite-4.0-H / Bamba ``mamba_*`` names and Nemotron-H's),
Mamba-1 (Jamba's ``mamba``) in :class:`Mamba1Geometry`,
Gated DeltaNet (``linear``, Qwen3-Next / Qwen3.5) in :class:`GatedDeltaNetGeometry` (``linear_*`` fields).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_KINDS = ("full", "sliding", "chunked", "mla")  # kinds that hold per-token KV of their own


def _per_rank(what: str, value: int, tp: int) -> int:
    """A state dimension vLLM splits over the TP ranks (its ``divide``: exact, or the model cannot be sharded so)."""
    if value % tp:
        raise ValueError(f"{what} {value} is not divisible by TP {tp}: vLLM cannot shard this model so")
    return value // tp


@dataclass(frozen=True)
class MambaGeometry:
    """A Mamba-2 layer's per-request state: a conv state and an SSM state (vLLM's ``mamba2_state_shape``)."""

    intermediate_size: int
    n_groups: int
    n_heads: int
    head_dim: int
    d_state: int
    conv_kernel: int
    ssm_cache_dtype: str | None = None  # the config's own mamba_ssm_cache_dtype / mamba_ssm_dtype, if it sets one
    name = "Mamba-2"

    @staticmethod
    def align_blocks(checkpoint: bool) -> int:
        """Blocks per request in vLLM's 'align' mode: 2 states, and a prefill checkpoint from 0.32."""
        return 3 if checkpoint else 2

    def state_bytes(self, tp: int, conv_dtype_bytes: int, ssm_dtype_bytes: int, spec_columns: int = 0) -> int:
        """Bytes of one request's state in one layer on one TP rank (vLLM's MambaSpec page size, unpadded).
        ``spec_columns``: the speculative tokens the conv state keeps room for (``num_spec``)."""
        groups = self.n_groups + (0 if self.n_groups % tp == 0 else tp - self.n_groups)  # groups follow head shards
        conv_dim = _per_rank("conv dim", self.intermediate_size + 2 * groups * self.d_state, tp)
        heads = _per_rank("mamba heads", self.n_heads, tp)
        conv = (self.conv_kernel - 1 + spec_columns) * conv_dim * conv_dtype_bytes
        ssm = heads * self.head_dim * self.d_state * ssm_dtype_bytes
        return conv + ssm


@dataclass(frozen=True)
class Mamba1Geometry:
    """A Mamba-1 layer's per-request state (Jamba; vLLM's ``mamba1_state_shape``): a conv state of
    ``conv_kernel - 1`` steps over the inner channels and an SSM state of ``d_state`` per inner channel."""

    intermediate_size: int  # mamba_expand x hidden_size
    d_state: int
    conv_kernel: int
    ssm_cache_dtype: str | None = None
    name = "Mamba-1"

    @staticmethod
    def align_blocks(checkpoint: bool) -> int:
        """Blocks per request in vLLM's 'align' mode: 2 states (only Mamba-2 keeps a prefill checkpoint)."""
        return 2

    def state_bytes(self, tp: int, conv_dtype_bytes: int, ssm_dtype_bytes: int, spec_columns: int = 0) -> int:
        """As Mamba-2's; vLLM 0.32's ``mamba1_state_shape`` keeps no room for speculative tokens."""
        inner = _per_rank("mamba inner size", self.intermediate_size, tp)
        return (self.conv_kernel - 1) * inner * conv_dtype_bytes + inner * self.d_state * ssm_dtype_bytes


@dataclass(frozen=True)
class GatedDeltaNetGeometry:
    """A Gated DeltaNet layer's per-request state (vLLM's ``gated_delta_net_state_shape``): a conv state over the
    keys, queries and values, and a recurrent state of one ``head_v_dim x head_k_dim`` matrix per value head."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    ssm_cache_dtype: str | None = None  # Qwen3.5's mamba_ssm_dtype (float32), if the config sets one
    name = "Gated DeltaNet"

    @staticmethod
    def align_blocks(checkpoint: bool) -> int:
        """Blocks per request in vLLM's 'align' mode: 2 states (GDN keeps no prefill checkpoint block)."""
        return 2

    def state_bytes(self, tp: int, conv_dtype_bytes: int, ssm_dtype_bytes: int, spec_columns: int = 0) -> int:
        """As Mamba-2's, the conv state widened by ``spec_columns`` likewise."""
        conv_dim = _per_rank(
            "conv dim", 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim, tp
        )
        heads = _per_rank("value heads", self.num_v_heads, tp)
        conv = (self.conv_kernel - 1 + spec_columns) * conv_dim * conv_dtype_bytes
        recurrent = heads * self.head_v_dim * self.head_k_dim * ssm_dtype_bytes
        return conv + recurrent


@dataclass(frozen=True)
class KimiDeltaGeometry(GatedDeltaNetGeometry):
    """A Kimi Delta Attention layer's state (Kimi Linear; vLLM's ``kda_state_shape``): Gated DeltaNet's shapes with as
    many key as value heads, all ``head_dim`` wide (``linear_attn_config``'s num_heads, head_dim,
    short_conv_kernel_size); its recurrent state is float32 (``kda_state_dtype``)."""

    name = "KDA"


# DeepSeek's sparse-attention indexer quantises its keys in blocks of 128 values, each with a float32 scale (vLLM 0.32
# deepseek_v2.py ``Indexer.quant_block_size`` and models/deepseek_v4 ``DeepseekV4Indexer.quant_block_size``)
INDEXER_QUANT_BLOCK = 128


def indexer_key_bytes(index_head_dim: int) -> int:
    """Bytes of one token's indexer key: ``index_head_dim`` fp8 values and a float32 scale per 128 of them."""
    return index_head_dim + index_head_dim // INDEXER_QUANT_BLOCK * 4


@dataclass(frozen=True)
class CompressedGeometry:
    """DeepSeek-V4's attention (vLLM 0.32 ``models/deepseek_v4``): every layer keeps a sliding window of latents
    (``head_dim`` wide, one KV head); a layer of compress ratio 4 or 128 also keeps one compressed latent per that many
    tokens and its compressor's float32 state, and a ratio-4 layer an indexer (``index_head_dim`` keys, and its own
    compressor). ``ratios``: each layer's, 1 for a sliding-window-only layer (the config's 0)."""

    ratios: tuple[int, ...]
    index_head_dim: int


@dataclass(frozen=True)
class LinearShapes:
    """The sizes of a decoder's linear layers and embeddings (config.json's ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``vocab_size``): what vLLM's LoRA adapter slots are shaped after. ``experts``: the
    routed experts of a mixture-of-experts model (0 for a dense one)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    experts: int = 0


class GeometryError(ValueError):
    """The config says something the planner does not understand; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def tp_refusal(num_heads: int | None, num_kv_heads: int | None, tp: int) -> str | None:
    """Why vLLM refuses to shard a model of these heads over ``tp`` ranks, in its words; None when it can. The query
    heads must divide by TP (``ModelConfig.verify_with_parallel_config``); the KV heads are split when there are at
    least as many as ranks, else replicated, and either way exactly (``QKVParallelLinear``'s ``divide``). MLA has one
    latent KV head that every rank holds: pass ``num_kv_heads`` None."""
    if num_heads and num_heads % tp:
        return f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel size ({tp})"
    if num_kv_heads and (num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads):
        how = "split" if num_kv_heads >= tp else "replicated"
        return f"{num_kv_heads} KV heads cannot be {how} evenly over tensor parallel size {tp}"
    return None


@dataclass(frozen=True)
class Geometry:
    architecture: str
    num_layers: int
    num_kv_heads: int  # total, before tensor parallelism (1 for MLA)
    head_dim: int  # per KV head; for MLA the latent width kv_lora_rank + qk_rope_head_dim
    dtype: str | None  # the model's dtype (torch_dtype), the KV dtype when --kv-cache-dtype is auto
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    max_position_embeddings: int | None = None  # vLLM's default max_model_len
    state: MambaGeometry | Mamba1Geometry | GatedDeltaNetGeometry | None = None  # of the "mamba" / "linear" layers
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint ships (num_nextn_predict_layers), 0 if none
    attention_chunk_size: int | None = None  # of the "chunked" layers (Llama 4)
    mla_heads: int | None = None  # an MLA model's attention heads (num_attention_heads), which vLLM < 0.7.1 cached
    unmodelled_cache: str | None = None  # why the planner cannot size this model's cache (a cache or shape it lacks)
    linear: LinearShapes | None = None  # the linear layers' sizes (LoRA slots), when config.json gives them all
    encoder_width: int | None = None  # a multimodal model's encoder output per token (the decoder's hidden size)
    multimodal: str | None = None  # the config's encoder section (vision_config, audio_config), None for text only
    full_shape: tuple[int, int] | None = None  # (KV heads, head_dim) of the full-attention layers, where not the rest's
    indexer_bytes: int | None = None  # DeepSeek sparse attention: each MLA layer's indexer cache, bytes per token
    num_heads: int | None = None  # attention (query) heads, total: what vLLM shards over the TP ranks
    # the Mamba-2 state a config's mamba_* fields describe where no layer holds one (Granite 4.0 micro: a hybrid's
    # class and fields, attention layers only), which some vLLM releases sized the attention block from
    unused_state: MambaGeometry | None = None
    compressed: CompressedGeometry | None = None  # DeepSeek-V4's compressed attention: its layers' caches and groups

    @property
    def kv_layers(self) -> int:
        return sum(kind in KV_KINDS for kind in self.layer_kinds)

    @property
    def reads_target_kv(self) -> bool:
        """Every layer reads another model's K/V and holds none (Gemma 4's assistant, a speculative drafter)."""
        return bool(self.layer_kinds) and set(self.layer_kinds) == {"shared"}

    @property
    def uniform(self) -> bool:
        """One kind of KV layer and nothing else that holds cache: vLLM's single-group case."""
        kinds = {k for k in self.layer_kinds if k != "none"}
        return kinds in ({"full"}, {"mla"})
