"""The plan's 0.34 rules against vLLM 0.34.0's own code: its pure functions and constants, read out of the CUDA
wheel's sources (``pip download --no-deps vllm==0.34.0``, unpacked once by scripts/vllm-cpu/releases.py) and run here.

Run as vLLM wrote them: ``measure_kv_cache_bytes`` and its margin constants (vllm/v1/worker/extensible_kv_cache.py),
``CacheConfig.resolved_gpu_memory_utilization`` and the defaults beside it (vllm/config/cache.py). The module around
them cannot be imported without CUDA's PyTorch, so each is taken from the file's syntax tree with the names it reads
(``current_platform.is_rocm()``, once for CUDA and once for ROCm). Not run, and why: ``measure_kv_cache_blocks``
and ``ExtensibleKVCache`` (they read a device's memory through ``torch.accelerator``; the plan takes their inputs
as the figures it is given), and the capacity arithmetic ``get_kv_cache_capacity`` (unchanged from 0.33, whose code
the vLLM 0.32 probes run: tests/test_vllm_releases.py)."""

from __future__ import annotations

import ast
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import lab
import releases
from vllm_capacity.sizing.memory import (
    EXTENSIBLE_MARGIN_FLOOR,
    EXTENSIBLE_MARGIN_FRACTION,
    MemoryBudget,
    extensible_kv_bytes,
)
from vllm_capacity.sizing.versions import default_block_size, default_gpu_memory_utilization

pytestmark = [pytest.mark.realvllm, pytest.mark.vllmcode]
GiB = 1 << 30


@pytest.fixture(scope="module")
def sources() -> Path:
    return releases.gpu_sources(lab.cache_dir(), Path(sys.executable), "0.34.0") / "vllm"


def _module_parts(path: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The top-level assignments and functions ``names`` of ``path``, executed in order in ``namespace``."""
    tree = ast.parse(path.read_text())
    body = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in names)
        or (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets))
    ]
    found = {n.name if isinstance(n, ast.FunctionDef) else n.targets[0].id for n in body}  # type: ignore[union-attr]
    assert found == names, f"{path.name} no longer has {names - found}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace


def _measure(sources: Path, rocm: bool) -> dict[str, Any]:
    platform = SimpleNamespace(is_rocm=lambda: rocm)
    return _module_parts(
        sources / "v1" / "worker" / "extensible_kv_cache.py",
        {"KV_CACHE_MARGIN_FLOOR_BYTES", "KV_CACHE_MARGIN_FRACTION", "measure_kv_cache_bytes"},
        {"current_platform": platform},
    )


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_margin_constants_are_vllms(sources: Path, platform: str) -> None:
    vllm = _measure(sources, rocm=platform == "rocm")
    assert vllm["KV_CACHE_MARGIN_FLOOR_BYTES"] == EXTENSIBLE_MARGIN_FLOOR[platform]
    assert vllm["KV_CACHE_MARGIN_FRACTION"] == EXTENSIBLE_MARGIN_FRACTION


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_extensible_sizing_is_measure_kv_cache_bytes(sources: Path, platform: str) -> None:
    """vLLM's function on what it measures (free and committed memory after warm-up) against the plan's on what it
    is given (what the engine holds beside the cache), over random GPUs, budgets and peaks, both arms of its min
    and the floor of 0 among them."""
    measure = _measure(sources, rocm=platform == "rocm")["measure_kv_cache_bytes"]
    rng = random.Random(34)
    for _ in range(2000):
        init_free = rng.randrange(8 * GiB, 192 * GiB)
        held = rng.randrange(0, init_free)  # weights, graphs, LoRA slots: resident after warm-up
        committed = rng.randrange(0, init_free - held + 1)  # the KV prefix warm-up committed
        free = init_free - held - committed
        requested = rng.choice([init_free, rng.randrange(1, init_free + 1)])
        peak = rng.randrange(0, 8 * GiB)
        growth = rng.choice([0, rng.randrange(0, 8 * GiB)])
        theirs = measure(
            init_free_memory=init_free,
            free_memory=free,
            committed_bytes=committed,
            requested_memory=requested,
            transient_peak_bytes=peak,
            torch_reserve_growth_bytes=growth,
        )
        ours = extensible_kv_bytes(
            init_free_memory=init_free,
            non_kv_used=held,
            requested_memory=requested,
            transient_peak_bytes=peak,
            margin_floor_bytes=EXTENSIBLE_MARGIN_FLOOR[platform],
            torch_reserve_growth_bytes=growth,
        )
        assert ours == theirs, (init_free, held, committed, requested, peak, growth)


def test_a_plans_budget_sizes_as_vllm_measures(sources: Path) -> None:
    """MemoryBudget under the extensible cache: the GPU all free at start, the engine holding weights, LoRA slots
    and graphs, the activation peak (and a multimodal encoder's outputs) the transient kept free."""
    measure = _measure(sources, rocm=False)["measure_kv_cache_bytes"]
    for utilization in (1.0, 0.95, 0.9, 0.5):
        b = MemoryBudget(int(79.19 * GiB), utilization, int(14.99 * GiB), int(1.19 * GiB), int(0.62 * GiB),
                         lora_bytes=1 << 28, encoder_cache_bytes=1 << 27, extensible=True)  # fmt: skip
        held = b.weights_bytes + b.lora_bytes + b.cuda_graph_bytes
        theirs = measure(
            init_free_memory=b.gpu_memory_bytes,
            free_memory=b.gpu_memory_bytes - held,
            committed_bytes=0,
            requested_memory=b.budget_bytes,
            transient_peak_bytes=b.activation_bytes + b.encoder_cache_bytes,
        )
        assert b.kv_cache_bytes == theirs


def test_the_defaults_are_vllms(sources: Path) -> None:
    """DEFAULT_BLOCK_SIZE and an unset gpu_memory_utilization resolved by vLLM's own property, in both modes."""
    tree = ast.parse((sources / "config" / "cache.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig"]
    consts: dict[str, Any] = {}
    for node in cls.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id.startswith("DEFAULT")
        ):
            consts[node.target.id] = ast.literal_eval(node.value)  # type: ignore[arg-type]
    (prop,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "resolved_gpu_memory_utilization"]
    prop.decorator_list = []
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[prop], type_ignores=[]), "cache.py", "exec"), namespace)  # noqa: S102
    resolve = namespace["resolved_gpu_memory_utilization"]
    assert consts["DEFAULT_BLOCK_SIZE"] == default_block_size((0, 34, 0)) == 64
    for extensible in (True, False):
        unset = SimpleNamespace(gpu_memory_utilization=None, enable_extensible_kv_cache=extensible, **consts)
        assert resolve(unset) == default_gpu_memory_utilization((0, 34, 0), extensible=extensible)
        assert (
            resolve(SimpleNamespace(gpu_memory_utilization=0.8, enable_extensible_kv_cache=extensible, **consts)) == 0.8
        )
    # the release before: the installed vllm-cpu 0.32's block size of 16 (0.33.0's wheel says the same)
    installed = lab.cache_dir() / f"vllm-cpu-{lab.VLLM_CPU_VERSION}"
    (cache_py,) = installed.glob("lib/python3*/site-packages/vllm/config/cache.py")
    assert "DEFAULT_BLOCK_SIZE: ClassVar[int] = 16" in cache_py.read_text()
    assert default_block_size((0, 33, 0)) == 16
