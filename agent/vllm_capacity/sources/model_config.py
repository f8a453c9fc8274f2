"""Model geometry from a Hugging Face ``config.json``, and weight sizes from safetensors headers.

I/O at the edges (reading files), plain data out. What the code does not understand raises
:class:`GeometryError` naming the field it could not interpret; nothing is guessed silently.

The geometry types (layer kinds, state shapes) are in :mod:`vllm_capacity.geometry`.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from vllm_capacity.geometry import (
    CompressedGeometry,
    GatedDeltaNetGeometry,
    Geometry,
    GeometryError,
    LinearShapes,
    Mamba1Geometry,
    MambaGeometry,
    indexer_key_bytes,
)
from vllm_capacity.sources.model_layers import (
    MAX_COUNT,
    MAX_LAYERS,
    chunked_layers,
    compressed_attention,
    dflash_sliding,
    gated_delta_net_state,
    kimi_delta_layers,
    layer_kinds,
    mamba1_state,
    mamba2_state,
    positive_int,
    required_int,
    shared_layers,
)
from vllm_capacity.units import MiB

# safetensors dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def _heads(cfg: dict[str, Any]) -> tuple[int, int]:
    """Attention heads and KV heads (all of them, before TP)."""
    heads = required_int(cfg, "num_attention_heads")
    kv_heads = positive_int(cfg, "num_key_value_heads") or heads
    if heads % kv_heads:  # vLLM's Attention: every KV head serves the same number of query heads
        raise GeometryError("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    return heads, kv_heads


def _head_dim(cfg: dict[str, Any], heads: int) -> int:
    """``head_dim``, else hidden_size / heads."""
    head_dim = positive_int(cfg, "head_dim")
    if head_dim is not None:
        return head_dim
    hidden = required_int(cfg, "hidden_size")
    if hidden % heads:
        raise GeometryError("head_dim", f"missing, and hidden_size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def parse_config(doc: dict[str, Any]) -> Geometry:
    """Geometry from a config.json document (multimodal models: its ``text_config``; EAGLE-1 drafters converted for
    vLLM: the decoder config nested under ``model``)."""
    if not isinstance(doc, dict):
        raise GeometryError("top level", f"a {type(doc).__name__}, not a JSON object")
    if doc.get("model_type") == "eagle" and isinstance(doc.get("model"), dict):
        doc = {**doc["model"], **{k: v for k, v in doc.items() if k not in ("model", "model_type")}}
    text = doc.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise GeometryError("text_config", f"{_short(text)} is not an object (the language model's own config)")
    cfg = {**doc, **text} if text else dict(doc)
    assistant = doc.get("model_type") in KV_READING_ASSISTANTS
    architecture = _architecture(doc if assistant else cfg)  # an assistant's text_config names no architecture
    num_layers = required_int(cfg, "num_hidden_layers")
    dtype = _dtype(doc, cfg)

    if (compressed := compressed_attention(cfg, num_layers)) is not None:  # DeepSeek-V4
        return _deepseek_v4(doc, cfg, str(architecture), dtype, compressed)
    if cfg.get("kv_lora_rank") is not None:  # MLA (DeepSeek V2/V3): one latent vector per token and layer
        return _mla(doc, cfg, str(architecture), dtype, num_layers)
    heads, kv_heads = _heads(cfg)
    head_dim = _head_dim(cfg, heads)
    kinds, window = dflash_sliding(cfg, *layer_kinds(cfg, num_layers))
    chunk = positive_int(cfg, "attention_chunk_size")
    kinds = shared_layers(cfg, chunked_layers(cfg, kinds, num_layers, chunk), num_layers, assistant=assistant)
    state, unused_state = _states(cfg, kinds)
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
        unused_state=unused_state,
        num_heads=heads,
    )


def _mla(doc: dict[str, Any], cfg: dict[str, Any], architecture: str, dtype: str | None, num_layers: int) -> Geometry:
    """An MLA model (DeepSeek V2/V3): one latent vector per token and layer; Kimi Linear's MLA beside KDA state
    layers."""
    kimi = kimi_delta_layers(cfg, num_layers)
    return Geometry(
        architecture,
        num_layers,
        1,
        required_int(cfg, "kv_lora_rank") + required_int(cfg, "qk_rope_head_dim"),
        dtype,
        tuple(kimi[0]) if kimi else ("mla",) * num_layers,
        None,
        _max_pos(cfg),
        kimi[1] if kimi else None,
        mtp_layers=_mtp_layers(cfg),
        mla_heads=positive_int(cfg, "num_attention_heads"),
        **_sparse_indexer(cfg),
        **_beside_the_cache(doc, cfg),
    )


def _deepseek_v4(
    doc: dict[str, Any], cfg: dict[str, Any], architecture: str, dtype: str | None, compressed: CompressedGeometry
) -> Geometry:
    """DeepSeek-V4: MLA-like layers of one ``head_dim``-wide latent, a sliding window each, and the compressed caches
    ``compressed`` describes."""
    layers = len(compressed.ratios)
    return Geometry(
        architecture, layers, 1, required_int(cfg, "head_dim"), dtype, ("mla",) * layers,
        required_int(cfg, "sliding_window"), _max_pos(cfg), mtp_layers=_mtp_layers(cfg),
        num_heads=positive_int(cfg, "num_attention_heads"), compressed=compressed, **_beside_the_cache(doc, cfg),
    )  # fmt: skip


# speculative drafters whose every layer reads the target's KV cache (transformers' Gemma4AssistantConfig: "all layers
# in a Gemma 4 Assistant model must be shared"; vLLM's config/speculative.py runs them as gemma4_mtp)
KV_READING_ASSISTANTS = ("gemma4_assistant", "gemma4_unified_assistant")

# the dtypes a config.json names that vLLM loads (its _STR_DTYPE_TO_TORCH_DTYPE), "torch." prefix allowed
MODEL_DTYPES = ("float32", "float", "bfloat16", "float16", "half")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _architecture(cfg: dict[str, Any]) -> str:
    """The first of ``architectures`` (vLLM's model class), else ``model_type``."""
    names = cfg.get("architectures")
    if names in (None, []):
        model_type = cfg.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise GeometryError("model_type", f"{_short(model_type)} is not a name")
        return model_type or "unknown"
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        example = '["LlamaForCausalLM"]'
        raise GeometryError("architectures", f"{_short(names)} is not a list of class names (e.g. {example})")
    return str(names[0])


def _dtype(doc: dict[str, Any], cfg: dict[str, Any]) -> str | None:
    """The model's dtype: ``torch_dtype`` (transformers < 4.56) or ``dtype``, the language model's first."""
    for key, value in (("torch_dtype", cfg.get("torch_dtype")), ("dtype", cfg.get("dtype")),
                       ("torch_dtype", doc.get("torch_dtype")), ("dtype", doc.get("dtype"))):  # fmt: skip
        if value is None:
            continue
        if not isinstance(value, str) or value.lower().removeprefix("torch.") not in MODEL_DTYPES:
            raise GeometryError(key, f"{_short(value)} is not a dtype vLLM loads ({', '.join(MODEL_DTYPES)})")
        return value
    return None


# the config sections of a multimodal model's encoders, whose outputs vLLM's memory profile holds
_ENCODER_SECTIONS = ("vision_config", "audio_config")


def _states(
    cfg: dict[str, Any], kinds: list[str]
) -> tuple[MambaGeometry | Mamba1Geometry | GatedDeltaNetGeometry | None, MambaGeometry | None]:
    """The state the model's state layers hold, and the Mamba-2 state its mamba_* fields describe where no layer
    holds one (None where they are incomplete: the plan says so where a release would read them)."""
    if "mamba" in kinds:
        return mamba2_state(cfg) or mamba1_state(cfg), None
    if "linear" in kinds:
        return gated_delta_net_state(cfg), None
    if cfg.get("mamba_n_heads") is not None:  # a hybrid's fields, and no layer that uses them
        with contextlib.suppress(GeometryError):
            return None, mamba2_state(cfg)
    return None, None


# where configs give their routed experts (Mixtral, Qwen MoE, DeepSeek), for the LoRA slots it leaves unmodelled
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _beside_the_cache(doc: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """What vLLM allocates beside the KV cache from the same budget: the linear layers' sizes (LoRA adapter slots),
    and a multimodal model's encoder section and the width of its outputs per token (its encoder cache). Absent
    fields leave them None."""
    hidden = positive_int(cfg, "hidden_size")
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
        width = required_int(vision, "out_hidden_size") * (1 + len(levels))
    return {"linear": linear, "encoder_width": width if section else None, "multimodal": section}


def _sparse_indexer(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek sparse attention (V3.2, GLM-5: ``index_topk``): vLLM 0.32 keeps an indexer cache per MLA layer beside
    the latent (``DeepseekV32IndexerCache``: ``index_head_dim`` fp8 values and a float32 scale per 128 of them, one
    byte each, per token). IndexCache configs, where only some layers keep one (``index_topk_freq`` /
    ``index_topk_pattern``), are left unmodelled."""
    if cfg.get("index_topk") is None:
        return {}
    head = required_int(cfg, "index_head_dim")
    freq, pattern = cfg.get("index_topk_freq", 1), cfg.get("index_topk_pattern")
    if pattern is not None and not isinstance(pattern, str | list):
        raise GeometryError("index_topk_pattern", f"{pattern!r} is not a pattern of layers ('S' skips one)")
    if freq != 1 or (pattern is not None and "S" in pattern):
        why = (
            f"DeepSeek sparse attention with IndexCache (index_topk_freq {freq!r}, index_topk_pattern {pattern!r}): "
            "only some layers keep an indexer cache, which the planner does not place"
        )
        return {"unmodelled_cache": why}
    return {"indexer_bytes": indexer_key_bytes(head)}


_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}


def _full_layer_shape(cfg: dict[str, Any], kinds: list[str], head_dim: int, kv_heads: int) -> tuple[int, int] | None:
    """Gemma 4's full-attention layers, whose K/V shape is not the sliding layers': ``per_layer_config`` (layer index
    -> head_dim / num_key_value_heads, as transformers 5 writes it) or ``global_head_dim`` (512 unless the config
    says) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` (transformers' Gemma4TextConfig). None
    where every layer has the first kind's shape."""
    overrides = cfg.get("per_layer_config")
    if overrides:
        return _per_layer_shape(overrides, kinds, head_dim, kv_heads)
    if cfg.get("model_type") in ("gemma4", "gemma4_text"):
        wide = positive_int(cfg, "global_head_dim") or 512
        heads = positive_int(cfg, "num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        shape = (heads or kv_heads, wide)
        return None if shape == (kv_heads, head_dim) else shape
    return None


def _per_layer_shape(overrides: Any, kinds: list[str], head_dim: int, kv_heads: int) -> tuple[int, int] | None:
    """The full-attention layers' one (KV heads, head_dim) from ``per_layer_config``; None where the overrides only
    repeat the first kind's shape. Another shape for a sliding layer, or several for the full ones, is refused."""
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
            positive_int(override, "num_key_value_heads") or kv_heads,
            positive_int(override, "head_dim") or head_dim,
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
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYERS:
                raise GeometryError(key, f"{value!r} is not a count of layers (0 to {MAX_LAYERS:,})")
            return int(value)
    return 0


def _max_pos(cfg: dict[str, Any]) -> int | None:
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_COUNT else None


#: a config.json larger than this is not one (real ones are a few KiB; a per-layer list of 10,000 layers is under 1 MiB)
MAX_CONFIG_BYTES = 16 * 2**20


def load_config(path: Path) -> Geometry:
    """The geometry of a config.json. GeometryError, naming the file, for any file that is not a model's config:
    unreadable, over 16 MiB, not JSON, nested deeper than the JSON reader follows, or a field vLLM would refuse."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise GeometryError(str(path), f"cannot read: {err.strerror}") from err
    if len(raw) > MAX_CONFIG_BYTES:
        raise GeometryError(str(path), f"is larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a model's config.json")
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise GeometryError(str(path), "is not a config's JSON: nested deeper than the JSON reader follows") from None
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
        except RecursionError:
            raise GeometryError(str(path), "header nested deeper than the JSON reader follows") from None
        except ValueError as err:
            raise GeometryError(str(path), f"header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise GeometryError(str(path), "header is not a JSON object of tensors")
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise GeometryError(f"{path}:{name}", f"unknown tensor dtype {dtype!r}")
        shape = info.get("shape", [])
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise GeometryError(f"{path}:{name}", f"shape {shape!r} is not a list of sizes")
        total += math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
    return total


def model_dir_weights_bytes(directory: Path) -> int:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise GeometryError(str(directory), "has no *.safetensors files")
    return sum(safetensors_bytes(f) for f in files)
