"""A vLLM 0.34 server as the agent sees it, built from vLLM 0.34.0's own format strings and labels (no CPU build of
0.34 exists, so no real 0.34 server can run here; the real CPU server of the tests is 0.32).

Each start-up line is the format string of the 0.34.0 wheel (``pip download --no-deps vllm==0.34.0``), quoted with
its file and line, filled with ``%`` as vLLM's logger fills it, behind the prefix vLLM's logger writes. The /metrics
payload is vLLM 0.32.0's real CPU capture (tests/fixtures/vllm/v1-0.32.0-cpu-saturated.prom) with its
``cache_config_info`` replaced by 0.34's (``CacheConfig.metrics_info``: every field of vllm/config/cache.py as
``str(value)``, so ``gpu_memory_utilization="None"`` unless it was set) and the families 0.33 and 0.34 added.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from support.files import fixture_text

GiB = 1 << 30

# vllm/v1/worker/extensible_kv_cache.py:694 (measure_kv_cache_blocks)
MEMORY_AFTER_WARMUP = (
    "Memory after warmup: %s GiB free, %s GiB committed to the KV cache, "
    "%s GiB kept for transient activations (%s GiB allocated at peak, "
    "%s GiB of torch reservation growth); %d KV cache blocks (%s GiB) "
    "fit within the requested %s GiB. Torch may reserve up to %s GiB."
)
# vllm/v1/worker/extensible_kv_cache.py:537 (extend_kv_cache)
EXTENDED = "Extended KV cache to %d blocks (%.2f GiB)."
# vllm/v1/worker/extensible_kv_cache.py:526
REMAPPING = "Remapping the KV cache from %d to %d blocks to fit the measured budget."
# vllm/v1/worker/gpu_worker.py:796: from 0.34 the estimate before warm-up
AVAILABLE = "Available KV cache memory: %s GiB"
# vllm/v1/core/kv_cache_utils.py:1169 (update_kv_cache_capacity): "GPU", or "GPU + host" under HiSparse
CAPACITY = "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
# vllm/v1/worker/gpu/model_runner.py:442 and :1217
MODEL_LOADING = "Model loading took %s GiB memory and %.6f seconds"
GRAPHS = "Graph capturing finished in %.0f secs, took %.2f GiB"
# vllm/entrypoints/common/startup.py:18 and :96
SERVER_VERSION = "vLLM server version %s, serving model %s"
NON_DEFAULT = "non-default args: %s"


def format_gib(b: float) -> str:
    """vllm/utils/mem_utils.py:31, format_gib."""
    return f"{round(b / GiB, 2)}"


def _line(prefix: str, source: str, message: str) -> str:
    return f"({prefix}) INFO 12-07 10:00:00 [{source}] {message}"


@dataclass(frozen=True)
class Start034:
    """One start of vLLM 0.34 on one GPU under the extensible KV cache: its figures, per rank."""

    blocks: int = 7540  # committed after warm-up
    bytes_per_block: int = 8 << 20  # Llama-3.1-8B bf16 at the default block size 64: 128 KiB a token
    estimate_bytes: float = 60.83 * GiB  # "Available KV cache memory": the reservation before warm-up
    weights_bytes: float = 14.99 * GiB
    graphs_bytes: float = 0.62 * GiB
    transient_peak_bytes: float = 1.19 * GiB
    requested_bytes: float = 79.19 * GiB  # total x resolved gpu_memory_utilization (1.0 unset)
    max_model_len: int = 32768
    remapped_from: int | None = None
    physical_extra_bytes: int = 1 << 20  # granule rounding of the committed segments
    host_tier: bool = False

    @property
    def tokens(self) -> int:
        """get_kv_cache_capacity: int(max_concurrency x max_model_len), one full-attention group: the blocks less
        the null block, in tokens (vllm/v1/core/kv_cache_utils.py)."""
        return int((self.blocks - 1) * 64 / self.max_model_len * self.max_model_len)

    def lines(self) -> list[str]:
        engine, worker = "EngineCore_DP0 pid=200", "Worker pid=210"
        fit_bytes = self.blocks * self.bytes_per_block
        out = [
            _line("APIServer pid=100", "startup.py:18", SERVER_VERSION % ("0.34.0", "meta-llama/Llama-3.1-8B")),
            _line("APIServer pid=100", "startup.py:96", NON_DEFAULT % "{'model': 'meta-llama/Llama-3.1-8B'}"),
            _line(worker, "model_runner.py:442", MODEL_LOADING % (format_gib(self.weights_bytes), 12.5)),
            _line(worker, "gpu_worker.py:796", AVAILABLE % format_gib(self.estimate_bytes)),
            _line(worker, "model_runner.py:1217", GRAPHS % (9, self.graphs_bytes / GiB)),
            _line(
                worker,
                "extensible_kv_cache.py:694",
                MEMORY_AFTER_WARMUP
                % (
                    format_gib(fit_bytes + 1.3 * GiB),
                    format_gib(64 << 20),
                    format_gib(self.transient_peak_bytes),
                    format_gib(self.transient_peak_bytes),
                    format_gib(0),
                    self.blocks,
                    format_gib(fit_bytes),
                    format_gib(self.requested_bytes),
                    format_gib(fit_bytes + 0.5 * GiB),
                ),
            ),
        ]
        if self.remapped_from is not None:
            out.append(_line(worker, "extensible_kv_cache.py:526", REMAPPING % (self.remapped_from, self.blocks)))
        out.append(
            _line(
                worker,
                "extensible_kv_cache.py:537",
                EXTENDED % (self.blocks, (fit_bytes + self.physical_extra_bytes) / GiB),
            )
        )
        pools = "GPU + host" if self.host_tier else "GPU"
        conc = self.tokens / self.max_model_len
        out.append(
            _line(
                engine,
                "kv_cache_utils.py:1169",
                CAPACITY % (pools, f"{self.tokens:,}", f"{self.max_model_len:,}", conc),
            )
        )
        return out


# vllm/config/cache.py of the 0.34.0 wheel: CacheConfig's fields in declaration order, as metrics_info gives them
# (str(value)); the values a CUDA server with the defaults reports after its engine settled them
CACHE_CONFIG_034 = {
    "block_size": "64",
    "gpu_memory_utilization": "None",
    "cache_dtype": "auto",
    "is_attention_free": "False",
    "num_gpu_blocks_override": "None",
    "sliding_window": "None",
    "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None",
    "kv_offloading_backend": "native",
    "simple_cpu_offload_num_blocks": "None",
    "num_gpu_blocks": "7540",
    "num_cpu_blocks": "None",
    "kv_cache_size_tokens": "482496",
    "kv_cache_max_concurrency": "14.72",
    "hash_block_size": "64",
    "cache_hit_alignment_tokens": "64",
    "kv_sharing_fast_prefill": "False",
    "mamba_cache_mode": "none",
    "enable_extensible_kv_cache": "True",
    "user_specified_block_size": "False",
}


def metrics_034(
    *, cache_config: dict[str, str] | None = None, extra: str = "", rejections: tuple[float, float] = (0, 0)
) -> str:
    """vLLM 0.32's real saturated capture as a 0.34 server would serve it: 0.34's cache_config_info (``cache_config``
    overrides labels), its admission rejections (``rejections``: max_num_queued_reqs, max_num_queued_tokens) and
    ``extra`` families before the end."""
    labels = {**CACHE_CONFIG_034, **(cache_config or {}), "engine": "0"}
    body = fixture_text("v1-0.32.0-cpu-saturated.prom")
    info = "vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} 1.0"
    body = re.sub(r"^vllm:cache_config_info\{.*$", info, body, flags=re.MULTILINE)
    reqs, toks = rejections
    body = re.sub(
        r'^(vllm:admission_rejections_total\{model_name="tiny-llama",reason="max_num_queued_reqs"\}) .*$',
        rf"\g<1> {reqs}",
        body,
        flags=re.MULTILINE,
    )
    body = re.sub(
        r'^(vllm:admission_rejections_total\{model_name="tiny-llama",reason="max_num_queued_tokens"\}) .*$',
        rf"\g<1> {toks}",
        body,
        flags=re.MULTILINE,
    )
    return body + extra
