"""The state layers of a hybrid model (Mamba-1, Mamba-2, Gated DeltaNet) in vLLM's KV cache: the state a request
holds, its blocks (prefix caching's 'align' mode, speculative tokens), and the attention block raised until a page
holds one state (``platforms/interface.py``). Used by :mod:`vllm_capacity.sizing.hybrid`."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from vllm_capacity.geometry import Geometry, KimiDeltaGeometry, Mamba1Geometry, MambaGeometry
from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.inputs import PlanInputs
from vllm_capacity.sizing.layers import STATE_KINDS, bytes_per_token_per_layer, kv_dtype_bytes
from vllm_capacity.sizing.versions import (
    ATTENTION_ONLY_HYBRID,
    ATTENTION_ONLY_HYBRID_CLASSES,
    ATTENTION_ONLY_HYBRID_RAISED,
    HYBRID_PREFIX_CACHING,
    MAMBA1_PREFIX_CACHING,
    MAMBA1_V1,
    MAMBA2_CHECKPOINT,
    MAMBA2_SPECULATIVE,
    MLA_HYBRID_BLOCK_ALIGNMENT,
    STATE_BLOCK_ALIGNMENT,
    STATE_SPECULATIVE_BLOCKS,
    dotted,
)


def where(geometry: Geometry, counts: Counter[str]) -> str:
    return f"{geometry.architecture} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))} layers)"


def speculative_state(geometry: Geometry, counts: Counter[str], inputs: PlanInputs) -> tuple[int, int]:
    """What speculative decoding adds to each request's state: blocks (one per speculative token), and columns of
    the conv state kept for the drafted tokens (not Mamba-1's); refused before the releases that were read."""
    if inputs.speculation is None:
        return 0, 0
    if inputs.version < STATE_SPECULATIVE_BLOCKS:
        raise NotModelled(
            f"{where(geometry, counts)}: speculative decoding beside state layers is planned from vLLM "
            f"{dotted(STATE_SPECULATIVE_BLOCKS)}, not before"
        )
    if isinstance(geometry.state, MambaGeometry) and inputs.version < MAMBA2_SPECULATIVE:
        raise NotModelled(
            f"{where(geometry, counts)}: speculative decoding beside Mamba-2 layers is planned from vLLM "
            f"{dotted(MAMBA2_SPECULATIVE)} (it came with PR #33726, February 2026; earlier releases not read)"
        )
    columns = 0 if isinstance(geometry.state, Mamba1Geometry) else inputs.speculation.num_speculative_tokens
    return inputs.speculation.state_blocks, columns


def state_layout(
    geometry: Geometry, counts: Counter[str], inputs: PlanInputs, per_layer: int, notes: list[str]
) -> tuple[int, int]:
    """The attention block size (raised until a page holds one state) and the state blocks per request; (the asked
    block size, 0) for a model without state layers."""
    block_size, version = inputs.block_size, inputs.version
    state_kinds = [k for k in STATE_KINDS if k in counts]
    if not state_kinds:
        return block_size, 0
    if len(state_kinds) > 1 or geometry.state is None:
        fields = "mamba_n_heads, mamba_d_state..." if "mamba" in counts else "linear_num_value_heads..."
        raise NotModelled(f"{where(geometry, counts)}: config.json gives no state fields the planner reads ({fields})")
    if isinstance(geometry.state, Mamba1Geometry):
        check_mamba1(inputs, counts, geometry)
    mode = resolve_mamba_mode(inputs.mamba_cache_mode, version)
    state_blocks = 1 if mode == "none" else geometry.state.align_blocks(version >= MAMBA2_CHECKPOINT)
    spec_blocks, spec_columns = speculative_state(geometry, counts, inputs)
    state_blocks += spec_blocks
    conv_bytes, ssm_bytes, why = _state_dtype_bytes(geometry, inputs.mamba_ssm_cache_dtype)
    state = geometry.state.state_bytes(inputs.tp, conv_bytes, ssm_bytes, spec_columns)
    needed = block_holding(state, per_layer, block_size, version, mla="mla" in counts)
    if block_size < needed:
        notes.append(
            f"vLLM raises the attention block size from {block_size} to {needed} tokens so that a page holds "
            f"one {geometry.state.name} state ({state:,} bytes)"
        )
        block_size = needed
    padding = (block_size * per_layer - state) / state * 100
    notes.append(
        f"Mamba cache mode {mode} ({state_blocks} state block(s) per request and layer group"
        f"{', one per speculative token included' if inputs.speculation else ''}); "
        f"{f'conv state widened by {spec_columns} speculative token(s); ' if spec_columns else ''}SSM state "
        f"{ssm_bytes} B per element{f' ({why})' if why else ''}; {geometry.state.name} page padded by "
        f"{padding:.2f}%"
    )
    return block_size, state_blocks


def _state_dtype_bytes(geometry: Geometry, requested: str) -> tuple[int, int, str | None]:
    """Bytes per element of a state's conv part (the model's dtype) and SSM part (``mamba_ssm_dtype``), and why the
    SSM dtype is what it is (None where asked for or the model's)."""
    ssm_name, why = mamba_ssm_dtype(geometry, requested)
    conv_bytes = kv_dtype_bytes("auto", geometry.dtype)
    try:
        ssm_bytes = conv_bytes if ssm_name == "auto" else kv_dtype_bytes(ssm_name, geometry.dtype)
    except ValueError:
        raise ValueError(
            f"SSM state dtype {ssm_name!r}{f' ({why})' if why else ''} is not a dtype vLLM knows"
        ) from None
    return conv_bytes, ssm_bytes, why


def block_holding(
    state: int, per_layer: int, block_size: int, version: tuple[int, int, int], *, mla: bool = False
) -> int:
    """The attention block size whose page (``per_layer`` bytes a token) holds one ``state``: the attention block grows
    in steps of 16 (from 0.20, of the block size asked for; beside MLA, of at least 128) until it does
    (platforms/interface.py)."""
    align = max(16, block_size) if version >= STATE_BLOCK_ALIGNMENT else 16
    if mla:
        align = max(align, MLA_HYBRID_BLOCK_ALIGNMENT)
    return align * math.ceil(state / (align * per_layer))


def attention_only_hybrid_block(geometry: Geometry, inputs: PlanInputs) -> tuple[int, str | None]:
    """The attention block size of a GraniteMoeHybrid config whose layers are all attention (Granite 4.0 micro), and
    the note that says why: from ATTENTION_ONLY_HYBRID_RAISED until ATTENTION_ONLY_HYBRID vLLM took the model class
    for a hybrid and raised the block until a page held the Mamba-2 state its unused mamba_* fields describe (in a
    hybrid's dtypes: the model's, or mamba_ssm_cache_dtype for the SSM state); otherwise the block size asked for."""
    if (
        geometry.architecture not in ATTENTION_ONLY_HYBRID_CLASSES
        or geometry.state is not None
        or inputs.resolved_engine_version != "v1"
        or not ATTENTION_ONLY_HYBRID_RAISED <= inputs.version < ATTENTION_ONLY_HYBRID
    ):
        return inputs.block_size, None
    if geometry.unused_state is None:
        raise NotModelled(
            f"{geometry.architecture} with attention layers only: vLLM {dotted(inputs.version)} sizes its attention "
            "block from the Mamba-2 state of the config's mamba_* fields (mamba_n_heads, mamba_d_head, mamba_d_state, "
            f"...), which config.json does not give whole; vLLM {dotted(ATTENTION_ONLY_HYBRID)} and later do not"
        )
    as_hybrid = replace(geometry, state=geometry.unused_state)
    conv_bytes, ssm_bytes, _ = _state_dtype_bytes(as_hybrid, inputs.mamba_ssm_cache_dtype)
    state = geometry.unused_state.state_bytes(inputs.tp, conv_bytes, ssm_bytes, 0)
    per_layer = bytes_per_token_per_layer(geometry, inputs.tp, kv_dtype_bytes(inputs.kv_cache_dtype, geometry.dtype))
    needed = block_holding(state, per_layer, inputs.block_size, inputs.version)
    if needed <= inputs.block_size:
        return inputs.block_size, None
    return needed, (
        f"vLLM {dotted(inputs.version)} takes {geometry.architecture} for a hybrid although every layer is attention, "
        f"and raises the attention block size from {inputs.block_size} to {needed} tokens so that a page would hold "
        f"the Mamba-2 state its mamba_* fields describe ({state:,} bytes; fixed in {dotted(ATTENTION_ONLY_HYBRID)})"
    )


def check_mamba1(inputs: PlanInputs, counts: Counter[str], geometry: Geometry) -> None:
    """Mamba-1 (Jamba) is planned where vLLM's rules for it were read."""
    if inputs.version < MAMBA1_V1:
        raise NotModelled(
            f"{where(geometry, counts)}: Mamba-1 layers in V1 are planned from vLLM {dotted(MAMBA1_V1)} "
            "(V0 kept their state outside the KV budget: pass --engine v0 for an older server)"
        )
    if inputs.mamba_cache_mode == "auto" and HYBRID_PREFIX_CACHING <= inputs.version < MAMBA1_PREFIX_CACHING:
        raise NotModelled(
            f"{where(geometry, counts)}: whether vLLM {dotted(inputs.version)} keeps Jamba's Mamba-1 state in "
            "'align' mode by default is not known: pass --mamba-cache-mode none or align (vllm:cache_config_info's "
            "mamba_cache_mode says which)"
        )


def resolve_mamba_mode(mode: str, version: tuple[int, int, int]) -> str:
    """``auto``: the mode vLLM picks with its default prefix caching, which it turns on for hybrid models from 0.28
    (and then picks 'align'); before, prefix caching is off for them, and so is the state cache ('none')."""
    if mode not in ("auto", "none", "align"):
        raise ValueError(f"mamba cache mode {mode!r} is not auto, none or align")
    if mode != "auto":
        return mode
    return "align" if version >= HYBRID_PREFIX_CACHING else "none"


def mamba_ssm_dtype(geometry: Geometry, requested: str) -> tuple[str, str | None]:
    """vLLM's ``mamba_ssm_cache_dtype``: an explicit value wins; ``auto`` takes the config's own field, Nemotron-H's
    float32 default (0.32 ``NemotronHForCausalLMConfig``), else the conv state's dtype (the model's)."""
    if isinstance(geometry.state, KimiDeltaGeometry):
        if requested not in ("auto", "float32"):
            raise NotModelled(
                f"--mamba-ssm-cache-dtype {requested}: vLLM 0.32's KDA layers keep their recurrent state in float32 "
                "whatever it says (kda_state_dtype, called without it), while its block sizing reads it"
            )
        return "float32", "KDA's recurrent state is float32 (vLLM's kda_state_dtype)"
    if requested != "auto":
        return requested, None
    if geometry.state is not None and geometry.state.ssm_cache_dtype:
        return geometry.state.ssm_cache_dtype, "the SSM state dtype comes from config.json"
    if geometry.architecture.startswith("NemotronH"):
        return "float32", "Nemotron-H's SSM state is float32 unless --mamba-ssm-cache-dtype says otherwise"
    return "auto", None
