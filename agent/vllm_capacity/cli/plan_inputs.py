"""What `vllm-capacity plan` is asked: from the command's options and the model's config.json to the planner's
inputs (:class:`~vllm_capacity.sizing.PlanInputs`) and, with --gpu-memory, the GPU's memory budget.

The command line parses the options (:mod:`vllm_capacity.cli.options`) and renders the plan
(:mod:`vllm_capacity.cli.plan`); everything between, including which combinations of options make sense, is here. A
missing or contradictory input raises :class:`MissingInput`, whose message names the option that gives it (the
command exits 2 with it).
"""

from __future__ import annotations

from pathlib import Path

from vllm_capacity.cli.configs import PlanConfig
from vllm_capacity.geometry import Geometry, GeometryError, tp_refusal
from vllm_capacity.sizing import (
    MemoryBudget,
    PlanInputs,
    Speculation,
    default_max_num_batched_tokens,
    default_max_num_seqs,
    kv_dtype_bytes,
    sampler_peak_bytes,
)
from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.inputs import resolved_engine_version
from vllm_capacity.sizing.lora import Lora, lora_slots
from vllm_capacity.sizing.memory import EXTENSIBLE_MARGIN_FLOOR, encoder_cache_bytes
from vllm_capacity.sizing.speculative import DRAFT_CONFIG_NEEDED
from vllm_capacity.sizing.versions import (
    CUDA_GRAPHS_IN_BUDGET,
    ENCODER_CACHE_PROFILE,
    EXTENSIBLE_KV_CACHE,
    EXTENSIBLE_PLATFORMS,
    default_block_size,
    default_gpu_memory_utilization,
    dotted,
)
from vllm_capacity.sources.model_config import load_config, model_dir_weights_bytes

ONE_MEMORY_SOURCE = "give one of --kv-cache-memory (as vLLM logs it) or --gpu-memory (with its utilization)"


class MissingInput(ValueError):
    """The plan needs a figure that was neither given nor can be read: the message says which option gives it."""


def lora_bytes(geometry: Geometry, lora: Lora | None, *, tp: int, pp: int, version: tuple[int, int, int]) -> int:
    """The LoRA adapter slots on the fullest GPU rank (0 without LoRA); NotModelled where they cannot be sized."""
    if lora is None:
        return 0
    dtype_bytes = kv_dtype_bytes("auto", geometry.dtype)
    return lora_slots(geometry, lora, tp=tp, pp=pp, dtype_bytes=dtype_bytes, version=version).total_bytes


def encoder_bytes(
    geometry: Geometry, tokens: int | None, *, budgeted: bool, version: tuple[int, int, int] = ENCODER_CACHE_PROFILE
) -> int:
    """A multimodal model's encoder cache held by vLLM's memory profile. ``budgeted``: planning from the GPU's
    memory, where a multimodal model without the figure would give a KV cache vLLM does not have."""
    if geometry.multimodal is None:
        if tokens is not None:
            raise MissingInput("--encoder-cache-tokens: config.json has no vision_config or audio_config")
        return 0
    if tokens is None:
        if budgeted:
            raise MissingInput(
                f"config.json is multimodal ({geometry.multimodal}): vLLM's memory profile holds the encoder's "
                "outputs, so --gpu-memory needs --encoder-cache-tokens N, from vLLM's log line 'Encoder cache will "
                "be initialized with a budget of N tokens' (0 with --skip-mm-profiling or --limit-mm-per-prompt of 0)"
            )
        return 0
    if tokens and version < ENCODER_CACHE_PROFILE:
        raise NotModelled(
            f"the encoder cache is sized as vLLM {dotted(ENCODER_CACHE_PROFILE)}'s memory profile holds it, not "
            f"{dotted(version)}'s: measure the profile's peak into --activation-memory with --encoder-cache-tokens 0"
        )
    if geometry.encoder_width is None:
        raise MissingInput("--encoder-cache-tokens needs config.json's hidden_size")
    return encoder_cache_bytes(tokens, geometry.encoder_width, kv_dtype_bytes("auto", geometry.dtype))


def assemble(values: PlanConfig) -> tuple[Geometry, PlanInputs, MemoryBudget | None]:
    """The model's geometry, the plan's inputs and (with --gpu-memory) the GPU's budget. Raises MissingInput for
    options that do not go together, GeometryError for a config.json that cannot be read, NotModelled or
    ImpossiblePlan where the budget cannot be given."""
    if values.model_config_path is not None and values.model_dir_path is None:
        config_path = values.model_config_path
    elif values.model_dir_path is not None and values.model_config_path is None:
        config_path = values.model_dir_path / "config.json"
    else:
        raise MissingInput("give one of --model-config or --model-dir")
    if (values.kv_cache_memory is None) == (values.gpu_memory is None):
        raise MissingInput(ONE_MEMORY_SOURCE)
    geometry = read_config(config_path)
    refusal = tp_refusal(
        geometry.num_heads or geometry.mla_heads,
        None if "mla" in geometry.layer_kinds else geometry.num_kv_heads,
        values.tp,
    )
    if refusal:
        raise MissingInput(f"--tp {values.tp}: vLLM refuses it for {config_path}: {refusal}")
    extensible_kv_cache(values)  # --extensible-kv-cache on where vLLM has none: refused on either path
    budget = gpu_budget(values, geometry)
    return geometry, plan_inputs(values, geometry, budget), budget


def gpu_budget(values: PlanConfig, geometry: Geometry) -> MemoryBudget | None:
    """vLLM's budget on one GPU rank with --gpu-memory; None when the KV memory is given directly (LoRA slots and the
    encoder cache are then inside vLLM's figure, but the options are still checked against the model). The LoRA
    slots are sized only here: outside a measured figure, what vLLM preallocates for them does not change it."""
    option = lora_option(values)
    if option is not None:
        option.check()  # options vLLM refuses are refused on either path
    if values.gpu_memory is None:
        lora = 0
    else:
        lora = lora_bytes(geometry, option, tp=values.tp, pp=values.pp, version=values.vllm_version)
    encoder = encoder_bytes(
        geometry, values.encoder_cache_tokens, budgeted=values.gpu_memory is not None, version=values.vllm_version
    )
    if values.gpu_memory is None:
        return None
    weights = values.weights_memory
    if weights is None:  # from the model directory's safetensors headers, divided over the TP x PP ranks
        if values.model_dir_path is None:
            raise MissingInput("--gpu-memory needs --weights-memory, or --model-dir to read the weights from")
        weights = model_dir_weights_bytes(values.model_dir_path) // (values.tp * values.pp)
    v1 = resolved_engine_version(values.engine_version, values.vllm_version) == "v1"
    extensible = extensible_kv_cache(values)
    budget = MemoryBudget(
        values.gpu_memory,
        gpu_memory_utilization(values),
        weights,
        _activation_bytes(values, geometry, v1),
        values.cuda_graph_memory or 0,
        lora_bytes=lora,
        encoder_cache_bytes=encoder,
        graphs_in_budget=extensible or (v1 and values.vllm_version >= CUDA_GRAPHS_IN_BUDGET),
        extensible=extensible,
        margin_floor_bytes=EXTENSIBLE_MARGIN_FLOOR.get(values.platform, EXTENSIBLE_MARGIN_FLOOR["cuda"]),
        not_given=tuple(
            name
            for name, given in (("activations", values.activation_memory), ("CUDA graphs", values.cuda_graph_memory))
            if given is None
        ),
    )
    budget.check()  # ImpossiblePlan when nothing is left for the KV cache
    return budget


def extensible_kv_cache(values: PlanConfig) -> bool:
    """Whether vLLM sizes this plan's KV cache after warm-up (0.34's extensible KV cache): as vLLM settles
    ``enable_extensible_kv_cache`` (``VllmConfig._resolve_extensible_kv_cache``): on by default from 0.34 on CUDA
    and ROCm; asked for where it does not exist, refused as vLLM refuses it."""
    supported = values.vllm_version >= EXTENSIBLE_KV_CACHE and values.platform in EXTENSIBLE_PLATFORMS
    if values.extensible_kv_cache == "on" and not supported:
        if values.vllm_version < EXTENSIBLE_KV_CACHE:
            raise MissingInput(
                f"--extensible-kv-cache on: vLLM {dotted(values.vllm_version)} has no extensible KV cache (from "
                f"{dotted(EXTENSIBLE_KV_CACHE)})"
            )
        raise MissingInput(
            f"--extensible-kv-cache on: vLLM supports it only on CUDA and ROCm, not --platform {values.platform}"
        )
    return supported and values.extensible_kv_cache != "off"


def gpu_memory_utilization(values: PlanConfig) -> float:
    """--gpu-memory-utilization as given, else as the release resolves it unset for the way it sizes the cache."""
    if values.gpu_memory_utilization is not None:
        return values.gpu_memory_utilization
    return default_gpu_memory_utilization(values.vllm_version, extensible=extensible_kv_cache(values))


def _activation_bytes(values: PlanConfig, geometry: Geometry, v1: bool) -> int:
    """The activation peak given, else V1's estimated as its sampler's warm-up (max_num_seqs as given or vllm serve's
    default for the GPU), else 0 (V0, or a config.json without the vocabulary): the plan's notes say which."""
    if values.activation_memory is not None:
        return values.activation_memory
    if not v1 or geometry.linear is None:
        return 0
    seqs = values.max_num_seqs or default_max_num_seqs(values.gpu_memory)
    return sampler_peak_bytes(geometry.linear.vocab_size, seqs)


def plan_inputs(values: PlanConfig, geometry: Geometry, budget: MemoryBudget | None) -> PlanInputs:
    max_model_len = values.max_model_len or geometry.max_position_embeddings
    if not max_model_len:
        raise MissingInput("config.json has no max_position_embeddings: give --max-model-len")
    if budget is not None:
        kv_cache_memory = budget.kv_cache_bytes
    elif values.kv_cache_memory is not None:
        kv_cache_memory = values.kv_cache_memory
    else:
        raise MissingInput(ONE_MEMORY_SOURCE)
    return PlanInputs(
        kv_cache_memory_bytes=kv_cache_memory,
        max_model_len=max_model_len,
        tp=values.tp,
        pp=values.pp,
        kv_cache_dtype=values.kv_cache_dtype,
        block_size=values.block_size or default_block_size(values.vllm_version),
        version=values.vllm_version,
        engine_version=values.engine_version,
        max_num_batched_tokens=values.max_num_batched_tokens or default_max_num_batched_tokens(values.gpu_memory),
        async_scheduling=values.async_scheduling == "on",
        mamba_cache_mode=values.mamba_cache_mode,
        mamba_ssm_cache_dtype=values.mamba_ssm_cache_dtype,
        speculation=speculation_option(values),
        chunked_local_hybrid=values.chunked_local_hybrid,
        kv_offloading_bytes=values.kv_offloading_size,
        lora=lora_option(values),
        encoder_cache_tokens=values.encoder_cache_tokens,
    )


def lora_option(values: PlanConfig) -> Lora | None:
    """vLLM's --enable-lora with --max-loras and --max-lora-rank (either turns it on; vLLM's defaults 1 and 16)."""
    if values.max_loras is None and values.max_lora_rank is None:
        if values.fully_sharded_loras == "on":
            raise MissingInput("--fully-sharded-loras needs --max-loras or --max-lora-rank (vLLM's --enable-lora)")
        return None
    return Lora(values.max_loras or 1, values.max_lora_rank or 16, values.fully_sharded_loras == "on")


def speculation_option(values: PlanConfig) -> Speculation | None:
    """vLLM's --speculative-config from --speculative-method, --num-speculative-tokens and --draft-model-config."""
    method, tokens, draft = values.speculative_method, values.num_speculative_tokens, values.draft_model_config_path
    if method is None:
        if tokens is not None or draft is not None:
            raise MissingInput("--num-speculative-tokens and --draft-model-config need --speculative-method")
        return None
    if tokens is None:
        raise MissingInput(f"--speculative-method {method} needs --num-speculative-tokens")
    if method in DRAFT_CONFIG_NEEDED and draft is None:
        raise MissingInput(f"--speculative-method {method} needs --draft-model-config (the draft model's config.json)")
    if method == "ngram" and draft is not None:  # mtp's: Gemma 4's assistant only (Speculation.check)
        raise MissingInput(f"--speculative-method {method} takes no --draft-model-config")
    return Speculation(method, tokens, read_config(draft) if draft is not None else None)


def read_config(path: Path) -> Geometry:
    """load_config, its errors naming the file as well as the field."""
    try:
        return load_config(path)
    except GeometryError as err:
        if err.field.startswith(str(path)):
            raise
        raise GeometryError(f"{path}: {err.field}", err.message) from None
