"""vLLM startup-log lines of every version (verbatim excerpts of what vLLM's model_runner.py, worker.py and
gpu_executor.py (V0) and gpu_model_runner.py, gpu_worker.py and kv_cache_utils.py (V1) print, and the logs quoted in
fixtures/cases/capacity-dev.json), and the real CPU server's own log; following a log through rotation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.files import CASES, VLLM_FIXTURES
from support.model_configs import LLAMA_31_8B
from support.vllm034 import Start034
from vllm_capacity.sources.vllm_log import LogFollower, StartupFigures, might_carry_figures, parse_line

GiB = 2**30


def figures(text: str) -> StartupFigures:
    s = StartupFigures()
    for line in text.splitlines():
        s.feed(line)
    return s


V0_066 = """\
INFO 01-13 11:35:21 model_runner.py:1099] Loading model weights took 14.9595 GB
INFO 01-13 11:35:23 worker.py:241] Memory profiling takes 1.32 seconds
INFO 01-13 11:35:23 worker.py:241] the current vLLM instance can use total_gpu_memory (39.50GiB) x gpu_memory_utilization (0.90) = 35.55GiB
INFO 01-13 11:35:23 worker.py:241] model weights take 14.96GiB; non_torch_memory takes 0.10GiB; PyTorch activation peak memory takes 9.37GiB; the rest of the memory reserved for KV Cache is 11.12GiB.
INFO 01-13 11:35:23 gpu_executor.py:76] # GPU blocks: 5691, # CPU blocks: 2048
INFO 01-13 11:35:23 gpu_executor.py:80] Maximum concurrency for 8192 tokens per request: 11.12x
"""  # noqa: E501

V0_064 = """\
Loading model weights took 14.9888 GB
Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB peak_torch_memory=17.06GiB memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB kv_cache_size=3.81GiB gpu_memory_utilization=0.90
GPU blocks: 1952, # CPU blocks: 2048
Maximum concurrency for 20000 tokens per request: 1.56x
"""  # noqa: E501

V1_0102 = """\
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [gpu_worker.py:298] Available KV cache memory: 6.51 GiB
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per request: 1.30x
"""  # noqa: E501

V1_033 = """\
\x1b[1;36m(EngineCore_DP1 pid=123)\x1b[0;0m INFO 11-02 10:00:00 [gpu_model_runner.py:3000] Model loading took 15.0 GiB memory and 12.345678 seconds
(EngineCore_DP1 pid=123) INFO 11-02 10:00:09 [gpu_model_runner.py:4000] Graph capturing finished in 7 secs, took 0.78 GiB
(EngineCore_DP1 pid=123) INFO 11-02 10:00:09 [gpu_worker.py:400] Available KV cache memory: 4.31 GiB
(EngineCore_DP1 pid=123) INFO 11-02 10:00:09 [kv_cache_utils.py:1147] GPU KV cache size: 208,625 tokens, Maximum concurrency for 32,768 tokens per request: 6.37x
"""  # noqa: E501


def test_v0_multi_line_profiling_output() -> None:
    (e,) = figures(V0_066).engines.values()
    assert e.weights_bytes == pytest.approx(14.96 * GiB)  # the profile's figure, after the loader's 14.9595 "GB"
    assert e.activation_peak_bytes == pytest.approx(9.37 * GiB)
    assert e.kv_cache_memory_bytes == pytest.approx(11.12 * GiB)
    assert (e.num_gpu_blocks, e.max_model_len, e.max_concurrency) == (5691, 8192, 11.12)
    assert e.kv_cache_tokens is None  # V0 prints blocks, not tokens


def test_v0_064_profile_and_gb_that_is_gib() -> None:
    (e,) = figures(V0_064).engines.values()
    assert e.weights_bytes == pytest.approx(14.9888 * GiB)
    assert e.kv_cache_memory_bytes == pytest.approx(3.81 * GiB)
    assert (e.num_gpu_blocks, e.max_model_len, e.max_concurrency) == (1952, 20000, 1.56)


def test_v1_thousands_separators() -> None:
    (e,) = figures(V1_0102).engines.values()
    assert (e.kv_cache_tokens, e.max_model_len, e.max_concurrency) == (42656, 32768, 1.30)
    assert e.kv_bytes_per_token == pytest.approx(6.51 * GiB / 42656)


def test_v1_one_line_capacity_ansi_and_data_parallel_prefix() -> None:
    s = figures(V1_033)
    assert list(s.engines) == ["1"]
    e = s.engines["1"]
    assert e.weights_bytes == pytest.approx(15.0 * GiB)
    assert e.cuda_graph_bytes == pytest.approx(0.78 * GiB)
    assert (e.kv_cache_tokens, e.max_model_len, e.max_concurrency) == (208625, 32768, 6.37)
    assert f"{e.kv_bytes_per_token / 1024:.1f}" == "21.7"  # the seed's figure


def test_figures_of_hundreds_of_digits_are_refused_not_a_crash_or_infinity() -> None:
    """A token count of 400 digits raised OverflowError and dropped the rest of that read's lines; weights of 400
    digits were exported as model_weights_bytes +Inf. Such a line is refused whole and counted; the lines after it
    are read."""
    huge = "9" * 400
    lines = [
        f"(EngineCore_DP0 pid=1) INFO 11-02 10:00:00 [gpu_model_runner.py:3000] Model loading took {huge}.0 GiB memory",
        f"(EngineCore_DP0 pid=1) INFO 11-02 10:00:01 [kv_cache_utils.py:1147] GPU KV cache size: {huge} tokens",
        "(EngineCore_DP0 pid=1) INFO 11-02 10:00:02 [kv_cache_utils.py:1147] GPU KV cache size: 208,625 tokens, "
        "Maximum concurrency for 32,768 tokens per request: 6.37x",
        f"(EngineCore_DP0 pid={'7' * 5000}) INFO 11-02 10:00:00 [gpu_worker.py:1] Model loading took 15.0 GiB memory",
        f"INFO 11-02 10:00:03 [scheduler.py:1] Chunked prefill is enabled with max_num_batched_tokens={'8' * 5000}.",
    ]
    s = StartupFigures()
    for line in lines:
        s.feed(line)
    (e,) = s.engines.values()
    assert e.weights_bytes is None or e.weights_bytes == pytest.approx(15.0 * GiB)
    assert (e.kv_cache_tokens, e.max_model_len) == (208625, 32768)  # the line after the refused ones
    assert s.implausible_lines == 2 and s.max_num_batched_tokens is None and s.ranks == {}


def test_tensor_parallel_workers_each_log_their_budget() -> None:
    text = (
        "(VllmWorker TP0 pid=1) INFO [gpu_worker.py:232] Available KV cache memory: 10.70 GiB\n"
        "(VllmWorker TP1 pid=2) INFO [gpu_worker.py:232] Available KV cache memory: 10.65 GiB\n"
    )
    (e,) = figures(text).engines.values()
    assert e.kv_cache_memory_bytes == pytest.approx(10.65 * GiB)  # every rank is sized to the smallest


def test_verbatim_logs_of_the_cases() -> None:
    cases = json.loads((CASES / "capacity-dev.json").read_text())
    checked = 0
    for case in cases:
        s = figures(case["verbatim_log"])
        if not s.engines:
            continue
        e = next(iter(s.engines.values()))
        if case["kv_cache_tokens"] and e.kv_cache_tokens:
            assert e.kv_cache_tokens == case["kv_cache_tokens"], case["id"]
            checked += 1
        if case["max_concurrency"] and e.max_concurrency:
            assert e.max_concurrency == case["max_concurrency"], case["id"]
        if case["kv_cache_memory_gib"] and e.kv_cache_memory_bytes:
            assert e.kv_cache_memory_bytes == pytest.approx(case["kv_cache_memory_gib"] * GiB), case["id"]
        if case["weights_gib"] and e.weights_bytes:
            assert e.weights_bytes == pytest.approx(case["weights_gib"] * GiB, rel=0.01), case["id"]
    assert checked >= 5


def test_real_cpu_server_log() -> None:
    s = figures((VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log").read_text())
    e = s.engines["0"]
    assert (e.kv_cache_tokens, e.max_model_len, e.max_concurrency) == (4096, 1024, 4.0)
    assert e.kv_cache_memory_bytes == pytest.approx(1.0 * GiB)  # "Explicitly set (1.0/9.21) GiB for KV cache"
    # "Overriding num_gpu_blocks=16384 with num_gpu_blocks_override=32": 32 of the budget's 16,384 blocks were kept
    assert (e.blocks_from_memory, e.num_gpu_blocks) == (16384, 32)
    assert e.kv_bytes_per_token == 512  # 2 x 2 layers x 2 KV heads x 32 x 2 B, not 1 GiB / 4,096
    assert e.kv_pool_bytes == 32 * 128 * 512
    assert e.device == "CPU"  # "CPU KV cache size: 4,096 tokens": host memory, no GPU rank


def test_the_log_names_where_the_kv_cache_lives() -> None:
    gpu = figures(V1_0102).engines["0"]
    assert gpu.device == "GPU"  # "GPU KV cache size: ..."
    quiet = figures("INFO 10-03 [gpu_worker.py:1] Available KV cache memory: 4.31 GiB\n").engines["0"]
    assert quiet.device is None  # not said: the report names no device


def test_a_new_start_clears_the_old_figures() -> None:
    s = figures(V1_0102 + "(APIServer pid=9) INFO 10-03 17:00:00 [api_utils.py:286] non-default args: {}\n")
    assert s.engines == {} and s.starts == 1


def test_follower_survives_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("line 1\nline 2\npart")
    f = LogFollower(log)
    assert f.read_lines() == ["line 1", "line 2"]
    assert f.read_lines() == []
    with log.open("a") as out:
        out.write("ial\nline 4\n")
    assert f.read_lines() == ["partial", "line 4"]
    log.write_text("new\n")  # truncated and rewritten in place
    assert f.read_lines() == ["new"]
    log.write_text("two\n")  # truncated and rewritten to the same size: its first bytes tell it apart
    assert f.read_lines() == ["two"]
    log.write_text("three\nfour\n")  # and to a larger one
    assert f.read_lines() == ["three", "four"]
    log.rename(tmp_path / "vllm.log.1")  # rotated: a new file under the old name
    log.write_text("after rotation\n")
    assert f.read_lines() == ["after rotation"]
    log.unlink()
    with pytest.raises(FileNotFoundError):
        f.read_lines()


def test_a_log_rewritten_in_place_at_the_same_size_with_the_same_head_is_read_again(tmp_path: Path) -> None:
    """Its first 256 bytes unchanged (vLLM's banner), the same size, other lines after: missed before. A file that
    was modified without growing was rewritten (an append grows it)."""
    import os

    log = tmp_path / "vllm.log"
    banner = "INFO 11-02 10:00:00 [api_server.py:1] vLLM API server version 0.32.0 " + "x" * 300 + "\n"
    log.write_text(banner + "GPU KV cache size: 100 tokens\n")
    f = LogFollower(log)
    assert len(f.read_lines()) == 2
    os.utime(log, ns=(1, 1))
    log.write_text(banner + "GPU KV cache size: 999 tokens\n")  # the same size
    st = log.stat()
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert f.read_lines() == [banner.rstrip("\n"), "GPU KV cache size: 999 tokens"]
    assert f.read_lines() == []  # read once
    with log.open("a") as out:
        out.write("appended\n")
    assert f.read_lines() == ["appended"]  # an append is an append


def test_a_figure_rounded_to_zero_is_unknown() -> None:
    s = figures("(Worker pid=1) INFO 11-29 10:41:25 [cpu_worker.py:260] Explicitly set (0.0/9.21) GiB for KV cache\n")
    assert s.engines["0"].kv_cache_memory_bytes is None


def test_max_num_seqs_from_the_non_default_args_line() -> None:
    figures = StartupFigures()
    figures.feed(
        "INFO 11-30 10:00:00 [utils.py:253] non-default args: {'model': 'Qwen/Qwen3-8B', 'max_model_len': 16384, "
        "'gpu_memory_utilization': 0.9, 'max_num_seqs': 8}"
    )
    assert figures.max_num_seqs == 8
    figures.feed("INFO 11-30 11:00:00 [utils.py:253] non-default args: {'model': 'Qwen/Qwen3-8B'}")
    assert figures.max_num_seqs is None  # the next start left it at vLLM's default: unknown


def test_each_workers_figures_are_kept_by_its_pid() -> None:
    """Per GPU rank, by the PID in the worker's prefix (the first line is real: vLLM ~0.10.2 at TP=4, case
    l40s-qwen3-235b-2507-fp8-tp4-ep in fixtures/cases/capacity-dev.json); the engine's own lines are not a rank's."""
    s = figures(
        "(Worker_TP3_EP3 pid=2081) INFO 09-24 20:53:41 [gpu_worker.py:298] Available KV cache memory: 10.65 GiB\n"
        "(EngineCore_DP0 pid=1944) INFO 09-24 20:53:41 [kv_cache_utils.py:864] GPU KV cache size: 238,208 tokens\n"
        "(VllmWorker rank=1 pid=77) INFO 05-01 10:00:00 [gpu_model_runner.py:1] Model loading took 7.10 GiB\n"
    )
    assert set(s.ranks) == {2081, 77}
    assert s.ranks[2081].kv_cache_memory_bytes == pytest.approx(10.65 * GiB)
    assert s.ranks[77].weights_bytes == pytest.approx(7.10 * GiB)
    assert figures("(APIServer pid=1) INFO 10-03 non-default args: {}\n").ranks == {}


def test_the_engines_speculative_config_line() -> None:
    """The engine's config line names its speculative method and tokens (0.32 ``SpeculativeConfig.__repr__``, as the
    real CPU server printed it), or None; a new start forgets it."""
    figures = StartupFigures()
    figures.feed(
        "(EngineCore pid=2796) INFO 12-01 14:11:28 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
        "model='/root/.cache/vllm-capacity/tiny-granite-hybrid', speculative_config=SpeculativeConfig(method='eagle', "
        "model='/root/.cache/vllm-capacity/tiny-llama-eagle', num_spec_tokens=2), tokenizer='/root/.cache/x'"
    )
    assert figures.speculation == ("eagle", 2)
    figures.feed("(APIServer pid=1) INFO 12-01 14:16:45 [api_utils.py:286] non-default args: {'model': 'x'}")
    assert figures.speculation is None
    figures.feed(
        "(EngineCore pid=5210) INFO 12-01 14:16:51 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
        "model='/m', speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=3), tokenizer="
    )
    assert figures.speculation == ("ngram", 3)
    figures.feed(
        "(EngineCore pid=7) INFO [core.py:133] Initializing a V1 LLM engine with config: model='/m', "
        "speculative_config=None, tokenizer='/m'"
    )
    assert figures.speculation is None


def test_max_num_batched_tokens_from_the_scheduler_line() -> None:
    """The scheduler logs its resolved batch budget, whatever set it (0.32 scheduler.py, as the real CPU server
    printed it); a new start forgets the old one."""
    figures = StartupFigures()
    figures.feed(
        "(APIServer pid=22594) INFO 12-01 12:00:48 [scheduler.py:307] Chunked prefill is enabled with "
        "max_num_batched_tokens=256."
    )
    assert figures.max_num_batched_tokens == 256
    figures.feed("(APIServer pid=1) INFO 12-01 12:05:00 [api_utils.py:286] non-default args: {'model': 'x'}")
    assert figures.max_num_batched_tokens is None


# --- bounds: the log is written by vLLM's request logger too, with users' prompts in it (#28 row 4) -------------

KNOWN_LOGS = [V0_066, V0_064] + [v for k, v in sorted(globals().items()) if k.startswith("V1_") and isinstance(v, str)]


def _every_known_line() -> list[str]:
    lines = [ln for text in KNOWN_LOGS for ln in text.splitlines()]
    lines += (VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log").read_text().splitlines()
    for case in json.loads((CASES / "capacity-dev.json").read_text()):
        lines += case["verbatim_log"].splitlines()
    return lines


def test_the_fixed_string_prefilter_passes_every_line_that_carries_a_figure() -> None:
    """A line the follower does not decode (no fixed string) must be one that carries nothing: checked over every
    verbatim line the tests hold, each fed alone."""
    carrying = 0
    for line in _every_known_line():
        if figures(line) != StartupFigures():
            carrying += 1
            assert might_carry_figures(line.encode()), line
    assert carrying >= 40


@pytest.mark.parametrize(
    "line",
    [
        "(" * 1_000_000,
        "(DP" * 300_000,
        "(EngineCore" * 100_000,
        "(Worker pid=" * 100_000,
        "speculative_config=SpeculativeConfig(method=x," * 30_000,
        "KV cache size: 1" + ",1" * 500_000,
    ],
    ids=["parens", "dp", "engine", "worker", "speculative", "separators"],
)
def test_a_hostile_line_is_read_in_linear_time(line: str) -> None:
    """A request log line is user text: 24 KB of "(" stalled the loop 8 s and 100 KB 169 s (the engine pattern
    backtracked over the whole line). Whatever the line, the patterns' work is linear in it: a megabyte line
    reads in well under a second here (the bound is loose: it fails only on super-linear matching)."""
    import time

    t0 = time.perf_counter()
    StartupFigures().feed(line)
    assert time.perf_counter() - t0 < 3.0


def test_request_log_lines_never_carry_a_figure(tmp_path: Path) -> None:
    """vLLM's request logger (--enable-log-requests) quotes prompts: a prompt cannot plant a figure."""
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=9) INFO 12-01 12:00:00 [logger.py:43] Received request cmpl-1: prompt: "
        "'Available KV cache memory: 999.0 GiB\\nGPU KV cache size: 9,999,999 tokens', params: SamplingParams(n=1)\n"
        "(APIServer pid=9) INFO 12-01 12:00:01 [logger.py:70] Generated response cmpl-1: output: "
        "'Maximum concurrency for 1 tokens per request: 999.00x'\n"
        "(EngineCore pid=7) INFO 12-01 12:00:02 [kv_cache_utils.py:1147] GPU KV cache size: 208,625 tokens\n"
    )
    lines = LogFollower(log, keep=might_carry_figures).read_lines()
    s = figures("\n".join(lines))
    assert (s.engines["0"].kv_cache_tokens, s.engines["0"].kv_cache_memory_bytes) == (208_625, None)
    assert s.engines["0"].max_concurrency is None


def test_a_line_longer_than_the_cap_is_passed_over_and_never_buffered(tmp_path: Path) -> None:
    """200 MiB without a newline peaked at 661 MiB: the unfinished line was kept whole. Now a line past max_line is
    dropped as it is read, counted, and the line after it is read as usual."""
    log = tmp_path / "vllm.log"
    follower = LogFollower(log, max_read=64 * 1024, max_line=4096)
    with log.open("wb") as out:
        out.write(b"first\n" + b"x" * 300_000)  # a long line, still unfinished
    reads = [follower.read_lines() for _ in range(6)]
    assert reads[0] == ["first"] and all(r == [] for r in reads[1:])
    assert len(follower._partial) == 0 and follower.long_lines == 1
    with log.open("ab") as out:
        out.write(b"x" * 10_000 + b"\nafter\n" + b"y" * 5000 + b"\nlast\n")
    lines = [ln for _ in range(3) for ln in follower.read_lines()]
    assert lines == ["after", "last"] and follower.long_lines == 2


async def test_the_log_is_read_and_matched_off_the_event_loop(tmp_path: Path) -> None:
    """A 1 GiB log catching up failed 36 of 244 /healthz probes: the patterns ran on the loop. The read and the
    matching both run in a worker thread now; the figures still land."""
    import threading

    from vllm_capacity.live.startup import SOURCE_LOG, StartupLogReader
    from vllm_capacity.live.status import SourceBook

    log = tmp_path / "vllm.log"
    log.write_text(V1_033)
    reader = StartupLogReader(LogFollower(log, keep=might_carry_figures), SourceBook(()))
    threads: set[bool] = set()
    feed = reader.figures.feed

    def feed_and_note(line: str) -> None:
        threads.add(threading.current_thread() is threading.main_thread())
        feed(line)

    reader.figures.feed = feed_and_note  # type: ignore[method-assign]
    await reader.read()
    assert threads == {False}
    assert reader.sources[SOURCE_LOG].up and reader.figures.engines["1"].kv_cache_tokens == 208_625


def _plan_notes(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> list[str]:
    from vllm_capacity import cli

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    base = ["plan", "--model-config", str(config), "--max-model-len", "8192", "--format", "json"]
    assert cli.main([*base, *args], environ={}) == 0
    return json.loads(capsys.readouterr().out)["notes"]


def test_the_log_lines_the_plan_points_to_are_vllms(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every start-up line the plan's notes tell a user to read a figure from ('X' for the figure) is one vLLM writes:
    it is in a recorded upstream log (the cases' verbatim logs, the real CPU server's), or, for the DEBUG line no
    recorded log holds, the agent's own log reader reads a figure from it."""
    gpu = ["--gpu-memory", "24GiB", "--weights-memory", "15GiB"]
    notes = [
        *_plan_notes(capsys, tmp_path, *gpu, "--vllm-version", "0.32.0"),  # both figures estimated or 0
        *_plan_notes(capsys, tmp_path, *gpu, "--vllm-version", "0.11.0"),  # graphs outside the budget
        *_plan_notes(capsys, tmp_path, *gpu, "--vllm-version", "0.8.2", "--engine", "v0"),  # no estimate
        *_plan_notes(capsys, tmp_path, "--kv-cache-memory", "4GiB", "--tp", "2"),  # one rank's figure
        *_plan_notes(capsys, tmp_path, "--kv-cache-memory", "4GiB", "--max-loras", "2"),  # slots in the weights
        *_plan_notes(capsys, tmp_path, *gpu, "--vllm-version", "0.34.0"),  # the extensible KV cache's lines
        *_plan_notes(capsys, tmp_path, "--kv-cache-memory", "4GiB", "--vllm-version", "0.34.0"),
    ]
    quoted = {q for note in notes for q in re.findall(r"(?<![A-Za-z])'([A-Za-z][^']*)'(?![A-Za-z])", note)}
    assert len(quoted) >= 6, quoted  # the notes above quote at least these many lines
    cases = json.loads((CASES / "capacity-dev.json").read_text())
    logs = [c["verbatim_log"] for c in cases] + [(VLLM_FIXTURES / "v1-0.32.0-cpu-startup.log").read_text()]
    lines = [line for log in logs for line in log.splitlines()]
    lines += Start034().lines()  # 0.34's, from its own format strings (no recorded 0.34 log: support/vllm034.py)
    for phrase in quoted:
        pattern = re.compile(re.escape(phrase).replace("X", r"[0-9.]+").replace("N", r"[0-9]+"))
        in_a_log = any(pattern.search(line) for line in lines)
        read = parse_line(phrase.replace("X", "1.25").replace(" N ", " 12 "))[1]
        assert in_a_log or read, f"{phrase!r}: in no recorded vLLM log, and not read by the log reader"
