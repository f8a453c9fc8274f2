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
    # vLLM 0.34's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py of the 0.34.0 wheel): the cache is
    # sized after warm-up and graph capture, so "Available KV cache memory" above is only the estimate it reserved
    # address space for. measure_kv_cache_blocks logs what the measured memory fits ...
    "warmup": re.compile(
        rf"Memory after warmup: {_NUM} GiB free, {_NUM} GiB committed to the KV cache, {_NUM} GiB kept for "
        rf"transient activations \({_NUM} GiB allocated at peak, {_NUM} GiB of torch reservation growth\); "
        rf"{_NUM} KV cache blocks \({_NUM} GiB\) fit within the requested {_NUM} GiB"
    ),
    # ... extend_kv_cache the blocks committed (the minimum over ranks) and their physical bytes ...
    "extended": re.compile(rf"Extended KV cache to {_NUM} blocks \({_NUM} ?GiB\)"),
    # ... after a warm-up that committed more than the measured budget fits
    "remapped": re.compile(rf"Remapping the KV cache from {_NUM} to {_NUM} blocks"),
}
# "GPU KV cache size: 208,625 tokens" (kv_cache_utils.py); the CPU backend logs "CPU KV cache size: ..."; 0.34
# under HiSparse "GPU + host KV cache size: ..." (update_kv_cache_capacity): the tokens of both tiers
_DEVICE = re.compile(r"\b(GPU|CPU|XPU|TPU|HPU|NPU)( \+ host)? KV cache size:")
# Printed once per start by the API server, before any engine figure (engine cores print theirs later): "vLLM API
# server version" up to 0.33, "vLLM server version %s, serving model %s" in 0.34 (entrypoints/common/startup.py)
_NEW_START = re.compile(r"non-default args:|vLLM (?:API )?server version")
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
    b"peak memory", b"max model len", b"num_gpu_blocks", b"non-default args", b"server version",
    b"max_num_batched_tokens", b"speculative_config=",
)  # fmt: skip
# vLLM's request logger (vllm/entrypoints/logger.py, --enable-log-requests / --enable-log-outputs) writes users'
# prompts and outputs into the same log: such a line never carries a figure, whatever text it quotes.
_REQUEST_LOG = (b"Received request ", b"Generated response ", b" details: prompt")
MAX_LINE = 64 * 1024  # vLLM's memory lines are < 300 bytes, its engine config line a few KiB


def might_carry_figures(line: bytes) -> bool:
    """Whether a raw log line can hold a figure: one of the fixed strings, and not a request log line."""
    return any(k in line for k in _FIXED) and not any(k in line for k in _REQUEST_LOG)


#: the largest figure a log line may carry: 2^53 (a float's exact integers); tokens, blocks and pids are far below,
#: and GiB figures (1 PiB = 2^20 GiB) too. A figure past it (hundreds of digits) is a line that cannot be right
MOST = float(2**53)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _count(text: str) -> int | None:
    """A count from the log (max_num_seqs, a token budget, a pid): None past :data:`MOST` (a line that cannot be
    right; int() of a number of 5,000 digits raises)."""
    return int(text) if len(text) <= 15 else None


def plausible(found: dict[str, float]) -> bool:
    """Whether every figure of a line can be right: finite and at most :data:`MOST`."""
    return all(0 <= v <= MOST for v in found.values())  # NaN fails both comparisons


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
        elif name == "warmup":
            found["transient_peak_gib"] = _number(groups[3])
            found["warmup_blocks"] = _number(groups[5])
            found["warmup_blocks_gib"] = _number(groups[6])
            found["requested_gib"] = _number(groups[7])
        elif name == "extended":
            found["extended_blocks"] = _number(groups[0])
            found["extended_gib"] = _number(groups[1])
        elif name == "remapped":
            found["remapped_from_blocks"] = _number(groups[0])
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
    #: the token figure counts a host tier too ("GPU + host KV cache size", 0.34 under HiSparse)
    host_tier: bool = False
    #: vLLM 0.34's extensible KV cache: sized after warm-up ("Memory after warmup" or "Extended KV cache" seen)
    extensible: bool = False
    warmup_blocks: int | None = None  # the blocks the memory measured after warm-up fits (the smallest rank's)
    warmup_blocks_bytes: float | None = None  # ... and their bytes, blocks x bytes per block
    requested_bytes: float | None = None  # the budget it fitted them in: total x resolved gpu_memory_utilization
    transient_peak_bytes: float | None = None  # the activations' peak kept free beside the cache
    extended_blocks: int | None = None  # the blocks committed: the final cache
    extended_bytes: float | None = None  # ... their physical bytes on the GPU (granules included)
    remapped_from_blocks: int | None = None  # warm-up had committed more, remapped down to extended_blocks

    @property
    def bytes_per_block(self) -> float | None:
        """One block's bytes under the extensible cache, from the warm-up line (None elsewhere)."""
        if self.warmup_blocks and self.warmup_blocks_bytes:
            return self.warmup_blocks_bytes / self.warmup_blocks
        return None

    @property
    def kv_blocks_bytes(self) -> float | None:
        """The bytes of the KV blocks as vLLM sized them, what its own arithmetic divides by a block's bytes: the
        extended blocks x a block's bytes (half a block more, for the rounding of the logged GiB) under the
        extensible cache, else :attr:`kv_pool_bytes`."""
        if not self.extensible:
            return self.kv_pool_bytes
        per_block = self.bytes_per_block
        if per_block is None or self.extended_blocks is None:
            return self.kv_pool_bytes
        return (self.extended_blocks + 0.5) * per_block

    @property
    def _override_share(self) -> float:
        """The share of the memory's blocks that --num-gpu-blocks-override kept (1 without an override)."""
        if self.blocks_from_memory and self.num_gpu_blocks:
            return self.num_gpu_blocks / self.blocks_from_memory
        return 1.0

    @property
    def kv_bytes_per_token(self) -> float | None:
        """'Available KV cache memory' / 'KV cache size' tokens (4.31 GiB / 208,625 = 21.7 KiB, say); under 0.34's
        extensible cache the post-warm-up blocks' bytes over the post-warm-up tokens (never the estimate's)."""
        if self.extensible:
            blocks_bytes = self.kv_blocks_bytes
            if not blocks_bytes or not self.kv_cache_tokens or self.bytes_per_block is None:
                return None
            return (blocks_bytes - 0.5 * self.bytes_per_block) / self.kv_cache_tokens
        if not self.kv_cache_memory_bytes or not self.kv_cache_tokens:
            return None
        return self.kv_cache_memory_bytes * self._override_share / self.kv_cache_tokens

    @property
    def kv_pool_bytes(self) -> float | None:
        """The KV memory vLLM allocated: the budget, or the overridden blocks' share of it; under 0.34's extensible
        cache the physical bytes of the blocks committed after warm-up (None until that line: "Available KV cache
        memory" is then only the estimate before warm-up)."""
        if self.extensible:
            return self.extended_bytes
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
    #: lines whose figures cannot be right (past :data:`MOST`), refused whole: the reader counts and logs them
    implausible_lines: int = 0

    def feed(self, line: str) -> None:
        if _NEW_START.search(line):
            self.engines.clear()  # a new start of vLLM: the old figures no longer describe it
            self.ranks.clear()
            self.starts += 1
            seqs = _MAX_NUM_SEQS.search(line)
            self.max_num_seqs = _count(seqs[1]) if seqs else None
            self.max_num_batched_tokens = None
            self.speculation = None
            return
        if batched := _BATCHED_TOKENS.search(line):
            self.max_num_batched_tokens = _count(batched[1])
            return
        if spec := _SPECULATIVE.search(line):
            tokens = _count(spec[2]) if spec[1] else None
            self.speculation = (spec[1], tokens) if spec[1] and tokens is not None else None
        engine, found = parse_line(line)
        if not found:
            return
        if not plausible(found):
            self.implausible_lines += 1
            return
        fig = self.engines.setdefault(engine, EngineFigures())
        line = _ANSI.sub("", line)
        self._rank(line, found)
        if device := _DEVICE.search(line):
            fig.device, fig.host_tier = device[1], device[2] is not None
        if "warmup_blocks" in found or "extended_blocks" in found:
            _extensible(fig, found)
        else:
            _engine_figures(fig, found)

    def _rank(self, line: str, found: dict[str, float]) -> None:
        """A worker's own weights and KV memory, by the PID of its log prefix."""
        if (worker := _WORKER.search(line[:PREFIX_CHARS])) and (
            "weights_gib" in found or "kv_cache_memory_gib" in found
        ):
            pid = _count(worker[1])
            if pid is None:
                return
            rank = self.ranks.setdefault(pid, RankFigures())
            if found.get("weights_gib"):
                rank.weights_bytes = found["weights_gib"] * GiB
            if found.get("kv_cache_memory_gib"):
                rank.kv_cache_memory_bytes = found["kv_cache_memory_gib"] * GiB


def _engine_figures(fig: EngineFigures, found: dict[str, float]) -> None:
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
        elif name in (
            "kv_cache_tokens",
            "num_gpu_blocks",
            "max_model_len",
            "blocks_from_memory",
            "remapped_from_blocks",
        ):
            setattr(fig, name, int(value))
        else:
            setattr(fig, name, value)


def _extensible(fig: EngineFigures, found: dict[str, float]) -> None:
    """The figures of 0.34's post-warm-up lines: under TP every worker logs its own, and vLLM commits the smallest
    rank's count on every rank (kv_cache_planning.finalize_extensible_kv_cache)."""
    fig.extensible = True
    if "warmup_blocks" in found:
        blocks = int(found["warmup_blocks"])
        if fig.warmup_blocks is None or blocks < fig.warmup_blocks:
            fig.warmup_blocks, fig.warmup_blocks_bytes = blocks, found["warmup_blocks_gib"] * GiB
            fig.requested_bytes = found["requested_gib"] * GiB
            fig.transient_peak_bytes = found["transient_peak_gib"] * GiB
            if found["transient_peak_gib"] and fig.activation_peak_bytes is None:
                fig.activation_peak_bytes = found["transient_peak_gib"] * GiB
    else:
        fig.extended_blocks = fig.num_gpu_blocks = int(found["extended_blocks"])
        physical = found["extended_gib"] * GiB
        fig.extended_bytes = physical if fig.extended_bytes is None else min(fig.extended_bytes, physical)


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
        self._mtime_ns = 0  # the file's modification time when it was last read to its end
        self._partial = b""
        self._in_long_line = False  # within a line longer than max_line: its bytes are dropped up to its end
        self.long_lines = 0

    def read_lines(self) -> list[str]:
        """New complete lines. Raises OSError when the file cannot be read (missing, no permission). The file is
        read from its start again when it is another file (device and inode), shorter than what was read, begins
        with other bytes than it did, or was modified without growing (truncated and rewritten in place, to the same
        size: an append always grows it, as the file is read no further than the size its stat gave)."""
        st = os.stat(self.path)
        with self.path.open("rb") as f:
            head = f.read(len(self._head)) if self._head else b""
            rewritten = st.st_size == self._offset and st.st_mtime_ns != self._mtime_ns and self._offset > 0
            if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset or head != self._head or rewritten:
                self._identity, self._offset, self._head = (st.st_dev, st.st_ino), 0, b""
                self._partial, self._in_long_line = b"", False
            if st.st_size == self._offset:
                self._mtime_ns = st.st_mtime_ns
                return []
            f.seek(self._offset)
            data = f.read(min(self.max_read, st.st_size - self._offset))
        if self._offset < HEAD_BYTES:
            self._head = (self._head + data)[:HEAD_BYTES]
        self._offset += len(data)
        if self._offset == st.st_size:
            self._mtime_ns = st.st_mtime_ns
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
