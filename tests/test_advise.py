"""`vllm-capacity advise` against a real Prometheus holding a week with planted truths (tests/support/prom_week.py):
it finds each, advises nothing for the calm deployment, its numbers are the planner's, and every figure it cites
re-runs as the PromQL it prints."""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import bcrypt
import httpx
import pytest
import trustme

from support.model_configs import LLAMA_31_8B
from support.prom_week import HOLDS, KNEE, LLAMA_POOL, prometheus_with_week
from test_cli import _main
from vllm_capacity import sizing
from vllm_capacity.advise.observe import matchers
from vllm_capacity.levers.traffic import advise
from vllm_capacity.levers.window import Asked, Figure, Observed
from vllm_capacity.sizing import PlanInputs
from vllm_capacity.sources.model_config import load_config, parse_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    return path


@dataclass(frozen=True)
class Week:
    """The Prometheus holding the week, behind TLS and basic auth as a production one is: its URL, the week's end,
    advise's options to reach it, and httpx's."""

    url: str
    end: int
    auth: tuple[str, ...]
    ca: Path
    password: str


@pytest.fixture(scope="module")
def week(tmp_path_factory: pytest.TempPathFactory, llama_config: Path) -> Iterator[Week]:
    work = tmp_path_factory.mktemp("prometheus")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(work / "ca.crt"))
    cert.cert_chain_pems[0].write_to_path(str(work / "tls.crt"))
    cert.private_key_pem.write_to_path(str(work / "tls.key"))
    hashed = bcrypt.hashpw(b"week-pw", bcrypt.gensalt(rounds=4)).decode()
    (work / "web.yml").write_text(
        f"tls_server_config: {{cert_file: {work / 'tls.crt'}, key_file: {work / 'tls.key'}}}\n"
        f"basic_auth_users: {{advisor: '{hashed}'}}\n"
    )
    (work / "password").write_text("week-pw\n")
    auth = ("--basic-auth-user", "advisor", "--basic-auth-password-file", str(work / "password"),
            "--ca-file", str(work / "ca.crt"))  # fmt: skip
    with prometheus_with_week(work, load_config(llama_config), work / "web.yml", ("advisor", "week-pw")) as (url, end):
        yield Week(url, end, auth, work / "ca.crt", "week-pw")


def _advise(week: Week, *args: str) -> dict:
    result = _main(
        "advise", "--prometheus-url", week.url, "--end", str(week.end), *week.auth, "--format", "json", *args
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _by_flag(model: dict) -> dict[str, dict]:
    return {r["flag"]: r for r in model["recommendations"]}


def test_advise_finds_each_planted_truth_with_the_planners_numbers(week: Week, llama_config: Path) -> None:
    doc = _advise(week, "--selector", '{namespace="serving"}', "--model-config", str(llama_config))
    (model,) = doc["models"]
    assert (model["model_name"], model["namespace"], model["window"]) == ("llama-8b", "serving", "7d")
    recs = _by_flag(model)
    llama = load_config(llama_config)
    now = PlanInputs(kv_cache_memory_bytes=LLAMA_POOL, max_model_len=32768, block_size=16, version=(0, 32, 0))
    # p99.9 of request lengths about 6,100 tokens against 32,768: 7K, and the planner's worst case at both
    mml = recs["max_model_len"]
    assert (mml["current"], mml["advised"]) == ("32768", "6144")  # 6,119 in whole K
    assert 6000 < mml["numbers"]["request_tokens_p999"] < 6200
    assert mml["numbers"]["max_concurrency_now"] == sizing.plan(llama, now).max_concurrency
    assert (
        mml["numbers"]["max_concurrency_advised"]
        == sizing.plan(llama, replace(now, max_model_len=6144)).max_concurrency
    )
    # preemptions at the daily peaks only: fp8, with the planner's tokens
    fp8 = recs["kv_cache_dtype"]
    assert (fp8["current"], fp8["advised"]) == ("auto", "fp8")
    assert (
        fp8["numbers"]["kv_cache_tokens_advised"]
        == sizing.plan(llama, replace(now, kv_cache_dtype="fp8")).kv_cache_tokens
    )
    assert "requests waiting for KV capacity at once" in fp8["effect"]  # the queue at the peaks, 2 x 4 requests
    assert 7 <= model["observed"]["waiting_for_capacity_max"]["value"] <= 8
    assert model["observed"]["used_tokens_max"]["value"] == pytest.approx(
        0.99 * model["observed"]["capacity_tokens"]["value"]
    )
    hours = fp8["numbers"]["preempted_hours"]
    assert 7 * 2 <= hours <= 7 * 8 and fp8["numbers"]["preempted_hours_at_peak"] == hours
    # the latency knee: max_num_seqs at the knee (28 ran), replicas for the peak of 2 x 32 with 20 % headroom
    assert recs["max_num_seqs"]["advised"] == str(KNEE) and f"up to {HOLDS} ran" in recs["max_num_seqs"]["effect"]
    assert recs["replicas"]["current"] == "2"
    assert recs["replicas"]["advised"] == str(math.ceil(recs["replicas"]["numbers"]["peak_demand"] * 1.2 / KNEE))
    assert 60 <= recs["replicas"]["numbers"]["peak_demand"] <= 64
    # 0.32 with 2.5 GiB of 80 free at least: 1 GiB kept, the rest to the cache
    assert (recs["gpu_memory_utilization"]["current"], recs["gpu_memory_utilization"]["advised"]) == ("0.9", "0.91")
    # TP 2 against two replicas, by the planner: the weights' half freed on each GPU
    tp = recs["tensor_parallel_size"]
    two = sizing.plan(llama, replace(now, tp=2, kv_cache_memory_bytes=LLAMA_POOL + int(14.96 * 2**30) // 2))
    assert tp["advised"] == "2" and tp["numbers"]["kv_cache_tokens_tp"] == pytest.approx(two.kv_cache_tokens, abs=16)
    assert "max_num_batched_tokens" not in recs


def test_the_calm_deployment_gets_no_advice_and_its_gaps_are_named(week: Week) -> None:
    doc = _advise(week)
    models = {m["model_name"]: m for m in doc["models"]}
    assert set(models) == {"llama-8b", "qwen-7b"}
    calm = models["qwen-7b"]
    assert calm["recommendations"] == []
    reasons = {n["flag"]: n for n in calm["not_advised"]}
    assert (
        reasons["kv_cache_dtype"]["reason"] == "no preemptions or shed requests in 7d: fp8 KV not needed for capacity"
    )
    assert "extensible" in reasons["gpu_memory_utilization"]["reason"]
    assert reasons["tensor_parallel_size"]["gap"] and "--model-config" in reasons["tensor_parallel_size"]["reason"]
    assert not reasons["replicas"]["gap"] and not reasons["max_model_len"]["gap"]
    # the busy one is still advised without a model config, on the said estimate
    busy = _by_flag(models["llama-8b"])
    assert busy["kv_cache_dtype"]["numbers"]["ratio"] == 2.0 and "estimate" in busy["kv_cache_dtype"]["effect"]
    text = _main("advise", "--prometheus-url", week.url, "--end", str(week.end), *week.auth, "--slo-ttft", "p99<=1s")
    assert text.returncode == 0 and "c1 / batch / qwen-7b: 7d" in text.stdout
    # vLLM's TTFT histogram is not in this week: the objective is said to have no data, not to have held
    assert "objective ttft p99<=1000ms: - over the window (no data)" in text.stdout
    assert "histogram_quantile(0.999, sum by (cluster, namespace, model_name, le)" in text.stdout  # re-runnable
    assert "nothing to change:" in text.stdout and "max_model_len: 32768 -> 6144" in text.stdout


def test_every_cited_figure_reruns_as_the_promql_it_prints(week: Week, llama_config: Path) -> None:
    doc = _advise(week, "--selector", '{namespace="serving"}', "--model-config", str(llama_config))
    checked = 0
    trust = ssl.create_default_context(cafile=week.ca)
    with httpx.Client(base_url=week.url, verify=trust, auth=("advisor", week.password)) as prom:
        for rec in doc["models"][0]["recommendations"]:
            for ev in rec["evidence"]:
                if "start" in ev:  # a range query: the points above 0 of the deployment's series (hours)
                    params = {"query": ev["promql"], "start": ev["start"], "end": ev["time"], "step": ev["step"]}
                    (series,) = prom.get("/api/v1/query_range", params=params).json()["data"]["result"]
                    assert sum(1 for _, v in series["values"] if float(v) > 0) == ev["value"]
                else:
                    got = prom.get("/api/v1/query", params={"query": ev["promql"], "time": ev["time"]}).json()
                    (sample,) = got["data"]["result"]
                    assert float(sample["value"][1]) == pytest.approx(ev["value"], rel=1e-9)
                checked += 1
    assert checked >= 15


def test_the_html_report_is_one_self_contained_file(week: Week, tmp_path: Path) -> None:
    out = tmp_path / "advice.html"
    result = _main("advise", "--prometheus-url", week.url, "--end", str(week.end), *week.auth, "--format", "html",
                   "--output", str(out))  # fmt: skip
    assert result.returncode == 0 and result.stdout == "", result.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.split("</h1>")[0]
    assert "<code>kv_cache_dtype</code>" in page and "Nothing to change." in page  # busy and calm deployments
    assert not any(tag in page for tag in ("<link", "<img", "@import", "src="))


def test_advise_cannot_answer_exits_2_with_one_line(week: Week, llama_config: Path, tmp_path: Path) -> None:
    url, end, auth = week.url, week.end, week.auth
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    cases = [
        (["--prometheus-url", "http://127.0.0.1:9"], "cannot reach Prometheus at http://127.0.0.1:9"),
        (["--prometheus-url", url, *auth[:3], str(wrong), *auth[4:]], "refused the credentials (HTTP 401)"),
        (["--prometheus-url", url], "certificate verify failed"),  # its CA not given
        (["--prometheus-url", url, "--insecure-skip-verify", "--ca-file", str(week.ca)], "HTTP 401"),
        (["--prometheus-url", url, *auth, "--selector", '{namespace="nowhere"}'], "matches no deployment"),
        (["--prometheus-url", url, *auth, "--end", str(end - 7 * 86400 + 1200), "--window", "1h"], "minutes of data"),
        (["--prometheus-url", url, *auth, "--selector", "namespace=serving"], "a label selector in braces"),
        (["--prometheus-url", url, *auth, "--model-config", str(llama_config)], "describes one model"),
        ([], "--prometheus-url is required"),
        (["--prometheus-url", url, "--window", "10m"], "below the minimum"),
    ]
    for args, message in cases:
        result = _main("advise", *(["--end", str(end)] if "--end" not in args else []), *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)


def test_the_rules_without_prometheus() -> None:
    """The pure rules over plain figures: a p99.9 past vLLM's last bucket advises no shorter max_model_len, too few
    requests none either; without preemptions no fp8; without demand series the replicas' gap is named."""

    def observed(**values: float) -> Observed:
        return Observed({"model_name": "m"}, "7d", {k: Figure(v, k, 0.0) for k, v in values.items()},
                        info={"version": "0.32.0", "cache_dtype": "auto", "block_size": "16"})  # fmt: skip

    base = {"max_model_len": 32768, "capacity_tokens": 200_000, "requests": 5000, "output_p999": 500}
    found = {f.flag: f for f in advise(observed(**base, prompt_p999=20000, prompt_top_bucket=20000), Asked())}
    assert "largest finite bucket" in found["max_model_len"].reason  # type: ignore[union-attr]
    found = {f.flag: f for f in advise(observed(**{**base, "requests": 10}, prompt_p999=3000), Asked())}
    assert "fewer than 1,000" in found["max_model_len"].reason  # type: ignore[union-attr]
    found = {f.flag: f for f in advise(observed(**base, prompt_p999=3000, preemptions=0), Asked())}
    assert found["max_model_len"].advised == "4096"  # type: ignore[union-attr]
    assert "not needed for capacity" in found["kv_cache_dtype"].reason  # type: ignore[union-attr]
    assert found["replicas"].gap  # type: ignore[union-attr]
    assert matchers('{namespace="a", model_name=~"l.*"}') == ',namespace="a", model_name=~"l.*"'


def test_any_part_of_the_figures_gives_a_finding_per_flag_never_a_crash() -> None:
    """Prometheus may hold any part of the series (a sidecar without NVML, vLLM without histograms, no objective):
    every subset of the figures, at values from 0 up, gives one finding per flag, each a recommendation or a reason."""
    import random

    rng = random.Random(7)
    names = ["max_model_len", "capacity_tokens", "requests", "prompt_p999", "output_p999", "prompt_top_bucket",
             "preemptions", "shed", "kv_usage_max", "limit_max_num_seqs", "limit_token_budget", "running_max",
             "peak_demand", "slo_knee", "slo_knee_observed", "per_replica_p90", "gpu_total_bytes",
             "gpu_free_min_bytes", "pool_bytes", "weights_bytes", "replicas"]  # fmt: skip
    geometry = parse_config(LLAMA_31_8B)
    flags = {"max_model_len", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
             "replicas", "tensor_parallel_size"}  # fmt: skip
    for _ in range(300):
        values = {n: rng.choice([0.0, 0.5, 1.0, 20.0, 3000.0, 2.0**34]) for n in names if rng.random() < 0.6}
        labels = (("version", rng.choice(["0.32.0", "0.34.0", "x"])), ("cache_dtype", rng.choice(["auto", "fp8"])),
                  ("gpu_memory_utilization", rng.choice(["0.9", "None"])))  # fmt: skip
        info = {k: v for k, v in labels if rng.random() < 0.8}
        o = Observed({"model_name": "m"}, "7d", {k: Figure(v, k, 0.0) for k, v in values.items()}, info=info)
        found = advise(o, Asked(geometry=geometry if rng.random() < 0.5 else None))
        assert {f.flag for f in found} == flags
