"""Shipping: the Dockerfile (hadolint; its install steps in a fresh virtualenv, since no OCI image can be built
here), and the Kubernetes manifests rendered with kubectl kustomize and validated offline."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from support.kustomize import kustomize
from support.kustomize import overlay as _overlay
from support.kustomize import sidecars as _sidecars
from support.promql import load_generator, render_mixin

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent
VERSIONS = ("1.29.0", "1.31.0", "1.33.0", "1.35.0")  # native sidecars: 1.29 and later


def test_hadolint() -> None:
    result = subprocess.run([str(BIN / "hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("\nFROM ") >= 1 and "AS build" in text, "multi-stage"
    base = next(line for line in text.splitlines() if line.startswith("ARG PYTHON_IMAGE="))
    # by digest, with its exact slim tag beside it for people (a tag can be pushed again; a digest cannot)
    assert re.fullmatch(r"ARG PYTHON_IMAGE=python:[0-9.]+-slim-\w+@sha256:[0-9a-f]{64}", base), base
    assert 'ENTRYPOINT ["vllm-capacity"]' in text and 'CMD ["serve"]' in text
    assert "USER 65532:65532" in text
    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert f'org.opencontainers.image.source="{repository}"' in text, "the address pyproject.toml gives"


def test_the_base_image_digest_is_refreshed_by_the_script(tmp_path: Path) -> None:
    """scripts/refresh-base-image rewrites the ARG line to the tag and digest given (the registry's, without
    --digest), and refuses what is not a digest."""
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text((ROOT / "Dockerfile").read_text())
    script = [sys.executable, str(ROOT / "scripts" / "refresh-base-image"), "--dockerfile", str(dockerfile)]
    digest = "sha256:" + "ab" * 32
    run = subprocess.run(
        [*script, "--tag", "python:3.11.12-slim-bookworm", "--digest", digest], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert f"ARG PYTHON_IMAGE=python:3.11.12-slim-bookworm@{digest}\n" in dockerfile.read_text()
    assert dockerfile.read_text().count("FROM ${PYTHON_IMAGE}") == 2
    bad = subprocess.run([*script, "--digest", "sha256:short"], capture_output=True, text=True)
    assert bad.returncode == 1 and "is not a sha256 digest" in bad.stderr


@pytest.mark.slow  # a fresh virtualenv and a wheel build: a minute or more, and it needs the package index
def test_dockerfile_install_steps_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    """The Dockerfile's two steps, here: build the wheel (no deps), install it alone into a clean environment.
    Then the installed agent runs from a tree it never writes to (as under a read-only root filesystem)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-cache-dir",
            "--no-deps",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("vllm_capacity-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--no-cache-dir", "-q", str(wheel)], check=True, capture_output=True
    )
    before = sorted(p for p in venv.rglob("*"))
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": str(venv / "bin")}
    version = subprocess.run(
        [str(venv / "bin" / "vllm-capacity"), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert version.returncode == 0 and version.stdout.startswith("vllm-capacity "), version.stderr
    report = subprocess.run(
        [
            str(venv / "bin" / "vllm-capacity"),
            "report",
            "--vllm-url",
            "http://127.0.0.1:9",
            "--timeout",
            "1s",
            "--nvml",
            "off",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert report.returncode == 1 and "(connect)" in report.stderr
    assert sorted(p for p in venv.rglob("*")) == before, "the agent wrote into its installation"
    (package,) = venv.glob("lib/python*/site-packages/vllm_capacity")
    assert not list(package.rglob("test*")), "tests are not shipped in the wheel"


def test_generated_copies_match_their_sources() -> None:
    generate = load_generator("deploy")
    for path, text in generate.render().items():
        assert path.read_text() == text, f"{path} drifted: run .venv/bin/python deploy/generate.py"


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(version: str, tmp_path: Path) -> None:
    _validate(kustomize(K8S / "example"), version, tmp_path)


def _validate(docs: list[dict], version: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"rendered-{version}.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(rendered)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed for resource deployment/vllm" in result.stdout + result.stderr


def test_prometheus_operator_objects_validate() -> None:
    from cloudcoil.models.prometheus_operator import v1

    docs = kustomize(K8S / "example")
    kinds = {"PodMonitor": v1.PodMonitor, "PrometheusRule": v1.PrometheusRule}
    checked = [kinds[d["kind"]].model_validate(d) for d in docs if d["kind"] in kinds]
    assert len(checked) == 3


def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    (rule,) = [d for d in kustomize(K8S / "monitoring") if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([shutil.which("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == 1


# The sidecar's endpoints whose answer never follows vLLM (tests/test_agent.py: /readyz is 200 while vLLM is down).
# A native sidecar's readiness counts towards the pod's: a probe tied to vLLM would let a scrape problem take vLLM
# out of its Service.
PROBE_PATHS = {"/healthz", "/readyz"}


def _assert_probes_never_follow_vllm(container: dict) -> None:
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["path"] in PROBE_PATHS, f"{container['name']} {probe}"


def test_no_shipped_sidecar_probe_depends_on_vllm(tmp_path: Path) -> None:
    example = _sidecars(kustomize(K8S / "example"))
    overlay = _sidecars(kustomize(_overlay(tmp_path / "overlay", "vllm-capacity-sidecar")))
    assert example and overlay
    for sidecar in example + overlay:
        _assert_probes_never_follow_vllm(sidecar)
    notes = (ROOT / "deploy" / "helm" / "vllm-capacity" / "templates" / "NOTES.txt").read_text()
    assert set(re.findall(r"path: (/\w+)", notes)) <= PROBE_PATHS, "the chart's sidecar snippet"


def test_manifests_expose_no_more_than_they_need() -> None:
    """The sidecar's port reachable from the monitoring namespace only, no service-account token, seccomp in the
    chart's snippet, and the local stack published on loopback only."""
    docs = kustomize(K8S / "example")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    rules = policy["spec"]["ingress"]
    metrics_rule = next(r for r in rules if {"port": 9790, "protocol": "TCP"} in r["ports"])
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert any(r["ports"] == [{"port": 8000, "protocol": "TCP"}] and "from" not in r for r in rules), "vLLM's API"
    (vllm,) = [d for d in docs if d["kind"] == "Deployment"]
    assert vllm["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    notes = (ROOT / "deploy" / "helm" / "vllm-capacity" / "templates" / "NOTES.txt").read_text()
    assert "seccompProfile: {type: RuntimeDefault}" in notes
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yaml").read_text())
    published = [p for service in compose["services"].values() for p in service.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published


def test_web_config_component(tmp_path: Path) -> None:
    """On top of the sidecar component: the web configuration mounted from its Secret, named by the env twin of
    --web.config.file, and every probe on the plain-HTTP probe port (tests/test_webconfig.py probes it as the kubelet
    would, under every client_auth_type)."""
    docs = kustomize(_overlay(tmp_path / "overlay", "vllm-capacity-sidecar", "vllm-capacity-web-config"))
    (sidecar,) = _sidecars(docs)
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "vllm-capacity-web-config")
    assert env["VLLM_CAPACITY_WEB_CONFIG_FILE"].startswith(mount["mountPath"] + "/") and mount["readOnly"]
    assert env["VLLM_CAPACITY_VLLM_URL"] == "http://127.0.0.1:8000", "the sidecar component's env is kept"
    # the probes on a plain-HTTP port of their own (--probe-listen): the kubelet sends no client certificate
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert env["VLLM_CAPACITY_PROBE_LISTEN"] == f":{ports['probes']}" and ports["capacity"] != ports["probes"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["scheme"] == "HTTP" and sidecar[probe]["httpGet"]["port"] == "probes", probe
    _assert_probes_never_follow_vllm(sidecar)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["vllm-capacity-web-config"]["secret"]["secretName"] == "vllm-capacity-web-config"
    from vllm_capacity.cli.options import SERVE_OPTIONS

    assert "VLLM_CAPACITY_WEB_CONFIG_FILE" in {o.env for o in SERVE_OPTIONS}
    for version in VERSIONS:
        _validate(docs, version, tmp_path)


def test_sidecar_patch_on_a_plain_deployment(tmp_path: Path) -> None:
    plain = kustomize(K8S / "vllm")
    (before,) = [d for d in plain if d["kind"] == "Deployment"]
    assert "initContainers" not in before["spec"]["template"]["spec"]
    overlay = _overlay(tmp_path / "overlay", "vllm-capacity-sidecar")
    (after,) = [d for d in kustomize(overlay) if d["kind"] == "Deployment"]
    pod = after["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["name"] == "vllm-capacity" and sidecar["restartPolicy"] == "Always"
    assert pod["containers"] == before["spec"]["template"]["spec"]["containers"], "vLLM's container is untouched"
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsUser"] == 65532
    port = sidecar["ports"][0]
    from vllm_capacity.cli import options

    default_port = int(next(o for o in options.SERVE_OPTIONS if o.flag == "--listen").default.rsplit(":", 1)[1])
    assert port["containerPort"] == default_port
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert sidecar["resources"]["limits"]["memory"] and sidecar["resources"]["requests"]["cpu"]
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in sidecar["volumeMounts"]} <= volumes
    assert all(m.get("readOnly") for m in sidecar["volumeMounts"])
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["VLLM_CAPACITY_VLLM_LOG"].startswith(
        next(m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] == "vllm-log")
    )
    assert after["spec"]["template"]["metadata"]["labels"]["vllm-capacity.io/scrape"] == "true"


def test_gpu_visibility_components(tmp_path: Path) -> None:
    for component, check in (
        ("gpu-dra", lambda pod, sidecar: pod["resourceClaims"][0]["name"] == sidecar["resources"]["claims"][0]["name"]),
        (
            "gpu-visible-devices",
            lambda pod, sidecar: (
                {"NVIDIA_DRIVER_CAPABILITIES": "utility"}.items()
                <= {e["name"]: e["value"] for e in sidecar["env"]}.items()
            ),
        ),
    ):
        overlay = _overlay(tmp_path / component, "vllm-capacity-sidecar", component)
        docs = kustomize(overlay)
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        pod = dep["spec"]["template"]["spec"]
        assert check(pod, pod["initContainers"][0]), component
        rendered = overlay / "out.yaml"
        rendered.write_text(yaml.safe_dump_all(docs))
        result = subprocess.run(
            [str(BIN / "kubernetes-validate"), "--strict", "-k", "1.35.0", str(rendered)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint() -> None:
    config = (
        "{extends: default, rules: {line-length: {max: 160}, document-start: disable,"
        " comments: {min-spaces-from-content: 1}}}"
    )
    # hand-written YAML; the generated copies (PyYAML's layout, embedded JSON) are covered by their drift tests,
    # promtool and the prometheus-operator models
    # Helm templates are not YAML until rendered: the chart's render tests cover them.
    files = [
        p
        for p in (ROOT / "deploy").rglob("*.yaml")
        if not p.read_text().startswith("# Generated by") and "templates" not in p.parts
    ]
    files.append(ROOT / "alerts" / "alertmanager.yaml")
    result = subprocess.run(
        [str(BIN / "yamllint"), "-s", "-d", config, *map(str, files)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


CHART = ROOT / "deploy" / "helm" / "vllm-capacity"


def _render_chart(values: dict) -> list[dict]:
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="cap", namespace="monitoring")
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_helm_lint_strict() -> None:
    import helm_python as helm

    result = helm.lint(str(CHART), strict=True)
    assert not result["errors"], result
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result["messages"]  # 1 = info only


def test_helm_chart_renders_the_monitoring_side(tmp_path: Path) -> None:
    from cloudcoil.models.prometheus_operator import v1

    docs = _render_chart({})
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "PodMonitor", "PodMonitor", "PrometheusRule"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    shipped = [
        g
        for n in ("vllm-capacity-alerts.yaml", "vllm-capacity-rules.yaml")
        for g in yaml.safe_load((ROOT / "alerts" / n).read_text())["groups"]
    ]
    assert rule["spec"]["groups"] == shipped  # the PromQL templates ({{ $labels }}) pass through Helm untouched
    v1.PrometheusRule.model_validate(rule)
    for pm in (d for d in docs if d["kind"] == "PodMonitor"):
        v1.PodMonitor.model_validate(pm)
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((ROOT / "dashboards" / name).read_text())
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-k", "1.33.0", str(rendered)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


RULE_SETTINGS = {
    "kvCacheHighRatio": 0.85,
    "ttftP99Seconds": 2.5,
    "exhaustionHorizonSeconds": 7200,
    "ttftWindow": "10m",
    "exporterSelector": 'job="capacity-sidecars"',
    "runbookURL": "https://runbooks.example.com/vllm-capacity.md",
    "clusterLabel": "k8s_cluster",
    "ttftBurnRateAlerts": True,
    "ttftObjectiveLe": "5.0",
    "ttftSloTarget": 0.995,
}


def _chart_rule_groups(values: dict) -> list[dict]:
    (rule,) = [d for d in _render_chart(values) if d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def test_the_charts_rule_settings_render_as_the_mixin_renders_them(tmp_path: Path) -> None:
    """prometheusRule.config takes the mixin's _config names (thresholds, exporter selector, runbook address, cluster
    label): the chart's rules are then what the mixin renders with the same settings, and Prometheus loads them."""
    groups = _chart_rule_groups({"prometheusRule": {"config": RULE_SETTINGS}})
    mixin = render_mixin(RULE_SETTINGS)
    assert groups == mixin["alerts"]["groups"] + mixin["rules"]["groups"]
    text = yaml.safe_dump({"groups": groups})
    assert "vllm_capacity_kv_cache_usage_ratio > 0.85" in text and "> 2.5" in text
    assert 'up{job="capacity-sidecars"} == 0' in text and "https://runbooks.example.com/vllm-capacity.md#" in text
    assert [g["name"] for g in groups] == [
        "vllm-capacity", "vllm-capacity-slo", "vllm-capacity-fleet", "vllm-capacity-slo-rules"
    ]  # fmt: skip
    assert 'le="5.0"' in text and "(14.4 * (1 - 0.995))" in text
    assert [g["name"] for g in _chart_rule_groups({})] == ["vllm-capacity", "vllm-capacity-fleet"]  # off by default
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    result = subprocess.run([shutil.which("promtool") or "promtool", "check", "rules", str(path)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_charts_dashboards_read_the_cluster_label_the_rules_group_by() -> None:
    """prometheusRule.config.clusterLabel reaches the dashboards too: with k8s_cluster they are what
    dashboards/generate.py renders for that label (variables and queries alike), not the default's `cluster`, which
    left every panel of a multi-cluster install empty; by default they are the shipped files."""
    import dataclasses

    dash = load_generator("dashboards")
    wanted = dash.dashboards(dataclasses.replace(dash.ALERTS.DEFAULT, cluster_label="k8s_cluster"))
    values = {"prometheusRule": {"config": {"clusterLabel": "k8s_cluster"}}}
    maps = [d for d in _render_chart(values) if d["kind"] == "ConfigMap"]
    assert len(maps) == len(wanted) == 2
    for cm in maps:
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == wanted[name]
        assert "k8s_cluster=~" in text and not re.search(r"[{,]cluster=~", text)
        assert "__vllm_capacity_cluster_label__" not in text


def test_the_exporter_selector_follows_the_sidecars_scrape_job() -> None:
    """A chart whose PodMonitor names the sidecars' job otherwise keeps its alerts on that job (an exporter selector
    left at vllm-capacity would page "exporter missing" for every pod); prometheusRule.config still wins."""
    text = yaml.safe_dump(_chart_rule_groups({"podMonitor": {"job": "sidecars"}}))
    assert 'up{job="sidecars"} == 0' in text and 'job="vllm-capacity"' not in text
    values = {"podMonitor": {"job": "sidecars"}, "prometheusRule": {"config": {"exporterSelector": 'job=~"a|b"'}}}
    assert 'up{job=~"a|b"} == 0' in yaml.safe_dump(_chart_rule_groups(values))


def test_the_values_schema_knows_every_rule_setting_and_only_those() -> None:
    defaults = yaml.safe_load((CHART / "files" / "rule-config.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["prometheusRule"]["properties"]["config"]
    assert set(config["properties"]) == set(defaults)
    with pytest.raises(Exception, match="kvCacheHigh"):
        _render_chart({"prometheusRule": {"config": {"kvCacheHigh": 0.8}}})  # a misspelt setting is an error


def test_a_mixin_expression_without_a_helm_form_stops_the_generator() -> None:
    deploy = load_generator("deploy")
    assert deploy._go("$._config.kvCacheHighRatio", set()) == ".c.kvCacheHighRatio"
    assert deploy._go("($._config.exhaustionHorizonSeconds) / 60", set()) == "divf .c.exhaustionHorizonSeconds 60"
    with pytest.raises(ValueError, match="no Helm form"):
        deploy._go('if $._config.showMultiCluster then "" else "x"', set())


def test_helm_chart_optional_alertmanager_config(tmp_path: Path) -> None:
    docs = _render_chart({"alertmanagerConfig": {"enabled": True, "pagerUrl": "https://pager.test/x"}})
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    config = tmp_path / "alertmanager.yaml"
    config.write_text(secret["stringData"]["alertmanager.yaml"])
    assert yaml.safe_load(config.read_text())["receivers"][0]["webhook_configs"][0]["url"] == "https://pager.test/x"
    result = subprocess.run([shutil.which("amtool"), "check-config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_chart_alertmanager_config_for_prometheus_operator() -> None:
    """kind AlertmanagerConfig: prometheus-operator's resource (validated by its CRD's model), the example's routes,
    receivers and inhibitions as the operator's spec spells them, the URLs given; the Secret stays the default."""
    from cloudcoil.models.prometheus_operator import v1alpha1

    values = {"alertmanagerConfig": {"enabled": True, "kind": "AlertmanagerConfig", "pagerUrl": "https://pager.test/x",
                                     "labels": {"alertmanagerConfig": "vllm"}}}  # fmt: skip
    (amc,) = [d for d in _render_chart(values) if d["kind"] == "AlertmanagerConfig"]
    v1alpha1.AlertmanagerConfig.model_validate(amc)
    assert amc["metadata"]["labels"]["alertmanagerConfig"] == "vllm"
    example = yaml.safe_load((ROOT / "alerts" / "alertmanager.yaml").read_text())
    spec = amc["spec"]
    assert spec["route"]["groupBy"] == example["route"]["group_by"]
    critical = spec["route"]["routes"][0]
    assert critical["receiver"] == "pager" and critical["matchers"] == [
        {"name": "severity", "matchType": "=", "value": "critical"}
    ]
    urls = {r["name"]: r["webhookConfigs"][0]["url"] for r in spec["receivers"]}
    assert urls == {"pager": "https://pager.test/x", "ticket": "https://tickets.example.com/hooks/vllm-capacity"}
    exporter_down = next(r for r in spec["inhibitRules"] if r["sourceMatch"][0]["value"] == "VLLMCapacityExporterDown")
    assert "VLLMTTFTSLOBreach" not in exporter_down["targetMatch"][0]["value"]  # the sidecar hides no TTFT page
    assert len(spec["inhibitRules"]) == len(example["inhibit_rules"])
    assert [d["kind"] for d in _render_chart({"alertmanagerConfig": {"enabled": True}}) if "Secret" in d["kind"]] == [
        "Secret"
    ]


def _job(podmonitor: dict) -> str:
    (endpoint,) = podmonitor["spec"]["podMetricsEndpoints"]
    (job,) = [r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
    return job


def test_every_shipped_podmonitor_names_its_job_and_looks_in_every_namespace() -> None:
    """The alerts select the sidecar by its job (exporterSelector): the Helm chart's and the plain manifests'
    PodMonitors name the sidecar's job so that it matches and vLLM's so that it does not (a vLLM outage paged as the
    exporter's and was silenced once), and they look beyond their own namespace, where vLLM runs."""
    from cloudcoil.models.prometheus_operator import v1

    selector = re.fullmatch(r'job="([^"]*)"', load_generator("alerts").DEFAULT.exporter_selector)
    assert selector, "the default exporter selector is an exact job name"
    plain = list(yaml.safe_load_all((K8S / "monitoring" / "podmonitors.yaml").read_text()))
    for docs in (_render_chart({}), plain):
        monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
        sidecar = next(d for n, d in monitors.items() if n.endswith(("-sidecar", "vllm-capacity")))
        vllm = next(d for n, d in monitors.items() if n.endswith("vllm"))
        assert _job(sidecar) == selector[1] and _job(vllm) != selector[1]
        for pm in monitors.values():
            assert pm["spec"]["namespaceSelector"] == {"any": True}
            v1.PodMonitor.model_validate(pm)
    narrow = _render_chart({"namespaceSelector": {"matchNames": ["llm"]}, "podMonitor": {"job": "capacity"}})
    for pm in (d for d in narrow if d["kind"] == "PodMonitor"):
        assert pm["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    assert "capacity" in {_job(d) for d in narrow if d["kind"] == "PodMonitor"}
    with pytest.raises(Exception, match="namespaceSelector"):
        _render_chart({"namespaceSelector": {"anyNamespace": True}})  # the schema refuses what the operator ignores


def test_the_charts_sidecar_snippet_has_resources_and_a_startup_probe() -> None:
    """The snippet NOTES prints carries the component's resources (a value, so one can add a CPU limit where a policy
    wants one; none by default: CFS throttling of a Python sidecar buys nothing) and a startup probe."""
    import helm_python as helm

    notes = (CHART / "templates" / "NOTES.txt").read_text()
    snippet = notes[notes.index("initContainers:") : notes.index("or use the Kustomize")]
    assert "startupProbe: {httpGet: {path: /healthz" in snippet
    assert "resources: {{ toJson .Values.sidecar.resources }}" in snippet
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (sidecar,) = [c for c in _sidecar_containers(K8S / "components" / "vllm-capacity-sidecar" / "sidecar.yaml")]
    assert values["sidecar"]["resources"] == sidecar["resources"]  # the same figures as the Kustomize component
    assert "cpu" not in sidecar["resources"]["limits"] and sidecar["resources"]["limits"]["memory"] == "128Mi"
    rendered = helm.Chart.load(str(CHART)).render({}, name="cap", namespace="monitoring")
    text = next(v for k, v in rendered.items() if k.endswith("NOTES.txt"))
    line = next(line for line in text.splitlines() if line.strip().startswith("resources:"))
    assert yaml.safe_load(line.strip())["resources"] == sidecar["resources"], line


def _sidecar_containers(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    return [c for c in doc["spec"]["template"]["spec"]["initContainers"] if c["name"] == "vllm-capacity"]


def test_the_chart_states_its_kubernetes_version_maintainers_and_icon() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.29.0-0"  # native sidecars (restartPolicy: Always on an init container)
    assert chart["maintainers"] and all(m.get("name") for m in chart["maintainers"])
    assert chart["icon"].endswith("/deploy/helm/vllm-capacity/icon.svg") and (CHART / "icon.svg").is_file()


def test_alerts_carry_the_extra_rule_labels_and_dashboards_the_folder_annotation_asked_for() -> None:
    docs = _render_chart(
        {"prometheusRule": {"ruleLabels": {"team": "inference", "severity": "ignored"}},
         "dashboards": {"folderAnnotation": "k8s-sidecar-target-directory", "folder": "/tmp/dashboards/vLLM"}}
    )  # fmt: skip
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert alerts and all(r["labels"]["team"] == "inference" for r in alerts)
    assert {r["labels"]["severity"] for r in alerts} <= {"critical", "warning", "info"}  # an alert's own label wins
    assert all("labels" not in r or "team" not in r["labels"] for r in rules if "record" in r)
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert maps and all(
        d["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "/tmp/dashboards/vLLM"} for d in maps
    )
    plain = [d for d in _render_chart({}) if d["kind"] == "ConfigMap"]
    assert all(d["metadata"]["annotations"] == {"grafana_folder": "vLLM"} for d in plain)


def test_helm_chart_scrapes_sidecars_that_serve_tls_with_basic_auth() -> None:
    from cloudcoil.models.prometheus_operator import v1

    basic = {"username": {"name": "scrape", "key": "user"}, "password": {"name": "scrape", "key": "password"}}
    tls = {"ca": {"secret": {"name": "scrape", "key": "ca.crt"}}, "serverName": "vllm-capacity"}
    docs = _render_chart({"podMonitor": {"scheme": "https", "basicAuth": basic, "tlsConfig": tls}})
    sidecar = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-sidecar"))
    (endpoint,) = sidecar["spec"]["podMetricsEndpoints"]
    assert (endpoint["scheme"], endpoint["basicAuth"], endpoint["tlsConfig"]) == ("https", basic, tls)
    v1.PodMonitor.model_validate(sidecar)
    vllm = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-vllm"))
    assert "basicAuth" not in vllm["spec"]["podMetricsEndpoints"][0]  # vLLM's own endpoint is not the sidecar's


def test_helm_chart_everything_off() -> None:
    off = {k: {"enabled": False} for k in ("podMonitor", "vllmPodMonitor", "prometheusRule", "dashboards")}
    assert _render_chart(off) == []


def test_production_stack_post_renderer() -> None:
    """Shaped like production-stack's engine Deployment: the post-renderer adds the sidecar to it alone."""
    engine = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm-llama3-deployment-vllm", "labels": {"model": "llama3", "helm-release-name": "vllm"}},
        "spec": {
            "selector": {"matchLabels": {"model": "llama3"}},
            "template": {
                "metadata": {"labels": {"model": "llama3"}},
                "spec": {
                    "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}],
                    "volumes": [{"name": "vllm-log", "emptyDir": {}}, {"name": "models", "emptyDir": {}}],
                },
            },
        },
    }
    router = {**engine, "metadata": {"name": "vllm-deployment-router", "labels": {}}}
    out = subprocess.run(
        [str(K8S / "production-stack" / "post-render")],
        input=yaml.safe_dump_all([engine, router]),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d}
    patched = docs["vllm-llama3-deployment-vllm"]["spec"]["template"]["spec"]
    assert [c["name"] for c in patched["initContainers"]] == ["vllm-capacity"]
    assert patched["initContainers"][0]["restartPolicy"] == "Always"
    _assert_probes_never_follow_vllm(patched["initContainers"][0])
    assert "initContainers" not in docs["vllm-deployment-router"]["spec"]["template"]["spec"]


COMPOSE = ROOT / "deploy" / "compose"


def test_compose_stack_validates() -> None:
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose missing: scripts/setup installs Debian's docker-compose"
    result = subprocess.run(
        [compose, "-f", str(COMPOSE / "docker-compose.yaml"), "config"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"vllm", "vllm-capacity", "prometheus", "alertmanager", "grafana"}
    sidecar = services["vllm-capacity"]
    assert sidecar["read_only"] and sidecar["user"] == "65532:65532" and sidecar["cap_drop"] == ["ALL"]
    assert sidecar["pid"] == "service:vllm"
    assert all(":" in s["image"] and not s["image"].endswith(":latest") for n, s in services.items() if "image" in s)


def test_compose_prometheus_and_grafana_provisioning(tmp_path: Path) -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yaml").read_text())["services"]
    mounts = {m.split(":")[1]: (COMPOSE / m.split(":")[0]).resolve() for m in compose["prometheus"]["volumes"]}
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    for rule_file in prom["rule_files"]:  # the rules Prometheus loads are the shipped ones, mounted read-only
        mount = next(m for m in mounts if rule_file.startswith(m + "/"))
        assert (mounts[mount] / rule_file[len(mount) + 1 :]).is_file(), rule_file
    local = tmp_path / "prometheus.yml"
    local.write_text((COMPOSE / "prometheus.yml").read_text().replace("/etc/prometheus/rules/", f"{ROOT}/alerts/"))
    result = subprocess.run([shutil.which("promtool"), "check", "config", str(local)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    grafana = {m.split(":")[1]: (COMPOSE / m.split(":")[0]).resolve() for m in compose["grafana"]["volumes"]}
    provider = yaml.safe_load((COMPOSE / "grafana" / "dashboards" / "vllm-capacity.yaml").read_text())["providers"][0]
    assert grafana[provider["options"]["path"]] == ROOT / "dashboards"
    datasource = yaml.safe_load((COMPOSE / "grafana" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


def test_compose_web_config_override(tmp_path: Path) -> None:
    """docker-compose.web-config.yaml gives the sidecar its web configuration as compose secrets and points
    Prometheus at it over TLS with basic auth; its Prometheus configuration is the plain one but for that."""
    shutil.copytree(COMPOSE, tmp_path / "compose")
    shutil.copytree(ROOT / "deploy" / "kubernetes" / "vllm", tmp_path / "kubernetes" / "vllm")
    secrets = tmp_path / "compose" / "web-config"
    for name in ("web.yml", "tls.crt", "tls.key", "ca.crt", "prometheus-password"):
        (secrets / name).write_text("placeholder\n")
    files = ["-f", str(tmp_path / "compose" / "docker-compose.yaml")]
    files += ["-f", str(tmp_path / "compose" / "docker-compose.web-config.yaml")]
    result = subprocess.run([shutil.which("docker-compose"), *files, "config"], capture_output=True, text=True)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    sidecar = services["vllm-capacity"]
    assert "VLLM_CAPACITY_WEB_CONFIG_FILE" in str(sidecar["environment"])
    assert {s["source"] if isinstance(s, dict) else s for s in sidecar["secrets"]} == {"web.yml", "tls.crt", "tls.key"}
    assert any("prometheus-web-config.yml" in str(v) for v in services["prometheus"]["volumes"])

    plain = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    tls = yaml.safe_load((COMPOSE / "prometheus-web-config.yml").read_text())
    job = next(j for j in tls["scrape_configs"] if j["job_name"] == "vllm-capacity")
    assert job.pop("scheme") == "https" and job.pop("basic_auth")["password_file"].startswith("/run/secrets/")
    assert job.pop("tls_config")["ca_file"] == "/run/secrets/ca.crt"
    assert tls == plain  # nothing else differs: no second copy to drift
    local = tmp_path / "prometheus.yml"
    text = (COMPOSE / "prometheus-web-config.yml").read_text().replace("/etc/prometheus/rules/", f"{ROOT}/alerts/")
    local.write_text(text.replace("/run/secrets/", f"{secrets}/"))
    result = subprocess.run([shutil.which("promtool"), "check", "config", str(local)], capture_output=True, text=True)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr


def test_keda_scales_on_the_one_replicas_needed_series() -> None:
    """The KEDA example asks for exactly the replicas the recording rule says (AverageValue 1), and that rule ships.
    Without the series it holds what it has: KEDA's default (ignoreNullValues true) reads no data as 0, and scaled a
    fleet whose Prometheus lost its sidecars down to minReplicaCount."""
    scaled = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "keda" / "scaledobject.yaml").read_text())
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1" and trigger["metadata"]["ignoreNullValues"] == "false"
    rules = yaml.safe_load((ROOT / "alerts" / "vllm-capacity-rules.yaml").read_text())["groups"][0]["rules"]
    recorded = {r["record"] for r in rules}
    assert "namespace_model_name:vllm_capacity_replicas_needed:ceil" in recorded
    assert "namespace_model_name:vllm_capacity_replicas_needed:ceil{" in trigger["metadata"]["query"]


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"podMonitor": {"scheme": "ftp"}}, "/podMonitor/scheme"),
        ({"podMontor": {"enabled": False}}, "additional properties 'podMontor'"),
        ({"podMonitor": {"interval": "15 seconds"}}, "/podMonitor/interval"),
        ({"podMonitor": {"interval": "30s1m"}}, "/podMonitor/interval"),  # Prometheus's units go largest first
        ({"podMonitor": {"interval": ""}}, "/podMonitor/interval"),
        ({"alertmanagerConfig": {"pagerUrl": "pager.example.com"}}, "/alertmanagerConfig/pagerUrl"),
        ({"prometheusRule": {"enabled": "yes"}}, "/prometheusRule/enabled"),
    ],
)
def test_the_values_schema_refuses_what_helm_would_ignore(values: dict, refusal: str) -> None:
    with pytest.raises(Exception, match="schema") as err:
        _render_chart(values)
    assert refusal in str(err.value)


@pytest.mark.parametrize("duration", ["1m30s", "1h", "90s", "500ms", "1d", "2w", "1h30m15s"])
def test_the_values_schema_takes_prometheus_durations(duration: str) -> None:
    """Prometheus's duration syntax, units combined largest first (model.ParseDuration), as PodMonitor intervals
    and the rules' windows take it: 1m30s was refused."""
    docs = _render_chart({"podMonitor": {"interval": duration}, "prometheusRule": {"config": {"ttftWindow": duration}}})
    assert {e["interval"] for d in docs if d["kind"] == "PodMonitor" for e in d["spec"]["podMetricsEndpoints"]} >= {
        duration
    }


def test_the_chart_readme_documents_every_value() -> None:
    """deploy/generate.py writes the chart's README from values.yaml's comments: every value has its row."""
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([a-zA-Z.]+)` \|", readme, re.MULTILINE))

    def leaves(doc: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in doc.items():
            path = f"{prefix}{k}"
            out |= {path} if not isinstance(v, dict) or not v or path in documented else leaves(v, path + ".")
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert leaves(values) <= documented, leaves(values) - documented


def test_the_chart_label_is_helms_own_form(tmp_path: Path) -> None:
    """helm.sh/chart is name-version with '+' as '_' (a label value cannot hold '+'), as Helm's own charts do."""
    import helm_python as helm

    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    chart_yaml = copy / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 0.1.0", "version: 0.1.0+build.7", 1))
    out = helm.Chart.load(str(copy)).render({}, name="cap", namespace="monitoring")
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    assert {d["metadata"]["labels"]["helm.sh/chart"] for d in docs} == {"vllm-capacity-0.1.0_build.7"}


def test_the_dcgm_exporter_join_rules_in_promtool(tmp_path: Path) -> None:
    """deploy/dcgm/recording-rules.yaml joins dcgm-exporter's series (UUID, gpu, Hostname) with the sidecar's (uuid,
    gpu) by the GPU's UUID: the budget against DCGM's framebuffer used, and DCGM's utilization by vLLM's model."""
    uuid = "GPU-5eed0000-0000-0000-0000-000000000000"
    side = f'namespace="serving",pod="llama-0",gpu="0",uuid="{uuid}"'
    dcgm = f'UUID="{uuid}",gpu="0",Hostname="node-1",modelName="NVIDIA H100 80GB HBM3",namespace="gpu-operator"'
    test = {
        "rule_files": [str(ROOT / "deploy" / "dcgm" / "recording-rules.yaml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f"vllm_capacity_gpu_memory_budget_bytes{{{side}}}", "values": "72000000000x5"},
                {"series": f'vllm_capacity_gpu_process_memory_bytes{{{side},pid="42",owner="vllm"}}',
                 "values": "70000000000x5"},
                {"series": 'vllm_capacity_vllm_info{namespace="serving",pod="llama-0",model_name="llama-8b"}',
                 "values": "1x5"},
                {"series": f"DCGM_FI_DEV_FB_USED{{{dcgm}}}", "values": "68664x5"},  # MiB
                {"series": f"DCGM_FI_DEV_GPU_UTIL{{{dcgm}}}", "values": "87x5"},
            ],
            "promql_expr_test": [
                {"expr": "gpu:dcgm_fb_used_over_vllm_budget:ratio", "eval_time": "4m", "exp_samples": [{
                    "labels": f'gpu:dcgm_fb_used_over_vllm_budget:ratio{{UUID="{uuid}",Hostname="node-1",gpu="0",'
                              'namespace="serving",pod="llama-0"}',
                    "value": 68664 * 1048576 / 72e9}]},
                {"expr": "gpu:dcgm_gpu_utilization:ratio_by_model", "eval_time": "4m", "exp_samples": [{
                    "labels": f'gpu:dcgm_gpu_utilization:ratio_by_model{{UUID="{uuid}",Hostname="node-1",gpu="0",'
                              'namespace="serving",pod="llama-0",model_name="llama-8b"}',
                    "value": 0.87}]},
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "dcgm-test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [shutil.which("promtool") or "promtool", "test", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_opentelemetry_collector_configuration(tmp_path: Path) -> None:
    """deploy/otel/collector.yaml: its pipeline names only what it defines, and the prometheus receiver's scrape
    configuration is one promtool accepts, keeping the namespace and pod labels the alerts group by. (No collector
    binary is packaged for this machine: the configuration's structure and its Prometheus part are what is checked.)"""
    doc = yaml.safe_load((ROOT / "deploy" / "otel" / "collector.yaml").read_text())
    (pipeline,) = doc["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(doc[kind]), kind
    assert pipeline["processors"][0] == "memory_limiter", "first in every pipeline (the collector's own advice)"
    scrape = doc["receivers"]["prometheus"]["config"]
    # the jobs and ports of the PodMonitors: the sidecar and vLLM itself, whose series the latency panels and alerts
    # read (a collector that scraped only the sidecar left them without data downstream)
    podmonitors = ROOT / "deploy" / "kubernetes" / "monitoring" / "podmonitors.yaml"
    monitors = list(yaml.safe_load_all(podmonitors.read_text()))
    wanted = {
        next(r["replacement"] for r in m["spec"]["podMetricsEndpoints"][0]["relabelings"] if r["targetLabel"] == "job"):
        m["spec"]["podMetricsEndpoints"][0]["port"]
        for m in monitors
    }  # fmt: skip
    port_name = ["__meta_kubernetes_pod_container_port_name"]
    ports = {
        job["job_name"]: next(r["regex"] for r in job["relabel_configs"] if r.get("source_labels") == port_name)
        for job in scrape["scrape_configs"]
    }
    assert ports == wanted == {"vllm-capacity": "capacity", "vllm": "http"}
    for job in scrape["scrape_configs"]:
        assert {r.get("target_label") for r in job["relabel_configs"]} >= {"namespace", "pod"}
        assert not any("$" in str(r) for r in job["relabel_configs"])  # the collector would read $ as its own variable
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        # Debian's promtool is built without Kubernetes discovery: the rest of the job is checked with a static target
        job["static_configs"] = [{"targets": ["127.0.0.1:9790"]}]
        del job["kubernetes_sd_configs"]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape))
    result = subprocess.run([shutil.which("promtool"), "check", "config", str(config)], capture_output=True, text=True)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr
