"""The command line's options: every flag with its environment twin, default, parser and help, the parser that
reads them, and the typed configuration each command receives. Long for a reason: most of it is the three option
tables and the configurations, one line per option, which read best in one place.

Every ``serve``/``report`` flag has an environment-variable twin ``VLLM_CAPACITY_<FLAG>`` (``--vllm-url`` ->
``VLLM_CAPACITY_VLLM_URL``); a flag on the command line wins over its twin, and the default applies when neither is
given. An invalid value raises :class:`UsageError` naming the flag (or variable) and why: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vllm_capacity import __version__
from vllm_capacity.cli.advise_config import AdviseConfig, parse_headroom, parse_time
from vllm_capacity.cli.configs import PlanConfig, ReportConfig, ServeConfig
from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.derive.facts import ServerFlags
from vllm_capacity.derive.latency_curve import ITL, TTFT, Objective, parse_objective
from vllm_capacity.redaction import redact_url
from vllm_capacity.sizing import NEWEST_VERSION
from vllm_capacity.units import GiB, format_duration, parse_duration, parse_listen, parse_size

ENV_PREFIX = "VLLM_CAPACITY_"
MAX_BODY_LIMIT = GiB  # a /metrics body beyond this is no vLLM's, and would not fit the sidecar's memory
MIN_INTERVAL = 0.1


class UsageError(Exception):
    """A bad flag or value: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _url(text: str) -> str:
    """An http(s) base URL with a host and, if any, a valid port; messages never show its userinfo."""
    shown = redact_url(text)
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"{shown!r} is not an http:// or https:// URL")
    if any(c.isspace() for c in text):
        raise ValueError(f"{shown!r} contains whitespace")
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number from 0 to 65535)
    except ValueError as err:
        raise ValueError(f"{shown!r} is not a valid URL: {err}") from None
    if not parts.hostname:
        raise ValueError(f"{shown!r} names no host")
    if parts.query or parts.fragment:
        raise ValueError(f"{shown!r} has a query or fragment: give the server's base URL")
    return text.rstrip("/")


def _duration(minimum: float, maximum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        seconds = parse_duration(text)
        if seconds < minimum:
            raise ValueError(f"{text!r} is below the minimum {format_duration(minimum)}")
        if seconds > maximum:
            raise ValueError(f"{text!r} is above the maximum {format_duration(maximum)}")
        return seconds

    return parse


def _web_config(text: str) -> Path:
    """A web configuration file that loads (checked now: a bad one is a start-up error, not a broken listener)."""
    from vllm_capacity.web import config as webconfig

    path = Path(text)
    try:
        webconfig.load(path)
    except webconfig.WebConfigError as err:
        raise ValueError(str(err)) from None
    return path


def _telemetry_path(text: str) -> str:
    if not text.startswith("/") or any(c.isspace() or c in "?#" for c in text):
        raise ValueError(f"{text!r} is not a path such as /metrics")
    if text in ("/", "/healthz", "/readyz"):
        raise ValueError(f"{text!r} is taken by the landing page or a probe")
    return text


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise ValueError(f"{text!r} is not a positive whole number")
    return int(text)


def _objective(kind: str) -> Callable[[str], Objective]:
    def parse(text: str) -> Objective:
        return parse_objective(kind, text)

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text.lower()

    return parse


def _several(parse: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """``a,b,c``: one value or several to compare, each parsed alone (the same one twice: once)."""

    def parse_all(text: str) -> tuple[Any, ...]:
        items = [t.strip() for t in text.split(",")]
        if "" in items:
            raise ValueError(f"{text!r}: an empty value in the list")
        return tuple(dict.fromkeys(parse(t) for t in items))

    return parse_all


def _flag(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (a flag given alone is true)."""
    value = _choice("true", "false", "1", "0", "yes", "no", "on", "off")(text)
    return value in ("true", "1", "yes", "on")


def _log_level(text: str) -> str:
    """promslog's levels (debug, info, warn, error), and "warning" as this flag took before."""
    level = _choice("debug", "info", "warn", "warning", "error")(text)
    return "warning" if level == "warn" else level


def _size(text: str) -> int:
    size = parse_size(text)
    if size < 1024:
        raise ValueError(f"{text!r} is below the minimum 1KiB")
    if size > MAX_BODY_LIMIT:
        raise ValueError(f"{text!r} is above the maximum 1GiB")
    return size


def _api_key_file(text: str) -> str:
    """The API key in the file: one line of visible ASCII (a UTF-8 byte-order mark and surrounding whitespace are
    dropped). Anything else could not go into an HTTP header, so it is refused here, naming the file, never the key."""
    path = Path(text)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {text}: {err.strerror}") from err
    try:
        key = raw.decode("utf-8").removeprefix("\ufeff").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{text} is not UTF-8 text") from None
    if not key:
        raise ValueError(f"{text} is empty")
    if "\n" in key or "\r" in key:
        raise ValueError(f"{text} holds more than one line: it must hold the API key alone")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{text} holds characters an API key cannot have (spaces, control or non-ASCII characters)")
    return key  # the key itself; never logged


@dataclass(frozen=True)
class Option:
    flag: str
    parse: Callable[[str], Any]
    default: str | None
    help: str
    key: str | None = None  # the name of the parsed value, when not the flag's
    aliases: tuple[str, ...] = ()  # other spellings of the flag (the Prometheus exporters' --web.* names)
    switch: bool = False  # given alone, the flag means "true" (--web.disable-exporter-metrics)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_").replace(".", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


VLLM_URL = Option("--vllm-url", _url, "http://127.0.0.1:8000", "base URL of the vLLM server")
TIMEOUT = Option("--timeout", _duration(0.01, 600.0), "4s", "deadline for each request to vLLM (e.g. 500ms, 4s)")
MAX_MODEL_LEN = Option(
    "--max-model-len", _positive_int, None, "max_model_len to use when /v1/models is unreachable or lacks it"
)
API_KEY_FILE = Option(
    "--api-key-file", _api_key_file, None, "file holding vLLM's API key, sent to /v1/* (never logged)"
)
MAX_BODY = Option("--max-body-size", _size, "32MiB", "largest vLLM response accepted (e.g. 32MiB)")


def _model_config(text: str) -> Any:
    from vllm_capacity.geometry import GeometryError
    from vllm_capacity.sources.model_config import load_config

    try:
        return load_config(Path(text))
    except GeometryError as err:
        raise ValueError(str(err)) from None


def _model_dir(text: str) -> Any:
    return _model_config(str(Path(text) / "config.json"))


MODEL_OPTIONS = (
    Option("--vllm-log", str, None, "vLLM's log file (shared volume) for the memory figures it prints at start"),
    Option("--model-config", _model_config, None, "the served model's config.json, for bytes per token"),
    Option("--model-dir", _model_dir, None, "the served model's directory (its config.json)"),
    Option("--tp", _positive_int, "1", "vLLM's tensor-parallel size (for bytes per token from the model config)"),
    Option("--pp", _positive_int, "1", "vLLM's pipeline-parallel size"),
)


def _gpus(text: str) -> list[str] | str:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{text!r} names no GPU (indices like 0,1 or UUIDs like GPU-..., or 'all')")
    if items == ["all"]:
        return "all"
    for item in items:
        if not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
            raise ValueError(f"{item!r} is neither a GPU index nor a GPU-/MIG- UUID")
    return items


NVML_OPTIONS = (
    Option("--nvml", _choice("auto", "on", "off"), "auto", "read GPUs through NVML: auto (when present), on, off"),
    Option(
        "--gpus",
        _gpus,
        None,
        "GPUs to report: indices or UUIDs, or all (default: NVIDIA_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES, else all)",
    ),
)

LATENCY_OPTIONS = (
    Option(
        "--slo-itl",
        _objective(ITL),
        None,
        "inter-token latency objective, e.g. p99<=50ms: the concurrency it allows is max_concurrency{basis=slo}",
    ),
    Option("--slo-ttft", _objective(TTFT), None, "time-to-first-token objective, e.g. p90<=2s (with --slo-itl: both)"),
    Option(
        "--latency-half-life",
        _duration(60.0, 7 * 86400.0),
        "1h",
        "how fast the latency-by-concurrency curve and the sustained concurrency forget old traffic: a half-life "
        "of traffic (1m to 7d)",
    ),
)
SERVE_OPTIONS = (
    VLLM_URL,
    Option(
        "--listen",
        parse_listen,
        ":9790",
        "host:port for /metrics, /healthz, /readyz (':9790' = all interfaces); also --web.listen-address",
        aliases=("--web.listen-address",),
    ),
    Option(
        "--web.telemetry-path",
        _telemetry_path,
        "/metrics",
        "the path Prometheus scrapes, as other exporters name it",
    ),
    Option(
        "--interval",
        _duration(MIN_INTERVAL, 3600.0),
        "5s",
        "how often to read vLLM (100ms, 0.5s, 1m or seconds; >= 100ms)",
    ),
    TIMEOUT,
    MAX_MODEL_LEN,
    API_KEY_FILE,
    MAX_BODY,
    Option(
        "--models-refresh",
        _duration(1.0, 86400.0),
        "5m",
        "how often to re-read /v1/models (also on every vLLM restart)",
    ),
    *MODEL_OPTIONS,
    *NVML_OPTIONS,
    Option(
        "--max-num-seqs",
        _positive_int,
        None,
        "vLLM's --max-num-seqs, for concurrency_limit{limit=max_num_seqs} (else read from --vllm-log when it says)",
    ),
    Option(
        "--max-num-batched-tokens",
        _positive_int,
        None,
        "vLLM's token budget per step, for concurrency_limit{limit=token_budget} (else read from --vllm-log)",
    ),
    *LATENCY_OPTIONS,
    Option(
        "--web.config.file",
        _web_config,
        None,
        "TLS and basic auth for the listener, in the exporter-toolkit format (re-read on SIGHUP)",
    ),
    Option(
        "--web.max-requests",
        _positive_int,
        "512",
        "most connections the listener holds at once (node_exporter's flag caps parallel scrapes; this cap bounds "
        "them too): at the cap a slow or idle one is evicted, else the new one is answered 503",
    ),
    Option(
        "--web.disable-exporter-metrics",
        _flag,
        "false",
        "leave out the sidecar's own process metrics (vllm_capacity_process_*), as exporters offer",
        switch=True,
    ),
    Option(
        "--gpu-device-series",
        _choice("on", "off"),
        "on",
        "off beside dcgm-exporter: leave out the GPU readings it exports (utilization, power, clocks, throttling, "
        "memory used); the memory budget, vLLM's processes and the memory total stay",
    ),
    Option(
        "--probe-listen",
        parse_listen,
        None,
        "host:port serving /healthz and /readyz alone, in plain HTTP whatever --web.config.file asks: for the "
        "kubelet's probes where the listener asks for client certificates (the kubelet sends none)",
    ),
    Option(
        "--log.format",
        _choice("json", "logfmt", "console"),
        "json",
        "json (one object per line) or logfmt (key=value), both led by promslog's time, level and msg as "
        "Prometheus' exporters log; or console; also --log-format",
        aliases=("--log-format",),
    ),
    Option(
        "--log.level",
        _log_level,
        "info",
        "debug, info, warn (or warning) or error; also --log-level",
        aliases=("--log-level",),
    ),
)
REPORT_OPTIONS = (
    VLLM_URL,
    TIMEOUT,
    MAX_MODEL_LEN,
    API_KEY_FILE,
    MAX_BODY,
    *MODEL_OPTIONS,
    *NVML_OPTIONS,
    *LATENCY_OPTIONS,
    Option("--format", _choice("text", "json"), "text", "text for people, json for scripts"),
    Option(
        "--watch",
        _duration(MIN_INTERVAL, 3600.0),
        None,
        "read again every this long and redraw in place (e.g. 2s; text only), until interrupted",
    ),
)


def _add(parser: argparse.ArgumentParser, options: Sequence[Option], groups: Groups) -> None:
    """Each option under the heading of its group, in the groups' order (every option in exactly one group)."""
    by_flag = {opt.flag: opt for opt in options}
    grouped = [flag for _, flags in groups for flag in flags]
    if sorted(grouped) != sorted(by_flag):
        raise AssertionError(f"{parser.prog}: options not in exactly one help group: {set(grouped) ^ set(by_flag)}")
    for title, flags in groups:
        section = parser.add_argument_group(title)
        for opt in (by_flag[f] for f in flags):
            default = f" (default {opt.default})" if opt.default is not None else ""
            switch: dict[str, Any] = {"nargs": "?", "const": "true"} if opt.switch else {}
            text = f"{opt.help}{default}; env {opt.env}".replace("%", "%%")  # argparse %-formats help ("20%")
            section.add_argument(opt.flag, *opt.aliases, dest=opt.dest, default=None, help=text, **switch)


def resolve(ns: argparse.Namespace, options: Sequence[Option], environ: dict[str, str]) -> dict[str, Any]:
    """Flag, else environment twin, else default; each parsed and validated. Raises UsageError."""
    values: dict[str, Any] = {}
    for opt in options:
        raw, where = getattr(ns, opt.dest), opt.flag
        if raw is None and environ.get(opt.env, "") != "":
            raw, where = environ[opt.env], f"{opt.env} (environment)"
        if raw is None:
            raw = opt.default
        if raw is None:
            values[opt.key or opt.dest] = None
            continue
        try:
            values[opt.key or opt.dest] = opt.parse(raw)
        except ValueError as err:
            raise UsageError(f"{where}: {err}") from err
    return values


def _memory(text: str) -> int:
    return parse_size(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise ValueError(f"{text!r} is not in (0, 1]")
    return value


def _version(text: str) -> tuple[int, int, int]:
    from vllm_capacity.sizing import parse_version

    return parse_version(text)


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    return int(text)


def _lora_rank(text: str) -> int:
    from vllm_capacity.sizing.lora import Lora

    rank = _positive_int(text)
    Lora(max_rank=rank).check()  # the ranks vLLM accepts, named in the error
    return rank


def _path_text(text: str) -> str:
    return str(_path(text))


def _path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise ValueError(f"{text} does not exist")
    return path


PLAN_OPTIONS = (
    Option("--model-config", _path, None, "the model's config.json", "model_config_path"),
    Option(
        "--model-dir",
        _path,
        None,
        "the model's directory: config.json and *.safetensors (weights from headers)",
        "model_dir_path",
    ),
    Option("--tp", _several(_positive_int), "1", "tensor-parallel size (several, e.g. 1,2: compared)"),
    Option("--pp", _positive_int, "1", "pipeline-parallel size"),
    Option(
        "--kv-cache-dtype",
        _several(
            _choice(
                "auto",
                "bfloat16",
                "float16",
                "half",
                "float32",
                "fp8",
                "fp8_e4m3",
                "fp8_e5m2",
                "fp8_inc",
                "int8",
                "fp8_ds_mla",
                "nvfp4_ds_mla",
                "int8_per_token_head",
                "fp8_per_token_head",
                "int4_per_token_head",
            )
        ),
        "auto",
        "KV cache dtype; auto follows the model's dtype (fp8_ds_mla, nvfp4_ds_mla: DeepSeek sparse attention's "
        "packed latent; *_per_token_head: values with a scale per head and token); several (auto,fp8): compared",
    ),
    Option(
        "--block-size",
        _positive_int,
        None,
        "tokens per KV block (default: vLLM's for --vllm-version: 64 from 0.34, 16 before)",
    ),
    Option(
        "--max-model-len",
        _several(_positive_int),
        None,
        "context length to plan for (default: max_position_embeddings); several (8192,32768): compared",
    ),
    Option("--vllm-version", _version, NEWEST_VERSION, "whose sizing rules to apply (e.g. 0.10.2)"),
    Option("--engine", _choice("v0", "v1"), None, "v0 or v1 (default: v0 before 0.8, else v1)", key="engine_version"),
    Option(
        "--max-num-batched-tokens",
        _positive_int,
        None,
        "vLLM's --max-num-batched-tokens, which bounds sliding-window layers (default: vllm serve's for the GPU: "
        "2048; 8192 from 70 GiB; 16384 from 160 GiB)",
    ),
    Option(
        "--max-num-seqs",
        _positive_int,
        None,
        "vLLM's --max-num-seqs, whose sampler warm-up is the activation peak estimated with --gpu-memory (default: "
        "vllm serve's for the GPU: 256; 1024 from 70 GiB)",
    ),
    Option(
        "--async-scheduling",
        _choice("on", "off"),
        "on",
        "vLLM's async scheduling (off on its CPU backend): on doubles the in-flight tokens sliding windows keep",
    ),
    Option(
        "--mamba-cache-mode",
        _choice("auto", "none", "align"),
        "auto",
        "vLLM's --mamba-cache-mode (auto: as its default prefix caching picks: none before 0.28, align from 0.28)",
    ),
    Option(
        "--mamba-ssm-cache-dtype",
        _choice("auto", "float32", "bfloat16", "float16"),
        "auto",
        "vLLM's --mamba-ssm-cache-dtype (auto: the config's, else the model's dtype)",
    ),
    Option(
        "--chunked-local-hybrid",
        _choice("auto", "on", "off"),
        "auto",
        "for Llama 4's chunked attention: vLLM's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE (auto: its "
        "default, known from 0.32; off sizes those layers like full attention)",
    ),
    Option(
        "--speculative-method",
        _choice("eagle", "eagle3", "mtp", "draft_model", "dflash", "ngram"),
        None,
        "vLLM's --speculative-config method, whose drafter shares the KV pool (default: none)",
    ),
    Option(
        "--num-speculative-tokens",
        _positive_int,
        None,
        "vLLM's num_speculative_tokens (needed with --speculative-method)",
    ),
    Option(
        "--draft-model-config",
        _path,
        None,
        "the drafter's config.json: the draft model's, the EAGLE head's (default for eagle: one layer shaped "
        "like the target's), or Gemma 4's assistant's (mtp)",
        "draft_model_config_path",
    ),
    Option(
        "--kv-offloading-size",
        _memory,
        None,
        "vLLM's --kv-offloading-size (e.g. 64GiB, over all TP ranks): plan the CPU tier of native KV offloading",
    ),
    Option(
        "--max-loras",
        _positive_int,
        None,
        "vLLM's --max-loras with --enable-lora: adapter slots preallocated beside the weights (default: no LoRA)",
    ),
    Option("--max-lora-rank", _lora_rank, None, "vLLM's --max-lora-rank (default 16 when --max-loras is given)"),
    Option(
        "--fully-sharded-loras",
        _choice("on", "off"),
        "off",
        "vLLM's --fully-sharded-loras: the adapters' slots split over the TP ranks",
    ),
    Option(
        "--encoder-cache-tokens",
        _count,
        None,
        "a multimodal model's encoder cache, from vLLM's log 'Encoder cache will be initialized with a budget of N "
        "tokens' (needed with --gpu-memory for a multimodal config.json)",
    ),
    Option(
        "--kv-cache-memory",
        _memory,
        None,
        "KV memory per GPU as vLLM logs it: 'Extended KV cache to N blocks (X GiB)' under 0.34's extensible KV "
        "cache, else 'Available KV cache memory'",
    ),
    Option("--gpu-memory", _memory, None, "memory of one GPU (e.g. 80GiB), to plan from the whole budget"),
    Option(
        "--gpu-memory-utilization",
        _several(_fraction),
        None,
        "vLLM's --gpu-memory-utilization (default: as --vllm-version resolves it unset: 1.0 under 0.34's "
        "extensible KV cache, else 0.92; 0.9 before 0.20); several (0.85,0.9): compared",
    ),
    Option(
        "--extensible-kv-cache",
        _choice("auto", "on", "off"),
        "auto",
        "vLLM 0.34's --enable-extensible-kv-cache (auto: as vLLM decides it: on from 0.34 on CUDA and ROCm; vLLM "
        "turns it off with --kv-cache-memory-bytes, --num-gpu-blocks-override, elastic EP and some KV connectors)",
    ),
    Option(
        "--platform",
        _choice("cuda", "rocm", "xpu", "tpu", "cpu"),
        "cuda",
        "the GPU platform: the extensible KV cache runs on cuda and rocm, with a 1 GiB or 3 GiB margin",
    ),
    Option("--weights-memory", _memory, None, "weights per GPU (default: from --model-dir's safetensors headers)"),
    Option(
        "--activation-memory",
        _memory,
        None,
        "activation peak per GPU, from vLLM's profile (default: estimated for V1 as its sampler's warm-up)",
    ),
    Option(
        "--cuda-graph-memory",
        _memory,
        None,
        "CUDA graph memory per GPU, from vLLM's 'Graph capturing finished in N secs, took X GiB' (0.34; before, "
        "its 'Estimated CUDA graph memory') (default: taken as 0, said)",
    ),
    Option("--format", _choice("text", "json"), "text", "text for people, json for scripts"),
)


def _concurrencies(text: str) -> tuple[int, ...]:
    """``1,2,4,8``: positive whole numbers, each larger than the one before."""
    values = tuple(_positive_int(t.strip()) for t in text.split(","))
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{text!r}: each concurrency must be larger than the one before")
    if values[-1] > 4096:
        raise ValueError(f"{text!r}: at most 4096 concurrent requests")
    return values


SWEEP_OPTIONS = (
    VLLM_URL,
    Option("--model", str, None, "the served model to load (default: the first /v1/models lists)"),
    API_KEY_FILE,
    Option("--concurrency", _concurrencies, "1,2,4,8,16,32,64", "concurrent requests of each step, ascending"),
    Option("--requests-per-step", _positive_int, None, "requests each step sends (default: 4 x its concurrency, >= 8)"),
    Option("--duration-per-step", _duration(1.0, 3600.0), None, "or how long each step sends them (e.g. 30s)"),
    Option("--warmup-requests", _count, "1", "requests before the first step, left out of every figure"),
    Option("--prompt-tokens", _positive_int, "1500", "tokens of each prompt (token IDs: no tokenizer needed)"),
    Option("--max-tokens", _positive_int, "200", "tokens each request generates, exactly (ignore_eos)"),
    Option("--slo-ttft", _objective(TTFT), None, "time-to-first-token objective, e.g. p99<=1s: the knee holds it"),
    Option("--slo-itl", _objective(ITL), None, "inter-token latency objective, e.g. p99<=50ms"),
    Option("--model-config", _model_config, None, "the served model's config.json: the levers' figures by the planner"),
    Option(
        "--vllm-log", _path_text, None, "vLLM's log file: the memory budget it printed at start, given in the report"
    ),
    Option("--max-num-seqs", _positive_int, None, "vLLM's --max-num-seqs, to name it when it binds"),
    Option("--max-num-batched-tokens", _positive_int, None, "vLLM's --max-num-batched-tokens, to name a full budget"),
    Option("--sample-interval", _duration(0.1, 60.0), "500ms", "how often vLLM's /metrics is read during a step"),
    Option("--timeout", _duration(1.0, 3600.0), "10m", "deadline of each request (and 10 s for each /metrics read)"),
    Option(
        "--format", _choice("text", "json", "csv", "html"), "text", "text for people, json or csv for scripts, html"
    ),
    Option("--output", str, None, "write the report to this file (default: standard output)"),
)


ADVISE_OPTIONS = (
    Option("--prometheus-url", _url, None, "the Prometheus server holding the sidecar's and vLLM's series (required)"),
    Option("--window", _duration(3600.0, 90 * 86400.0), "7d", "how much history to read (e.g. 7d, 24h)"),
    Option("--end", parse_time, None, "when the window ends: Unix seconds or RFC 3339 (default: now)"),
    Option("--selector", str, None, "label matchers every query carries, e.g. '{namespace=\"serving\"}'"),
    Option("--model-config", _model_config, None, "the served model's config.json: the planner's figures, TP"),
    Option("--tp", _positive_int, "1", "the tensor-parallel size the model is served with"),
    Option("--headroom", parse_headroom, "20%", "share of the peak kept free when sizing replicas"),
    Option(
        "--slo-ttft", _objective(TTFT), None, "time-to-first-token objective, e.g. p99<=1s: checked over the window"
    ),
    Option("--slo-itl", _objective(ITL), None, "inter-token latency objective, e.g. p99<=50ms"),
    Option("--bearer-token-file", _api_key_file, None, "file holding a bearer token for Prometheus (never logged)"),
    Option("--basic-auth-user", str, None, "basic-auth user for Prometheus"),
    Option("--basic-auth-password-file", _api_key_file, None, "file holding its password (never logged)"),
    Option("--ca-file", _path_text, None, "CA bundle that signed Prometheus's TLS certificate"),
    Option("--insecure-skip-verify", _flag, "false", "do not verify Prometheus's TLS certificate", switch=True),
    Option("--timeout", _duration(1.0, 600.0), "30s", "deadline of each query"),
    Option("--format", _choice("text", "json", "html"), "text", "text for people, json for scripts, html"),
    Option("--output", str, None, "write the report to this file (default: standard output)"),
)


PLAN_DOES_NOT_FIT = 1  # a valid plan whose answer is no: vLLM would refuse to start
PLAN_NOT_MODELLED = 3  # valid input the planner cannot size (a kind or vLLM version it does not model)
PLAN_EXIT_CODES = f"""exit status:
  0  the plan
  {PLAN_DOES_NOT_FIT}  does not fit: one request of max_model_len needs more KV cache than there is (vLLM would
     refuse to start), or nothing is left of the GPU for the KV cache
  2  invalid input: an option, or a config.json that is not valid JSON, lacks a field, or has one vLLM would
     refuse (the file and field named); --tp that vLLM cannot shard the model over
  {PLAN_NOT_MODELLED}  not modelled: the planner cannot size this model or vLLM version (and says why)"""


Groups = tuple[tuple[str, tuple[str, ...]], ...]  # (heading, its flags) in the order --help shows them

#: each command's --help: its options by purpose, and a few examples
HELP: dict[str, tuple[Groups, str]] = {
    "serve": (
        (
            ("vLLM", ("--vllm-url", "--interval", "--timeout", "--api-key-file", "--max-body-size",
                      "--models-refresh", "--max-model-len")),
            ("the model and vLLM's settings (bytes per token, what limits concurrency)",
             ("--vllm-log", "--model-config", "--model-dir", "--tp", "--pp", "--max-num-seqs",
              "--max-num-batched-tokens")),
            ("GPUs (NVML)", ("--nvml", "--gpus", "--gpu-device-series")),
            ("latency objectives", ("--slo-itl", "--slo-ttft", "--latency-half-life")),
            ("the listener (Prometheus exporters' flags)",
             ("--listen", "--web.telemetry-path", "--web.config.file", "--web.max-requests",
              "--web.disable-exporter-metrics", "--probe-listen")),
            ("logging", ("--log.format", "--log.level")),
        ),
        """examples:
  vllm-capacity serve --vllm-url http://127.0.0.1:8000 --listen :9790
  vllm-capacity serve --vllm-log vllm.log --model-dir llama-3.1-8b --slo-itl 'p99<=50ms'
  vllm-capacity serve --web.config.file web.yml --probe-listen :9791 --gpu-device-series off   # beside dcgm""",
    ),
    "report": (
        (
            ("vLLM", ("--vllm-url", "--timeout", "--api-key-file", "--max-body-size", "--max-model-len")),
            ("the model", ("--vllm-log", "--model-config", "--model-dir", "--tp", "--pp")),
            ("GPUs (NVML)", ("--nvml", "--gpus")),
            ("latency objectives", ("--slo-itl", "--slo-ttft", "--latency-half-life")),
            ("output", ("--format", "--watch")),
        ),
        """examples:
  vllm-capacity report --vllm-url http://127.0.0.1:8000
  vllm-capacity report --vllm-url http://127.0.0.1:8000 --format json
  vllm-capacity report --watch 2s --slo-itl 'p99<=50ms'   # live, redrawn in place""",
    ),
    "plan": (
        (
            ("the model and vLLM", ("--model-config", "--model-dir", "--tp", "--pp", "--vllm-version", "--engine",
                                    "--platform")),
            ("the KV cache", ("--kv-cache-dtype", "--block-size", "--max-model-len", "--kv-cache-memory",
                              "--extensible-kv-cache", "--kv-offloading-size", "--mamba-cache-mode",
                              "--mamba-ssm-cache-dtype", "--chunked-local-hybrid")),
            ("the scheduler", ("--max-num-batched-tokens", "--max-num-seqs", "--async-scheduling")),
            ("speculative decoding, LoRA, encoders",
             ("--speculative-method", "--num-speculative-tokens", "--draft-model-config", "--max-loras",
              "--max-lora-rank", "--fully-sharded-loras", "--encoder-cache-tokens")),
            ("the GPU's memory (instead of --kv-cache-memory)",
             ("--gpu-memory", "--gpu-memory-utilization", "--weights-memory", "--activation-memory",
              "--cuda-graph-memory")),
            ("output", ("--format",)),
        ),
        """examples:
  vllm-capacity plan --model-config config.json --kv-cache-memory 4.31GiB --max-model-len 32768
  vllm-capacity plan --model-dir llama-3.1-8b --gpu-memory 80GiB --max-model-len 32768
  vllm-capacity plan --model-config config.json --kv-cache-memory 16GiB --tp 1,2 --kv-cache-dtype auto,fp8

""" + PLAN_EXIT_CODES,
    ),
    "sweep": (
        (
            ("vLLM", ("--vllm-url", "--model", "--api-key-file", "--timeout", "--sample-interval")),
            ("the load", ("--concurrency", "--requests-per-step", "--duration-per-step", "--warmup-requests",
                          "--prompt-tokens", "--max-tokens")),
            ("objectives and vLLM's settings (the knee, the levers)",
             ("--slo-ttft", "--slo-itl", "--model-config", "--vllm-log", "--max-num-seqs",
              "--max-num-batched-tokens")),
            ("output", ("--format", "--output")),
        ),
        """examples:
  vllm-capacity sweep --vllm-url http://127.0.0.1:8000 --concurrency 1,2,4,8,16 --slo-itl 'p99<=50ms'
  vllm-capacity sweep --concurrency 1,4,16,64 --prompt-tokens 4000 --max-tokens 500 --model-config config.json \\
      --vllm-log vllm.log
  vllm-capacity sweep --format html --output sweep.html""",
    ),
    "advise": (
        (
            ("Prometheus", ("--prometheus-url", "--bearer-token-file", "--basic-auth-user",
                            "--basic-auth-password-file", "--ca-file", "--insecure-skip-verify", "--timeout")),
            ("what to read", ("--window", "--end", "--selector")),
            ("the model and the objectives", ("--model-config", "--tp", "--headroom", "--slo-ttft", "--slo-itl")),
            ("output", ("--format", "--output")),
        ),
        """examples:
  vllm-capacity advise --prometheus-url http://prometheus:9090 --window 7d
  vllm-capacity advise --prometheus-url https://prom:9090 --ca-file ca.crt --bearer-token-file token \\
      --selector '{namespace="llm"}' --model-config config.json --slo-itl 'p99<=50ms'
  vllm-capacity advise --prometheus-url http://prometheus:9090 --format html --output advice.html""",
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-capacity", description="KV-cache capacity and concurrency exporter for vLLM.")
    parser.add_argument("--version", action="version", version=f"vllm-capacity {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    helps = {
        "serve": "run the sidecar: scrape vLLM, serve /metrics",
        "report": "print one capacity snapshot of a vLLM server",
        "plan": "vLLM's capacity math offline, from a model's config.json",
        "sweep": "a concurrency sweep against a vLLM server: the knee, its limit, the levers",
        "advise": "what to change, from a window of real traffic in Prometheus",
    }
    for command, (_, options) in COMMANDS.items():
        groups, examples = HELP[command]
        sub_parser = sub.add_parser(
            command,
            help=helps[command],
            description=helps[command][0].upper() + helps[command][1:] + ".",
            epilog=examples,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add(sub_parser, options, groups)
    return parser


Config = ServeConfig | ReportConfig | PlanConfig | SweepConfig | AdviseConfig
COMMANDS: dict[str, tuple[type[Config], tuple[Option, ...]]] = {
    "serve": (ServeConfig, SERVE_OPTIONS),
    "report": (ReportConfig, REPORT_OPTIONS),
    "plan": (PlanConfig, PLAN_OPTIONS),
    "sweep": (SweepConfig, SWEEP_OPTIONS),
    "advise": (AdviseConfig, ADVISE_OPTIONS),
}


#: options gathered into one record, for the commands whose configuration has a field of that name
RECORDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "flags": (ServerFlags, ("max_model_len", "max_num_seqs", "max_num_batched_tokens")),
}


def config(command: str, ns: argparse.Namespace, environ: dict[str, str]) -> Config:
    """The typed configuration of ``command`` from its parsed flags and their environment twins. Raises UsageError."""
    cls, options = COMMANDS[command]
    values = resolve(ns, options, environ)
    has = {f.name for f in fields(cls)}
    for name, (record, keys) in RECORDS.items():
        if name in has:
            values[name] = record(**{key: values.pop(key, None) for key in keys})
    if "compared" in has:
        values["compared"] = _spread(values)
    return cls(**values)


#: plan's options that take several values to compare (--tp 1,2 --kv-cache-dtype auto,fp8)
COMPARABLE = ("tp", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization")


def _spread(values: dict[str, Any]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """Each comparable option's first value in its field; those given several, with their values."""
    compared = []
    for key in COMPARABLE:
        given = values[key]
        if isinstance(given, tuple):
            values[key] = given[0]
            if len(given) > 1:
                compared.append((key, given))
    return tuple(compared)
