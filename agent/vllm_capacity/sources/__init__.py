"""Sources: everything that reads the outside world (vLLM's HTTP API, NVML, model files, logs).

Each source turns what it reads into plain data and reports failures as :class:`SourceError` with a
:class:`Reason` (the ``reason`` label of ``vllm_capacity_source_errors_total``) and a human message.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a read of a source failed: the ``reason`` label of ``vllm_capacity_source_errors_total``. Stable: alerts,
    dashboards and people's queries use these values; docs/metrics.md lists them (a test keeps the two in step)."""

    INTERNAL = "internal"  # an error nothing expected (a defect, or an input no rule covers): named and counted
    # reading vLLM over HTTP (sources/vllm.py)
    CONNECT = "connect"  # the connection was refused or could not be made
    TIMEOUT = "timeout"  # no complete answer within --timeout (also NVML: no answer within its deadline)
    TRUNCATED = "truncated"  # the connection closed mid-response, or a body ends without its last newline
    CONNECTION_ERROR = "connection_error"  # any other transport failure
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    REDIRECT = "redirect"  # a 3xx: not followed, the agent reads the server it was pointed at
    UNAUTHORIZED = "unauthorized"  # 401/403: the API key is missing or wrong
    BODY_TOO_LARGE = "body_too_large"  # over --max-body-size
    EMPTY_BODY = "empty_body"
    NOT_METRICS = "not_metrics"  # an HTML or JSON page where metrics text was expected
    NOT_VLLM = "not_vllm"  # metrics without any vllm: family
    PARSE_ERROR = "parse_error"  # not valid Prometheus text, not UTF-8, or not an OpenAI model list
    MISSING_MAX_MODEL_LEN = "missing_max_model_len"  # /v1/models lists no max_model_len
    IMPLAUSIBLE_VALUE = "implausible_value"  # a value that cannot be right (usage above 1, a negative count...)
    # a family passed the scan's bounds (a line over 8 KiB, 16,384 lines, the largest when all pass 16,384 lines):
    # that family is left out of the read, the rest is read
    FAMILY_OVER_LIMIT = "family_over_limit"
    # a line of over 1 MiB (no newline in a megabyte: not an exposition vLLM writes): the read is refused as it
    # arrives, never held whole (a 31 MiB line once took the sidecar past its 128 Mi limit)
    LINE_TOO_LONG = "line_too_long"
    # vLLM's log file (--vllm-log)
    MISSING = "missing"
    PERMISSION = "permission"
    IO_ERROR = "io_error"
    # NVML (sources/nvml.py): the driver's error, named as in nvml.h
    HUNG = "hung"  # an earlier NVML call has not returned: no second one is started
    UNINITIALIZED = "uninitialized"
    NOT_SUPPORTED = "not_supported"
    NO_PERMISSION = "no_permission"
    DRIVER_NOT_LOADED = "driver_not_loaded"
    LIBRARY_NOT_FOUND = "library_not_found"
    FUNCTION_NOT_FOUND = "function_not_found"
    GPU_LOST = "gpu_lost"
    RESET_REQUIRED = "reset_required"
    DRIVER_VERSION_MISMATCH = "driver_version_mismatch"
    GPU_NOT_FOUND = "gpu_not_found"
    # memory in use and no process listed: they are hidden from the sidecar (its own PID namespace, driver >=
    # 535.113.01); counted per GPU and read, the budget's process shares are absent
    PROCESSES_HIDDEN = "processes_hidden"
    # NVML lists some of the GPU's processes but not all: more memory is in use than the listed and the reserved
    PROCESSES_PARTLY_HIDDEN = "processes_partly_hidden"
    # the processes NVML lists hold more memory than the GPU says is used: the readings disagree, "system" is absent
    MEMORY_INCONSISTENT = "memory_inconsistent"
    NVML_ERROR = "nvml_error"  # any other NVML error


class SourceError(Exception):
    """A source could not produce data: ``reason`` says why in one stable token; ``str(err)`` is the cause."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
