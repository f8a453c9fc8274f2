"""A model's layers as its config.json names them: each layer's kind (the many ways configs say it, each a reader
of its own) and the per-request state of Mamba-1, Mamba-2 and Gated DeltaNet layers. :mod:`model_config` puts them
into a :class:`~vllm_capacity.geometry.Geometry`."""

from __future__ import annotations

from typing import Any

from vllm_capacity.geometry import (
    CompressedGeometry,
    GatedDeltaNetGeometry,
    GeometryError,
    KimiDeltaGeometry,
    Mamba1Geometry,
    MambaGeometry,
)

_LAYER_TYPE_NAMES = {
    "full_attention": "full",
    "attention": "full",
    "global": "full",
    "sliding_attention": "sliding",
    "sliding_window": "sliding",
    "local": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "mamba": "mamba",
    "mamba2": "mamba",
}


#: the largest count of layers a config.json may give: far above any model's (DeepSeek-V3 61, Llama 3.1 405B 126),
#: low enough that a config of 2^40 layers is refused in a line, not a MemoryError or a minute of planning
MAX_LAYERS = 10_000
#: the largest of any other count or size (heads, head_dim, hidden_size, windows, context lengths): a 32-bit int,
#: as the checkpoints' own loaders take them
MAX_COUNT = 2**31 - 1


def positive_int(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(key, f"{value!r} is not a positive integer")
    most = MAX_LAYERS if "layers" in key else MAX_COUNT
    if value > most:
        shown = f"{value:,}" if value < 10**30 else f"a number of {len(str(value))} digits"
        raise GeometryError(key, f"{shown} is more than any model's ({most:,} at most)")
    return int(value)


def required_int(cfg: dict[str, Any], key: str) -> int:
    value = positive_int(cfg, key)
    if value is None:
        raise GeometryError(key, "missing from config.json")
    return value


def mamba2_state(cfg: dict[str, Any]) -> MambaGeometry | None:
    """Mamba-2 state geometry: Granite-4.0-H / Bamba (``mamba_n_heads``...) or Nemotron-H (``mamba_num_heads``...)."""
    ssm_dtype = cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype")
    if cfg.get("mamba_n_heads") is not None:
        heads, head_dim = required_int(cfg, "mamba_n_heads"), required_int(cfg, "mamba_d_head")
        expand = positive_int(cfg, "mamba_expand")
        return MambaGeometry(
            intermediate_size=expand * required_int(cfg, "hidden_size") if expand else heads * head_dim,
            n_groups=positive_int(cfg, "mamba_n_groups") or 1,
            n_heads=heads,
            head_dim=head_dim,
            d_state=required_int(cfg, "mamba_d_state"),
            conv_kernel=positive_int(cfg, "mamba_d_conv") or 4,
            ssm_cache_dtype=ssm_dtype,
        )
    if cfg.get("mamba_num_heads") is not None:
        heads, head_dim = required_int(cfg, "mamba_num_heads"), required_int(cfg, "mamba_head_dim")
        return MambaGeometry(
            intermediate_size=heads * head_dim,
            n_groups=positive_int(cfg, "n_groups") or 1,
            n_heads=heads,
            head_dim=head_dim,
            d_state=required_int(cfg, "ssm_state_size"),
            conv_kernel=positive_int(cfg, "conv_kernel") or 4,
            ssm_cache_dtype=ssm_dtype,
        )
    return None


def mamba1_state(cfg: dict[str, Any]) -> Mamba1Geometry | None:
    """Mamba-1 state geometry of Jamba (the fields vLLM's ``JambaForCausalLM.get_mamba_state_shape_from_config``
    reads: ``mamba_expand x hidden_size`` inner channels, ``mamba_d_state``, ``mamba_d_conv``)."""
    if cfg.get("model_type") != "jamba" and not str((cfg.get("architectures") or [""])[0]).startswith("Jamba"):
        return None
    return Mamba1Geometry(
        intermediate_size=required_int(cfg, "mamba_expand") * required_int(cfg, "hidden_size"),
        d_state=required_int(cfg, "mamba_d_state"),
        conv_kernel=positive_int(cfg, "mamba_d_conv") or 4,
        ssm_cache_dtype=cfg.get("mamba_ssm_cache_dtype"),
    )


def gated_delta_net_state(cfg: dict[str, Any]) -> GatedDeltaNetGeometry | None:
    """Gated DeltaNet state geometry (Qwen3-Next, Qwen3.5): the ``linear_*`` fields vLLM's Qwen GDN layer reads."""
    if cfg.get("linear_num_value_heads") is None:
        return None
    return GatedDeltaNetGeometry(
        num_k_heads=required_int(cfg, "linear_num_key_heads"),
        num_v_heads=required_int(cfg, "linear_num_value_heads"),
        head_k_dim=required_int(cfg, "linear_key_head_dim"),
        head_v_dim=required_int(cfg, "linear_value_head_dim"),
        conv_kernel=positive_int(cfg, "linear_conv_kernel_dim") or 4,
        ssm_cache_dtype=cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype"),
    )


def kimi_delta_layers(cfg: dict[str, Any], num_layers: int) -> tuple[list[str], KimiDeltaGeometry] | None:
    """Kimi Linear's layers and KDA state from ``linear_attn_config``: ``kda_layers`` (1-based, as its config class
    reads them) hold a KDA state ("linear"), the others MLA; None without that section."""
    section = cfg.get("linear_attn_config")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise GeometryError("linear_attn_config", f"a {type(section).__name__}, not an object")
    kda = section.get("kda_layers")
    if not isinstance(kda, list) or not all(isinstance(i, int) and 1 <= i <= num_layers for i in kda):
        raise GeometryError("linear_attn_config.kda_layers", f"expected layer numbers from 1 to {num_layers}")
    heads, head_dim = required_int(section, "num_heads"), required_int(section, "head_dim")
    state = KimiDeltaGeometry(heads, heads, head_dim, head_dim, positive_int(section, "short_conv_kernel_size") or 4)
    return ["linear" if i + 1 in kda else "mla" for i in range(num_layers)], state


# the compress ratios vLLM 0.32's DeepSeek-V4 compressor takes (``CompressorStateCache``: "assert compress_ratio in
# [4, 128]"); 0 and 1 are a layer of the sliding window alone (``max(1, config.compress_ratios[layer_id])``)
COMPRESS_RATIOS = (4, 128)


def compressed_attention(cfg: dict[str, Any], num_layers: int) -> CompressedGeometry | None:
    """DeepSeek-V4's layers from ``compress_ratios`` (one a layer; a trailing one for its MTP layer is not read, as
    vLLM reads only the first ``num_hidden_layers``); None without it."""
    ratios = cfg.get("compress_ratios")
    if ratios is None:
        return None
    if not isinstance(ratios, list) or len(ratios) < num_layers:
        raise GeometryError("compress_ratios", f"expected a list of {num_layers} ratios, one a layer")
    for i, ratio in enumerate(ratios[:num_layers]):
        if isinstance(ratio, bool) or not isinstance(ratio, int) or max(1, ratio) not in (1, *COMPRESS_RATIOS):
            raise GeometryError(f"compress_ratios[{i}]", f"{ratio!r}: vLLM's compressor takes 4 or 128 (0: none)")
    layers = tuple(max(1, r) for r in ratios[:num_layers])
    index_head_dim = required_int(cfg, "index_head_dim") if 4 in layers else 0
    return CompressedGeometry(layers, index_head_dim)


def layer_kinds(cfg: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    """Each layer's kind and the sliding window, from whichever way the config says them (the first of
    ``_KIND_READERS`` that finds its fields); every layer full attention when none does."""
    window = _sliding_window(cfg)
    for read in _KIND_READERS:
        kinds = read(cfg, num_layers, window)
        if kinds is not None:
            return kinds, window
    return ["full"] * num_layers, window


def dflash_sliding(cfg: dict[str, Any], kinds: list[str], window: int | None) -> tuple[list[str], int | None]:
    """A DFlash drafter's ``dflash_config``, as vLLM 0.32 resolves it (``qwen3_dflash._resolve_layer_attention``):
    ``use_swa`` makes every layer sliding-window unless ``layer_types`` names sliding ones, and a sliding layer's
    window is ``swa_window_size`` where given, else ``sliding_window`` (MiMo-V2.5-Pro's DFlash drafter sets use_swa)."""
    dflash = cfg.get("dflash_config")
    if dflash is None:
        return kinds, window
    if not isinstance(dflash, dict):
        raise GeometryError("dflash_config", "is not an object")
    if dflash.get("use_swa") and "sliding" not in kinds:
        kinds = ["sliding" if k == "full" else k for k in kinds]
    if "sliding" not in kinds:
        return kinds, window
    size = dflash.get("swa_window_size", window)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise GeometryError("dflash_config.swa_window_size", f"{size!r}: a sliding DFlash layer needs a window")
    return kinds, size


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        return None  # Qwen2/2.5 carry a window they do not use
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise GeometryError("sliding_window", f"{window!r} is not a positive integer or null")
    return window


def _from_layer_types(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """``layer_types``, one name a layer (transformers' own spelling)."""
    if cfg.get("layer_types") is None:
        return None
    types = cfg["layer_types"]
    if not isinstance(types, list) or len(types) != num_layers:
        raise GeometryError("layer_types", f"expected a list of {num_layers} layer types")
    kinds = []
    for i, t in enumerate(types):
        if t not in _LAYER_TYPE_NAMES:
            raise GeometryError(f"layer_types[{i}]", f"unknown layer type {t!r}")
        kinds.append(_LAYER_TYPE_NAMES[t])
    # transformers >= 5 writes Granite-4.0-H's Mamba-2 layers as "linear_attention": the mamba_* fields say which
    if "linear" in kinds and mamba2_state(cfg) is not None:
        kinds = ["mamba" if k == "linear" else k for k in kinds]
    if "sliding" in kinds and window is None:
        raise GeometryError("sliding_window", "layer_types has sliding-window layers, but no window is given")
    return kinds


def _from_hybrid_pattern(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """Nemotron-H's ``hybrid_override_pattern``: M = Mamba, * = attention, - = MLP (E: an expert layer)."""
    if cfg.get("hybrid_override_pattern") is None:
        return None
    pattern = cfg["hybrid_override_pattern"]
    mapping = {"M": "mamba", "*": "full", "-": "none", "E": "none"}
    if not isinstance(pattern, str) or len(pattern) != num_layers or set(pattern) - set(mapping):
        raise GeometryError("hybrid_override_pattern", f"{pattern!r} is not {num_layers} of M, *, -")
    return [mapping[c] for c in pattern]


def _from_block_types(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """Jamba's and Granite-4.0-H's ``layers_block_type``: mamba or attention."""
    if cfg.get("layers_block_type") is None:
        return None
    types = cfg["layers_block_type"]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"mamba", "attention"}:
        raise GeometryError("layers_block_type", f"expected {num_layers} of 'mamba' / 'attention'")
    return [_LAYER_TYPE_NAMES[t] for t in types]


def _from_attention_period(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """Jamba: layer i is attention when i % attn_layer_period == attn_layer_offset, Mamba otherwise."""
    if cfg.get("attn_layer_period") is None:
        return None
    period, offset = required_int(cfg, "attn_layer_period"), cfg.get("attn_layer_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise GeometryError("attn_layer_offset", f"{offset!r} is not a layer offset below {period}")
    return ["full" if i % period == offset else "mamba" for i in range(num_layers)]


def _from_full_interval(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """Qwen3-Next / 3.5: every ``full_attention_interval``-th layer is full attention, the others linear."""
    if cfg.get("full_attention_interval") is None:
        return None
    k = required_int(cfg, "full_attention_interval")
    return ["full" if (i + 1) % k == 0 else "linear" for i in range(num_layers)]


def _from_window(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """A window and no layer list: Gemma 3 (every sliding_window_pattern-th layer global), Gemma 2 (alternating,
    sliding first), else every layer slides (Mistral v0.1, Phi-3)."""
    if window is None:
        return None
    if cfg.get("sliding_window_pattern") is not None:
        n = required_int(cfg, "sliding_window_pattern")
        return ["full" if (i + 1) % n == 0 else "sliding" for i in range(num_layers)]
    if cfg.get("model_type") == "gemma2":
        return ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    return ["sliding"] * num_layers


_KIND_READERS = (
    _from_layer_types,
    _from_hybrid_pattern,
    _from_block_types,
    _from_attention_period,
    _from_full_interval,
    _from_window,
)


def chunked_layers(cfg: dict[str, Any], kinds: list[str], num_layers: int, chunk: int | None) -> list[str]:
    """Llama 4's chunked local attention, where the config gives a chunk size but no chunked layer names."""
    if chunk is not None and "chunked" not in kinds:
        kinds = _llama4_chunked(cfg, kinds, num_layers)
    if "chunked" in kinds and chunk is None:
        raise GeometryError("attention_chunk_size", "layer_types has chunked-attention layers, but no chunk size")
    return kinds


def shared_layers(cfg: dict[str, Any], kinds: list[str], num_layers: int, *, assistant: bool = False) -> list[str]:
    """Gemma 3n / 4: the last ``num_kv_shared_layers`` layers reuse earlier layers' KV (no cache of their own). A
    Gemma 4 assistant's layers all read the target's (vLLM zeroes its ``num_kv_shared_layers`` and points each layer
    at the target's last layer of its type)."""
    if assistant:
        return ["shared"] * num_layers
    shared = cfg.get("num_kv_shared_layers") or 0
    if not shared:
        return kinds
    if not isinstance(shared, int) or shared >= num_layers:
        raise GeometryError("num_kv_shared_layers", f"{shared!r} is not a count below {num_layers}")
    return kinds[: num_layers - shared] + ["shared"] * shared


def _llama4_chunked(cfg: dict[str, Any], kinds: list[str], num_layers: int) -> list[str]:
    """Llama 4 without ``layer_types``: the RoPE layers attend within chunks, the NoPE ones (``no_rope_layers[i]``
    0; else every ``no_rope_layer_interval``-th, 4 by default) globally, as vLLM's ``llama4.py`` and transformers'
    ``Llama4TextConfig`` read them."""
    if kinds != ["full"] * num_layers:
        raise GeometryError("attention_chunk_size", "chunked attention beside other layer kinds is not modelled")
    flags = cfg.get("no_rope_layers")
    if flags:
        if not isinstance(flags, list) or len(flags) != num_layers or set(flags) - {0, 1}:
            raise GeometryError("no_rope_layers", f"expected {num_layers} flags of 0 (NoPE, global) or 1 (RoPE)")
        return ["chunked" if f else "full" for f in flags]
    interval = positive_int(cfg, "no_rope_layer_interval") or 4
    return ["full" if (i + 1) % interval == 0 else "chunked" for i in range(num_layers)]
