"""The typed configuration of each command: a field per option (the options themselves, their parsing and
environment twins: :mod:`.options`; sweep's: :mod:`.sweep_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.derive.latency_curve import Objective
from vllm_capacity.geometry import Geometry
from vllm_capacity.sizing import EngineVersion

Switch = Literal["auto", "on", "off"]  # auto: as the release or the machine decides
OnOff = Literal["on", "off"]
TextOrJson = Literal["text", "json"]
LogFormat = Literal["json", "logfmt", "console"]


@dataclass(frozen=True)
class SourceConfig:
    """What serve and report read vLLM (and the model, its log, the GPUs) with; a field per option."""

    vllm_url: str
    timeout: float
    flags: ServerFlags  # --max-model-len; serve's --max-num-seqs, --max-num-batched-tokens
    api_key_file: str | None  # the key read from the file, not its path; never logged
    max_body_size: int
    vllm_log: str | None
    model_config: Geometry | None
    model_dir: Geometry | None
    tp: int
    pp: int
    nvml: Switch
    gpus: list[str] | str | None
    slo_itl: Objective | None
    slo_ttft: Objective | None
    latency_half_life: float


@dataclass(frozen=True)
class ServeConfig(SourceConfig):
    listen: tuple[str, int]
    interval: float
    models_refresh: float
    web_telemetry_path: str
    web_config_file: Path | None
    probe_listen: tuple[str, int] | None
    web_max_requests: int
    web_disable_exporter_metrics: bool
    gpu_device_series: OnOff  # off: beside dcgm-exporter, the device's own readings left out
    log_format: LogFormat
    log_level: str


@dataclass(frozen=True)
class ReportConfig(SourceConfig):
    format: TextOrJson
    watch: float | None


@dataclass(frozen=True)
class PlanConfig:
    model_config_path: Path | None
    model_dir_path: Path | None
    tp: int
    pp: int
    kv_cache_dtype: str
    block_size: int | None
    max_model_len: int | None
    vllm_version: tuple[int, int, int]
    engine_version: EngineVersion | None  # --engine
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    async_scheduling: OnOff
    mamba_cache_mode: Literal["auto", "none", "align"]
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"]
    chunked_local_hybrid: Switch
    speculative_method: Literal["eagle", "eagle3", "mtp", "draft_model", "dflash", "ngram"] | None
    num_speculative_tokens: int | None
    draft_model_config_path: Path | None
    kv_offloading_size: int | None
    max_loras: int | None
    max_lora_rank: int | None
    fully_sharded_loras: OnOff
    encoder_cache_tokens: int | None
    kv_cache_memory: int | None
    gpu_memory: int | None
    gpu_memory_utilization: float | None
    extensible_kv_cache: Switch
    platform: Literal["cuda", "rocm", "xpu", "tpu", "cpu"]
    weights_memory: int | None
    activation_memory: int | None
    cuda_graph_memory: int | None
    format: TextOrJson
    #: the flags given several values, each with its values (--tp 1,2): one plan of every combination, side by side;
    #: the fields above hold each flag's first value
    compared: tuple[tuple[str, tuple[Any, ...]], ...] = ()
