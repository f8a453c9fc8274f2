"""Model geometry from a Hugging Face ``config.json``, and weight sizes from safetensors headers.

I/O at the edges (reading files), plain data out. What the code does not understand raises
:class:`GeometryError` naming the field it could not interpret; nothing is guessed silently.

The geometry types (layer kinds, state shapes) are in :mod:`vllm_capacity.geometry`.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from vllm_capacity.geometry import (
    GatedDeltaNetGeometry,
    Geometry,
    GeometryError,
    LinearShapes,
    Mamba1Geometry,
    MambaGeometry,
)
from vllm_capacity.units import MiB

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

# safetensors dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def _positive_int_field(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(key, f"{value!r} is not a positive integer")
    return int(value)


def _int(cfg: dict[str, Any], key: str) -> int:
    value = _positive_int_field(cfg, key)
    if value is None:
        raise GeometryError(key, "missing from config.json")
    return value


def _mamba2(cfg: dict[str, Any]) -> MambaGeometry | None:
    """Mamba-2 state geometry: Granite-4.0-H / Bamba (``mamba_n_heads``...) or Nemotron-H (``mamba_num_heads``...)."""
    ssm_dtype = cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype")
    if cfg.get("mamba_n_heads") is not None:
        heads, head_dim = _int(cfg, "mamba_n_heads"), _int(cfg, "mamba_d_head")
        expand = _positive_int_field(cfg, "mamba_expand")
        return MambaGeometry(
            intermediate_size=expand * _int(cfg, "hidden_size") if expand else heads * head_dim,
            n_groups=_positive_int_field(cfg, "mamba_n_groups") or 1,
            n_heads=heads,
            head_dim=head_dim,
            d_state=_int(cfg, "mamba_d_state"),
            conv_kernel=_positive_int_field(cfg, "mamba_d_conv") or 4,
            ssm_cache_dtype=ssm_dtype,
        )
    if cfg.get("mamba_num_heads") is not None:
        heads, head_dim = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim")
        return MambaGeometry(
            intermediate_size=heads * head_dim,
            n_groups=_positive_int_field(cfg, "n_groups") or 1,
            n_heads=heads,
            head_dim=head_dim,
            d_state=_int(cfg, "ssm_state_size"),
            conv_kernel=_positive_int_field(cfg, "conv_kernel") or 4,
            ssm_cache_dtype=ssm_dtype,
        )
    return None


def _mamba1(cfg: dict[str, Any]) -> Mamba1Geometry | None:
    """Mamba-1 state geometry of Jamba (the fields vLLM's ``JambaForCausalLM.get_mamba_state_shape_from_config``
    reads: ``mamba_expand x hidden_size`` inner channels, ``mamba_d_state``, ``mamba_d_conv``)."""
    if cfg.get("model_type") != "jamba" and not str((cfg.get("architectures") or [""])[0]).startswith("Jamba"):
        return None
    return Mamba1Geometry(
        intermediate_size=_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"),
        d_state=_int(cfg, "mamba_d_state"),
        conv_kernel=_positive_int_field(cfg, "mamba_d_conv") or 4,
        ssm_cache_dtype=cfg.get("mamba_ssm_cache_dtype"),
    )


def _gated_delta_net(cfg: dict[str, Any]) -> GatedDeltaNetGeometry | None:
    """Gated DeltaNet state geometry (Qwen3-Next, Qwen3.5): the ``linear_*`` fields vLLM's Qwen GDN layer reads."""
    if cfg.get("linear_num_value_heads") is None:
        return None
    return GatedDeltaNetGeometry(
        num_k_heads=_int(cfg, "linear_num_key_heads"),
        num_v_heads=_int(cfg, "linear_num_value_heads"),
        head_k_dim=_int(cfg, "linear_key_head_dim"),
        head_v_dim=_int(cfg, "linear_value_head_dim"),
        conv_kernel=_positive_int_field(cfg, "linear_conv_kernel_dim") or 4,
        ssm_cache_dtype=cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype"),
    )


def _layer_kinds(cfg: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    """Each layer's kind and the sliding window, from whichever way the config says them (the first of
    ``_KIND_READERS`` that finds its fields); every layer full attention when none does."""
    window = _sliding_window(cfg)
    for read in _KIND_READERS:
        kinds = read(cfg, num_layers, window)
        if kinds is not None:
            return kinds, window
    return ["full"] * num_layers, window


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
    # transformers >= 5 writes Granite-4.0-H's Mamba-2 layers as "linear_attention": the mamba_* fields say which
    linear = "mamba" if _mamba2(cfg) is not None else "linear"
    for i, t in enumerate(types):
        if t not in _LAYER_TYPE_NAMES:
            raise GeometryError(f"layer_types[{i}]", f"unknown layer type {t!r}")
        kinds.append(linear if _LAYER_TYPE_NAMES[t] == "linear" else _LAYER_TYPE_NAMES[t])
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
    period, offset = _int(cfg, "attn_layer_period"), cfg.get("attn_layer_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise GeometryError("attn_layer_offset", f"{offset!r} is not a layer offset below {period}")
    return ["full" if i % period == offset else "mamba" for i in range(num_layers)]


def _from_full_interval(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """Qwen3-Next / 3.5: every ``full_attention_interval``-th layer is full attention, the others linear."""
    if cfg.get("full_attention_interval") is None:
        return None
    k = _int(cfg, "full_attention_interval")
    return ["full" if (i + 1) % k == 0 else "linear" for i in range(num_layers)]


def _from_window(cfg: dict[str, Any], num_layers: int, window: int | None) -> list[str] | None:
    """A window and no layer list: Gemma 3 (every sliding_window_pattern-th layer global), Gemma 2 (alternating,
    sliding first), else every layer slides (Mistral v0.1, Phi-3)."""
    if window is None:
        return None
    if cfg.get("sliding_window_pattern") is not None:
        n = _int(cfg, "sliding_window_pattern")
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


def _head_dim(cfg: dict[str, Any], heads: int) -> int:
    """``head_dim``, else hidden_size / heads."""
    head_dim = _positive_int_field(cfg, "head_dim")
    if head_dim is not None:
        return head_dim
    hidden = _int(cfg, "hidden_size")
    if hidden % heads:
        raise GeometryError("head_dim", f"missing, and hidden_size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def _chunked_layers(cfg: dict[str, Any], kinds: list[str], num_layers: int, chunk: int | None) -> list[str]:
    """Llama 4's chunked local attention, where the config gives a chunk size but no chunked layer names."""
    if chunk is not None and "chunked" not in kinds:
        kinds = _llama4_chunked(cfg, kinds, num_layers)
    if "chunked" in kinds and chunk is None:
        raise GeometryError("attention_chunk_size", "layer_types has chunked-attention layers, but no chunk size")
    return kinds


def _shared_layers(cfg: dict[str, Any], kinds: list[str], num_layers: int) -> list[str]:
    """Gemma 3n / 4: the last ``num_kv_shared_layers`` layers reuse earlier layers' KV (no cache of their own)."""
    shared = cfg.get("num_kv_shared_layers") or 0
    if not shared:
        return kinds
    if not isinstance(shared, int) or shared >= num_layers:
        raise GeometryError("num_kv_shared_layers", f"{shared!r} is not a count below {num_layers}")
    return kinds[: num_layers - shared] + ["shared"] * shared


def parse_config(doc: dict[str, Any]) -> Geometry:
    """Geometry from a config.json document (multimodal models: its ``text_config``; EAGLE-1 drafters converted for
    vLLM: the decoder config nested under ``model``)."""
    if not isinstance(doc, dict):
        raise GeometryError("config.json", "is not a JSON object")
    if doc.get("model_type") == "eagle" and isinstance(doc.get("model"), dict):
        doc = {**doc["model"], **{k: v for k, v in doc.items() if k not in ("model", "model_type")}}
    cfg = dict(doc)
    if isinstance(doc.get("text_config"), dict):
        cfg = {**doc, **doc["text_config"]}
    architecture = (cfg.get("architectures") or [cfg.get("model_type") or "unknown"])[0]
    num_layers = _int(cfg, "num_hidden_layers")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or doc.get("torch_dtype") or doc.get("dtype")

    if cfg.get("kv_lora_rank") is not None:  # MLA (DeepSeek V2/V3): one latent vector per token and layer
        return Geometry(
            str(architecture),
            num_layers,
            1,
            _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim"),
            dtype,
            ("mla",) * num_layers,
            None,
            _max_pos(cfg),
            mtp_layers=_mtp_layers(cfg),
            mla_heads=_positive_int_field(cfg, "num_attention_heads"),
            **_sparse_indexer(cfg),
            **_beside_the_cache(doc, cfg),
        )
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _positive_int_field(cfg, "num_key_value_heads") or heads
    head_dim = _head_dim(cfg, heads)
    kinds, window = _layer_kinds(cfg, num_layers)
    chunk = _positive_int_field(cfg, "attention_chunk_size")
    kinds = _shared_layers(cfg, _chunked_layers(cfg, kinds, num_layers, chunk), num_layers)
    state = (_mamba2(cfg) or _mamba1(cfg)) if "mamba" in kinds else _gated_delta_net(cfg) if "linear" in kinds else None
    full_shape = _full_layer_shape(cfg, kinds, head_dim, kv_heads)
    return Geometry(
        str(architecture),
        num_layers,
        kv_heads,
        head_dim,
        dtype,
        tuple(kinds),
        window,
        _max_pos(cfg),
        state,
        _mtp_layers(cfg),
        chunk if "chunked" in kinds else None,
        unmodelled_cache=_other_shapes(cfg, head_dim),
        **_beside_the_cache(doc, cfg),
        full_shape=full_shape,
    )


# the config sections of a multimodal model's encoders, whose outputs vLLM's memory profile holds
_ENCODER_SECTIONS = ("vision_config", "audio_config")
# where configs give their routed experts (Mixtral, Qwen MoE, DeepSeek), for the LoRA slots it leaves unmodelled
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _beside_the_cache(doc: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """What vLLM allocates beside the KV cache from the same budget: the linear layers' sizes (LoRA adapter slots),
    and a multimodal model's encoder section and the width of its outputs per token (its encoder cache). Absent
    fields leave them None."""
    hidden = _positive_int_field(cfg, "hidden_size")
    fields = ("intermediate_size", "num_attention_heads", "vocab_size")
    linear = None
    if hidden is not None and all(isinstance(cfg.get(k), int) and cfg[k] > 0 for k in fields):
        experts = next((cfg[k] for k in _EXPERT_FIELDS if isinstance(cfg.get(k), int) and cfg[k] > 0), 0)
        linear = LinearShapes(hidden, cfg["intermediate_size"], cfg["num_attention_heads"], cfg["vocab_size"], experts)
    section = next((k for k in _ENCODER_SECTIONS if isinstance(doc.get(k), dict)), None)
    width = hidden
    if section is not None and doc[section].get("deepstack_visual_indexes"):
        # Qwen3-VL: each image token's embedding carries the deepstack levels beside it (vLLM 0.32 qwen3_vl.py:
        # out_hidden_size x (1 + len(deepstack_visual_indexes)))
        vision = doc[section]
        levels = vision["deepstack_visual_indexes"]
        if not isinstance(levels, list):
            raise GeometryError(f"{section}.deepstack_visual_indexes", f"{levels!r} is not a list of layers")
        width = _int(vision, "out_hidden_size") * (1 + len(levels))
    return {"linear": linear, "encoder_width": width if section else None, "multimodal": section}


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
    interval = _positive_int_field(cfg, "no_rope_layer_interval") or 4
    return ["full" if (i + 1) % interval == 0 else "chunked" for i in range(num_layers)]


# the indexer quantises its keys in blocks of 128 values, each with a float32 scale (vLLM 0.32 deepseek_v2.py
# ``Indexer.quant_block_size``, "TODO: get from config")
INDEXER_QUANT_BLOCK = 128


def _sparse_indexer(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek sparse attention (V3.2, GLM-5: ``index_topk``): vLLM 0.32 keeps an indexer cache per MLA layer beside
    the latent (``DeepseekV32IndexerCache``: ``index_head_dim`` fp8 values and a float32 scale per 128 of them, one
    byte each, per token). IndexCache configs, where only some layers keep one (``index_topk_freq`` /
    ``index_topk_pattern``), are left unmodelled."""
    if cfg.get("index_topk") is None:
        return {}
    head = _int(cfg, "index_head_dim")
    freq, pattern = cfg.get("index_topk_freq", 1), cfg.get("index_topk_pattern")
    if pattern is not None and not isinstance(pattern, str | list):
        raise GeometryError("index_topk_pattern", f"{pattern!r} is not a pattern of layers ('S' skips one)")
    if freq != 1 or (pattern is not None and "S" in pattern):
        why = (
            f"DeepSeek sparse attention with IndexCache (index_topk_freq {freq!r}, index_topk_pattern {pattern!r}): "
            "only some layers keep an indexer cache, which the planner does not place"
        )
        return {"unmodelled_cache": why}
    return {"indexer_bytes": head + head // INDEXER_QUANT_BLOCK * 4}


_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}


def _full_layer_shape(cfg: dict[str, Any], kinds: list[str], head_dim: int, kv_heads: int) -> tuple[int, int] | None:
    """Gemma 4's full-attention layers, whose K/V shape is not the sliding layers': ``per_layer_config`` (layer index
    -> head_dim / num_key_value_heads, as transformers 5 writes it) or ``global_head_dim`` (512 unless the config
    says) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` (transformers' Gemma4TextConfig). None
    where every layer has the first kind's shape."""
    overrides = cfg.get("per_layer_config")
    if overrides:
        if not isinstance(overrides, dict):
            raise GeometryError("per_layer_config", f"{overrides!r} is not a map of layer index to overrides")
        shapes, full = set(), 0
        for index, override in overrides.items():
            i = int(index) if str(index).isdigit() else -1
            if not 0 <= i < len(kinds) or not isinstance(override, dict) or set(override) - _LAYER_OVERRIDES:
                raise GeometryError(
                    f"per_layer_config[{index}]",
                    f"{override!r}: only head_dim and num_key_value_heads of a layer in range are understood",
                )
            shape = (
                _positive_int_field(override, "num_key_value_heads") or kv_heads,
                _positive_int_field(override, "head_dim") or head_dim,
            )
            if kinds[i] == "shared":
                continue  # reuses an earlier layer's cache: holds none of its own
            if kinds[i] != "full":
                if shape != (kv_heads, head_dim):
                    raise GeometryError(f"per_layer_config[{index}]", f"a {kinds[i]} layer of another shape")
                continue
            shapes.add(shape)
            full += 1
        if not shapes:
            return None  # only overrides that repeat the first kind's shape
        if len(shapes) > 1 or full != kinds.count("full"):
            raise GeometryError("per_layer_config", "full-attention layers of more than one shape")
        (shape,) = shapes
        return None if shape == (kv_heads, head_dim) else shape
    if cfg.get("model_type") in ("gemma4", "gemma4_text"):
        wide = _positive_int_field(cfg, "global_head_dim") or 512
        heads = _positive_int_field(cfg, "num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        shape = (heads or kv_heads, wide)
        return None if shape == (kv_heads, head_dim) else shape
    return None


def _other_shapes(cfg: dict[str, Any], head_dim: int) -> str | None:
    """Layers whose K/V shape the planner does not read (vLLM 0.32 caches them in pages of another size): named, so
    that the plan refuses rather than sizing every layer like the first kind."""
    if cfg.get("use_bidirectional_attention") == "all":  # Gemma 4's embedding variants: transformers halves the window
        return "use_bidirectional_attention 'all' changes the sliding window the config gives: not modelled"
    if cfg.get("hybrid_layer_pattern") is not None or cfg.get("swa_head_dim") is not None:  # MiMo-V2
        return (
            f"its sliding layers have a shape of their own (swa_head_dim {cfg.get('swa_head_dim')}, "
            f"swa_num_key_value_heads {cfg.get('swa_num_key_value_heads')}): pages of two sizes, which the planner "
            "does not size"
        )
    v_dim = cfg.get("v_head_dim")
    if v_dim is not None and v_dim != head_dim:
        return f"its V heads are {v_dim} wide and its K heads {head_dim} (v_head_dim): the planner sizes K and V alike"
    return None


def _mtp_layers(cfg: dict[str, Any]) -> int:
    """The multi-token-prediction layers a checkpoint ships, which vLLM's ``--speculative-config.method mtp`` runs
    as the drafter: ``num_nextn_predict_layers`` (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo) or ``mtp_num_hidden_layers``
    (Qwen3.5), as vLLM 0.32's ``SpeculativeConfig.hf_config_override`` reads them."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if cfg.get(key) is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise GeometryError(key, f"{value!r} is not a count of layers")
            return int(value)
    return 0


def _max_pos(cfg: dict[str, Any]) -> int | None:
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_config(path: Path) -> Geometry:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise GeometryError(str(path), f"cannot read: {err.strerror}") from err
    except ValueError as err:
        raise GeometryError(str(path), f"is not JSON: {err}") from err
    return parse_config(doc)


def safetensors_bytes(path: Path) -> int:
    """Bytes of the tensors in one .safetensors file, from its header alone (the tensor data is never read)."""
    with Path(path).open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise GeometryError(str(path), "too short for a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * MiB:
            raise GeometryError(str(path), f"header of {length} bytes: not a safetensors file")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise GeometryError(str(path), f"header is not JSON: {err}") from err
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise GeometryError(f"{path}:{name}", f"unknown tensor dtype {dtype!r}")
        total += math.prod(info.get("shape", [])) * SAFETENSORS_DTYPE_BYTES[dtype]
    return total


def model_dir_weights_bytes(directory: Path) -> int:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise GeometryError(str(directory), "has no *.safetensors files")
    return sum(safetensors_bytes(f) for f in files)
