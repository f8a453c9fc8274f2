"""``vllm-capacity sweep``: the limits-and-levers engine on plain readings, then whole sweeps against a simulated
vLLM (tests/support/sim_vllm.py) that is KV-bound, batch-bound or budget-bound on demand, its reports, its checks
(exit 2 and one line), Ctrl-C and vLLM dying mid-sweep."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from pathlib import Path

import pytest

from support.sim_vllm import SimVllm, serving
from vllm_capacity import cli
from vllm_capacity.cli.options import UsageError
from vllm_capacity.cli.sweep import run_sweep
from vllm_capacity.cli.sweep_config import SweepConfig
from vllm_capacity.cli.sweep_html import MISSING
from vllm_capacity.derive import ServerFlags
from vllm_capacity.derive.latency_curve import parse_objective
from vllm_capacity.levers.advice import Situation, levers
from vllm_capacity.levers.knee import StepFigures, find_knee
from vllm_capacity.levers.limits import Binding, Reading, binding_limit
from vllm_capacity.sources.model_config import load_config

FIXTURES = Path(__file__).parent / "fixtures"


def _readings(n: int, **values: float) -> list[Reading]:
    """``n`` reads a second apart; a value given as a tuple (start, step) grows by step each read."""
    out = []
    for i in range(n):
        fields = {k: (v[0] + v[1] * i if isinstance(v, tuple) else v) for k, v in values.items()}
        out.append(Reading(at=float(i), **fields))
    return out


def test_the_binding_limit_is_vllms_evidence_most_of_the_stretch() -> None:
    kv = _readings(6, running=8, waiting=3, waiting_for_capacity=3, kv_usage=0.97, preemptions_total=(10, 2))
    found = binding_limit(kv, ServerFlags())
    assert (found.limit, found.share, found.preemptions) == ("kv_cache", 1.0, 10)
    assert "KV cache 97% full at most" in found.evidence and "10 preemptions" in found.evidence
    seqs = _readings(5, running=4, waiting=6, waiting_for_capacity=6, kv_usage=0.3, preemptions_total=5)
    assert binding_limit(seqs, ServerFlags(max_num_seqs=4)).limit == "max_num_seqs"
    budget = _readings(5, running=3, waiting=4, waiting_for_capacity=4, kv_usage=0.3, steps_total=(0, 10),
                       step_tokens_sum=(0, 10 * 1900))  # fmt: skip
    assert binding_limit(budget, ServerFlags(max_num_batched_tokens=2048)).limit == "token_budget"
    calm = _readings(5, running=2, waiting=0, kv_usage=0.2)
    assert binding_limit(calm, ServerFlags()).limit == "none"
    # a limit named in a quarter of the step binds it, though nothing waited for the rest
    late = calm[:4] + _readings(2, running=8, waiting=2, kv_usage=0.95, preemptions_total=(0, 1))
    assert binding_limit(late, ServerFlags()).limit == "kv_cache"
    assert binding_limit(calm[:1], ServerFlags()).limit == "unknown"
    # preemptions in the step name the KV cache, though the reads caught it full in none of their moments
    burst = [
        *_readings(7, running=2, waiting=0, kv_usage=0.5, preemptions_total=0),
        Reading(at=9.0, running=2, waiting=0, kv_usage=0.5, preemptions_total=6),
    ]
    found = binding_limit(burst, ServerFlags())
    assert (found.limit, found.preemptions) == ("kv_cache", 6) and "6 preemptions" in found.evidence


def _step(c: int, tps: float, itl99: float, limit: str = "none") -> StepFigures:
    return StepFigures(c, tps, {"itl": {0.99: itl99}, "ttft": {0.99: 0.1}}, Binding(limit, 1.0, f"{limit} at {c}"))


def test_the_knee_holds_the_objective_else_the_last_doubling_that_paid() -> None:
    steps = [_step(1, 50, 0.02), _step(2, 95, 0.03), _step(4, 180, 0.04), _step(8, 190, 0.09, "kv_cache")]
    itl = parse_objective("itl", "p99<=50ms")
    knee = find_knee(steps, [itl])
    assert (knee.concurrency, knee.limit) == (4, "kv_cache") and "itl p99 90 ms > 50 ms" in knee.reason
    plain = find_knee(steps, [])
    assert (plain.concurrency, plain.limit) == (4, "kv_cache") and "+6%" in plain.reason
    growing = find_knee(steps[:3], [])
    assert growing.concurrency == 4 and "beyond" in growing.reason
    assert find_knee([_step(1, 50, 0.09)], [itl]).concurrency is None


def test_levers_for_the_kv_cache_and_none_that_cannot_help() -> None:
    kv = Situation("kv_cache", 8, 1700, kv_capacity_tokens=25_600, kv_usage_max=0.99, max_model_len=32768,
                   kv_cache_dtype="auto", block_size=16, max_num_seqs=256)  # fmt: skip
    found = {lever.flag: lever for lever in levers(kv)}
    assert set(found) == {"--kv-cache-dtype", "--max-model-len"}  # not --max-num-seqs: the KV cache binds
    assert "25,600 tokens (15.1 requests of 1,700) -> 51,200 (30.1)" in found["--kv-cache-dtype"].effect
    assert found["--max-model-len"].value == "2048"
    # with the model's config the planner gives the ratio: Llama's 16-bit KV to fp8, exactly 2
    llama = load_config(FIXTURES / "models" / "tiny-llama" / "config.json")
    planned = levers(Situation(**{**kv.__dict__, "geometry": llama}))
    assert "the planner's figure" in planned[0].effect
    fp8 = Situation(**{**kv.__dict__, "kv_cache_dtype": "fp8"})
    assert [lever.flag for lever in levers(fp8)] == ["--max-model-len"]
    seqs = Situation("max_num_seqs", 4, 400, kv_capacity_tokens=4096, kv_usage_max=0.4, max_num_seqs=4)
    (lever,) = levers(seqs)
    assert (lever.flag, lever.value) == ("--max-num-seqs", "8") and "10.2 requests of 400" in lever.effect
    assert levers(Situation("max_num_seqs", 4, 400, kv_usage_max=0.95, max_num_seqs=4)) == []
    assert levers(Situation("unknown", 4, 400)) == []


def _values(url: str, **over: object) -> SweepConfig:
    base = dict(vllm_url=url, model=None, api_key_file=None, concurrency=(1, 2, 4), requests_per_step=8,
                duration_per_step=None, warmup_requests=1, prompt_tokens=380, max_tokens=20, slo_ttft=None,
                slo_itl=None, model_config=None, vllm_log=None, flags=ServerFlags(),
                sample_interval=0.05, timeout=30.0, format="json", output=None)  # fmt: skip
    return SweepConfig(**{**base, **over})  # type: ignore[arg-type]


async def _sweep(sim: SimVllm, **over: object) -> tuple[int, dict]:
    async with serving(sim) as (url, _):
        code, report = await run_sweep(_values(url, **over), io.StringIO())
    return code, json.loads(report)


async def test_a_kv_bound_server_is_named_kv_cache_with_fp8_and_max_model_len() -> None:
    # 4,096 tokens of KV cache, requests of 400: ten fit, so 16 at once wait on the cache
    code, doc = await _sweep(SimVllm(token_delay=0.002), concurrency=(2, 16), requests_per_step=32)
    assert code == 0
    low, high = doc["steps"]
    assert low["requests"] == high["requests"] == 32 and low["errors"] == {}
    assert high["limit"] == "kv_cache" and high["kv_cache_usage_ratio_max"] >= 0.9
    assert high["requests_waiting_max"] > 0 and high["kv_cache_capacity_tokens"] == 4096
    assert doc["knee"]["limit"] == "kv_cache"
    assert {lever["flag"] for lever in doc["levers"]} >= {"--kv-cache-dtype"}
    for kind in ("ttft", "tpot", "itl", "e2e"):
        assert high[f"{kind}_seconds"]["p50"] <= high[f"{kind}_seconds"]["p99"]
    assert high["output_tokens_per_second"] > low["output_tokens_per_second"] * 0.5


async def test_a_batch_bound_server_is_named_max_num_seqs() -> None:
    code, doc = await _sweep(
        SimVllm(max_running=2, token_delay=0.001), concurrency=(1, 2, 8), flags=ServerFlags(max_num_seqs=2)
    )
    assert code == 0
    assert doc["steps"][-1]["limit"] == "max_num_seqs" and doc["steps"][-1]["kv_cache_usage_ratio_max"] < 0.9
    assert doc["knee"]["limit"] == "max_num_seqs"
    assert [lever["flag"] for lever in doc["levers"]] in ([], ["--max-num-seqs"])


async def test_a_server_whose_steps_fill_the_budget_is_named_token_budget() -> None:
    sim = SimVllm(max_running=3, token_delay=0.001, step_fill=0.95)
    code, doc = await _sweep(sim, concurrency=(1, 8), flags=ServerFlags(max_num_batched_tokens=2048))
    assert code == 0 and doc["steps"][-1]["limit"] == "token_budget"


async def test_the_text_and_csv_reports_hold_every_step() -> None:
    async with serving(SimVllm(token_delay=0.001)) as (url, _):
        _, text = await run_sweep(_values(url, format="text", concurrency=(1, 2), requests_per_step=4), io.StringIO())
        _, table = await run_sweep(_values(url, format="csv", concurrency=(1, 2), requests_per_step=4), io.StringIO())
    assert "Knee: concurrency" in text and text.count("\n1 ") + text.count("\n2 ") == 2
    rows = list(csv.DictReader(io.StringIO(table)))
    assert [r["concurrency"] for r in rows] == ["1", "2"] and float(rows[0]["ttft_p50_seconds"]) > 0


async def test_ctrl_c_keeps_the_finished_steps() -> None:
    sim = SimVllm(token_delay=0.005)
    async with serving(sim) as (url, _):
        task = asyncio.create_task(run_sweep(_values(url, concurrency=(1, 2)), io.StringIO()))
        while sim.served < 12:  # noqa: ASYNC110  (the warm-up and step 1, then into step 2)
            await asyncio.sleep(0.01)
        import os
        import signal

        os.kill(os.getpid(), signal.SIGINT)
        code, report = await asyncio.wait_for(task, 10)
    doc = json.loads(report)
    assert code == 130 and doc["interrupted"] is True
    assert [s["concurrency"] for s in doc["steps"]] == [1] and doc["steps"][0]["requests"] == 8


async def test_vllm_dying_mid_sweep_fails_that_step_and_keeps_the_rest() -> None:
    sim = SimVllm(token_delay=0.005)
    async with serving(sim) as (url, runner):
        task = asyncio.create_task(run_sweep(_values(url, concurrency=(1, 4, 8)), io.StringIO()))
        while sim.served < 12:  # noqa: ASYNC110  (the simulation's count, polled)
            await asyncio.sleep(0.01)
        await runner.cleanup()
        code, report = await asyncio.wait_for(task, 30)
    doc = json.loads(report)
    assert code == 1
    assert doc["steps"][0]["requests"] == 8 and doc["steps"][0]["failed"] is None
    assert doc["steps"][-1]["failed"] and "vLLM stopped answering" in doc["steps"][-1]["failed"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "4,2"], "--concurrency: '4,2': each concurrency must be larger than the one before"),
        (["--concurrency", "1,x"], "--concurrency: 'x' is not a positive whole number"),
        (["--slo-itl", "fast"], "--slo-itl: 'fast' is not an objective like p99<=50ms or p90<=2s"),
        (["--model", "other"], "--model 'other': http://127.0.0.1:PORT serves tiny-llama"),
        (["--prompt-tokens", "1000"],
         "--prompt-tokens 1000 + --max-tokens 200 is more than tiny-llama's max_model_len 1024: vLLM would refuse "
         "every request"),
        (["--output", "/nonexistent/dir/r.json"], "--output /nonexistent/dir/r.json: /nonexistent/dir does not exist"),
    ],
)  # fmt: skip
def test_what_cannot_run_exits_2_with_one_line(
    args: list[str], message: str, fake_vllm_thread: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["sweep", "--vllm-url", fake_vllm_thread, *args], {})
    err = capsys.readouterr().err.strip()
    port = fake_vllm_thread.rsplit(":", 1)[1]
    assert code == 2 and err == f"vllm-capacity sweep: error: {message.replace('PORT', port)}"


async def test_a_server_that_does_not_serve_the_warm_up_request_stops_the_sweep_before_its_load() -> None:
    """vLLM 0.32 ends a request whose prompt holds a token past the model's vocabulary at once, with nothing
    generated: every request of the sweep was then "short" (found on the real server). The warm-up says why."""
    sim = SimVllm(vocab_size=200)  # the prompts' token IDs go up to 299
    async with serving(sim) as (url, _):
        with pytest.raises(UsageError, match=r"vLLM did not serve the warm-up request \(short: 0 of 20 tokens"):
            await run_sweep(_values(url), io.StringIO())
    assert sim.served == 1


def test_an_unreachable_server_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["sweep", "--vllm-url", "http://127.0.0.1:9"], {})
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("vllm-capacity sweep: error: cannot read vLLM at http://127.0.0.1:9")
    )


def _blue_pixels(png: Path) -> int:
    """Pixels of matplotlib's first colour (tab:blue) in a screenshot: the charts' lines and markers."""
    from PIL import Image

    with Image.open(png) as image:
        raw = image.convert("RGB").tobytes()
    pixels = zip(raw[0::3], raw[1::3], raw[2::3], strict=True)
    return sum(1 for r, g, b in pixels if abs(r - 31) < 25 and abs(g - 119) < 25 and abs(b - 180) < 25)


async def test_the_html_report_opens_in_chromium_draws_its_charts_and_loads_nothing(tmp_path: Path) -> None:
    import re
    import shutil
    import subprocess

    itl = parse_objective("itl", "p99<=20ms")
    async with serving(SimVllm(token_delay=0.002)) as (url, _):
        _, page = await run_sweep(_values(url, format="html", concurrency=(1, 4, 16), slo_itl=itl), io.StringIO())
    assert page.count("<svg") == 4 and "<script" not in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//""", page)
    report = tmp_path / "sweep.html"
    report.write_text(page)
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: scripts/setup installs it"
    # no network at all: every host resolves to nothing and every connection goes to a closed port
    offline = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
               f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(
        [chromium, *offline, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0 and dom.stdout.count("<svg") == 4 and "Knee: concurrency" in dom.stdout
    shot = tmp_path / "sweep.png"
    args = [chromium, *offline, "--window-size=1300,1500", f"--screenshot={shot}", report.as_uri()]
    subprocess.run(args, capture_output=True, timeout=120, check=True)
    assert _blue_pixels(shot) > 500  # four charts' lines and markers, not a blank page


def test_html_without_matplotlib_says_how_to_install_it(
    fake_vllm_thread: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure raises ImportError
    code = cli.main(["sweep", "--vllm-url", fake_vllm_thread, "--format", "html"], {})
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "vllm-capacity sweep: error: " + MISSING


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_a_terminal_sees_a_bar_for_the_step_under_way_and_a_line_per_step() -> None:
    """On a terminal each request redraws the step's bar in place (its requests done of its count), and each step's
    line clears it; into a file or a pipe only the lines are written, no escape and no bar."""
    async with serving(SimVllm()) as (url, _):
        shown = _Terminal()
        code, _ = await run_sweep(_values(url, concurrency=(1, 2), requests_per_step=4), shown)
        piped = io.StringIO()
        await run_sweep(_values(url, concurrency=(1, 2), requests_per_step=4), piped)
    assert code == 0
    out = shown.getvalue()
    bars = [frame for frame in out.split("\r") if frame.startswith("[")]
    assert "[" + "#" * 30 + "] concurrency 1 (step 1 of 2): 4/4 requests" in bars
    assert "[" + "#" * 15 + "." * 15 + "] concurrency 2 (step 2 of 2): 2/4 requests" in bars
    assert out.count("\r\x1b[Ksweep: concurrency") == 2  # each step's line clears the bar
    lines = piped.getvalue().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["concurrency 1", "concurrency 2"], lines
    assert "\r" not in piped.getvalue() and "\x1b" not in piped.getvalue()


async def test_the_report_gives_the_memory_budget_vllms_log_printed(tmp_path: Path) -> None:
    """--vllm-log: the report gives once what vLLM's start-up log says one GPU rank holds (the seed's A10G: 15.18 GiB
    of weights, 4.31 GiB of KV cache, 0.78 GiB of CUDA graphs), read with the sidecar's own log reader, and names
    what the log does not give; a log without those lines is named, not a crash."""
    log = tmp_path / "vllm.log"
    prefix = "(EngineCore_DP0 pid=7) INFO 11-02 10:00:00"
    log.write_text(
        "INFO 11-02 09:59:00 [api_server.py:1] vLLM API server version 0.10.2\n"
        f"{prefix} [gpu_model_runner.py:3000] Model loading took 15.18 GiB memory and 12.3 seconds\n"
        f"{prefix} [gpu_worker.py:400] Available KV cache memory: 4.31 GiB\n"
        f"{prefix} [gpu_model_runner.py:3100] Graph capturing finished in 9 secs, took 0.78 GiB\n"
        + "INFO 11-02 10:01:00 [logger.py:1] Received request cmpl-1: prompt: 'x'\n"
        * 1000
    )
    empty = tmp_path / "other.log"
    empty.write_text("nothing of vLLM's here\n")
    async with serving(SimVllm()) as (url, _):
        _, report = await run_sweep(
            _values(url, concurrency=(1,), requests_per_step=4, vllm_log=str(log)), io.StringIO()
        )
        _, text = await run_sweep(
            _values(url, concurrency=(1,), requests_per_step=4, vllm_log=str(log), format="text"), io.StringIO()
        )
        _, other = await run_sweep(
            _values(url, concurrency=(1,), requests_per_step=4, vllm_log=str(empty), format="text"), io.StringIO()
        )
        _, without = await run_sweep(_values(url, concurrency=(1,), requests_per_step=4), io.StringIO())
    budget = json.loads(report)["memory_budget"]
    gib = 2**30
    assert budget["source"] == str(log) and budget["error"] is None
    assert (budget["weights_bytes"], budget["kv_cache_bytes"], budget["cuda_graphs_bytes"]) == (
        pytest.approx(15.18 * gib),
        pytest.approx(4.31 * gib),
        pytest.approx(0.78 * gib),
    )
    assert budget["activation_peak_bytes"] is None
    assert "weights 15.18 GiB, KV cache 4.31 GiB, CUDA graphs 0.78 GiB" in text
    assert "not in the log: activation peak" in text
    assert "holds none of vLLM's start-up memory lines" in other
    assert json.loads(without)["memory_budget"] is None


def test_tp_against_replicas_by_the_planner_for_the_pool_the_log_gave() -> None:
    """With the model's config and vLLM's log (a rank's KV pool and weights), the KV cache's levers weigh TP 2 (half
    the weights a rank: the planner's tokens for the pool it frees) against two replicas of TP 1, in tokens and in
    requests of the swept length; without the log's figures neither is offered."""
    from vllm_capacity.sources.model_config import parse_config

    llama = parse_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "torch_dtype": "bfloat16", "max_position_embeddings": 131072})  # fmt: skip
    gib = 2**30
    base = Situation("kv_cache", 8, 1700, kv_capacity_tokens=28_000, kv_usage_max=0.99, max_model_len=32768,
                     kv_cache_dtype="auto", block_size=16, geometry=llama)  # fmt: skip
    assert {lever.flag for lever in levers(base)} == {"--kv-cache-dtype", "--max-model-len"}
    # a 24 GiB GPU: 15 GiB of weights leave 4 GiB of KV cache; at TP 2 each rank frees 7.5 GiB more: 11.5 GiB
    tight = Situation(**{**base.__dict__, "pool_bytes": 4 * gib, "weights_bytes": 15 * gib})
    (tp,) = [lever for lever in levers(tight) if lever.flag in ("--tensor-parallel-size", "replicas")]
    # Llama-3.1-8B: 128 KiB a token at TP 1 (32 layers x 8 heads x 128 x 2 x 2 bytes), 64 KiB a rank at TP 2
    assert tp.flag == "--tensor-parallel-size" and tp.value == "2"
    assert "TP 2 holds 188,416 tokens" in tp.effect and "two replicas of TP 1 65,536" in tp.effect, tp.effect
    # an 80 GiB GPU, 70 GiB of KV cache beside 5 GiB of weights: TP 2 frees 2.5 GiB, under 10 % over two replicas
    roomy = Situation(**{**base.__dict__, "pool_bytes": 70 * gib, "weights_bytes": 5 * gib})
    (rep,) = [lever for lever in levers(roomy) if lever.flag in ("--tensor-parallel-size", "replicas")]
    assert rep.flag == "replicas" and "gains under 10%" in rep.effect, rep.effect
