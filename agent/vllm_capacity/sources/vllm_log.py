"""vLLM's startup log: the memory figures it prints, for every version's line formats.

``parse_line`` is pure (one line in, the figures it carries out); :class:`StartupFigures` accumulates them, a new
start of vLLM clearing the old; :class:`LogFollower` reads a log file that vLLM writes to a shared volume,
surviving rotation and truncation. Formats: the lines vLLM's workers and KV-cache code print per release, quoted
verbatim in ``tests/test_vllm_log.py`` (GB that are GiB,
thousands separators, V0's multi-line profiling output, per-worker lines under TP, ANSI colour, process prefixes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_capacity.units import GiB, MiB

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
# The engine's prefix, "(EngineCore_DP1 pid=123)", opens the line (after colour codes): it is looked for in the
# first PREFIX_CHARS only, so the pattern's backtracking is bounded whatever the rest of the line holds (a request
# log line of 100 KB of "(" cost 169 s when the whole line was searched).
PREFIX_CHARS = 160
_ENGINE = re.compile(r"\((?:[A-Za-z]*Engine[A-Za-z]*_?(?:DP)?|[^()]*\bDP)(\d+)[^()]*pid=\d+\)")
# a worker's prefix, one per GPU rank: "(Worker_TP1 pid=2080)", "(Worker_PP1_TP0 pid=..)", "(VllmWorker rank=1 pid=..)"
_WORKER = re.compile(r"\([A-Za-z]*Worker[^)]*?\bpid=(\d+)\)")

# name -> regex; the first group is the value. GiB figures are bytes / 2**30 even where vLLM writes "GB".
_PATTERNS: dict[str, re.Pattern[str]] = {
    "weights_gib": re.compile(
        rf"(?:Loading model weights|Model loading) took {_NUM} ?(?:GB|GiB)|model weights take {_NUM} ?GiB"
    ),
    "kv_cache_memory_gib": re.compile(
        rf"Available KV cache memory: {_NUM} ?GiB"
        rf"|the rest of the memory reserved for KV Cache is {_NUM} ?GiB"
        rf"|kv_cache_size={_NUM}GiB"
        rf"|reserved {_NUM} ?GiB memory for KV Cache as specified by kv_cache_memory_bytes"
        rf"|(?:Explicitly|Auto) set \({_NUM}/[0-9.]+\) GiB for KV cache"  # the CPU backend
    ),
    "kv_cache_tokens": re.compile(rf"KV cache size: {_NUM} tokens"),
    "max_concurrency": re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x"),
    "num_gpu_blocks": re.compile(rf"\b(?:GPU|cuda|xpu|hpu|tpu|npu) blocks: {_NUM}"),  # not the CPU swap blocks
    "cuda_graph_gib": re.compile(rf"Graph capturing finished in [0-9.]+ secs, took {_NUM} ?GiB"),
    "activation_peak_gib": re.compile(
        rf"PyTorch activation peak memory takes {_NUM} ?GiB|torch peak memory increase: {_NUM} ?GiB"
    ),
    "max_model_len": re.compile(rf"Using max model len {_NUM}"),
    "blocks_override": re.compile(rf"Overriding num_gpu_blocks={_NUM} with num_gpu_blocks_override={_NUM}"),
}
# "GPU KV cache size: 208,625 tokens" (kv_cache_utils.py); the CPU backend logs "CPU KV cache size: ..."
_DEVICE = re.compile(r"\b(GPU|CPU|XPU|TPU|HPU|NPU) KV cache size:")
# Printed once per start by the API server, before any engine figure (engine cores print theirs later).
_NEW_START = re.compile(r"non-default args:|vLLM API server version")
# in the "non-default args: {...}" line: the --max-num-seqs the server was started with
_MAX_NUM_SEQS = re.compile(r"'max_num_seqs': (\d+)")
# the scheduler's resolved batch budget, whatever set it (scheduler.py): it bounds sliding and chunked layers' blocks
_BATCHED_TOKENS = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
# the engine's "Initializing a V1 LLM engine (v0.32.0) with config: ... speculative_config=SpeculativeConfig(
# method='eagle', model='/models/head', num_spec_tokens=2), ..." (SpeculativeConfig.__repr__), or "=None"
_SPECULATIVE = re.compile(
    r"speculative_config=(?:None\b|SpeculativeConfig\(method='?([\w.-]+)'?,[^()]{0,4096}?num_spec_tokens=(\d+)\))"
)

# Every line any pattern above reads holds one of these fixed strings: a line without them is passed over by a
# substring test (C speed, no regex), and only lines with them are decoded (LogFollower's ``keep``).
_FIXED = (
    b"took", b"weights take", b"KV cache", b"KV Cache", b"kv_cache", b"Maximum concurrency", b"blocks: ",
    b"peak memory", b"max model len", b"num_gpu_blocks", b"non-default args", b"API server version",
    b"max_num_batched_tokens", b"speculative_config=",
)  # fmt: skip
# vLLM's request logger (vllm/entrypoints/logger.py, --enable-log-requests / --enable-log-outputs) writes users'
# prompts and outputs into the same log: such a line never carries a figure, whatever text it quotes.
_REQUEST_LOG = (b"Received request ", b"Generated response ", b" details: prompt")
MAX_LINE = 64 * 1024  # vLLM's memory lines are < 300 bytes, its engine config line a few KiB


def might_carry_figures(line: bytes) -> bool:
    """Whether a raw log line can hold a figure: one of the fixed strings, and not a request log line."""
    return any(k in line for k in _FIXED) and not any(k in line for k in _REQUEST_LOG)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_line(line: str) -> tuple[str, dict[str, float]]:
    """The engine index (from a ``(EngineCore_DP1 pid=..)`` prefix, else "0") and the figures one line carries."""
    line = _ANSI.sub("", line)
    m = _ENGINE.search(line[:PREFIX_CHARS])
    engine = m[1] if m else "0"
    found: dict[str, float] = {}
    for name, pattern in _PATTERNS.items():
        hit = pattern.search(line)
        if not hit:
            continue
        groups = [g for g in hit.groups() if g is not None]
        if name == "max_concurrency":
            found["max_model_len"] = _number(groups[0])
            found["max_concurrency"] = _number(groups[1])
        elif name == "blocks_override":
            found["blocks_from_memory"] = _number(groups[0])
            found["num_gpu_blocks"] = _number(groups[1])
        else:
            found[name] = _number(groups[0])
    return engine, found


@dataclass
class EngineFigures:
    """What the latest start of vLLM logged for one engine; per GPU rank where vLLM logs per rank."""

    weights_bytes: float | None = None
    kv_cache_memory_bytes: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    cuda_graph_bytes: float | None = None
    activation_peak_bytes: float | None = None
    blocks_from_memory: int | None = None  # before --num-gpu-blocks-override replaced them
    #: where the KV cache lives, from "GPU KV cache size: ..." / "CPU KV cache size: ..." (None: not logged)
    device: str | None = None

    @property
    def _override_share(self) -> float:
        """The share of the memory's blocks that --num-gpu-blocks-override kept (1 without an override)."""
        if self.blocks_from_memory and self.num_gpu_blocks:
            return self.num_gpu_blocks / self.blocks_from_memory
        return 1.0

    @property
    def kv_bytes_per_token(self) -> float | None:
        """'Available KV cache memory' / 'KV cache size' tokens (4.31 GiB / 208,625 = 21.7 KiB, say)."""
        if not self.kv_cache_memory_bytes or not self.kv_cache_tokens:
            return None
        return self.kv_cache_memory_bytes * self._override_share / self.kv_cache_tokens

    @property
    def kv_pool_bytes(self) -> float | None:
        """The KV memory vLLM allocated: the budget, or the overridden blocks' share of it."""
        if self.kv_cache_memory_bytes is None:
            return None
        return self.kv_cache_memory_bytes * self._override_share


@dataclass
class RankFigures:
    """What one GPU rank's worker logged about its own memory (its weights differ by pipeline stage)."""

    weights_bytes: float | None = None
    kv_cache_memory_bytes: float | None = None


@dataclass
class StartupFigures:
    engines: dict[str, EngineFigures] = field(default_factory=dict)
    #: per worker, by the PID in its log prefix (the PID NVML lists on its GPU when the pod shares its PID namespace)
    ranks: dict[int, RankFigures] = field(default_factory=dict)
    starts: int = 0
    #: --max-num-seqs, when the start's "non-default args" line gives it (None: vLLM's default, or no such line)
    max_num_seqs: int | None = None
    #: the scheduler's max_num_batched_tokens, from "Chunked prefill is enabled with max_num_batched_tokens=N"
    max_num_batched_tokens: int | None = None
    #: the engine's speculative method and num_speculative_tokens, from its config line; None: none, or not seen
    speculation: tuple[str, int] | None = None

    def feed(self, line: str) -> None:
        if _NEW_START.search(line):
            self.engines.clear()  # a new start of vLLM: the old figures no longer describe it
            self.ranks.clear()
            self.starts += 1
            seqs = _MAX_NUM_SEQS.search(line)
            self.max_num_seqs = int(seqs[1]) if seqs else None
            self.max_num_batched_tokens = None
            self.speculation = None
            return
        if batched := _BATCHED_TOKENS.search(line):
            self.max_num_batched_tokens = int(batched[1])
            return
        if spec := _SPECULATIVE.search(line):
            self.speculation = (spec[1], int(spec[2])) if spec[1] else None
        engine, found = parse_line(line)
        if not found:
            return
        fig = self.engines.setdefault(engine, EngineFigures())
        line = _ANSI.sub("", line)
        if (worker := _WORKER.search(line[:PREFIX_CHARS])) and (
            "weights_gib" in found or "kv_cache_memory_gib" in found
        ):
            rank = self.ranks.setdefault(int(worker[1]), RankFigures())
            if found.get("weights_gib"):
                rank.weights_bytes = found["weights_gib"] * GiB
            if found.get("kv_cache_memory_gib"):
                rank.kv_cache_memory_bytes = found["kv_cache_memory_gib"] * GiB
        if device := _DEVICE.search(line):
            fig.device = device[1]
        for name, value in found.items():
            if name.endswith("_gib"):
                if value == 0:
                    continue  # a small figure rounded to "0.0 GiB" says nothing (the CPU backend logs 2 MiB so)
                attr = name.removesuffix("_gib") + "_bytes"
                value_bytes = value * GiB
                current = getattr(fig, attr)
                # under TP every worker logs its own figure: keep the smallest, as vLLM sizes every rank to it
                if attr == "kv_cache_memory_bytes" and current is not None:
                    value_bytes = min(current, value_bytes)
                setattr(fig, attr, value_bytes)
            elif name in ("kv_cache_tokens", "num_gpu_blocks", "max_model_len", "blocks_from_memory"):
                setattr(fig, name, int(value))
            else:
                setattr(fig, name, value)


HEAD_BYTES = 256  # the file's first bytes that tell it from one rewritten in its place (vLLM's lines: a timestamp)


class LogFollower:
    """Reads what was appended to a log file since the last call; starts over after rotation or truncation.

    Bounded whatever the file holds: at most ``max_read`` bytes a call (a large log is caught up over several
    calls), a line longer than ``max_line`` is passed over (counted in ``long_lines``) and never buffered, and only
    lines ``keep`` accepts (on their bytes) are decoded."""

    def __init__(
        self,
        path: Path,
        *,
        max_read: int = 8 * MiB,
        max_line: int = MAX_LINE,
        keep: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_read, self.max_line, self.keep = max_read, max_line, keep
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file being followed
        self._head = b""  # its first bytes as read: a file rewritten in place, to any size, begins otherwise
        self._offset = 0
        self._partial = b""
        self._in_long_line = False  # within a line longer than max_line: its bytes are dropped up to its end
        self.long_lines = 0

    def read_lines(self) -> list[str]:
        """New complete lines. Raises OSError when the file cannot be read (missing, no permission). The file is
        read from its start again when it is another file (device and inode), shorter than what was read, or
        begins with other bytes than it did (truncated and rewritten in place, even to the same size)."""
        st = os.stat(self.path)
        with self.path.open("rb") as f:
            head = f.read(len(self._head)) if self._head else b""
            if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset or head != self._head:
                self._identity, self._offset, self._head = (st.st_dev, st.st_ino), 0, b""
                self._partial, self._in_long_line = b"", False
            if st.st_size == self._offset:
                return []
            f.seek(self._offset)
            data = f.read(self.max_read)
        if self._offset < HEAD_BYTES:
            self._head = (self._head + data)[:HEAD_BYTES]
        self._offset += len(data)
        return self._lines(self._partial + data)

    def _lines(self, data: bytes) -> list[str]:
        lines = data.split(b"\n")
        tail = lines.pop()  # an unfinished last line waits for its end
        if self._in_long_line:
            if not lines:
                return []  # still inside the long line
            lines.pop(0)  # its end
            self._in_long_line = False
        if len(tail) > self.max_line:
            self._in_long_line, tail = True, b""
            self.long_lines += 1
        self._partial = tail
        keep = self.keep
        out = []
        for ln in lines:
            if len(ln) > self.max_line:
                self.long_lines += 1
            elif keep is None or keep(ln):
                out.append(ln.decode("utf-8", errors="replace"))
        return out
