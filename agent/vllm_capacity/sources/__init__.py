"""Sources: everything that reads the outside world (vLLM's HTTP API, NVML, model files, logs).

Each source turns what it reads into plain data and reports failures as :class:`SourceError` with a short,
stable ``reason`` (the ``reason`` label of ``vllm_capacity_source_errors_total``) and a human message.
"""

from __future__ import annotations


class SourceError(Exception):
    """A source could not produce data. ``reason`` is a stable snake_case token; ``str(err)`` is the cause."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
