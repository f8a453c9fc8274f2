"""Speculative decoding in vLLM's KV cache: the drafter's layers share the target's pool, and each request reserves
slots for the drafted tokens.

After vLLM 0.32's ``vllm/config/speculative.py`` and ``vllm/config/vllm.py``:

* An EAGLE / EAGLE-3 head, a model's own MTP layers (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo: ``--speculative-config
  .method mtp``) or a separate draft model registers attention layers like the target's, and V1 sizes one pool for
  all of them (``get_kv_cache_spec`` walks the whole forward context). A drafter whose pages equal the target's
  simply adds layers to a group; one with other pages (fewer KV heads, another head size) joins a single group of
  per-layer page sizes (``UniformTypeKVCacheSpecs``) from 0.11.0, so a block costs the sum of every layer's page.
* Gemma 4's assistant (``method mtp`` with a ``gemma4_assistant`` drafter, from 0.21.0) holds no KV of its own:
  each of its layers reads the target's last layer of its type (cross-model KV sharing), so it adds no page; its
  look-ahead is an MTP's.
* DFlash (``method dflash``: a block-diffusion drafter of its own config.json, Qwen3-shaped) registers its layers
  like a draft model's; its block of drafts is a bonus query and one per drafted token.
* ``num_lookahead_tokens`` = ``num_speculative_tokens`` for EAGLE-family and draft-model drafters (+1 for DFlash
  from 0.23.0, 0 for n-gram):
  ``allocate_slots`` reserves them beyond the scheduled tokens, capped at ``max_model_len``, so vLLM's "Maximum
  concurrency" at ``max_model_len`` is unchanged while a shorter request may hold one block more.
* Mamba / Gated DeltaNet layers keep one state block per speculative token besides their own (``MambaSpec
  .num_speculative_blocks``).

The drafter's KV takes the target's dtype (vLLM loads the drafter in the target's dtype and one ``--kv-cache-dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing.errors import NotModelled
from vllm_capacity.sizing.layers import bytes_per_token_per_layer
from vllm_capacity.sizing.versions import (
    DFLASH,
    DFLASH_BONUS_SLOT,
    DFLASH_SLIDING,
    GEMMA4_MTP,
    GEMMA4_UNIFIED_MTP,
    MIXED_PAGE_SIZES,
    SPECULATIVE_RULES,
    EngineVersion,
    Version,
    dotted,
)

METHODS = ("eagle", "eagle3", "mtp", "draft_model", "dflash", "ngram")
# drafters with KV layers of their own, and look-ahead slots
WITH_LAYERS = ("eagle", "eagle3", "mtp", "draft_model", "dflash")
DRAFT_CONFIG_NEEDED = ("draft_model", "dflash")  # a drafter of its own the planner cannot assume a shape for
EAGLE_LAYERS = 1  # an EAGLE / EAGLE-3 head without its config.json: one decoder layer (the issue #19996 log fits it)


@dataclass(frozen=True)
class Speculation:
    """vLLM's ``--speculative-config``: the method, ``num_speculative_tokens``, and the drafter's config.json when
    there is one (an EAGLE head's, or the draft model's)."""

    method: str
    num_speculative_tokens: int
    draft: Geometry | None = None

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive")
        if self.method in DRAFT_CONFIG_NEEDED and self.draft is None:
            raise ValueError(f"speculative method {self.method} needs the draft model's config.json")
        if self.method == "ngram" and self.draft is not None:
            raise ValueError("speculative method ngram has no separate drafter config")
        reads_target = self.draft is not None and self.draft.reads_target_kv
        if self.method == "mtp" and self.draft is not None and not reads_target:
            raise ValueError(
                "speculative method mtp takes a drafter's config.json only for Gemma 4's assistant (model_type "
                "gemma4_assistant); a model's own MTP layers are in its config.json"
            )
        if reads_target and self.method != "mtp":
            raise ValueError("Gemma 4's assistant (a drafter reading the target's KV) runs as speculative method mtp")

    def lookahead_tokens(self, version: Version) -> int:
        """KV slots each request reserves for the drafted tokens (vLLM's ``num_lookahead_tokens``): DFlash's block
        of drafts is one bonus query and one per drafted token from 0.23.0 (the scheduler's extra slot)."""
        if self.method == "dflash" and version >= DFLASH_BONUS_SLOT:
            return self.num_speculative_tokens + 1
        return self.num_speculative_tokens if self.method in WITH_LAYERS else 0

    @property
    def state_blocks(self) -> int:
        """State blocks a Mamba / GDN layer keeps per request besides its own (``num_speculative_blocks``)."""
        return self.num_speculative_tokens


@dataclass(frozen=True)
class Drafter:
    """The drafter's KV layers: how many, of which kind, and the geometry whose heads size their pages."""

    kind: str  # full | mla
    layers: int
    geometry: Geometry
    what: str  # for the plan's notes


def drafter(target: Geometry, speculation: Speculation) -> Drafter | None:
    """The KV layers ``speculation`` adds to ``target``'s pool; None for a drafter without any (n-gram)."""
    method = speculation.method
    own_kind = "mla" if "mla" in target.layer_kinds else "full"
    if method == "ngram":
        return None
    if method == "mtp":
        if not target.mtp_layers:
            raise NotModelled(
                f"{target.architecture}: config.json names no MTP layers (num_nextn_predict_layers or "
                "mtp_num_hidden_layers), so --speculative-method mtp has nothing to run"
            )
        return Drafter(own_kind, target.mtp_layers, target, f"{target.mtp_layers} MTP layer(s) of the model's own")
    draft = speculation.draft
    if draft is None:
        return Drafter(
            own_kind,
            EAGLE_LAYERS,
            target,
            f"{EAGLE_LAYERS} {method.upper()} layer with the target's attention shape (assumed: give "
            "--draft-model-config for the drafter's own)",
        )
    kinds = {k for k in draft.layer_kinds if k != "none"}
    if kinds not in ({"full"}, {"mla"}):
        raise NotModelled(
            f"drafter {draft.architecture} has {', '.join(sorted(kinds))} layers: only drafters whose layers are all "
            "full attention, or all MLA, are modelled"
        )
    what = f"{draft.kv_layers} layer(s) of the drafter {draft.architecture}"
    return Drafter(kinds.pop(), draft.kv_layers, draft, what)


def _dflash_as_run(speculation: Speculation, version: Version, name: str) -> tuple[Speculation, list[str]]:
    """The DFlash drafter as ``version`` runs it: refused before vLLM had one; before 0.25.0 its sliding layers run
    as full attention (noted)."""
    if version < DFLASH:
        raise NotModelled(f"{name}: vLLM {dotted(version)} has no DFlash (first in {dotted(DFLASH)})")
    draft = speculation.draft
    if draft is None or version >= DFLASH_SLIDING or "sliding" not in draft.layer_kinds:
        return speculation, []
    kinds = tuple("full" if k == "sliding" else k for k in draft.layer_kinds)
    note = (
        f"{name}: vLLM {dotted(version)} runs every DFlash drafter layer as full attention, whatever its config says "
        f"(sliding windows from {dotted(DFLASH_SLIDING)})"
    )
    return replace(speculation, draft=replace(draft, layer_kinds=kinds, sliding_window=None)), [note]


def is_gemma4_assistant(target: Geometry, speculation: Speculation) -> bool:
    """Whether the drafter is Gemma 4's assistant, which reads the target's KV: its config.json says so, or it is MTP
    on a Gemma 4, which has no MTP layers of its own (all the agent knows of a live server is its logged method)."""
    if speculation.draft is not None:
        return speculation.draft.reads_target_kv
    return speculation.method == "mtp" and not target.mtp_layers and _gemma4(target)


def adds_layers(target: Geometry, speculation: Speculation) -> bool:
    """Whether the drafter adds KV layers to the pool: n-gram drafts from the prompt, Gemma 4's assistant reads the
    target's pages."""
    return speculation.method in WITH_LAYERS and not is_gemma4_assistant(target, speculation)


def _gemma4(geometry: Geometry) -> bool:
    return geometry.architecture.startswith(("Gemma4", "gemma4"))  # the class, or the model_type of a text_config


def _check_gemma4_assistant(target: Geometry, speculation: Speculation, version: Version) -> None:
    """Refuse Gemma 4's assistant beside another model, or before the release that first runs it."""
    draft = speculation.draft
    unified = draft is not None and draft.architecture.startswith("Gemma4Unified")
    if not _gemma4(target):
        raise NotModelled(
            f"a drafter that reads the target's KV ({draft.architecture if draft else 'MTP'}) beside "
            f"{target.architecture}: vLLM pairs Gemma 4's assistant with a Gemma 4 only"
        )
    first = GEMMA4_UNIFIED_MTP if unified else GEMMA4_MTP
    if version < first:
        raise NotModelled(f"Gemma 4's assistant (MTP) is planned from vLLM {dotted(first)}, which first runs it")


@dataclass(frozen=True)
class DraftPages:
    """A drafter whose pages differ from the target's: its bytes per token per rank, over all its layers."""

    bytes_per_token: int
    layers: int


def _as_run(
    speculation: Speculation, *, pp: int, engine_version: EngineVersion, version: Version
) -> tuple[Speculation, str, list[str]]:
    """The speculation as vLLM ``version`` runs it, its name for the notes, and the notes of how it runs; NotModelled
    where the planner does not follow it (V0, pipeline parallelism, a release before the rules were read)."""
    speculation.check()
    name = f"speculative decoding ({speculation.method}, {speculation.num_speculative_tokens} token(s))"
    if engine_version != "v1":
        raise NotModelled(f"{name} under V0: its draft worker kept a cache of its own, which is not modelled")
    if version < SPECULATIVE_RULES:
        raise NotModelled(f"{name} is planned from vLLM {dotted(SPECULATIVE_RULES)}, not before")
    notes: list[str] = []
    if speculation.method == "dflash":
        speculation, notes = _dflash_as_run(speculation, version, name)
    if pp > 1:
        raise NotModelled(f"{name} under pipeline parallelism: where the drafter's layers go is not modelled")
    if lookahead := speculation.lookahead_tokens(version):
        notes.append(
            f"each request reserves {lookahead} look-ahead slot(s) for the drafted tokens "
            "(vLLM's num_lookahead_tokens), capped at max_model_len: the concurrency at max_model_len is unchanged, "
            "a shorter request may hold one block more"
        )
    return speculation, name, notes


def with_drafter(
    target: Geometry,
    speculation: Speculation,
    *,
    tp: int,
    pp: int,
    kv_dtype_bytes: int,
    engine_version: EngineVersion,
    version: Version,
) -> tuple[Geometry, DraftPages | None, list[str]]:
    """The target with the drafter's layers added when their pages match (one pool, more layers), or the drafter's
    pages apart when they do not (vLLM's single group of per-layer page sizes); the notes say what was assumed."""
    speculation, name, notes = _as_run(speculation, pp=pp, engine_version=engine_version, version=version)
    if is_gemma4_assistant(target, speculation):
        _check_gemma4_assistant(target, speculation, version)
        what = f"Gemma 4's assistant{f' {speculation.draft.architecture}' if speculation.draft else ''}"
        shared = f"{name}: {what} reads the target's KV cache (vLLM's cross-model KV sharing): no pages of its own"
        return target, None, [shared, *notes]
    found = drafter(target, speculation)
    if found is None:
        return target, None, [f"{name}: the drafter holds no KV cache", *notes]
    per_layer = bytes_per_token_per_layer(target, tp, kv_dtype_bytes)
    draft_per_layer = bytes_per_token_per_layer(found.geometry, tp, kv_dtype_bytes)
    own_kinds = {k for k in target.layer_kinds if k in ("full", "sliding", "mla")}
    joins = found.kind == "mla" if "mla" in own_kinds else found.kind == "full"
    if not joins:
        raise NotModelled(f"{name}: a {found.kind} drafter beside {', '.join(sorted(own_kinds))} layers")
    added = f"{name}: {found.what} share(s) the KV pool"
    if draft_per_layer == per_layer:
        extended = replace(target, layer_kinds=(*target.layer_kinds, *(found.kind,) * found.layers))
        return extended, None, [f"{added}, +{per_layer * found.layers:,} bytes per token", *notes]
    if not target.uniform:
        raise NotModelled(
            f"{name}: a drafter whose pages ({draft_per_layer:,} bytes per token and layer) differ from the target's "
            f"({per_layer:,}) beside a hybrid layout is not modelled"
        )
    if version < MIXED_PAGE_SIZES:
        raise NotModelled(
            f"{name}: a drafter whose pages differ from the target's needs vLLM "
            f"{dotted(MIXED_PAGE_SIZES)} (one group of per-layer page sizes); before, vLLM refused it"
        )
    pages = DraftPages(draft_per_layer * found.layers, found.layers)
    note = (
        f"{added} with pages of their own ({draft_per_layer:,} bytes per token and layer, the target's "
        f"{per_layer:,}): a block costs every layer's page, +{pages.bytes_per_token:,} bytes per token"
    )
    return target, pages, [note, *notes]
